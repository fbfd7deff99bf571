"""Structure-aware shrinking (wacc.judge.shrink): smaller, still failing, always a valid
scenario."""

from __future__ import annotations

import itertools
import math
import sys
from types import SimpleNamespace

import pytest

from wacc.judge import shrink
from wacc.judge.shrink import (
    _gradient_removals,
    _simpler_floats,
    _step_removals,
    _value_simplifications,
    shrink_scenario,
)
from wacc_ref.scenario import Accumulate, Checkpoint, Finish, Restore, Scenario, Step


def _scenario(
    steps: tuple[Step, ...],
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = (("weight", (2,)), ("bias", ())),
    *,
    loss_scale: float = 8.0,
    grad_dtype: str = "float32",
) -> Scenario:
    return Scenario(
        work_dtype="float32",
        grad_dtype=grad_dtype,
        loss_scale=loss_scale,
        fused=False,
        parameters=parameters,
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


def test_step_removals_try_whole_windows_then_single_steps_from_the_last() -> None:
    """Step removal first drops each window (accumulates up to and including a finish, then the
    unfinished tail), then each single step from the last to the first, and never offers a
    candidate that leaves a restore without an earlier checkpoint."""
    a1 = Accumulate.of("sum", 1.0, {"bias": (1.0,)})
    a2 = Accumulate.of("sum", 2.0, {"bias": (2.0,)})
    a3 = Accumulate.of("sum", 3.0, {"bias": (3.0,)})
    f1, f2 = Finish("sums"), Finish("mean")
    c, r = Checkpoint(), Restore()
    original = _scenario((a1, c, f1, a2, r, f2, a3))
    # windows: [a1 c f1] (dropping it orphans the restore), [a2 r f2], the tail [a3]
    assert list(_step_removals(original)) == [
        _scenario((a1, c, f1, a3)),
        _scenario((a1, c, f1, a2, r, f2)),
        _scenario((a1, c, f1, a2, r, f2)),
        _scenario((a1, c, f1, a2, r, a3)),
        _scenario((a1, c, f1, a2, f2, a3)),
        _scenario((a1, c, f1, r, f2, a3)),
        _scenario((a1, c, a2, r, f2, a3)),
        # dropping the checkpoint would orphan the restore: not offered
        _scenario((c, f1, a2, r, f2, a3)),
    ]
    # back-to-back finishes are windows of one step each
    assert list(_step_removals(_scenario((f1, f2)))) == [
        _scenario((f2,)),
        _scenario((f1,)),
        _scenario((f1,)),
        _scenario((f2,)),
    ]
    # a single window is dropped whole, leaving no steps
    assert list(_step_removals(_scenario((a1, a2, f1)))) == [
        _scenario(()),
        _scenario((a1, a2)),
        _scenario((a1, f1)),
        _scenario((a2, f1)),
    ]


def test_gradient_removals_drop_whole_parameters_then_single_entries() -> None:
    """Gradient removal first drops each parameter (its entries leave every accumulate step,
    only when another parameter remains), then each single entry of each accumulate step,
    every other step and entry kept as it was."""
    parameters = (("weight", (2,)), ("bias", ()), ("extra", ()))
    first = Accumulate.of("sum", 5.0, {"weight": (1.0, 2.0), "bias": (3.0,), "extra": (4.0,)})
    second = Accumulate.of("mean", 6.0, {"bias": None})
    finish = Finish("sums")
    original = _scenario((first, finish, second), parameters)

    def acc(step: Accumulate, *names: str) -> Accumulate:
        kept = step.grads_mapping()
        return Accumulate.of(step.kind, step.weight, {name: kept[name] for name in names})

    assert list(_gradient_removals(original)) == [
        _scenario((acc(first, "bias", "extra"), finish, second), (("bias", ()), ("extra", ()))),
        _scenario(
            (acc(first, "weight", "extra"), finish, acc(second)),
            (("weight", (2,)), ("extra", ())),
        ),
        _scenario((acc(first, "weight", "bias"), finish, second), (("weight", (2,)), ("bias", ()))),
        _scenario((acc(first, "bias", "extra"), finish, second), parameters),
        _scenario((acc(first, "weight", "extra"), finish, second), parameters),
        _scenario((acc(first, "weight", "bias"), finish, second), parameters),
        _scenario((first, finish, acc(second)), parameters),
    ]
    # the only parameter is never dropped: a scenario needs one
    alone = Accumulate.of("sum", 5.0, {"bias": (3.0,)})
    assert list(_gradient_removals(_scenario((alone,), (("bias", ()),)))) == [
        _scenario((acc(alone),), (("bias", ()),))
    ]


def test_simpler_floats_are_zero_then_signed_one_then_fewer_significant_bits() -> None:
    """The simpler values of a float are 0, then 1 with its sign, then the value rounded to 1, 2,
    4 and 8 significant bits, without repeats and without the value itself; zero has none, and
    a non-finite value has 0 and 1."""
    assert _simpler_floats(0.0) == [] and _simpler_floats(-0.0) == []
    assert _simpler_floats(1.0) == [0.0] and _simpler_floats(-1.0) == [0.0]
    # 0.75 = 0b0.11: one significant bit rounds it to 1.0 (already listed); two keep it
    assert _simpler_floats(0.75) == [0.0, 1.0]
    # 1/3 = 0b0.010101...: to 1 bit 0b0.01, to 2 bits 0b0.011, to 4 bits 0b0.01011 (11/32),
    # to 8 bits 171/512 (1/3 * 512 = 170.67 rounds up)
    third = [0.0, 1.0, 0.25, 0.375, 11 / 32, 171 / 512]
    assert _simpler_floats(1 / 3) == third
    assert _simpler_floats(-1 / 3) == [-v for v in third]
    for value in (math.inf, -math.inf, math.nan):
        assert _simpler_floats(value) == [0.0, 1.0]
    # float64's largest value rounds up to 2**1024 at 1 to 8 bits: no such candidate (it was an
    # OverflowError, found by a shrink of a dynamic-scaling scenario near float64's top)
    top = sys.float_info.max
    assert _simpler_floats(top) == [0.0, 1.0] and _simpler_floats(-top) == [0.0, -1.0]
    # 0b1.1 x 2**1023: to 1 bit 2**1024 (dropped), to 2 or more bits the value itself
    near = 1.5 * 2.0**1023
    assert _simpler_floats(near) == [0.0, 1.0]


def test_simpler_floats_keep_the_roundings_that_fit_after_one_that_overflows() -> None:
    """A rounding to 1 bit that overflows float64 drops only that candidate: 205 * 2**1016 =
    0b0.11001101 x 2**1024 rounds to 2**1024 at 1 bit (dropped), to 0b0.11 x 2**1024 =
    3 * 2**1022 at 2 bits, to 0b0.1101 x 2**1024 = 13 * 2**1020 at 4 bits, and is itself at 8."""
    value = 205 * 2.0**1016
    expected = [0.0, 1.0, 3 * 2.0**1022, 13 * 2.0**1020]
    assert _simpler_floats(value) == expected
    assert _simpler_floats(-value) == [0.0, -1.0, *(-v for v in expected[2:])]


def test_value_simplifications_offer_each_simpler_value_in_order() -> None:
    """Value simplification offers the loss scale 1, then for each accumulate step (past any
    other step) the weights 1, 2, 3, 7 below its weight, then each gradient value replaced by
    each of its simpler values (None entries skipped), changing nothing else."""
    parameters = (("bias", ()), ("weight", (2,)), ("extra", ()))
    head, tail = Finish("sums"), Finish("mean")

    def step(weight: float, weight_values: tuple[float, float], extra: float) -> Accumulate:
        return Accumulate.of(
            "sum", weight, {"bias": None, "weight": weight_values, "extra": (extra,)}
        )

    def scenario(middle: Accumulate, loss_scale: float = 8.0) -> Scenario:
        return _scenario((head, middle, tail), parameters, loss_scale=loss_scale)

    assert list(_value_simplifications(scenario(step(100.0, (0.75, 1.0), 2.0)))) == [
        scenario(step(100.0, (0.75, 1.0), 2.0), loss_scale=1.0),
        scenario(step(1.0, (0.75, 1.0), 2.0)),
        scenario(step(2.0, (0.75, 1.0), 2.0)),
        scenario(step(3.0, (0.75, 1.0), 2.0)),
        scenario(step(7.0, (0.75, 1.0), 2.0)),
        scenario(step(100.0, (0.0, 1.0), 2.0)),
        scenario(step(100.0, (1.0, 1.0), 2.0)),
        scenario(step(100.0, (0.75, 0.0), 2.0)),
        scenario(step(100.0, (0.75, 1.0), 0.0)),
        scenario(step(100.0, (0.75, 1.0), 1.0)),
    ]
    # only the listed weights below the step's weight are offered
    lighter = list(_value_simplifications(scenario(step(7.0, (0.0, 0.0), 0.0), 1.0)))
    assert [candidate.steps[1] for candidate in lighter] == [
        step(weight, (0.0, 0.0), 0.0) for weight in (1.0, 2.0, 3.0)
    ]


def test_value_simplifications_skip_values_the_gradient_dtype_cannot_hold() -> None:
    """A simpler value the gradient dtype cannot represent is skipped, and the simpler values
    after it are still offered (416 in float8_e4m3fn: 1 bit rounds to 512, beyond its largest
    value 448; 2 bits give 384)."""
    step = Accumulate.of("sum", 1.0, {"bias": (416.0,)})
    original = _scenario((step,), (("bias", ()),), loss_scale=1.0, grad_dtype="float8_e4m3fn")
    assert [candidate.steps for candidate in _value_simplifications(original)] == [
        (Accumulate.of("sum", 1.0, {"bias": (value,)}),) for value in (0.0, 1.0, 384.0)
    ]


def test_no_candidate_is_tried_once_the_time_budget_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The time budget is a deadline: once the clock reaches it, no further candidate is offered
    and the current scenario is returned (a fake clock ticks one second per reading)."""
    ticks = itertools.count()
    monkeypatch.setattr(shrink, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    offered: list[Scenario] = []

    def record(candidate: Scenario) -> bool:
        offered.append(candidate)
        return False

    # readings: 0 sets the deadline to 4, 1 enters the loop, 2 and 3 precede the first two
    # candidates, 4 reaches the deadline before the third
    assert shrink_scenario(BIG, record, seconds=4.0) is BIG
    assert offered == list(itertools.islice(_step_removals(BIG), 2))
    offered.clear()
    assert shrink_scenario(BIG, record, seconds=0.0) is BIG
    assert offered == []
