"""The gate's measurements: work units, shards, and metrics per (dtype, family, source) key.

Two sources, both deterministic: ``corpus`` (the report's seeded corpus, one unit per scenario)
and ``check`` (``wacc check``'s families and stateful machine under the ``ci`` profile, one unit
per work dtype x family). Unit ``i`` of the ordered list belongs to shard ``i mod N`` (shard
``K/N`` takes ``i mod N == K - 1``), so shards are disjoint, cover everything, and merging their
metrics (sums of counts, maxima of metrics: associative) equals the unsharded run exactly.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from wacc.engine import CheckConfig, family_names, run_family
from wacc.implementation import Implementation
from wacc.report.corpus import CorpusEntry, build_corpus
from wacc.verdict import ORACLES, ScenarioVerdict, judge
from wacc_ref import formats
from wacc_ref.strict_json import shown

__all__ = [
    "GATE_CORPUS",
    "GATE_CORPUS_SEED",
    "GATE_CORPUS_SIZE",
    "Metrics",
    "Shard",
    "Unit",
    "measure",
    "merge_metrics",
    "units",
]

_SHARD = re.compile(r"([1-9][0-9]{0,8})/([1-9][0-9]{0,8})")
GATE_CORPUS_SEED = 0
GATE_CORPUS_SIZE = "default"
GATE_CORPUS: dict[str, int | str] = {"seed": GATE_CORPUS_SEED, "size": GATE_CORPUS_SIZE}


@dataclass(frozen=True, order=True)
class Shard:
    """Shard ``index`` (1-based) of ``count``."""

    index: int = 1
    count: int = 1

    @classmethod
    def parse(cls, text: object) -> Shard:
        """``"K/N"`` with ``1 <= K <= N``; ``ValueError`` naming the text otherwise.

        Only the spelling :meth:`__str__` writes: ASCII digits without sign, space or leading
        zero (``int()`` would also take ``"+1"``, ``" 1"`` and ``"١"``), at most 9 of them.
        """
        match = _SHARD.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"must be K/N (decimal digits, no sign, space or leading zero), got {shown(text)}"
            )
        index, count = int(match[1]), int(match[2])
        if not index <= count:
            raise ValueError(f"K/N needs 1 <= K <= N, got {shown(text)}")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def takes(self, position: int) -> bool:
        """Whether unit ``position`` of the ordered unit list is in this shard."""
        return position % self.count == self.index - 1


@dataclass
class Metrics:
    """What the gate tracks for one key: counts and the worst metrics."""

    scenarios: int = 0
    failing: int = 0
    max_ulps: float = 0.0
    max_ratio: float = 0.0
    findings: list[str] = dataclasses.field(default_factory=list)  # failure lines (first few)

    def add(self, verdict: ScenarioVerdict, *, counted: bool = True) -> None:
        """Count a judged scenario (``counted=False``: a shrunk failure, metrics only)."""
        self.scenarios += counted
        self.max_ulps = max(self.max_ulps, verdict.maximum("max_ulps"))
        self.max_ratio = max(self.max_ratio, verdict.maximum("max_ratio"))
        if verdict.failed:
            self.failing += counted
            if len(self.findings) < 3:
                self.findings.append("; ".join(verdict.describe(limit=2)))

    def merged(self, other: Metrics) -> Metrics:
        """Both together (sums and maxima)."""
        return Metrics(
            scenarios=self.scenarios + other.scenarios,
            failing=self.failing + other.failing,
            max_ulps=max(self.max_ulps, other.max_ulps),
            max_ratio=max(self.max_ratio, other.max_ratio),
            findings=(self.findings + other.findings)[:3],
        )


@dataclass(frozen=True)
class Unit:
    """One unit of gate work: a corpus scenario, or one check family on one dtype."""

    key: str  # "<dtype>/<family>/<source>"
    entry: CorpusEntry | None = None
    dtype: str = ""
    family: str = ""


def units(corpus: Iterable[CorpusEntry]) -> list[Unit]:
    """Every unit, in the fixed order shards are cut from: the checks first, then the corpus."""
    out = [
        Unit(key=f"{dtype}/{family}/check", dtype=dtype, family=family)
        for dtype in formats.WORK_DTYPES
        for family in family_names()
    ]
    out += [
        Unit(key=f"{entry.scenario.work_dtype}/{entry.family}/corpus", entry=entry)
        for entry in corpus
    ]
    return out


def measure(
    implementation: Implementation,
    *,
    shard: Shard = Shard(),
    corpus: list[CorpusEntry] | None = None,
    progress: Callable[[str], None] = lambda key: None,
) -> dict[str, Metrics]:
    """Run this shard's units; metrics per key (keys of other shards absent)."""
    if corpus is None:
        corpus = build_corpus(size=GATE_CORPUS_SIZE, corpus_seed=GATE_CORPUS_SEED)
    results: dict[str, Metrics] = {}
    # No shrinking: the gate reports that a key fails; `wacc check` shrinks and explains.
    config = CheckConfig(profile="ci", shrink_seconds=0.0)
    for position, unit in enumerate(units(corpus)):
        if not shard.takes(position):
            continue
        progress(unit.key)
        metrics = results.setdefault(unit.key, Metrics())
        if unit.entry is not None:
            scenario = dataclasses.replace(unit.entry.scenario, fused=implementation.fused)
            metrics.add(judge(implementation, scenario, oracles=ORACLES))
        else:
            shrunk = run_family(
                implementation, unit.dtype, unit.family, config, on_verdict=metrics.add
            )
            if shrunk is not None:
                metrics.add(shrunk, counted=False)
    return results


def merge_metrics(parts: Iterable[Mapping[str, Metrics]]) -> dict[str, Metrics]:
    """The union of shard results (a key in several shards is merged)."""
    merged: dict[str, Metrics] = {}
    for part in parts:
        for key, metrics in part.items():
            merged[key] = merged[key].merged(metrics) if key in merged else metrics
    return dict(sorted(merged.items()))
