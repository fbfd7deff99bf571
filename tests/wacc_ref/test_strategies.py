"""Meta-tests of wacc_ref.strategies: every family is reachable; scenarios are valid, replayable."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, TypeVar

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from wacc_ref import errors, formats
from wacc_ref.oracles import (
    run_reference,
    stepwise_differences,
    trace_differences,
    trace_violations,
)
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    RestoreCorrupted,
    Scenario,
    from_json,
    scenarios_identical,
    to_json,
    without_interruptions,
)
from wacc_ref.strategies import (
    MAX_SKEW,
    MAX_STEPS,
    MAX_TOKEN_COUNT,
    OVERFLOW_SCALE_BINADES,
    checkpoint_interruptions,
    gradient_values,
    loss_scales,
    overflow_prone_scales,
    scaled_gradient_values,
    scenarios,
    unequal_microbatches,
    zero_weights,
)
from wacc_ref.traces import (
    ScenarioTrace,
)

T = TypeVar("T")

# Explicit settings: no example database (no files written), no deadline (CI machines vary).
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, database=None)
# find(): derandomized (a family that is reachable is found on every run, no flakiness), the
# first match is enough (no shrinking), bounded search.
FIND_SETTINGS = settings(
    max_examples=1500, deadline=None, database=None, derandomize=True, phases=[Phase.generate]
)

SPEC_ERROR_NAMES = frozenset(
    name
    for name in errors.__all__
    if isinstance(getattr(errors, name), type)
    and issubclass(getattr(errors, name), errors.WeightedAccumulationError)
)


def _find(strategy: st.SearchStrategy[T], condition: Callable[[T], bool]) -> T:
    return find(strategy, condition, settings=FIND_SETTINGS)


def _windows(scenario: Scenario) -> list[list[Accumulate]]:
    """The accumulate steps of each window (split at finish steps); for interruption-free runs."""
    windows: list[list[Accumulate]] = [[]]
    for step in scenario.steps:
        if isinstance(step, Accumulate):
            windows[-1].append(step)
        elif isinstance(step, Finish):
            windows.append([])
    return windows


def _all_gradient_values(scenario: Scenario) -> list[float]:
    return [
        value
        for step in scenario.steps
        if isinstance(step, Accumulate)
        for _, values in step.grads
        if values is not None
        for value in values
    ]


def _significant_bits(value: float) -> int:
    """Bits from the leading to the last nonzero bit of the significand of a finite float."""
    significand = int(math.ldexp(math.frexp(abs(value))[0], 53))
    return significand.bit_length() - (significand & -significand).bit_length() + 1


def _has_cancelling_pair(scenario: Scenario) -> bool:
    """Some element gets x in one microbatch and -x in a later one of the same window, with x a
    moderate value of more than 12 significant bits (so the pair cannot be two independent draws
    of a special or short value)."""
    for window in _windows(scenario):
        seen: set[tuple[str, int, float]] = set()
        for step in window:
            for name, values in step.grads:
                for position, value in enumerate(values or ()):
                    moderate = 2.0**-10 <= abs(value) <= 2.0**10
                    if moderate and _significant_bits(value) > 12:
                        if (name, position, -value) in seen:
                            return True
                    seen.add((name, position, value))
    return False


# --------------------------------------------------------------------------------------------
# Each family is reachable
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(formats.FORMATS))
def test_gradient_values_reach_subnormals_zero_signs_and_the_top(dtype: str) -> None:
    """gradient_values reaches a subnormal, -0.0, max_finite and the top binade of every format."""
    fmt = formats.get_format(dtype)
    values = gradient_values(dtype)
    assert 0 < abs(_find(values, lambda v: 0 < abs(v) < fmt.min_normal)) < fmt.min_normal
    assert math.copysign(1.0, _find(values, lambda v: v == 0 and math.copysign(1, v) < 0)) < 0
    assert abs(_find(values, lambda v: abs(v) == fmt.max_finite)) == fmt.max_finite
    top = math.ldexp(1.0, fmt.emax)
    found = _find(values, lambda v: top <= abs(v) < fmt.max_finite)
    assert top <= abs(found) < fmt.max_finite


@pytest.mark.parametrize("dtype", list(formats.FORMATS))
def test_gradient_values_are_representable_and_finite_unless_asked(dtype: str) -> None:
    """Without allow_nan/allow_infinity every value is a finite value of the format; with them,
    NaN and (if the format has one) inf are reachable."""

    @PROPERTY_SETTINGS
    @given(gradient_values(dtype, work_dtype="float16"))
    def check(value: float) -> None:
        assert math.isfinite(value) and formats.is_representable(value, dtype), value.hex()

    check()
    special = gradient_values(dtype, allow_nan=True, allow_infinity=True)
    assert math.isnan(_find(special, math.isnan))
    if formats.get_format(dtype).has_inf:
        assert math.isinf(_find(special, math.isinf))


def test_gradient_values_reach_the_work_dtype_edges() -> None:
    """With work_dtype float16, float32 gradients reach float16's overflow tie 65520 and half its
    smallest subnormal (2**-25), the values where conversion into D overflows or ties to zero."""
    values = gradient_values("float32", work_dtype="float16")
    assert _find(values, lambda v: v == 65520.0) == 65520.0
    assert _find(values, lambda v: v == 2.0**-25) == 2.0**-25


def test_scaled_gradient_values_stay_in_the_gradient_dtype() -> None:
    """Loss-scaled gradients are finite values of the gradient dtype and reach D's top binade."""

    @PROPERTY_SETTINGS
    @given(scaled_gradient_values("bfloat16", work_dtype="float16", loss_scale=2.0**15))
    def check(value: float) -> None:
        assert math.isfinite(value) and formats.is_representable(value, "bfloat16"), value.hex()

    check()
    near_max = scaled_gradient_values("float32", work_dtype="float16", loss_scale=2.0**15)
    assert 2.0**14 <= abs(_find(near_max, lambda v: abs(v) >= 2.0**14)) <= 65504.0


def test_unequal_microbatches_reach_the_count_and_skew_extremes() -> None:
    """Token counts reach 1 and 10**6 and a window skew of exactly 10**5."""
    counts = unequal_microbatches()
    assert min(_find(counts, lambda c: min(c) == 1)) == 1
    assert max(_find(counts, lambda c: max(c) == MAX_TOKEN_COUNT)) == MAX_TOKEN_COUNT
    skewed = _find(counts, lambda c: max(c) == min(c) * MAX_SKEW)
    assert max(skewed) == min(skewed) * MAX_SKEW


@PROPERTY_SETTINGS
@given(unequal_microbatches(min_size=2, max_size=5))
def test_unequal_microbatches_respect_their_bounds(counts: list[int]) -> None:
    """Counts are ints in [1, 10**6], 2 to 5 of them, with largest/smallest <= 10**5."""
    assert 2 <= len(counts) <= 5
    assert all(isinstance(c, int) and 1 <= c <= MAX_TOKEN_COUNT for c in counts)
    assert max(counts) <= min(counts) * MAX_SKEW


def test_zero_weights_reach_all_zero_windows_and_both_zero_signs() -> None:
    """zero_weights reaches an all-zero window of several batches, a -0.0 weight, and a mix."""
    weights = zero_weights()

    def all_zero(window: list[float]) -> bool:
        return len(window) >= 3 and not any(window)

    assert all_zero(_find(weights, all_zero))
    negative_zero = _find(weights, lambda w: any(x == 0 and math.copysign(1, x) < 0 for x in w))
    assert any(x == 0 and math.copysign(1.0, x) < 0 for x in negative_zero)
    mixed = _find(weights, lambda w: any(w) and not all(w))
    assert any(mixed) and not all(mixed)


@PROPERTY_SETTINGS
@given(zero_weights(min_size=1, max_size=6))
def test_zero_weights_always_hold_an_explicit_zero(weights: list[float]) -> None:
    """Every window has at least one weight exactly 0 and every other weight is a count >= 1."""
    assert any(w == 0 for w in weights), weights
    assert all(w == 0 or (w >= 1 and w == int(w)) for w in weights), weights


@pytest.mark.parametrize("dtype", formats.WORK_DTYPES)
def test_overflow_prone_scales_make_s_times_w_overflow(dtype: str) -> None:
    """Overflow-prone S are representable powers of two whose product with W = 2**21 (or W = 2
    at the top scale) exceeds D's max_finite while S and W stay finite in D."""
    fmt = formats.get_format(dtype)

    @PROPERTY_SETTINGS
    @given(overflow_prone_scales(dtype))
    def check(scale: float) -> None:
        assert formats.is_representable(scale, dtype) and math.frexp(scale)[0] == 0.5
        assert Fraction(scale) * 2 ** (OVERFLOW_SCALE_BINADES + 1) > Fraction(fmt.max_finite)

    check()
    pair = st.tuples(overflow_prone_scales(dtype), unequal_microbatches())
    scale, counts = _find(
        pair,
        lambda p: (
            Fraction(p[0]) * sum(p[1]) > Fraction(fmt.max_finite) and sum(p[1]) <= fmt.max_finite
        ),
    )
    assert Fraction(scale) * sum(counts) > Fraction(fmt.max_finite) >= sum(counts)


def test_float16_spec_example_is_an_overflow_prone_case() -> None:
    """The semantics' fp16 case S = 2**15, W = 4096 is reachable from overflow_prone_scales."""
    assert _find(overflow_prone_scales("float16"), lambda s: s == 2.0**15) == 2.0**15


@PROPERTY_SETTINGS
@given(loss_scales("float16"))
def test_ordinary_loss_scales_are_valid(scale: float) -> None:
    """Ordinary loss scales are finite, positive and exactly representable in D."""
    assert math.isfinite(scale) and scale > 0 and formats.is_representable(scale, "float16")


def test_scenarios_reach_an_overflowing_s_times_w_that_finishes() -> None:
    """A generated scenario's finish_mean succeeds with S·W > max_finite(D) while S, W <= it."""

    def overflowing(scenario: Scenario) -> bool:
        fmt = formats.get_format(scenario.work_dtype)
        limit = Fraction(fmt.max_finite)
        for outcome in run_reference(scenario):
            result = outcome.result
            if outcome.op == "finish_mean" and result is not None:
                product = Fraction(result.loss_scale) * Fraction(result.weight)
                if product > limit and Fraction(result.weight) <= limit:
                    return True
        return False

    found = _find(scenarios(max_interruptions=0, kinds=("sum",)), overflowing)
    assert overflowing(found), to_json(found)


def test_scenarios_reach_an_all_zero_window_before_finish_mean() -> None:
    """A generated window of only zero-weight batches ends in finish_mean, which raises
    ZeroTotalWeightError and clears nothing (issued stays > 0)."""

    def all_zero_window(scenario: Scenario) -> bool:
        return any(
            o.op == "finish_mean" and o.error == "ZeroTotalWeightError" and o.state.issued > 0
            for o in run_reference(scenario)
        )

    found = _find(scenarios(max_interruptions=0, invalid_weights=False), all_zero_window)
    assert all_zero_window(found), to_json(found)


def test_scenarios_reach_a_mid_window_restore() -> None:
    """A generated restore lands in the middle of a window (pending buffers, issued > 0)."""

    def mid_window(scenario: Scenario) -> bool:
        return any(
            o.op == "restore" and o.error is None and o.state.issued > 0 and o.state.pending
            for o in run_reference(scenario)
        )

    found = _find(scenarios(), mid_window)
    assert mid_window(found), to_json(found)


@pytest.mark.parametrize("kind", ["pending_wrong_shape", "param_shape_wrong", "issued_bool"])
def test_scenarios_reach_a_corrupted_record_restore(kind: str) -> None:
    """A generated corrupted restore of the given kind is applied and raises RecordError."""

    def corrupted(scenario: Scenario) -> bool:
        return any(
            o.op == "restore_corrupted" and not o.skipped and o.error == "RecordError"
            for o in run_reference(scenario)
        )

    found = _find(scenarios(corruption_kinds=(kind,)), corrupted)
    assert corrupted(found), to_json(found)
    assert any(isinstance(s, RestoreCorrupted) and s.kind == kind for s in found.steps)


def test_scenarios_reach_an_async_checkpoint_restored_later() -> None:
    """An async checkpoint is followed by accumulation before the restore that loads it."""

    def delayed(scenario: Scenario) -> bool:
        steps = scenario.steps
        for i, step in enumerate(steps):
            if isinstance(step, Checkpoint) and step.asynchronous:
                for later in steps[i + 1 :]:
                    if isinstance(later, Checkpoint):
                        break
                    if isinstance(later, Restore):
                        between = steps[i + 1 : steps.index(later, i + 1)]
                        return any(isinstance(s, Accumulate) for s in between)
        return False

    assert delayed(_find(scenarios(), delayed))


@pytest.mark.parametrize("grad_dtype", list(formats.FORMATS))
def test_scenarios_reach_a_subnormal_gradient(grad_dtype: str) -> None:
    """A generated scenario hands in a gradient value that is subnormal in its gradient dtype."""
    fmt = formats.get_format(grad_dtype)

    def subnormal(scenario: Scenario) -> bool:
        return any(0 < abs(v) < fmt.min_normal for v in _all_gradient_values(scenario))

    assert subnormal(_find(scenarios(grad_dtypes=(grad_dtype,), max_interruptions=0), subnormal))


def test_scenarios_reach_a_cancelling_pair() -> None:
    """A generated window hands in x and later -x (x with many significant bits) for the same
    element."""
    wide = scenarios(max_interruptions=0, grad_dtypes=("float32", "float64"))
    found = _find(wide, _has_cancelling_pair)
    assert _has_cancelling_pair(found), to_json(found)


def test_scenarios_reach_nan_and_inf_gradients_only_when_asked() -> None:
    """allow_nan/allow_infinity make NaN and inf gradients reachable."""
    special = scenarios(allow_nan=True, allow_infinity=True, grad_dtypes=("float32",))
    found = _find(special, lambda s: any(math.isnan(v) for v in _all_gradient_values(s)))
    assert any(math.isnan(v) for v in _all_gradient_values(found))
    found = _find(special, lambda s: any(math.isinf(v) for v in _all_gradient_values(s)))
    assert any(math.isinf(v) for v in _all_gradient_values(found))


# --------------------------------------------------------------------------------------------
# Generated scenarios are valid, replayable and run cleanly on the reference
# --------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(scenarios(allow_nan=True, allow_infinity=True))
def test_generated_scenarios_validate_and_round_trip_json(scenario: Scenario) -> None:
    """Every generated scenario re-validates from its JSON and round-trips bit for bit."""
    assert len([s for s in scenario.steps if isinstance(s, Accumulate | Finish)]) <= MAX_STEPS
    text = to_json(scenario)
    back = from_json(text)
    assert scenarios_identical(back, scenario), text
    assert to_json(back) == text
    for value in _all_gradient_values(scenario):
        assert formats.is_representable(value, scenario.grad_dtype), (value.hex(), text)


def _run_twice(scenario: Scenario, **options: Any) -> ScenarioTrace:
    first = run_reference(scenario, **options)
    second = run_reference(from_json(to_json(scenario)), **options)
    assert trace_differences(first, second) == [], to_json(scenario)
    return first


@PROPERTY_SETTINGS
@given(scenarios(allow_nan=True, allow_infinity=True), st.sampled_from(["fma", "op_rounded"]))
def test_run_reference_raises_only_spec_errors_and_is_deterministic(
    scenario: Scenario, fused_variant: str
) -> None:
    """run_reference of a generated scenario records only §11 error classes, gives the same trace
    twice (also after a JSON round trip), and keeps every invariant of the semantics of a trace."""
    trace = _run_twice(scenario, fused_variant=fused_variant)
    assert len(trace) == len(scenario.steps)
    for outcome in trace:
        assert outcome.error is None or outcome.error in SPEC_ERROR_NAMES, to_json(scenario)
    assert trace_violations(trace) == [], to_json(scenario)


@PROPERTY_SETTINGS
@given(
    scenarios(fused=True, allow_nan=True, allow_infinity=True),
    st.sampled_from(["fma", "op_rounded", "two_step"]),
)
def test_stepwise_oracle_accepts_the_reference_in_every_variant(
    scenario: Scenario, fused_variant: str
) -> None:
    """The reference following any one fused variant passes the stepwise oracle of its own
    scenario (the oracle accepts the semantics §6 set, and is exact everywhere else)."""
    trace = run_reference(scenario, fused_variant=fused_variant)
    assert stepwise_differences(scenario, trace) == [], to_json(scenario)


@settings(max_examples=25, deadline=None, database=None)
@given(scenarios(max_interruptions=0, allow_nan=True, allow_infinity=True))
def test_run_reference_exact_mode_raises_only_spec_errors(scenario: Scenario) -> None:
    """The exact mode runs generated scenarios too: only §11 errors (ExactModeError for
    non-finite gradients), deterministic traces."""
    trace = _run_twice(scenario, mode="exact")
    for outcome in trace:
        assert outcome.error is None or outcome.error in SPEC_ERROR_NAMES, to_json(scenario)


@PROPERTY_SETTINGS
@given(scenarios(max_interruptions=0), st.data())
def test_immediate_resume_is_bit_identical(scenario: Scenario, data: st.DataObject) -> None:
    """Checkpoint (sync or async) + restore inserted at any position leaves every finish result
    and every later state bit-identical to the uninterrupted run (semantics §9)."""
    position = data.draw(st.integers(0, len(scenario.steps)), label="position")
    asynchronous = data.draw(st.booleans(), label="asynchronous")
    interrupted = Scenario(
        work_dtype=scenario.work_dtype,
        grad_dtype=scenario.grad_dtype,
        loss_scale=scenario.loss_scale,
        fused=scenario.fused,
        parameters=scenario.parameters,
        steps=scenario.steps[:position]
        + (Checkpoint(asynchronous=asynchronous), Restore())
        + scenario.steps[position:],
    )
    assert scenarios_identical(without_interruptions(interrupted), scenario)
    plain = run_reference(scenario).outcomes
    resumed = run_reference(interrupted).outcomes
    resumed = resumed[:position] + resumed[position + 2 :]
    for want, got in zip(plain, resumed, strict=True):
        assert want.error == got.error, to_json(interrupted)
        assert want.state.differences(got.state, what=f"step {want.index}") == []
        if want.result is not None:
            assert got.result is not None, to_json(interrupted)
            assert want.result.differences(got.result, what=f"step {want.index}") == []


@PROPERTY_SETTINGS
@given(scenarios(max_interruptions=0, max_steps=6), st.data())
def test_checkpoint_interruptions_keep_the_base_steps_in_order(
    scenario: Scenario, data: st.DataObject
) -> None:
    """Interruptions only insert checkpoint/restore steps: the base steps stay, in order, and every
    restore follows a checkpoint (the result validates as a scenario)."""
    steps = data.draw(checkpoint_interruptions(scenario.steps), label="steps")
    base = tuple(s for s in steps if isinstance(s, Accumulate | Finish))
    assert base == scenario.steps
    Scenario(
        work_dtype=scenario.work_dtype,
        grad_dtype=scenario.grad_dtype,
        loss_scale=scenario.loss_scale,
        fused=scenario.fused,
        parameters=scenario.parameters,
        steps=steps,
    )


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: unequal_microbatches(max_size=0), "max_size"),
        (lambda: unequal_microbatches(max_skew=0), "max_skew"),
        (lambda: zero_weights(min_size=0), "min_size"),
        (lambda: scenarios(work_dtypes=("float8_e5m2",)), "work_dtypes"),
        (lambda: scenarios(grad_dtypes=()), "grad_dtypes"),
        (lambda: scenarios(kinds=("sum", "max")), "kinds"),
        (lambda: scenarios(max_steps=0), "max_steps"),
        (lambda: checkpoint_interruptions((), corruption_kinds=("melted",)), "melted"),
    ],
)
def test_strategy_options_are_validated(make: Callable[[], Any], fragment: str) -> None:
    """A bad strategy option raises ValueError naming it when the strategy is drawn from."""
    with pytest.raises(ValueError, match=fragment):
        find(make(), lambda _: True, settings=FIND_SETTINGS)
