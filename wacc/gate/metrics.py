"""What the gate measures per key and what its files hold: light, so that a baseline is read and
judged (``wacc.gate.baseline``) before the judge and torch are imported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wacc.judge.verdict import ScenarioVerdict

__all__ = ["GATE_CORPUS", "GATE_CORPUS_SEED", "GATE_CORPUS_SIZE", "GateFinding", "Metrics"]

GATE_CORPUS_SEED = 0
GATE_CORPUS_SIZE = "default"
GATE_CORPUS: dict[str, int | str] = {"seed": GATE_CORPUS_SEED, "size": GATE_CORPUS_SIZE}


@dataclass(frozen=True)
class GateFinding:
    """One failing scenario: what makes it one with others (:mod:`wacc.judge.signature`), its first
    failure lines, the replay file written for it (``None`` without ``--out``) and its number of
    steps."""

    signature: str
    message: str
    replay: str | None = None
    steps: int = 0  # the scenario's length: a group shows its shortest


@dataclass
class Metrics:
    """What the gate tracks for one key: counts, the worst metrics, the time spent, and every
    failing scenario (the shrunk one for a check family)."""

    scenarios: int = 0
    failing: int = 0
    max_ulps: float = 0.0
    max_ratio: float = 0.0
    findings: list[GateFinding] = dataclasses.field(default_factory=list)
    milliseconds: int = 0  # measured: the JUnit time of the key

    def add(self, verdict: ScenarioVerdict, *, counted: bool = True) -> None:
        """Count a judged scenario (``counted=False``: a shrunk failure, metrics only)."""
        self.scenarios += counted
        self.max_ulps = max(self.max_ulps, verdict.maximum("max_ulps"))
        self.max_ratio = max(self.max_ratio, verdict.maximum("max_ratio"))
        self.failing += counted and verdict.failed

    def merged(self, other: Metrics) -> Metrics:
        """Both together (sums, maxima, the findings of both)."""
        return Metrics(
            scenarios=self.scenarios + other.scenarios,
            failing=self.failing + other.failing,
            max_ulps=max(self.max_ulps, other.max_ulps),
            max_ratio=max(self.max_ratio, other.max_ratio),
            findings=self.findings + other.findings,
            milliseconds=self.milliseconds + other.milliseconds,
        )
