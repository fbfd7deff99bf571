"""What the gate prints and writes: a table and grouped failures on stdout, JUnit XML, and a
pull-request summary short enough for a comment (:data:`SUMMARY_MAX_LINES`)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from junitparser import Failure, JUnitXml, Skipped, TestCase, TestSuite

from wacc.gate.compare import Comparison
from wacc.gate.groups import FailureGroup
from wacc.gate.measure import Metrics
from wacc.tables import format_metric, render_table

__all__ = [
    "SUMMARY_MAX_LINES",
    "failure_lines",
    "replay_command",
    "table",
    "write_junit",
    "write_summary",
]

SUMMARY_MAX_LINES = 60  # a pull-request comment a reviewer reads without scrolling much
_SUMMARY_ROWS = 15  # keys that are not plainly "ok", at most, in the summary's table
_SUMMARY_GROUPS = 5  # failure groups, at most, in the summary
_MESSAGE_CHARS = 300  # a finding's message in the summary (the replay file has everything)


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


def replay_command(replay: str, implementation: str) -> str:
    """The shell command that replays one written failure."""
    return shlex.join(["wacc", "replay", replay, "--impl", implementation])


def _keys_text(group: FailureGroup, limit: int = 6) -> str:
    shown = [f"{key} ({count})" for key, count in list(group.keys.items())[:limit]]
    more = len(group.keys) - limit
    return ", ".join(shown) + (f" and {more} more key(s)" if more > 0 else "")


def failure_lines(groups: Sequence[FailureGroup], *, implementation: str) -> list[str]:
    """One block per failure group: counts, keys, the first finding and its replay command."""
    lines: list[str] = []
    for group in groups:
        lines.append(
            f"FAILURE {group.count} scenario(s) in {len(group.keys)} key(s): {group.signature}"
        )
        lines.append(f"  keys: {_keys_text(group)}")
        lines.append(f"  first, {group.first_key}: {group.first.message}")
        if group.first.replay is not None:
            files = f" ({len(group.replays)} replay files)" if len(group.replays) > 1 else ""
            lines.append(f"  replay: {replay_command(group.first.replay, implementation)}{files}")
        else:
            lines.append("  replay: no file written (wacc gate --out DIR writes them)")
    return lines


def _shortened(text: str) -> str:
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 3] + "..."


def _code(text: str) -> str:
    """``text`` as inline markdown code (a backtick inside cannot end it)."""
    return "`` " + text.replace("`", "'") + " ``"


def write_summary(
    comparison: Comparison,
    path: Path,
    *,
    implementation: str,
    seconds: float,
    groups: Sequence[FailureGroup] = (),
    artifacts: Sequence[str] = (),
    not_judged: Sequence[str] = (),
) -> Path:
    """A markdown summary for a pull-request comment: the verdict, the keys that are not plainly
    ok, the largest failure groups with a replay command each, the regressions (a feature lost
    since the baseline first; before them the missing core features that stopped the run, under
    ``Not run``), what was not judged and why (``not_judged``: one line per missing
    feature), and where the artifacts are. The caps on rows, groups and items keep it within
    :data:`SUMMARY_MAX_LINES` lines (the JUnit XML has every key, the replay folder every
    failure)."""
    verdict = "passed" if comparison.passed else "FAILED"
    failing = sum(group.count for group in groups)
    unchanged = sum(1 for row in comparison.rows if row[3] == "ok")
    keys = len(comparison.rows) - len(comparison.features_not_judged)  # a feature's row: no key
    lines = [
        f"### wacc gate {verdict}: `{implementation}` ({seconds:.0f} s)",
        "",
        f"{failing} failing scenario(s) in {len(groups)} distinct failure(s), "
        f"{len(comparison.regressions)} regression(s), {len(comparison.improvements)} "
        f"improvement(s); {unchanged} of {keys} keys as in the baseline.",
    ]
    notable = [row for row in comparison.rows if row[3] != "ok"]
    if notable:
        lines += ["", "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
        lines += ["| " + " | ".join(_cells(row)) + " |" for row in notable[:_SUMMARY_ROWS]]
        if len(notable) > _SUMMARY_ROWS:
            lines.append(f"| ... and {len(notable) - _SUMMARY_ROWS} more key(s) |" + " |" * 5)
    if groups:
        lines += ["", f"**Failures** ({len(groups)} distinct, largest first)", ""]
        for group in groups[:_SUMMARY_GROUPS]:
            lines.append(
                f"- {group.count} scenario(s) in {len(group.keys)} key(s), first "
                f"{group.first_key}: {_code(_shortened(group.first.message))}"
            )
            if group.first.replay is not None:
                lines.append(f"  replay: `{replay_command(group.first.replay, implementation)}`")
        if len(groups) > _SUMMARY_GROUPS:
            lines.append(f"- ... and {len(groups) - _SUMMARY_GROUPS} more (see the artifacts)")
    for title, items in (("Not run", comparison.unsupported),
                         ("Regressions", comparison.lost + comparison.regressions),
                         ("Improvements", comparison.improvements),
                         ("Not judged", not_judged)):  # fmt: skip
        if items:
            lines += ["", f"**{title}**", ""] + [f"- {item}" for item in items[:_SUMMARY_GROUPS]]
            if len(items) > _SUMMARY_GROUPS:
                lines.append(f"- ... and {len(items) - _SUMMARY_GROUPS} more (see the artifacts)")
    if artifacts:
        lines += ["", "Artifacts: " + "; ".join(artifacts) + "."]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_junit(
    comparison: Comparison, path: Path, *, implementation: str, not_judged: Sequence[str] = ()
) -> Path:
    """JUnit XML: one test case per key, its measured time, failed for a hard failure or a
    regression (the failure text: the key's failure and regression lines, and the replay
    command of its first failing scenarios), skipped when not judged (the text: ``not_judged``,
    why; a row ``feature: <name>``: that feature's line); and a test case ``features``, failed
    for a missing core feature that stopped the run (type ``unsupported``) or a feature lost
    since the baseline (``REGRESSION``)."""
    suite = TestSuite(f"wacc gate {implementation}")
    features = TestCase("features", classname="wacc.gate", time=0.0)
    # A missing core feature (it stopped the run before any key) or a lost one: this case fails.
    problems = comparison.unsupported + comparison.lost
    if problems:
        kind = "unsupported" if comparison.unsupported else "REGRESSION"
        failure = Failure(problems[0][:200], type_=kind)
        failure.text = "\n".join(problems)
        features.result = [failure]
    suite.add_testcase(features)
    for key, now, _, status in comparison.rows:
        case = TestCase(key, classname="wacc.gate", time=now.milliseconds / 1000)
        if status == "not judged":
            # A feature's row: its own line; a key's: every feature's (which one it needs is
            # the family's, not said here).
            why = (
                [comparison.features_not_judged[key]]
                if key in comparison.features_not_judged
                else list(not_judged)
            )
            skipped = Skipped("; ".join(why)[:200] or "not judged")
            skipped.text = "\n".join(why)
            case.result = [skipped]
            suite.add_testcase(case)
            continue
        problems = [
            line
            for line in comparison.failures + comparison.regressions
            if line.startswith(f"{key}:")
        ]
        problems += [
            f"replay: {replay_command(finding.replay, implementation)}"
            for finding in now.findings[:3]
            if finding.replay is not None
        ]
        if problems:
            failure = Failure(problems[0][:200], type_=status)  # CI viewers show the message
            failure.text = "\n".join(problems)
            case.result = [failure]
        suite.add_testcase(case)
    xml = JUnitXml()
    xml.add_testsuite(suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    xml.write(str(path), pretty=True)
    return path
