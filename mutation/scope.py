"""What is mutated, how it is grouped, and the score each group must reach (issue 16).

The modules come from ``[tool.mutmut] only_mutate`` in ``pyproject.toml`` (one list, read here),
so the report can never disagree with what mutmut ran.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the `mutation` extra installs tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Group:
    """Modules scored together, and the least fraction of their non-equivalent mutants killed."""

    name: str
    patterns: tuple[str, ...]
    target: Fraction


# wacc_torch is production code: one score over the package.  Each reference and judge module
# is scored on its own (a strong module must not hide a weak one).
GROUPS: tuple[Group, ...] = (
    Group("wacc_torch", ("wacc_torch/*",), Fraction(95, 100)),
    Group("wacc_ref/oracles.py", ("wacc_ref/oracles.py",), Fraction(90, 100)),
    Group("wacc_ref/bounds.py", ("wacc_ref/bounds.py",), Fraction(90, 100)),
    Group("wacc_ref/accumulator.py", ("wacc_ref/accumulator.py",), Fraction(90, 100)),
    Group("wacc/judge/verdict.py", ("wacc/judge/verdict.py",), Fraction(90, 100)),
    Group("wacc/gate/compare.py", ("wacc/gate/compare.py",), Fraction(90, 100)),
    Group("wacc/judge/shrink.py", ("wacc/judge/shrink.py",), Fraction(90, 100)),
    # What the user reads is tested like what the judge computes (issue 33).
    Group("wacc/report/writer.py", ("wacc/report/writer.py",), Fraction(90, 100)),
    Group("wacc/gate/outputs.py", ("wacc/gate/outputs.py",), Fraction(90, 100)),
    Group("wacc/audit/report.py", ("wacc/audit/report.py",), Fraction(90, 100)),
    Group("wacc/tables.py", ("wacc/tables.py",), Fraction(90, 100)),
)


def mutmut_config(root: Path = ROOT) -> dict[str, object]:
    """The ``[tool.mutmut]`` table of ``pyproject.toml``."""
    return mutmut_table((root / "pyproject.toml").read_text(encoding="utf-8"))


def mutmut_table(text: str) -> dict[str, object]:
    """The ``[tool.mutmut]`` table of a ``pyproject.toml`` text."""
    table = tomllib.loads(text)["tool"]["mutmut"]
    assert isinstance(table, dict)
    return dict(table)


def group_of(path: str) -> Group:
    """The group a mutated file (``wacc_torch/zero_copy.py``) is scored in."""
    for group in GROUPS:
        if any(fnmatch.fnmatch(path, pattern) for pattern in group.patterns):
            return group
    raise KeyError(f"{path} is mutated but belongs to no group of mutation.scope.GROUPS")
