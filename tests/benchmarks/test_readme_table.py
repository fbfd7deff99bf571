"""The performance page (docs/performance.md) shows the committed report's targets table
verbatim."""

from __future__ import annotations

from pathlib import Path

from benchmarks.results import replace_targets_block, targets_block

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_is_the_reports_table() -> None:
    """The table between the performance page's perf-targets markers equals
    reports/perf/README.md's, and the page says how to refresh it."""
    readme = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    report = (ROOT / "reports" / "perf" / "README.md").read_text(encoding="utf-8")
    assert "python -m benchmarks --readme docs/performance.md" in readme
    assert targets_block(report).startswith("| suite |")
    assert targets_block(readme) == targets_block(report)


def test_replacing_the_block_keeps_the_rest() -> None:
    """``--readme`` rewrites only what lies between the markers."""
    text = "intro\n<!-- perf-targets:begin -->\nold\n<!-- perf-targets:end -->\nrest\n"
    new = replace_targets_block(text, "| new |")
    assert new == "intro\n<!-- perf-targets:begin -->\n| new |\n<!-- perf-targets:end -->\nrest\n"
    assert targets_block(new) == "| new |"
