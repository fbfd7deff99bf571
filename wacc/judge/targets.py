"""What the search climbs: Hypothesis targets on a verdict's worst error/bound ratio and ulps,
so that every family (the engine's and the stateful machine's) steers towards the worst case."""

from __future__ import annotations

import math

from hypothesis import target

from wacc.judge.verdict import ScenarioVerdict

__all__ = ["observe_metrics"]


def observe_metrics(verdict: ScenarioVerdict) -> None:
    """Report ``verdict``'s largest error/bound ratio and ulps as Hypothesis targets (an infinite
    value as 1e300: ``target`` takes finite numbers only)."""
    ratio = verdict.maximum("max_ratio")
    ulps = verdict.maximum("max_ulps")
    target(ratio if math.isfinite(ratio) else 1e300, label="error/bound")
    target(ulps if math.isfinite(ulps) else 1e300, label="ulps")
