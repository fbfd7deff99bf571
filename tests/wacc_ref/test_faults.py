"""The reference's outcome of a structural fault (semantics §5, §11): a refused one is
ParameterMismatchError at any weight with nothing changed, an accepted one is the dense step."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import find

from tests.wacc_ref.scenario_support import FAULT_SHAPES, FAULT_VALUES, fault_scenario
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.errors import InvalidWeightError, ParameterMismatchError
from wacc_ref.faults import ACCEPTED_FAULTS, FAULT_KINDS, REFUSED_FAULTS, Fault, fault_problem
from wacc_ref.oracles import run_reference
from wacc_ref.scenario import Accumulate
from wacc_ref.strategies import faults
from wacc_ref.traces import ScenarioTrace


def _keys(trace: ScenarioTrace) -> list[tuple[object, ...]]:
    return [outcome.key()[1:] for outcome in trace.outcomes]  # (the index differs)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("weight", [1.0, 0.0])
@pytest.mark.parametrize("kind", REFUSED_FAULTS)
def test_a_refused_fault_raises_parameter_mismatch_and_changes_nothing(
    kind: str, weight: float, op: str
) -> None:
    """The faulty step raises ParameterMismatchError at weight 1 and 0, its state is the state
    before it, and the rest of the window runs as if the step had not been made."""
    trace = run_reference(fault_scenario(kind, weight, op))
    without = run_reference(fault_scenario(kind, weight, op, middle=False))
    assert trace.outcomes[1].error == "ParameterMismatchError"
    assert trace.outcomes[1].state.key() == trace.outcomes[0].state.key()
    assert _keys(trace)[2:] == _keys(without)[1:]


@pytest.mark.parametrize("kind", ACCEPTED_FAULTS)
def test_an_accepted_fault_is_the_dense_step(kind: str) -> None:
    """A non-contiguous or channels-last gradient gives what the dense one gives; a missing
    name what the step without that entry gives."""
    scenario = fault_scenario(kind, 1.0, "mean")
    step = scenario.steps[1]
    assert isinstance(step, Accumulate) and step.fault is not None
    name = step.fault.name
    grads = tuple(g for g in step.grads if not (kind == "missing" and g[0] == name))
    dense = dataclasses.replace(step, grads=grads, fault=None)
    plain = dataclasses.replace(scenario, steps=(scenario.steps[0], dense, *scenario.steps[2:]))
    assert _keys(run_reference(scenario)) == _keys(run_reference(plain))
    if kind == "missing":  # the left-out name contributes nothing: not the full step
        full = dataclasses.replace(step, fault=None)
        with_all = dataclasses.replace(
            scenario, steps=(scenario.steps[0], full, *scenario.steps[2:])
        )
        assert _keys(run_reference(scenario)) != _keys(run_reference(with_all))


def test_the_weight_is_checked_before_the_structure() -> None:
    """§5's check order: a negative weight with a malformed gradient is InvalidWeightError."""
    scenario = fault_scenario("int64", -1.0, "sum")
    assert run_reference(scenario).outcomes[1].error == "InvalidWeightError"


def test_a_mean_weight_that_does_not_survive_d_comes_after_the_structure() -> None:
    """§5's check order: a float16 mean of weight 10**6 (w_D = inf) with a bool gradient is
    ParameterMismatchError; without the fault it is InvalidWeightError."""
    faulty = fault_scenario("bool", 1e6, "mean", work="float16")
    assert run_reference(faulty).outcomes[1].error == "ParameterMismatchError"
    step = faulty.steps[1]
    assert isinstance(step, Accumulate)
    clean = dataclasses.replace(
        faulty, steps=(faulty.steps[0], dataclasses.replace(step, fault=None), *faulty.steps[2:])
    )
    assert run_reference(clean).outcomes[1].error == "InvalidWeightError"
    assert Fault("bool", "w").refused


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_the_strategy_draws_every_fault_kind(kind: str) -> None:
    """wacc_ref.strategies.faults reaches each kind for a step holding a (2, 2) and a rank-4
    gradient, and every fault it draws applies (the scenario with it is valid)."""
    grads = tuple(FAULT_VALUES.items())
    drawn = find(faults(tuple(FAULT_SHAPES.items()), grads), lambda fault: fault.kind == kind)
    assert fault_problem(drawn, FAULT_SHAPES) is None


def test_the_refusals_due_list_every_failing_check_in_the_order_of_s5() -> None:
    """The reference's accumulate steps know every §11 class their inputs call for, in §5's
    order, the first being the one raised: a negative weight with an int64 gradient is due both
    (weight first); a float16 mean of 10**6 with a bool gradient is due both (structure first);
    a transposed (non-contiguous) gradient with a negative weight is due the weight's only (§5
    accepts the layout); a clean step none. Other steps say None (not known)."""
    cases = [
        (fault_scenario("int64", -1.0, "sum"), ("InvalidWeightError", "ParameterMismatchError")),
        (
            fault_scenario("bool", 1e6, "mean", work="float16"),
            ("ParameterMismatchError", "InvalidWeightError"),
        ),
        (fault_scenario("transposed", -1.0, "mean"), ("InvalidWeightError",)),
        (fault_scenario("transposed", 1.0, "mean"), ()),
    ]
    for scenario, due in cases:
        outcomes = run_reference(scenario).outcomes
        assert outcomes[1].due == due, (scenario, outcomes[1])
        assert outcomes[1].error == (due[0] if due else None)
        assert outcomes[0].due == () and outcomes[-1].due is None


def test_the_refusals_due_judge_params_against_the_binding_of_an_open_window() -> None:
    """Once a window holds a step (issued 1, then 2), params with another name or another shape
    than the bound ones are due ParameterMismatchError, the class the step then raises; in a
    window with nothing in it (after finish_sums) the same params are due nothing, and the step
    takes them as the new binding (semantics §5: the tracked set changes only between windows)."""
    bound = {"w": (2,)}
    grads = {"w": [1.0, 2.0]}
    accumulator = ReferenceAccumulator(dtype="float64", loss_scale=1.0)
    for _ in range(2):  # issued 1, then 2: the window is open at each
        accumulator.accumulate_sum(bound, 1.0, grads=grads)
        for params in ({"v": (2,)}, {"w": (3,)}):
            assert accumulator.refusals_due(params, 1.0, grads={}, mean=False) == (
                "ParameterMismatchError",
            )
            with pytest.raises(ParameterMismatchError):
                accumulator.accumulate_sum(params, 1.0, grads={})
    accumulator.finish_sums()
    other = {"v": (3,)}
    assert accumulator.refusals_due(other, 1.0, grads={"v": [1.0, 2.0, 3.0]}, mean=False) == ()
    accumulator.accumulate_sum(other, 1.0, grads={"v": [1.0, 2.0, 3.0]})  # rebinds: no raise
    assert accumulator.refusals_due(bound, 1.0, grads={}, mean=False) == ("ParameterMismatchError",)


@pytest.mark.parametrize("mean", [False, True])
def test_the_refusals_due_see_a_total_weight_that_overflows(mean: bool) -> None:
    """In float64, a window holding weight 1.5e308 is due InvalidWeightError for a second 1.5e308
    (W = 3e308 overflows float64, semantics §6), sum or mean alike, and the step raises it; a
    second weight of 1 (W stays finite) is due nothing."""
    params = {"w": (2,)}
    grads = {"w": [1.0, 2.0]}
    accumulator = ReferenceAccumulator(dtype="float64", loss_scale=1.0)
    accumulator.accumulate_sum(params, 1.5e308, grads=grads)
    assert accumulator.refusals_due(params, 1.5e308, grads=grads, mean=mean) == (
        "InvalidWeightError",
    )
    step = accumulator.accumulate_mean if mean else accumulator.accumulate_sum
    with pytest.raises(InvalidWeightError, match="overflow"):
        step(params, 1.5e308, grads=grads)
    assert accumulator.refusals_due(params, 1.0, grads=grads, mean=mean) == ()


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("weight", [-1.0, 0.0, 1.0, 1e6, float("inf")])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_the_first_refusal_due_is_the_one_the_step_raises(
    kind: str, weight: float, op: str
) -> None:
    """For every fault kind, weight and entry point (in float16, where 10**6 does not survive
    D), refusals_due judged before the step starts with the class the step raises (nothing due
    when it raises nothing). (That judging it changes nothing, the tests above show: the traces
    they compare were run with it.)"""
    scenario = fault_scenario(kind, weight, op, work="float16")
    outcome = run_reference(scenario).outcomes[1]
    assert outcome.due is not None and outcome.due[:1] == (
        (outcome.error,) if outcome.error is not None else ()
    ), outcome
