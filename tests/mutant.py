"""How the suite behaves when mutmut runs it for one mutant (issue 16).

mutmut names the mutant under test in ``MUTANT_UNDER_TEST`` (``...__mutmut_<n>``; its stats and
clean runs use other values), and runs its pytest in ``mutants/``, next to the per-test
durations its stats phase wrote. Never set in CI or a developer's run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

MUTANT_MARK = "__mutmut_"  # in the name of every mutant mutmut runs (not its stats or clean runs)
STATS = Path("mutmut-stats.json")  # relative: mutmut's pytest runs in mutants/
CARRY = Path("wacc-carry.json")  # written there by `python -m mutation run` (mutation/carry.py)
CARRIED_EXIT = 34  # mutmut's "skipped": the report counts it as a carried survivor


class _Item(Protocol):
    nodeid: str


def under_mutant() -> bool:
    """Whether this process runs the tests of one mutant."""
    return MUTANT_MARK in os.environ.get("MUTANT_UNDER_TEST", "")


def mutant_under_test() -> str | None:
    """The name of the mutant this process runs the tests of, if any."""
    name = os.environ.get("MUTANT_UNDER_TEST", "")
    return name if MUTANT_MARK in name else None


def read_carried(path: Path = CARRY) -> frozenset[str]:
    """The triaged survivors this run carries instead of running (``mutation/carry.py``); none
    if there is no readable file, so a damaged file can only make a run run more."""
    try:
        names = json.loads(path.read_text(encoding="utf-8"))["carried"]
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()
    if not isinstance(names, list):
        return frozenset()
    return frozenset(name for name in names if isinstance(name, str))


def read_durations(path: Path = STATS) -> dict[str, float]:
    """mutmut's call duration of each test, by node id; empty if there is no readable file."""
    try:
        durations = json.loads(path.read_text(encoding="utf-8"))["duration_by_test"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(durations, dict):
        return {}
    return {str(k): float(v) for k, v in durations.items() if isinstance(v, (int, float))}


def fastest_first(items: Sequence[_Item], durations: dict[str, float]) -> list[_Item]:
    """The items by recorded duration, fastest first; one never timed goes last (stable)."""
    unknown = max(durations.values(), default=0.0) + 1.0
    return sorted(items, key=lambda item: durations.get(item.nodeid, unknown))


FIRST_STAGE = 16  # node ids collected before the first test runs; each later stage is 4x larger


def stages(node_ids: Sequence[str], durations: dict[str, float]) -> list[list[str]]:
    """The node ids fastest first, cut into stages of 16, 64, 256, ... ids (the last takes the
    rest): a mutant's pytest collects a stage only once the one before it passed.

    Collecting every covering test (a core function has 500 to 750) costs about a second in each
    forked worker, more than running the test that kills a typical mutant; with stages, a mutant
    killed by one of its fastest tests collects a few modules instead of 30. A survivor still runs
    every id, in the same order, so the verdicts are the same.
    """
    unknown = max(durations.values(), default=0.0) + 1.0
    ordered = sorted(node_ids, key=lambda node_id: durations.get(node_id, unknown))
    cuts: list[list[str]] = []
    size = FIRST_STAGE
    while ordered:
        last = len(ordered) <= 2 * size  # no stage of a few stragglers: the last takes them
        cuts.append(ordered if last else ordered[:size])
        ordered = [] if last else ordered[size:]
        size *= 4
    return cuts
