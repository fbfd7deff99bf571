"""The CI smoke run: a fixed handful of mutants the report says are killed, killed again.

``reports/mutation/smoke.csv`` names each sampled mutant, its change (as ``results.csv`` has it)
and the tests that kill it.  The run copies the repository to a temporary directory, narrows
``[tool.mutmut]`` there to the sampled files and those tests (so mutmut's stats and clean runs
take seconds, not the full selection's half hour), runs ``mutmut run`` on the sampled names and
fails if any of them is not killed, or is no longer the change the report names (then the report
is stale: rerun ``tox -e mutation``).  It proves the harness still works end to end (mutants are
generated, the trampolines switch them on, the tests see them) on the code as it is now.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mutation.outcomes import read_outcomes
from mutation.scope import mutmut_config, mutmut_table
from wacc.judge.profiles import MUTATION_PROFILE

SMOKE_COLUMNS = ("mutant", "change", "tests")


class SmokeError(ValueError):
    """The smoke file or the report it refers to cannot be used (the message says why)."""


@dataclass(frozen=True)
class Sample:
    mutant: str
    change: str
    tests: tuple[str, ...]

    @property
    def path(self) -> str:
        """The source file: ``wacc_ref.bounds.x_f__mutmut_1`` -> ``wacc_ref/bounds.py``."""
        return self.mutant.rpartition(".")[0].replace(".", "/") + ".py"


def read_samples(path: Path, results: Path) -> list[Sample]:
    """The sampled mutants, each checked against ``results.csv``: killed, with the same change."""
    with results.open(newline="", encoding="utf-8") as handle:
        recorded = {row["mutant"]: row for row in csv.DictReader(handle)}
    samples = []
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != SMOKE_COLUMNS:
            raise SmokeError(f"{path}: the header must be {','.join(SMOKE_COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            sample = Sample(row["mutant"], row["change"], tuple(row["tests"].split()))
            report = recorded.get(sample.mutant)
            if report is None or report["status"] not in ("killed", "timeout"):
                status = "absent" if report is None else report["status"]
                raise SmokeError(f"{path}:{line}: {sample.mutant} is {status} in {results}")
            if report["change"] != sample.change:
                raise SmokeError(f"{path}:{line}: {sample.mutant} is not the change {results} has")
            if not sample.tests:
                raise SmokeError(f"{path}:{line}: {sample.mutant} names no test")
            samples.append(sample)
    if not samples:
        raise SmokeError(f"{path}: no sampled mutant")
    return samples


_MUTMUT_TABLE = re.compile(r"^\[tool\.mutmut\]\n(?:(?!\[).*\n|\n)*", re.MULTILINE)


def narrowed_pyproject(text: str, samples: list[Sample]) -> str:
    """``pyproject.toml`` with ``[tool.mutmut]`` mutating only the sampled files, running only
    their tests (JSON strings and arrays are TOML too)."""
    table = mutmut_table(text)
    table["only_mutate"] = sorted({sample.path for sample in samples})
    table["pytest_add_cli_args_test_selection"] = sorted(
        {test for sample in samples for test in sample.tests}
    )
    lines = ["[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    narrowed, count = _MUTMUT_TABLE.subn("\n".join(lines) + "\n\n", text)
    if count != 1:
        raise SmokeError("pyproject.toml has no [tool.mutmut] table to narrow")
    return narrowed


def _copy_tree(root: Path, target: Path) -> None:
    tracked = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, tracked):
        source = root / name
        if source.is_file():
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)


def run_smoke(root: Path, samples: list[Sample], *, timeout: float) -> list[str]:
    """Run mutmut on the samples in a narrowed copy; the problems found (empty: all killed)."""
    mutmut_config(root)  # the real table must be there to narrow
    with tempfile.TemporaryDirectory(prefix="wacc-mutation-smoke-") as tmp:
        work = Path(tmp)
        _copy_tree(root, work)
        pyproject = work / "pyproject.toml"
        pyproject.write_text(
            narrowed_pyproject(pyproject.read_text(encoding="utf-8"), samples), encoding="utf-8"
        )
        env = dict(
            os.environ, HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", MUTATION_PROFILE)
        )
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", "2"]
        completed = subprocess.run(
            command + [sample.mutant for sample in samples],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if completed.returncode != 0:
            tail = (completed.stdout + completed.stderr)[-2000:]
            return [f"`mutmut run` exited {completed.returncode}:\n{tail}"]
        outcomes = {outcome.name: outcome for outcome in read_outcomes(work)}
    problems = []
    for sample in samples:
        outcome = outcomes.get(sample.mutant)
        if outcome is None:
            problems.append(f"{sample.mutant}: mutmut generated no such mutant (report stale?)")
        elif outcome.change != sample.change:
            problems.append(
                f"{sample.mutant}: now `{outcome.change}`, the report has `{sample.change}`; "
                "the code changed: rerun `tox -e mutation` and pick the sample again"
            )
        elif not outcome.detected:
            problems.append(
                f"{sample.mutant} ({sample.change}) {outcome.status}; the report says it is "
                f"killed by {' '.join(sample.tests)}"
            )
    return problems
