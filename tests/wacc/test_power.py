"""The judge's power: every planted bug of :mod:`tests.wacc.planted` is flagged, shrunk short."""

from __future__ import annotations

import pytest

from tests.wacc.planted import PLANTED, HysteresisKeptAtGrowth, Planted, WeightInFloat32
from wacc.judge.engine import CheckConfig, run_family
from wacc.judge.implementation import DEFAULT_IMPL, load_implementation
from wacc.judge.verdict import ScenarioVerdict, judge
from wacc_ref.scenario import (
    Accumulate,
    Finish,
    ScalerOptions,
    Scenario,
    SetLossScale,
    UpdateScaler,
)

MAX_SHRUNK_ACCUMULATES = 3  # the limit for a shrunk scenario
EXAMPLES = 100  # per planted bug (the ci budget); each stops at its first failure
FOUND_BY_GENERATION = [name for name, planted in PLANTED.items() if planted.fewest is not None]


def _accumulates(verdict: ScenarioVerdict) -> int:
    return sum(isinstance(step, Accumulate) for step in verdict.scenario.steps)


def _flagged(planted: Planted) -> ScenarioVerdict:
    verdict = run_family(
        planted.implementation, planted.dtype, planted.family, CheckConfig(examples=EXAMPLES)
    )
    assert verdict is not None, f"{planted.cls.__name__} passed the {planted.family} family"
    return verdict


def test_planted_bugs_are_at_least_fifteen() -> None:
    """The power test plants at least fifteen distinct bugs that the generated scenarios find."""
    assert len({planted.cls for planted in PLANTED.values()}) == len(PLANTED)
    assert len(FOUND_BY_GENERATION) >= 15


@pytest.mark.parametrize("name", FOUND_BY_GENERATION)
def test_planted_bug_is_flagged_with_a_short_shrunk_scenario(name: str) -> None:
    """The engine flags the planted bug through its own oracle, shrunk to at most 3 accumulates."""
    planted = PLANTED[name]
    verdict = _flagged(planted)
    assert planted.oracle in verdict.failed_oracles, verdict.describe()
    # Flagged for the planted deviation, not because the variant crashed.
    assert not any((step.actual_error or "").startswith("unexpected") for step in verdict.steps), (
        verdict.messages
    )
    assert planted.fewest is not None
    assert planted.fewest <= _accumulates(verdict) <= MAX_SHRUNK_ACCUMULATES, verdict.describe()


def _big_window() -> Scenario:
    # 2**24 + 1 tokens: W needs 25 bits, so a float32 W rounds it to 2**24.
    return Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("w", (1,)),),
        steps=(
            Accumulate(kind="sum", weight=2.0**24, grads=(("w", (1.0,)),)),
            Accumulate(kind="sum", weight=1.0, grads=(("w", (1.0,)),)),
            Finish("mean"),
        ),
    )


def test_weight_in_float32_is_flagged_on_a_window_beyond_two_to_the_24() -> None:
    """A float32 W is flagged (semantics) on a window of 2**24 + 1 tokens."""
    verdict = judge(PLANTED[WeightInFloat32.__name__].implementation, _big_window())
    assert "semantics" in verdict.failed_oracles
    assert any("total_weight" in line for line in verdict.describe())
    assert isinstance(verdict.scenario.steps[-1], Finish)


def test_weight_in_float32_is_found_by_the_engine() -> None:
    """The generated windows reach a total weight that float32 cannot hold."""
    _flagged(PLANTED[WeightInFloat32.__name__])


def test_hysteresis_kept_at_growth_is_flagged_on_overflow_growth_overflow() -> None:
    """Hysteresis 2, interval 1: an overflow is absorbed, a clean window grows the scale and
    restores the hysteresis, so the next overflow is absorbed again; the planted scaler backs
    off there instead, and the judge names that update's scale (semantics)."""
    scenario = Scenario(
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=1024.0,
        fused=False,
        parameters=(("w", (1,)),),
        steps=(
            UpdateScaler(True),
            UpdateScaler(False),
            SetLossScale(2048.0),
            Accumulate(kind="sum", weight=1.0, grads=(("w", (1.0,)),)),
            Finish("sums"),
            UpdateScaler(True),
        ),
        scaler=ScalerOptions(growth_interval=1, hysteresis=2),
    )
    verdict = judge(PLANTED[HysteresisKeptAtGrowth.__name__].implementation, scenario)
    assert verdict.failed_oracles == ("semantics",), verdict.describe()
    (line,) = verdict.describe()
    expected = "step 5 (update_scaler) scaler.scale: expected 2048.0 (0x1.0000000000000p+11)"
    assert expected in line, line
    correct = judge(load_implementation(DEFAULT_IMPL), scenario)
    assert not correct.failed, correct.describe()  # wacc_torch's scaler passes the same loop


def test_stateful_machine_flags_a_planted_bug() -> None:
    """The stateful machine returns the shrunk failing scenario of a planted bug."""
    planted = PLANTED["ZeroWeightNotCounted"]
    verdict = run_family(planted.implementation, "float32", "stateful", CheckConfig(examples=20))
    assert verdict is not None
    assert "semantics" in verdict.failed_oracles
    assert _accumulates(verdict) <= MAX_SHRUNK_ACCUMULATES
