"""Structure-aware shrinking (wacc.shrink): smaller, still failing, always a valid scenario."""

from __future__ import annotations

from wacc.shrink import shrink_scenario
from wacc_ref.scenario import Accumulate, Checkpoint, Finish, Restore, Scenario, Step


def _scenario(steps: tuple[Step, ...]) -> Scenario:
    return Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=8.0,
        fused=False,
        parameters=(("weight", (2,)), ("bias", ())),
        steps=steps,
    )


BIG = _scenario(
    (
        Accumulate.of("sum", 200.0, {"weight": (3.25, -1.5), "bias": (0.375,)}),
        Checkpoint(),
        Accumulate.of("mean", 7.0, {"weight": (2.0**-20, 5.0)}),
        Restore(),
        Finish("sums"),
        Accumulate.of("mean", 1.0, {"weight": (-7.75, 1.0), "bias": (9.0,)}),
        Accumulate.of("sum", 3.0, {"bias": (-0.125,)}),
        Finish("mean"),
    )
)


def _has_negative_bias_gradient(scenario: Scenario) -> bool:
    return any(
        isinstance(step, Accumulate)
        and any(name == "bias" and values and values[0] < 0 for name, values in step.grads)
        for step in scenario.steps
    )


def test_shrinking_keeps_the_failure_and_removes_everything_else() -> None:
    """A failure that needs one gradient value shrinks to one step holding a simpler value."""
    shrunk = shrink_scenario(BIG, _has_negative_bias_gradient, seconds=30)
    assert _has_negative_bias_gradient(shrunk)
    assert shrunk.parameters == (("bias", ()),) and len(shrunk.steps) == 1
    (step,) = shrunk.steps
    assert isinstance(step, Accumulate) and step.grads == (("bias", (-1.0,)),)
    assert step.weight == 1.0 and shrunk.loss_scale == 1.0


def test_every_candidate_is_a_valid_scenario() -> None:
    """The predicate only ever sees valid scenarios (restores still follow a checkpoint)."""
    seen: list[Scenario] = []

    def record(candidate: Scenario) -> bool:
        seen.append(candidate)
        assert isinstance(candidate, Scenario)
        return any(isinstance(step, Restore) for step in candidate.steps)

    shrunk = shrink_scenario(BIG, record, seconds=30)
    assert seen and [type(step) for step in shrunk.steps] == [Checkpoint, Restore]


def test_a_scenario_that_cannot_shrink_comes_back_unchanged() -> None:
    """When no candidate still fails, the original scenario is returned."""
    assert shrink_scenario(BIG, lambda candidate: candidate == BIG, seconds=30) is BIG
