"""What the gate prints and writes: a table on stdout, JUnit XML, a pull-request summary."""

from __future__ import annotations

from pathlib import Path

from junitparser import Failure, JUnitXml, TestCase, TestSuite

from wacc.gate.compare import Comparison
from wacc.gate.measure import Metrics
from wacc.tables import format_metric, render_table

__all__ = ["table", "write_junit", "write_summary"]


def _cells(row: tuple[str, Metrics, Metrics, str]) -> list[str]:
    key, now, base, status = row
    return [
        key,
        str(now.scenarios),
        str(now.failing),
        f"{format_metric(now.max_ulps)} ({format_metric(base.max_ulps)})",
        f"{format_metric(now.max_ratio)} ({format_metric(base.max_ratio)})",
        status,
    ]


_HEADER = [
    "dtype/family/source",
    "scenarios",
    "failing",
    "max ulps (baseline)",
    "max err/bound (baseline)",
    "status",
]


def table(comparison: Comparison) -> str:
    """The comparison as aligned text."""
    return render_table(_HEADER, [_cells(row) for row in comparison.rows])


def write_summary(
    comparison: Comparison, path: Path, *, implementation: str, seconds: float
) -> Path:
    """A markdown summary for a pull-request comment."""
    verdict = "passed" if comparison.passed else "FAILED"
    lines = [
        f"### wacc gate {verdict}: `{implementation}` ({seconds:.0f} s)",
        "",
        f"{len(comparison.failures)} hard failure(s), {len(comparison.regressions)} regression(s), "
        f"{len(comparison.improvements)} improvement(s).",
        "",
        "| " + " | ".join(_HEADER) + " |",
        "|" + "---|" * len(_HEADER),
    ]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in comparison.rows]
    for title, items in (("Failures", comparison.failures), ("Regressions", comparison.regressions),
                         ("Improvements", comparison.improvements)):  # fmt: skip
        if items:
            lines += ["", f"**{title}**", ""] + [f"- {item}" for item in items]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_junit(comparison: Comparison, path: Path, *, implementation: str, seconds: float) -> Path:
    """JUnit XML: one test case per key, failed for a hard failure or a regression."""
    suite = TestSuite(f"wacc gate {implementation}")
    per_case = seconds / max(1, len(comparison.rows))
    for key, _, _, status in comparison.rows:
        case = TestCase(key, classname="wacc.gate", time=per_case)
        problems = [
            line
            for line in comparison.failures + comparison.regressions
            if line.startswith(f"{key}:")
        ]
        if problems:
            case.result = [Failure("\n".join(problems), type_=status)]
        suite.add_testcase(case)
    xml = JUnitXml()
    xml.add_testsuite(suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    xml.write(str(path), pretty=True)
    return path
