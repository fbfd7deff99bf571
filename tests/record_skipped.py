"""A pytest plugin (loaded by tests/conftest.py): with ``WACC_RECORD_SKIPPED`` naming a file, the
node id of every skipped test, and of every module skipped whole at collection (a missing extra's
``pytest.importorskip``), is appended there.

CI runs the README's test command with only the ``dev`` extra, then installs the extras it adds
and reruns exactly what that first run skipped (``.ci/run``). A list of what was skipped rather
than a marker to remember: a new test that skips without an extra is rerun with it, whatever its
reason says. xdist's workers and its controller may both write one id: readers deduplicate
(``sort -u``). An xfail is not a skip here.
"""

from __future__ import annotations

import os

import pytest


def _record(report: pytest.CollectReport | pytest.TestReport) -> None:
    path = os.environ.get("WACC_RECORD_SKIPPED")
    if path and report.skipped and not hasattr(report, "wasxfail"):
        with open(path, "a", encoding="utf-8") as out:  # one short line per write (O_APPEND)
            out.write(f"{report.nodeid}\n")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record(report)
