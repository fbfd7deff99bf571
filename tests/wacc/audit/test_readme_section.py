"""The audit's pages: the example loop of "Audit your training loop" (docs/audit-your-loop.md)
audits as shown, and the results page (docs/audit.md) has a row for every built-in loop."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wacc.audit.adapters import ADAPTERS

ROOT = Path(__file__).resolve().parents[3]


def _page(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def test_section_table_lists_every_builtin_loop() -> None:
    """The table of the results page has a row for every built-in loop."""
    section = _page("audit.md")
    for name in ADAPTERS:
        assert f"| {name} |" in section


@pytest.mark.slow
def test_example_user_loop_passes(tmp_path: Path) -> None:
    """The page's example loop, saved as a module, passes `wacc audit module:function`."""
    (code,) = re.findall(r"```py\n(.*?)```", _page("audit-your-loop.md"), flags=re.S)
    (tmp_path / "readme_loop.py").write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", "readme_loop:my_loop", "--windows", "unequal",
         "zero", "--quiet", "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader((tmp_path / "out" / "audit.csv").read_text().splitlines()))
    assert [r["verdict"] for r in rows] == ["pass", "pass"]
    assert [r["tokens_counted"] == str(float(r["tokens_true"])) for r in rows] == [True, True]
