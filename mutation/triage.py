"""The hand-written verdicts on surviving mutants: ``reports/mutation/triage.csv``.

One row per survivor that is not a gap::

    mutant,change,verdict,reason,function_hash

``verdict`` is ``equivalent`` (no input can tell the mutant from the code: the reason says why)
or ``accepted`` (it can be told apart, but not by a test worth having: the reason says why).
``change`` is the mutant's change as the report prints it: mutmut numbers the mutants of a
function in order, so when a function is edited a name can come to mean another change, and a
row whose change no longer matches is *stale*, never silently applied to a different mutant.
``function_hash`` is mutmut's hash of the mutated function's source (its AST) in the run that
last saw the mutant survive, filled in by ``python -m mutation report``; while the function keeps
that hash, a run carries the verdict over instead of running the mutant again (``mutation.carry``).
Empty for a row no run has confirmed yet.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

VERDICTS = ("equivalent", "accepted")
COLUMNS = ("mutant", "change", "verdict", "reason", "function_hash")
_HASH = re.compile(r"[0-9a-f]{12}")  # mutmut's: the first 12 hex digits of a sha256


class TriageError(ValueError):
    """The triage file cannot be read as written (the message names the line and field)."""


@dataclass(frozen=True)
class Verdict:
    mutant: str
    change: str
    verdict: str
    reason: str
    function_hash: str = ""


def read_triage(path: Path) -> dict[str, Verdict]:
    """The verdicts by mutant name; a missing file is no verdicts."""
    if not path.exists():
        return {}
    verdicts: dict[str, Verdict] = {}
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise TriageError(f"{path}: the header must be {','.join(COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            if None in row or any(row[column] is None for column in COLUMNS):
                raise TriageError(f"{path}:{line}: expected {len(COLUMNS)} fields")
            verdict = Verdict(**{column: row[column].strip() for column in COLUMNS})
            if verdict.verdict not in VERDICTS:
                allowed = ", ".join(VERDICTS)
                raise TriageError(
                    f"{path}:{line}: verdict {verdict.verdict!r} is not one of {allowed}"
                )
            if not verdict.reason:
                raise TriageError(f"{path}:{line}: {verdict.mutant} has no reason")
            if verdict.function_hash and not _HASH.fullmatch(verdict.function_hash):
                raise TriageError(
                    f"{path}:{line}: function_hash {verdict.function_hash!r} is not 12 "
                    "lowercase hex digits (mutmut's hash) or empty"
                )
            if verdict.mutant in verdicts:
                raise TriageError(f"{path}:{line}: {verdict.mutant} is triaged twice")
            verdicts[verdict.mutant] = verdict
    return verdicts


def write_triage(path: Path, verdicts: list[Verdict]) -> None:
    """Rewrite the file, sorted by mutant name (the report's order)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(COLUMNS)
        for verdict in sorted(verdicts, key=lambda v: v.mutant):
            writer.writerow(
                [
                    verdict.mutant,
                    verdict.change,
                    verdict.verdict,
                    verdict.reason,
                    verdict.function_hash,
                ]
            )
