"""One judged row per scenario x implementation x device (the report's ``divergence.csv``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from wacc.judge.implementation import Implementation, load_implementation
from wacc.judge.verdict import ORACLES, ScenarioVerdict, judge
from wacc.report.corpus import FUSED_SUFFIX, CorpusEntry, judged_scenario
from wacc_ref.scenario import Accumulate, Finish, Scenario

__all__ = [
    "FUSED_SUFFIX",
    "IMPLEMENTATIONS",
    "NotJudged",
    "Row",
    "judge_corpus",
    "window_length",
    "weight_skew",
]

# report name -> factory spec, in the order of the headline table
IMPLEMENTATIONS: Mapping[str, str] = {
    "wacc_torch": "wacc.implementation:wacc_torch_reproducible",
    "wacc_torch_fused": "wacc.implementation:wacc_torch_fused",
    "wacc_torch_zero_copy": "wacc.implementation:wacc_torch_zero_copy",
    "pixparse_loop": "wacc.baselines:pixparse_loop",
    "scale_times_weight": "wacc.baselines:scale_times_weight",
    "fused_undeclared": "wacc.baselines:fused_undeclared",
}


@dataclass(frozen=True)
class Row:
    """One line of ``divergence.csv``."""

    scenario_id: str
    family: str
    implementation: str
    device: str
    work_dtype: str
    grad_dtype: str
    window_length: int
    weight_skew: float
    loss_scale: float
    max_ulps: float
    max_rel_error: float
    max_ratio: float
    verdict: str  # "pass" or "fail: <oracles>"
    replay: str  # the replay file (relative to the report) for a failing row, else ""

    @property
    def failed(self) -> bool:
        """Whether an oracle failed on this row."""
        return self.verdict != "pass"


@dataclass(frozen=True)
class NotJudged:
    """A scenario x implementation x device the corpus has but the implementation is not judged
    on: its family (or a step) needs features the implementation lacks (:mod:`wacc.judge.contract`).
    ``divergence.csv`` has a line for it, its verdict ``not judged: <features>``."""

    scenario_id: str
    family: str
    implementation: str
    device: str
    work_dtype: str
    grad_dtype: str
    features: tuple[str, ...]

    @property
    def verdict(self) -> str:
        """``not judged: <feature>, ...``: the words of the CSV's verdict column."""
        return "not judged: " + ", ".join(self.features)


def _windows(scenario: Scenario) -> list[list[Accumulate]]:
    windows: list[list[Accumulate]] = [[]]
    for step in scenario.steps:
        if isinstance(step, Accumulate):
            windows[-1].append(step)
        elif isinstance(step, Finish):
            windows.append([])
    return [window for window in windows if window]


def window_length(scenario: Scenario) -> int:
    """The most microbatches any window of the scenario accumulates."""
    return max((len(window) for window in _windows(scenario)), default=0)


def weight_skew(scenario: Scenario) -> float:
    """The largest ratio of the largest to the smallest positive finite weight in a window."""
    skews = [1.0]
    for window in _windows(scenario):
        weights = [s.weight for s in window if math.isfinite(s.weight) and s.weight > 0]
        if weights:
            skews.append(max(weights) / min(weights))
    return max(skews)


def _row(entry: CorpusEntry, name: str, device: str, verdict: ScenarioVerdict, suffix: str) -> Row:
    scenario = verdict.scenario
    failed = verdict.failed_oracles
    # The corpus scenario, or the twin the implementation was judged on (wacc.report.corpus).
    replay = f"scenarios/{entry.scenario_id}{suffix}.json"
    return Row(
        scenario_id=entry.scenario_id,
        family=entry.family,
        implementation=name,
        device=device,
        work_dtype=scenario.work_dtype,
        grad_dtype=scenario.grad_dtype,
        window_length=window_length(scenario),
        weight_skew=weight_skew(scenario),
        loss_scale=scenario.loss_scale,
        max_ulps=verdict.maximum("max_ulps"),
        max_rel_error=verdict.maximum("max_rel_error"),
        max_ratio=verdict.maximum("max_ratio"),
        verdict="fail: " + ",".join(failed) if failed else "pass",
        replay=replay if failed else "",
    )


def judge_corpus(
    corpus: Sequence[CorpusEntry],
    *,
    implementations: Mapping[str, str] = IMPLEMENTATIONS,
    devices: Sequence[str] = ("cpu",),
    progress: Callable[[], None] = lambda: None,
    not_judged: list[NotJudged] | None = None,
) -> tuple[list[Row], dict[tuple[str, str, str], ScenarioVerdict]]:
    """Judge every entry on every implementation and device with all three oracles.

    Returns the rows and the verdicts keyed by (scenario id, implementation, device). Each
    implementation runs the scenario :func:`~wacc.report.corpus.judged_scenario` gives it (the
    ``fused=True`` twin for a fused one, no checkpoints for one without records); one it
    gives none is not run, and appended to ``not_judged`` (with the features it needs).
    """
    loaded: dict[str, Implementation] = {
        name: load_implementation(spec) for name, spec in implementations.items()
    }
    rows: list[Row] = []
    verdicts: dict[tuple[str, str, str], ScenarioVerdict] = {}
    for entry in corpus:
        for name, implementation in loaded.items():
            taken = judged_scenario(entry, implementation)
            if taken is None:
                lacking = implementation.coverage().lacking(
                    family=entry.family, ops=(step.op for step in entry.scenario.steps)
                )
                for device in devices:
                    if not_judged is not None:
                        not_judged.append(
                            NotJudged(
                                scenario_id=entry.scenario_id, family=entry.family,
                                implementation=name, device=device,
                                work_dtype=entry.scenario.work_dtype,
                                grad_dtype=entry.scenario.grad_dtype, features=lacking,
                            )
                        )  # fmt: skip
                    progress()
                continue
            scenario, suffix = taken
            for device in devices:
                verdict = judge(implementation, scenario, device=device, oracles=ORACLES)
                rows.append(_row(entry, name, device, verdict, suffix))
                verdicts[(entry.scenario_id, name, device)] = verdict
                progress()
    return rows, verdicts
