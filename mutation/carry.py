"""Triaged survivors carried over instead of run again, while their function is unchanged.

A survivor triaged ``equivalent`` or ``accepted`` runs every test that covers its function and
passes them all: in the core functions that is 500-950 tests, 35-50 s each on 2 cores, and such
survivors were most of a full run's time. A test change cannot make a survivor *more* surviving,
so running it again can only tell that a new test now kills it; what it can never show is a
weakening of the suite, which is what a re-run of the report is for. So a run carries the verdict
of a triaged survivor whose function's source has mutmut's same hash as in the run that last
confirmed the verdict (``function_hash`` in ``triage.csv``, written by ``mutation report``), the
way PIT's and Stryker's incremental modes reuse a result while code and tests are unchanged. Any
edit of the function (or of the mutmut version, which could renumber its mutants) runs it again;
``python -m mutation run --rerun-triaged`` runs every one.

The list goes to ``mutants/wacc-carry.json``, where ``tests/conftest.py`` reads it: under a
carried mutant, pytest exits at once with mutmut's "skipped" code (34), reported as *carried*.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from mutation.triage import Verdict

CARRY = Path("mutants") / "wacc-carry.json"  # under the run's root; tests/mutant.py reads it
CARRIED_EXIT = 34  # mutmut's exit code for "skipped"; mutation.outcomes reports it as carried


def function_key(mutant: str) -> str:
    """``wacc_torch.x.xǁCǁf__mutmut_3`` -> ``wacc_torch.x.xǁCǁf``: mutmut's key of the function."""
    return mutant.rsplit("__mutmut_", 1)[0]


def function_hashes(root: Path) -> dict[str, str]:
    """mutmut's hash of every function in every file it mutates under ``root``, by its key
    (``wacc_ref.bounds.x_f``), computed by mutmut's own function from the unmutated source."""
    from mutmut.configuration import reset_config
    from mutmut.mutation.file_mutation import compute_function_hashes
    from mutmut.utils.file_utils import walk_mutatable_files

    from mutation.outcomes import in_directory

    hashes: dict[str, str] = {}
    with in_directory(root):
        reset_config()  # mutmut caches the config of the directory it was first asked in
        for path in walk_mutatable_files():
            module = ".".join(Path(path).with_suffix("").parts)
            source = Path(path).read_text(encoding="utf-8")
            for key, value in compute_function_hashes(source).items():
                hashes[f"{module}.{key}"] = value
    return hashes


def carried(verdicts: Mapping[str, Verdict], hashes: Mapping[str, str]) -> list[str]:
    """The triaged mutants whose function has the hash their verdict was confirmed at, sorted."""
    return sorted(
        name
        for name, verdict in verdicts.items()
        if verdict.function_hash and hashes.get(function_key(name)) == verdict.function_hash
    )


def write_carry(root: Path, names: list[str]) -> None:
    """``mutants/wacc-carry.json`` under ``root`` (made if missing): the mutants to carry."""
    path = root / CARRY
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"carried": names}, indent=0), encoding="utf-8")


def confirmed_hashes(
    verdicts: Mapping[str, Verdict], survivors_run: Mapping[str, str], run_hashes: Mapping[str, str]
) -> dict[str, Verdict]:
    """The verdicts with ``function_hash`` set for every mutant that this run *ran* and saw
    survive with the change its row names (``survivors_run``: name -> change): the hash of its
    function in that run (``run_hashes``, mutmut's stats). Other rows are returned as they are."""
    updated = dict(verdicts)
    for name, change in survivors_run.items():
        verdict = verdicts.get(name)
        run_hash = run_hashes.get(function_key(name))
        if verdict is None or verdict.change != change or run_hash is None:
            continue
        updated[name] = Verdict(
            verdict.mutant, verdict.change, verdict.verdict, verdict.reason, run_hash
        )
    return updated
