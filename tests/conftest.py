"""Suite-wide configuration: Hypothesis profiles (explicit, never global precision state)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import gmpy2
import mpmath
import pytest
from hypothesis import settings

from tests import mutant
from wacc.judge.profiles import register_profiles

# The profiles are wacc's own (``wacc check --profile`` uses the same ones): "ci" is
# derandomized so that a red CI run reproduces exactly; "dev" explores new examples.
register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Read when conftest is imported: mutmut's fork server imports it before it forks the mutants'
# workers, so they share one parsed copy (nothing there outside a mutmut run).
_MUTMUT_DURATIONS = mutant.read_durations()
_CARRIED = mutant.read_carried()


_STAGES = pytest.StashKey[list[list[str]]]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> bool | None:
    """Under mutmut, collect a mutant's covering tests in stages, fastest first
    (``mutant.stages``): only the first stage now, the next ones in ``pytest_runtestloop`` once
    every test before them passed. Any other run (CI, a developer's, mutmut's stats and clean
    runs, an argument that is not a node id) collects as usual. A mutant the run carries
    (``mutation/carry.py``) collects nothing: pytest exits with mutmut's "skipped" code."""
    name = mutant.mutant_under_test()
    if name is not None and name in _CARRIED:
        pytest.exit(
            f"{name} is a triaged survivor whose function is unchanged: carried, not run",
            returncode=mutant.CARRIED_EXIT,
        )
    args = session.config.args
    if not (mutant.under_mutant() and _MUTMUT_DURATIONS and all("::" in arg for arg in args)):
        return None
    if not isinstance(getattr(session._fixturemanager, "_pending_conftests", None), dict):
        return None  # a pytest whose fixture manager works otherwise: collect as usual
    cuts = mutant.stages(args, _MUTMUT_DURATIONS)
    session.config.stash[_STAGES] = cuts
    session.perform_collect(cuts[0])
    return True


def _conftests_pending_again(session: pytest.Session) -> None:
    """pytest parses a conftest's fixtures when its directory is first collected, onto that
    collection's directory node; a later collection makes new nodes, which would see none of
    them. Mark every conftest pending again, as pytest did when it registered them."""
    pending = session._fixturemanager._pending_conftests
    for name, plugin in session.config.pluginmanager.list_name_plugin():
        if name and name.endswith("conftest.py"):
            pending[Path(name).absolute().parent] = plugin


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    """Run the staged collection's tests, one stage after another (pytest's own loop otherwise).
    A failure or a collection error stops the run as ``-x`` would: mutmut reads the exit code."""
    cuts = session.config.stash.get(_STAGES, None)
    if cuts is None:
        return None
    for index, cut in enumerate(cuts):
        if index:
            _conftests_pending_again(session)
        items = session.items if index == 0 else session.perform_collect(cut)
        if session.testsfailed:
            raise session.Interrupted(f"collection of stage {index + 1} failed")
        for position, item in enumerate(items):
            nextitem = items[position + 1] if position + 1 < len(items) else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
    return True


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--campaigns",
        action="store_true",
        help="also run the tests marked `campaign` (minutes each; `tox -e nightly` runs them)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under mutmut, run a mutant's covering tests fastest first. mutmut passes them in set order
    and stops at the first failure (``-x``), so a killed mutant otherwise often waits for a slow
    test that a fast one would have beaten; a survivor runs them all either way, so the verdicts
    are the same (the tests are independent: the suite passes in any order under xdist)."""
    if mutant.under_mutant() and _MUTMUT_DURATIONS:
        items[:] = mutant.fastest_first(items, _MUTMUT_DURATIONS)
    if not config.getoption("--campaigns"):
        skip = pytest.mark.skip(reason="a campaign: run with --campaigns (tox -e nightly)")
        for item in items:
            if item.get_closest_marker("campaign"):
                item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection created (torch, the packages, the test modules) out of the cyclic
    garbage collector's reach: it lives for the whole run anyway, so a full collection (a test's
    ``gc.collect()``, or an automatic one) then walks only what the tests make. In a process
    forked after collection (mutmut's workers, ``python -m mutation``) walking the inherited heap
    would also copy every page of it: seconds per test, enough to pass for a hang."""
    gc.freeze()


def _global_precision() -> tuple[object, ...]:
    # The settings only: gmpy2's sticky flags (inexact, ...) legitimately change.
    context = gmpy2.get_context()
    return (
        mpmath.mp.prec,
        context.precision,
        context.emin,
        context.emax,
        context.subnormalize,
        context.round,
    )


@pytest.fixture(autouse=True)
def _no_global_precision_leaks() -> Iterator[None]:
    """Every test leaves mpmath's and gmpy2's global contexts exactly as it found them.

    Precision is always explicit in this project (a ``prec`` argument, a local gmpy2 context);
    a test or a library call that changes the global one would silently change its neighbours.
    """
    before = _global_precision()
    yield
    after = _global_precision()
    assert after == before, f"global precision changed: {before} -> {after}"


# With WACC_RECORD_SKIPPED naming a file, every skipped test and module is listed there: CI
# (.ci/run) runs them again once it has installed the extras the README's install leaves out.
from tests.record_skipped import pytest_collectreport, pytest_runtest_logreport  # noqa: E402, F401
