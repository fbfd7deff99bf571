"""§3-§8 and §11 on small hand-checked examples for wacc_ref.accumulator (emulated mode)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from wacc_ref.accumulator import (
    ReferenceAccumulator,
    ReferenceResult,
    ReferenceState,
)
from wacc_ref.errors import (
    ExactModeError,
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    RecordError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroTotalWeightError,
)
from wacc_ref.formats import WORK_DTYPES, round_to

P = {"w": (2,), "b": ()}  # a two-parameter "module": name -> shape


def bits(array: np.ndarray | None) -> list[int] | None:
    """float64 bit patterns of an array (NaN, ±0 distinguished), for bitwise comparisons."""
    if array is None:
        return None
    return np.ascontiguousarray(array, dtype=np.float64).view(np.uint64).reshape(-1).tolist()


def snapshot(acc: ReferenceAccumulator) -> tuple[object, ...]:
    """Everything observable about an accumulator, in a form that compares bit for bit."""
    record = acc.state_dict()
    pending = record.pop("pending")
    assert isinstance(pending, dict)
    frozen_pending = {
        name: (bits(value) if value.dtype != object else value.reshape(-1).tolist())
        for name, value in pending.items()
    }
    return (sorted(record.items(), key=repr), frozen_pending, acc.state)


def result_bits(result: ReferenceResult) -> tuple[object, ...]:
    return (
        {name: bits(g) for name, g in result.grads.items()},
        result.weight,
        result.loss_scale,
        result.issued,
        result.zero_weight,
        result.normalized,
    )


# --- §4 construction ------------------------------------------------------------------------


def test_loss_scale_2_15_is_accepted_and_2_16_refused_in_float16() -> None:
    """fp16 holds 2**15 but not 2**16 (max 65504): the latter raises naming the value and D."""
    assert ReferenceAccumulator(dtype="float16", loss_scale=2.0**15).state.loss_scale == 32768.0
    with pytest.raises(InvalidLossScaleError, match=r"65536.*float16"):
        ReferenceAccumulator(dtype="float16", loss_scale=2.0**16)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        ("float32", 0.0),
        ("float32", -1.0),
        ("float32", math.nan),
        ("float32", math.inf),
        ("float32", 1.0 + 2**-30),  # not a float32
        ("bfloat16", 1.0 + 2**-9),  # not a bfloat16
        ("float16", 2.0**-25),  # below fp16's smallest subnormal
        ("float64", True),
        ("float64", "2"),
        ("float16", 2**16),
    ],
)
def test_invalid_loss_scales_are_refused_naming_value_and_dtype(dtype: str, scale: object) -> None:
    """S must be finite, > 0 and exactly representable in D, else InvalidLossScaleError."""
    with pytest.raises(InvalidLossScaleError) as info:
        ReferenceAccumulator(dtype=dtype, loss_scale=scale)  # type: ignore[arg-type]
    assert repr(scale) in str(info.value) and dtype in str(info.value), str(info.value)


def test_non_power_of_two_loss_scale_is_divided_out_once() -> None:
    """fp16 S=3 is representable; a buffer 3*5=15 with W=1 finishes at exactly 5."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=3)
    acc.accumulate_sum({"p": (1,)}, 1, grads={"p": [15.0]})
    assert acc.finish_mean().grads["p"].tolist() == [5.0]  # type: ignore[union-attr]


def test_bad_constructor_options_raise() -> None:
    """Unknown dtype/mode/variant, float8 work dtype and bad precision are refused."""
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ReferenceAccumulator(dtype="float8_e4m3fn", loss_scale=1.0)
    with pytest.raises(ValueError, match="'fast'"):
        ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="fast")
    with pytest.raises(ValueError, match="'fms'"):
        ReferenceAccumulator(dtype="float32", loss_scale=1.0, fused=True, fused_variant="fms")
    with pytest.raises(ValueError, match="precision"):
        ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="exact", precision=1)
    with pytest.raises(TypeError, match="fused"):
        ReferenceAccumulator(dtype="float32", loss_scale=1.0, fused=1)  # type: ignore[arg-type]


# --- §3 state -------------------------------------------------------------------------------


def test_state_is_a_frozen_copy_and_reading_it_changes_nothing() -> None:
    """acc.state copies dtype, S, counters, W and fused; it cannot be mutated."""
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0, fused=True)
    acc.accumulate_sum(P, 3, grads={"w": [1.0, 2.0]})
    acc.accumulate_sum(P, 0, grads={})
    before = snapshot(acc)
    state = acc.state
    assert state == ReferenceState(
        dtype="bfloat16", loss_scale=4.0, issued=2, zero_weight=1, total_weight=3.0, fused=True
    )
    with pytest.raises(AttributeError):
        state.issued = 5  # type: ignore[misc]
    assert snapshot(acc) == before


# --- §5 accumulate_sum ----------------------------------------------------------------------


def test_sum_converts_then_adds_bfloat16() -> None:
    """bf16: buf=1 plus float32 g=2**-8+2**-30 gives 1.0 (convert, then add), not 1+2**-7."""
    # conv_bf16(g) = 2**-8 (g is 2**-8 plus far less than half a bf16 ulp there); 1 + 2**-8 is a
    # tie in [1, 2) (ulp 2**-7) and goes to the even 1.0.  One rounding of 1 + 2**-8 + 2**-30
    # lies above that tie: 1 + 2**-7 (what buf.add_(g_fp32) would give).
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=1.0)
    acc.accumulate_sum({"p": (1,)}, 1, grads={"p": np.array([1.0], dtype=np.float32)})
    g = np.array([2.0**-8 + 2.0**-30], dtype=np.float32)
    assert float(g[0]) == 2.0**-8 + 2.0**-30  # float32 holds it exactly
    acc.accumulate_sum({"p": (1,)}, 1, grads={"p": g})
    assert acc.finish_sums().grads["p"].tolist() == [1.0]  # type: ignore[union-attr]
    assert round_to(Fraction(1) + Fraction(2.0**-8 + 2.0**-30), "bfloat16") == 1.0 + 2**-7


def test_sum_converts_float64_gradients_through_float32() -> None:
    """§2: a float64 gradient 1+2**-8+2**-30 enters a bf16 buffer as 1.0 (double rounding)."""
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=1.0)
    acc.accumulate_sum({"p": ()}, 1, grads={"p": 1 + 2**-8 + 2**-30})
    assert acc.finish_sums().grads["p"].tolist() == 1.0  # type: ignore[union-attr]


def test_sum_rounds_each_addition_in_float16() -> None:
    """fp16: 2048 + 1 = 2049 is a tie (ulp 2) and goes to 2048; 2048 + 3 gives 2052."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=1.0)
    params = {"p": (2,)}
    acc.accumulate_sum(params, 1, grads={"p": [2048.0, 2048.0]})
    acc.accumulate_sum(params, 1, grads={"p": [1.0, 3.0]})
    result = acc.finish_sums()
    assert result.grads["p"].tolist() == [2048.0, 2052.0]  # type: ignore[union-attr]
    assert result.weight == 2.0 and result.issued == 2 and not result.normalized


def test_sum_weight_is_added_in_float64_issue_order() -> None:
    """W is round_64(W + w) in issue order: 2**53 + 1 + 1 stays 2**53, 1 + 1 + 2**53 does not."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    for w in (2.0**53, 1, 1):
        acc.accumulate_sum({"p": ()}, w, grads={"p": 1.0})
    assert acc.state.total_weight == 2.0**53
    acc.finish_sums()
    for w in (1, 1, 2.0**53):
        acc.accumulate_sum({"p": ()}, w, grads={"p": 1.0})
    assert acc.state.total_weight == 2.0**53 + 2


@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
def test_zero_weight_batch_with_nan_gradients_only_counts(method: str) -> None:
    """A w=0 batch reads no gradient (NaN/inf ignored): only issued and zero_weight move."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=2.0)
    acc.accumulate_sum(P, 2, grads={"w": [1.0, -3.0]})
    before = acc.state_dict()
    getattr(acc, method)(P, 0, grads={"w": [math.nan, math.inf], "b": math.nan})
    getattr(acc, method)(P, 0.0, grads={"w": None})
    after = acc.state_dict()
    assert after["issued"] == 3 and after["zero_weight"] == 2
    assert after["total_weight"] == before["total_weight"] == 2.0
    assert after["pending"].keys() == before["pending"].keys() == {"w"}  # type: ignore[attr-defined]
    assert bits(after["pending"]["w"]) == bits(before["pending"]["w"])  # type: ignore[index]


@pytest.mark.parametrize("dtype", WORK_DTYPES)
@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
def test_negative_zero_first_contribution_gives_positive_zero(dtype: str, method: str) -> None:
    """A lazily allocated buffer starts at +0.0, so a first -0.0 contribution leaves +0.0."""
    acc = ReferenceAccumulator(dtype=dtype, loss_scale=1.0)
    getattr(acc, method)({"p": (2,)}, 3, grads={"p": [-0.0, -1.0]})
    getattr(acc, method)({"p": (2,)}, 1, grads={"p": [-0.0, -1.0]})
    pending = acc.state_dict()["pending"]["p"]  # type: ignore[index]
    assert math.copysign(1.0, pending[0]) == 1.0, pending[0].hex()
    # Second element: sums -1 + -1 = -2; means -1*3 + -1*1 = -4 (both exact in every D).
    assert pending[1] == (-2.0 if method == "accumulate_sum" else -4.0)


def test_lazy_buffers_and_none_gradients() -> None:
    """A parameter with only None/absent gradients in positive-weight batches finishes as None."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum(P, 1, grads={"w": [1.0, 2.0], "b": None})
    acc.accumulate_sum(P, 0, grads={"b": 5.0})  # zero weight: b still gets no buffer
    acc.accumulate_sum(P, 2, grads={})
    record = acc.state_dict()
    assert list(record["pending"]) == ["w"]  # type: ignore[call-overload]
    result = acc.finish_sums()
    assert result.grads["b"] is None
    assert result.grads["w"].tolist() == [1.0, 2.0]  # type: ignore[union-attr]
    assert result.weight == 3.0


def test_finish_mean_divides_the_parameters_after_one_without_gradient() -> None:
    """finish_mean gives None for a parameter that got no gradient and still divides every
    parameter tracked after it: [1, 3] / W = 2 is [0.5, 1.5] (exact in float32)."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    params = {"a": (), "w": (2,)}  # the parameter without a gradient comes first
    acc.accumulate_sum(params, 2, grads={"w": [1.0, 3.0]})
    result = acc.finish_mean()
    assert result.grads["a"] is None
    assert result.grads["w"].tolist() == [0.5, 1.5]  # type: ignore[union-attr]


# --- §6 accumulate_mean ---------------------------------------------------------------------


def test_bfloat16_weight_1001_counts_as_1000() -> None:
    """bf16: conv(1001) = 1000 (ulp 8 there; 1001 is nearer 1000): W and g*w_D use 1000."""
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=1.0)
    acc.accumulate_mean({"p": ()}, 1001, grads={"p": 0.5})
    assert acc.state.total_weight == 1000.0
    result = acc.finish_sums()
    assert result.grads["p"].tolist() == 500.0  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("dtype", "weight", "becomes"),
    [("float16", 2.0**-30, "0.0"), ("float16", 70000, "inf"), ("bfloat16", 1e39, "inf")],
)
def test_mean_weight_that_does_not_survive_dtype_is_refused(
    dtype: str, weight: float, becomes: str
) -> None:
    """w > 0 whose w_D is 0 or not finite raises InvalidWeightError naming w and w_D."""
    acc = ReferenceAccumulator(dtype=dtype, loss_scale=1.0)
    with pytest.raises(InvalidWeightError, match=rf"{re.escape(repr(weight))}.*becomes {becomes}"):
        acc.accumulate_mean({"p": ()}, weight, grads={"p": 1.0})


def test_sum_weight_70000_is_fine_in_float16() -> None:
    """Sums keep W in float64: w=70000 is a valid fp16 sum weight (it is never converted)."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=1.0)
    acc.accumulate_sum({"p": ()}, 70000, grads={"p": 7.0})
    assert acc.finish_mean().grads["p"].tolist() == round_to(  # type: ignore[union-attr]
        round_to(Fraction(7, 70000), "float32"), "float16"
    )


MEAN_EXAMPLE = (1.0, 0.5 + 2**-7, 1 - 2**-8)  # bf16 buf, g, w (see the arith tests)


@pytest.mark.parametrize(
    ("fused", "variant", "expected"),
    [
        (False, "fma", 1.5),  # not fused: always the reproducible two-step order
        (True, "two_step", 1.5),
        (True, "fma", 1.5 + 2**-7),
        (True, "op_rounded", 1.5 + 2**-7),
    ],
)
def test_mean_step_rounds_as_the_variant_says_bfloat16(
    fused: bool, variant: str, expected: float
) -> None:
    """bf16 1 + (0.5+2**-7)(1-2**-8): two-step 1.5, one rounding 1.5+2**-7 (hand-derived)."""
    # Exact c*w = 0.5 + 3*2**-9 - 2**-15 rounds (ulp 2**-8) down to t = 0.5 + 2**-8; 1 + t is the
    # tie 1.5 + 2**-8 between 1.5 and 1.5 + 2**-7 and goes to the even 1.5.  The exact
    # 1.5 + 2**-8 + 2**-9 - 2**-15 is above that tie; float32 holds it exactly.
    buf, g, w = MEAN_EXAMPLE
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=1.0, fused=fused, fused_variant=variant)
    acc.accumulate_sum({"p": ()}, 1, grads={"p": buf})
    acc.accumulate_mean({"p": ()}, w, grads={"p": g})
    assert acc.state.total_weight == 2 - 2**-8
    assert acc.state.fused is fused
    assert acc.finish_sums().grads["p"].tolist() == expected  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("variant", "expected"), [("fma", 1 + 2**-10), ("op_rounded", 1.0), ("two_step", 1.0)]
)
def test_mean_step_op_rounded_differs_from_fma_float16(variant: str, expected: float) -> None:
    """fp16 1 + (145*2**-12)(113*2**-13) = 1 + 2**-11 + 2**-25: FMA 1+2**-10, float32 route 1.0."""
    # 145 * 113 = 16385 = 2**14 + 1.  float32 (ulp 2**-23 at 1) drops 2**-25 and lands on the
    # fp16 tie 1 + 2**-11, which goes to the even 1.0; the exact sum is above the tie.
    acc = ReferenceAccumulator(dtype="float16", loss_scale=1.0, fused=True, fused_variant=variant)
    acc.accumulate_sum({"p": ()}, 1, grads={"p": 1.0})
    acc.accumulate_mean({"p": ()}, 113 * 2.0**-13, grads={"p": 145 * 2.0**-12})
    assert acc.finish_sums().grads["p"].tolist() == expected  # type: ignore[union-attr]


# --- §7, §8 finishing -----------------------------------------------------------------------


def test_float16_scale_2_15_and_weight_4096_finish_finite() -> None:
    """fp16: S*W = 2**27 overflows fp16, but buf/S/W = 2**15/2**15/4096 = 2**-12 exactly."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=2.0**15)
    acc.accumulate_sum({"p": ()}, 4096, grads={"p": 2.0**15})
    result = acc.finish_mean()
    assert result.grads["p"].tolist() == 2.0**-12  # type: ignore[union-attr]
    assert round_to(2.0**27, "float16") == math.inf  # the product the semantics never forms
    assert result.normalized and result.weight == 4096.0 and result.loss_scale == 2.0**15


def test_finish_mean_float32_divides_by_three() -> None:
    """fp32 1/3: the 24-bit significand 1.0101...01|0101... rounds up to 0x1.555556p-2."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum({"p": ()}, 3, grads={"p": 1.0})
    assert acc.finish_mean().grads["p"].tolist() == float.fromhex("0x1.555556p-2")  # type: ignore[union-attr]


def test_finish_mean_rounds_through_float32_before_bfloat16() -> None:
    """bf16 y/W with y=0x1.52p0, W=684206: float32 lands on a bf16 tie, giving 0x1.04p-19."""
    y, weight = float.fromhex("0x1.52p0"), 684206
    tie = Fraction(float.fromhex("0x1.03p-19"))
    quotient = Fraction(y) / weight
    half_float32_ulp = Fraction(2) ** (-19 - 24)
    # Just below the bf16 midpoint 0x1.03p-19, by less than half a float32 ulp: float32 rounds it
    # onto the midpoint, and bf16 sends the midpoint to the even 0x1.04p-19.  One rounding of the
    # exact quotient would give 0x1.02p-19.
    assert 0 < tie - quotient < half_float32_ulp
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=1.0)
    acc.accumulate_sum({"p": ()}, weight, grads={"p": y})
    got = acc.finish_mean().grads["p"].tolist()  # type: ignore[union-attr]
    assert got == float.fromhex("0x1.04p-19"), got.hex()


def test_finish_mean_with_zero_total_weight_clears_nothing() -> None:
    """W == 0 (only zero-weight batches) raises ZeroTotalWeightError and keeps the window."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    with pytest.raises(ZeroTotalWeightError):
        acc.finish_mean()  # empty window
    acc.accumulate_mean(P, 0, grads={"w": [1.0, 1.0]})
    before = snapshot(acc)
    with pytest.raises(ZeroTotalWeightError, match="issued=1"):
        acc.finish_mean()
    assert snapshot(acc) == before
    acc.accumulate_mean(P, 2, grads={"w": [1.0, 3.0]})
    result = acc.finish_mean()
    assert result.issued == 2 and result.zero_weight == 1
    # Contributions g * w_D = [2, 6], W = 2: [1, 3].
    assert result.grads["w"].tolist() == [1.0, 3.0] and result.grads["b"] is None  # type: ignore[union-attr]


def test_finish_starts_an_empty_window_but_keeps_the_binding() -> None:
    """After finish_sums the counters are zero, pending empty, and the tracked set is kept
    until the next window binds (a mid-window change of the set still raises)."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum(P, 2, grads={"w": [1.0, 1.0]})
    acc.finish_sums()
    record = acc.state_dict()
    assert (record["issued"], record["zero_weight"], record["total_weight"]) == (0, 0, 0.0)
    assert record["pending"] == {} and record["param_names"] == ["w", "b"]
    acc.accumulate_sum(P, 1, grads={})
    with pytest.raises(ParameterMismatchError, match=r"no longer trainable.*\['b'\]"):
        acc.accumulate_sum({"w": (2,)}, 1, grads={})


def test_finish_sums_of_an_unbound_accumulator_is_empty() -> None:
    """finish_sums before any accumulate returns no gradients and a zero weight."""
    result = ReferenceAccumulator(dtype="float64", loss_scale=1.0).finish_sums()
    assert result.grads == {} and result.weight == 0.0 and result.issued == 0


def test_mutating_a_record_does_not_touch_the_accumulator() -> None:
    """Writing into a state_dict() buffer leaves the pending buffer it was copied from alone."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum(P, 1, grads={"w": [1.0, 1.0]})
    record = acc.state_dict()
    record["pending"]["w"][0] = 99.0  # type: ignore[index]
    assert acc.state_dict()["pending"]["w"].tolist() == [1.0, 1.0]  # type: ignore[index]
    acc.accumulate_sum(P, 1, grads={"w": [1.0, 1.0]})
    assert acc.finish_sums().grads["w"].tolist() == [2.0, 2.0]  # type: ignore[union-attr]


# --- gradient dtypes --------------------------------------------------------------------------


def test_narrow_gradient_dtypes_are_read_exactly() -> None:
    """float16, bfloat16 and float8 gradient arrays are converted with their exact values."""
    acc = ReferenceAccumulator(dtype="float64", loss_scale=1.0)
    params = {"a": (1,), "b": (1,), "c": (1,), "d": (1,)}
    acc.accumulate_sum(
        params,
        1,
        grads={
            "a": np.array([1 + 2**-10], dtype=np.float16),
            "b": np.array([1 + 2**-7], dtype=ml_dtypes.bfloat16),
            "c": np.array([448.0], dtype=ml_dtypes.float8_e4m3fn),
            "d": np.array([2.0**-16], dtype=ml_dtypes.float8_e5m2),
        },
    )
    grads = acc.finish_sums().grads
    assert [g.tolist() for g in grads.values()] == [[1 + 2**-10], [1 + 2**-7], [448.0], [2.0**-16]]  # type: ignore[union-attr]


# --- §11 errors: each leaves the state unchanged ------------------------------------------------


def _busy(dtype: str = "float16", *, mode: str = "emulated") -> ReferenceAccumulator:
    acc = ReferenceAccumulator(dtype=dtype, loss_scale=4.0, mode=mode)
    acc.accumulate_sum(P, 3, grads={"w": [1.0, -2.0]})
    acc.accumulate_mean(P, 0, grads={"b": 1.0})
    acc.accumulate_mean(P, 2, grads={"b": 0.25})
    return acc


BAD_CALLS: dict[str, tuple[type[Exception], Callable[[ReferenceAccumulator], object]]] = {
    "negative weight": (InvalidWeightError, lambda a: a.accumulate_sum(P, -1, grads={})),
    "nan weight": (InvalidWeightError, lambda a: a.accumulate_sum(P, math.nan, grads={})),
    "inf weight": (InvalidWeightError, lambda a: a.accumulate_mean(P, math.inf, grads={})),
    "bool weight": (InvalidWeightError, lambda a: a.accumulate_sum(P, True, grads={})),
    "str weight": (InvalidWeightError, lambda a: a.accumulate_sum(P, "3", grads={})),  # type: ignore[arg-type]
    "longdouble weight": (
        InvalidWeightError,
        lambda a: a.accumulate_sum(P, np.longdouble(1) / 3, grads={}),
    ),
    "huge int weight": (InvalidWeightError, lambda a: a.accumulate_sum(P, 10**400, grads={})),
    "mean weight underflows": (
        InvalidWeightError,
        lambda a: a.accumulate_mean(P, 2.0**-30, grads={"w": [1.0, 1.0]}),
    ),
    "mean weight overflows": (
        InvalidWeightError,
        lambda a: a.accumulate_mean(P, 70000, grads={"w": [1.0, 1.0]}),
    ),
    "renamed parameter": (
        ParameterMismatchError,
        lambda a: a.accumulate_sum({"w": (2,), "bias": ()}, 1, grads={}),
    ),
    "reshaped parameter": (
        ParameterMismatchError,
        lambda a: a.accumulate_sum({"w": (3,), "b": ()}, 1, grads={}),
    ),
    "empty params": (ParameterMismatchError, lambda a: a.accumulate_sum({}, 1, grads={})),
    "unknown gradient": (
        ParameterMismatchError,
        lambda a: a.accumulate_sum(P, 1, grads={"w": [1.0, 1.0], "z": 1.0}),
    ),
    "gradient shape": (
        ParameterMismatchError,
        lambda a: a.accumulate_sum(P, 1, grads={"w": [1.0, 2.0], "b": [1.0]}),
    ),
    "integer gradient": (
        ParameterMismatchError,
        lambda a: a.accumulate_sum(P, 1, grads={"w": np.array([1, 2])}),
    ),
    "gradients not a mapping": (TypeError, lambda a: a.accumulate_sum(P, 1, grads=[1.0])),  # type: ignore[arg-type]
    "bad record": (RecordError, lambda a: a.load_state_dict({**a.state_dict(), "issued": -1}, P)),
}


@pytest.mark.parametrize("mode", ["emulated", "exact"])
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_every_error_leaves_the_state_unchanged(case: str, mode: str) -> None:
    """Each bad call raises its specific error and leaves state_dict() and state identical."""
    error, call = BAD_CALLS[case]
    acc = _busy(mode=mode)
    before = snapshot(acc)
    with pytest.raises(error):
        call(acc)
    assert snapshot(acc) == before, case
    acc.accumulate_sum(P, 1, grads={"w": [1.0, 1.0]})  # still usable
    assert acc.state.issued == 4


@pytest.mark.parametrize("mode", ["emulated", "exact"])
def test_weight_that_overflows_the_total_is_refused(mode: str) -> None:
    """A weight whose float64 total W would be inf raises InvalidWeightError and changes nothing."""
    largest = float.fromhex("0x1.fffffffffffffp+1023")
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode=mode)
    acc.accumulate_sum(P, largest, grads={"w": [1.0, 1.0]})
    before = snapshot(acc)
    with pytest.raises(InvalidWeightError, match="overflow"):
        acc.accumulate_sum(P, largest, grads={"w": [1.0, 1.0]})
    assert snapshot(acc) == before


def test_error_classes_form_the_spec_hierarchy() -> None:
    """Every error derives from WeightedAccumulationError, itself a ValueError."""
    for cls in (
        InvalidLossScaleError,
        InvalidWeightError,
        ParameterMismatchError,
        ZeroTotalWeightError,
        RecordError,
        ExactModeError,
    ):
        assert issubclass(cls, WeightedAccumulationError)
    assert issubclass(WeightedAccumulationError, ValueError)


def test_error_messages_name_the_offending_value() -> None:
    """Messages carry the weight (with hex), the unknown parameter and the bad shape."""
    acc = _busy()
    with pytest.raises(InvalidWeightError, match=r"-0\.5 \(-0x1\.0+p-1\)"):
        acc.accumulate_sum(P, -0.5, grads={})
    with pytest.raises(ParameterMismatchError, match="'z'"):
        acc.accumulate_sum(P, 1, grads={"z": 1.0})
    with pytest.raises(ParameterMismatchError, match=r"'b'.*\[1\].*\[\]"):
        acc.accumulate_sum(P, 1, grads={"b": [1.0]})


def test_set_loss_scale_mid_window_names_both_scales_and_the_remedy() -> None:
    """semantics §4 Reading: set_loss_scale once the window has issued microbatches raises
    InvalidLossScaleError naming the new scale (with its hex form), the issued count, the
    window's scale and what to do (finish or discard the window first); nothing changes."""
    acc = _busy()  # loss scale 4.0, three microbatches issued
    before = snapshot(acc)
    message = (
        r"^set_loss_scale\(8\.0 \(0x1\.0+p\+3\)\): the window has issued 3 microbatch\(es\) "
        r"under loss scale 4\.0, .*every backward of a window has one loss scale; "
        r"finish or discard the window first$"
    )
    with pytest.raises(InvalidLossScaleError, match=message):
        acc.set_loss_scale(8.0)
    assert snapshot(acc) == before


# --- determinism --------------------------------------------------------------------------------


def _random_window(acc: ReferenceAccumulator, seed: int) -> ReferenceResult:
    rng = np.random.default_rng(seed)
    params = {"w": (3, 4), "b": (4,)}
    for step in range(8):
        grads = {
            "w": rng.standard_normal((3, 4)) * 2.0 ** int(rng.integers(-20, 20)),
            "b": None if step % 3 == 0 else rng.standard_normal(4),
        }
        weight = int(rng.integers(0, 300)) if step % 4 else 0
        if step % 2:
            acc.accumulate_mean(params, weight, grads=grads)
        else:
            acc.accumulate_sum(params, weight, grads=grads)
    return acc.finish_mean()


@pytest.mark.parametrize("dtype", WORK_DTYPES)
@pytest.mark.parametrize("variant", ["fma", "op_rounded", "two_step"])
def test_same_inputs_give_identical_bits(dtype: str, variant: str) -> None:
    """Two runs of the same window (fused variant included) give bit-identical results."""
    first = _random_window(
        ReferenceAccumulator(dtype=dtype, loss_scale=8.0, fused=True, fused_variant=variant), 5
    )
    second = _random_window(
        ReferenceAccumulator(dtype=dtype, loss_scale=8.0, fused=True, fused_variant=variant), 5
    )
    assert result_bits(first) == result_bits(second)


# --- issue 16: constructor types, environment, overflow message, exact window reset ----------


def test_precision_must_be_an_int_not_a_bool_or_float() -> None:
    """``precision`` is a count of bits: a bool or a float is a TypeError naming the value (not
    read as 1 or 64)."""
    with pytest.raises(TypeError, match=r"precision.*got True"):
        ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="exact", precision=True)
    with pytest.raises(TypeError, match=r"precision.*got 64\.0"):
        ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="exact", precision=64.0)  # type: ignore[arg-type]


def test_a_flushing_environment_is_refused_with_the_detectors_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the gradual-underflow check fails (FTZ/DAZ), a weighted accumulate raises
    UnsupportedEnvironmentError carrying the check's own reason, and nothing changes."""
    from wacc_ref import arith

    def flushing() -> None:
        raise RuntimeError("subnormals are flushed (simulated FTZ)")

    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    before = snapshot(acc)
    monkeypatch.setattr(arith, "check_gradual_underflow", flushing)
    with pytest.raises(UnsupportedEnvironmentError, match=r"subnormals are flushed \(simulated"):
        acc.accumulate_sum(P, 1.0, grads={"w": [1.0, 1.0]})
    assert snapshot(acc) == before


def test_a_total_weight_overflow_message_starts_with_the_weight() -> None:
    """The InvalidWeightError for a total W beyond float64 names the weight passed, as repr and
    hex (the message format of every weight error)."""
    largest = float.fromhex("0x1.fffffffffffffp+1023")
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum(P, largest, grads={"w": [1.0, 1.0]})
    named = re.escape(f"weight {largest!r} ({largest.hex()}) makes the total weight overflow")
    with pytest.raises(InvalidWeightError, match=f"^{named}"):
        acc.accumulate_sum(P, largest, grads={"w": [1.0, 1.0]})


def test_exact_mode_finish_starts_the_next_window_at_total_weight_zero() -> None:
    """exact mode: after a finish, W is exactly 0 (so finish_mean of the empty window raises
    ZeroTotalWeightError), and the next window's W and mean count only its own weights:
    S = 2, W = 2, buf [1, 3] finishes at [1/4, 3/4]."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=2.0, mode="exact")
    acc.accumulate_sum(P, 3, grads={"w": [1.0, 1.0]})
    acc.finish_sums()
    assert acc.state.total_weight == 0 and isinstance(acc.state.total_weight, Fraction)
    with pytest.raises(ZeroTotalWeightError):
        acc.finish_mean()
    acc.accumulate_sum(P, 2, grads={"w": [1.0, 3.0]})
    result = acc.finish_mean()
    assert result.exact_weight == Fraction(2) and result.weight == 2.0
    expected = [round_to(Fraction(g, 2 * 2), "float64") for g in (1, 3)]
    assert bits(result.grads["w"]) == bits(np.array(expected))
    assert acc.state.total_weight == 0
