"""Scores per group and module, the survivors' verdicts, and the files of ``reports/mutation/``.

The score of a group is ``detected / (generated - equivalent)``: a mutant no test can tell apart
from the code is no test's failure; an *accepted* survivor still counts against the score.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from mutation.outcomes import DETECTED, NOT_RUN, Outcome
from mutation.scope import GROUPS, Group, group_of
from mutation.triage import Verdict


@dataclass
class Tally:
    """Counts of one module or group."""

    generated: int = 0
    killed: int = 0
    timeout: int = 0
    survived: int = 0
    no_tests: int = 0
    not_run: int = 0
    equivalent: int = 0
    accepted: int = 0

    def add(self, outcome: Outcome, verdict: Verdict | None) -> None:
        self.generated += 1
        if outcome.status == "timeout":
            self.timeout += 1
        elif outcome.status in DETECTED:
            self.killed += 1
        elif outcome.status == "no tests":
            self.no_tests += 1
        elif outcome.status in NOT_RUN:
            self.not_run += 1
        else:
            self.survived += 1
        if verdict is not None and outcome.survived:
            if verdict.verdict == "equivalent":
                self.equivalent += 1
            else:
                self.accepted += 1

    @property
    def score(self) -> Fraction | None:
        """Over the mutants run (a partial run is scored on what it ran, and says so)."""
        counted = self.generated - self.not_run - self.equivalent
        return Fraction(self.killed + self.timeout, counted) if counted else None


@dataclass
class Findings:
    """Everything the report states and checks."""

    outcomes: list[Outcome]
    verdicts: Mapping[str, Verdict]
    groups: dict[str, Tally] = field(default_factory=dict)
    modules: dict[str, Tally] = field(default_factory=dict)
    gaps: list[Outcome] = field(default_factory=list)  # survivors with no verdict
    stale: list[str] = field(default_factory=list)  # triage rows that no longer apply

    @property
    def problems(self) -> list[str]:
        """Why the report fails its targets (empty when it meets them)."""
        found = [f"untriaged survivor {o.name} ({o.status}): {o.change}" for o in self.gaps]
        found += self.stale
        not_run = sum(tally.not_run for tally in self.groups.values())
        if not_run:
            found.append(f"{not_run} mutants not run: the run stopped part way")
        for group in GROUPS:
            tally = self.groups.get(group.name)
            if tally is None or tally.generated == 0:
                found.append(f"{group.name}: no mutants (is [tool.mutmut] in step with scope?)")
            elif tally.score is None:
                found.append(f"{group.name}: no mutant of its {tally.generated} was run")
            elif tally.score < group.target:
                found.append(
                    f"{group.name}: score {percent(tally.score)} is below its target "
                    f"{percent(group.target)}"
                )
        return found


def percent(value: Fraction | None) -> str:
    """A score, rounded *down* to 0.1 % (a report never claims more than was measured)."""
    if value is None:
        return "n/a"
    tenths = (value * 1000).numerator // (value * 1000).denominator
    return f"{tenths // 10}.{tenths % 10} %"


def judge(outcomes: Sequence[Outcome], verdicts: Mapping[str, Verdict]) -> Findings:
    """Tally every mutant, find the untriaged survivors and the stale triage rows."""
    findings = Findings(outcomes=list(outcomes), verdicts=verdicts)
    by_name = {outcome.name: outcome for outcome in outcomes}
    for outcome in outcomes:
        verdict = usable_verdict(verdicts, outcome)
        group = group_of(outcome.path)
        findings.groups.setdefault(group.name, Tally()).add(outcome, verdict)
        findings.modules.setdefault(outcome.path, Tally()).add(outcome, verdict)
        if outcome.survived and verdict is None:
            findings.gaps.append(outcome)
    for name, row in verdicts.items():
        mutant = by_name.get(name)
        if mutant is None:
            findings.stale.append(f"triage row {name}: no such mutant any more; remove the row")
        elif row.change != mutant.change:
            findings.stale.append(
                f"triage row {name}: written for `{row.change}`, the mutant is now "
                f"`{mutant.change}`; triage it again"
            )
        elif not mutant.survived:
            findings.stale.append(f"triage row {name}: the mutant is now {mutant.status}")
    return findings


_COUNT_HEADER = (
    "| generated | killed | timeout | survived | no tests | not run | equivalent | accepted "
    "| score |"
)


def _count_cells(tally: Tally) -> str:
    return (
        f"{tally.generated} | {tally.killed} | {tally.timeout} | {tally.survived} | "
        f"{tally.no_tests} | {tally.not_run} | {tally.equivalent} | {tally.accepted} | "
        f"{percent(tally.score)}"
    )


def headline(findings: Findings) -> str:
    """The per-group table (also on docs/mutation.md, between markers)."""
    lines = [
        "| group " + _COUNT_HEADER + " target | met |",
        "|---" * 12 + "|",
    ]
    for group in GROUPS:
        tally = findings.groups.get(group.name, Tally())
        met = tally.score is not None and tally.score >= group.target
        lines.append(
            f"| {group.name} | {_count_cells(tally)} | >= {percent(group.target)} | "
            f"{'yes' if met else 'no'} |"
        )
    return "\n".join(lines)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def markdown(findings: Findings, info: Mapping[str, str]) -> str:
    """``reports/mutation/README.md``."""
    parts = [
        "# wacc mutation testing",
        "",
        "Written by `python -m mutation report` from the last `mutmut run`; do not edit by hand. "
        "Score = (killed + timeout) / (generated - not run - equivalent): an equivalent mutant "
        "is one no input can tell from the code; an accepted survivor still counts against it. "
        "Every survivor is triaged in `triage.csv` (equivalent or accepted, with the reason); "
        "`results.csv` lists every mutant.",
        "",
        "## Scores",
        "",
        HEADLINE_BEGIN,
        headline(findings),
        HEADLINE_END,
        "",
        "## Per module",
        "",
        "| module " + _COUNT_HEADER,
        "|---" * 10 + "|",
    ]
    for path in sorted(findings.modules):
        parts.append(f"| {path} | {_count_cells(findings.modules[path])} |")
    survivors = [o for o in findings.outcomes if o.survived]
    parts += ["", f"## Survivors ({len(survivors)})", ""]
    if survivors:
        parts += ["| mutant | status | change | verdict | reason |", "|---|---|---|---|---|"]
        for outcome in survivors:
            verdict = usable_verdict(findings.verdicts, outcome)
            parts.append(
                f"| {outcome.name} | {outcome.status} | `{_escape(outcome.change)}` | "
                f"{verdict.verdict if verdict else '**gap**'} | "
                f"{_escape(verdict.reason) if verdict else ''} |"
            )
    problems = findings.problems
    parts += ["", "## Status", ""]
    parts += [f"- {problem}" for problem in problems] or [
        "Every target met, every survivor triaged."
    ]
    parts += ["", "## Provenance", ""]
    parts += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(parts) + "\n"


HEADLINE_BEGIN = "<!-- mutation-scores:begin -->"
HEADLINE_END = "<!-- mutation-scores:end -->"


def replace_headline(text: str, table: str) -> str:
    """``text`` (docs/mutation.md) with the table between the markers replaced."""
    start = text.index(HEADLINE_BEGIN) + len(HEADLINE_BEGIN)
    return text[:start] + "\n" + table + "\n" + text[text.index(HEADLINE_END, start) :]


def write_csv(path: Path, findings: Findings) -> None:
    """``results.csv``: every mutant, its status and the verdict of a survivor."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["mutant", "module", "function", "status", "verdict", "change"])
        for outcome in findings.outcomes:
            verdict = usable_verdict(findings.verdicts, outcome)
            label = (verdict.verdict if verdict else "gap") if outcome.survived else ""
            row = [outcome.name, outcome.path, outcome.function, outcome.status, label]
            writer.writerow([*row, outcome.change])


def usable_verdict(verdicts: Mapping[str, Verdict], outcome: Outcome) -> Verdict | None:
    """The triage row of ``outcome``, or None when there is none or it was written about another
    change (mutmut renumbers mutants when a function is edited; such a row is reported stale)."""
    verdict = verdicts.get(outcome.name)
    return verdict if verdict is not None and verdict.change == outcome.change else None


def group_names() -> list[str]:
    return [group.name for group in GROUPS]


__all__ = ["Findings", "Group", "Tally", "judge", "markdown", "percent", "write_csv"]
