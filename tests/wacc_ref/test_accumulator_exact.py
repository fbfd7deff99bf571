"""The exact (real-number, semantics §12.2) mode of wacc_ref.accumulator."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest

from tests.wacc_ref.test_accumulator import bits, snapshot
from wacc_ref.accumulator import ReferenceAccumulator, ReferenceResult
from wacc_ref.errors import ExactModeError, ZeroTotalWeightError
from wacc_ref.formats import WORK_DTYPES, round_to


def mpf_fraction(value: mpmath.mpf) -> Fraction:
    """The exact value of an mpf, from its raw tuple (no global precision involved)."""
    sign, man, exp, _ = value._mpf_
    magnitude = Fraction(int(man)) * Fraction(2) ** int(exp)
    return -magnitude if sign else magnitude


def test_exact_sums_use_gradients_before_conversion() -> None:
    """Exact mode adds g as handed in: bf16 D does not round 1+2**-8+2**-30 (emulated gives 1)."""
    exact = ReferenceAccumulator(dtype="bfloat16", loss_scale=1.0, mode="exact")
    exact.accumulate_sum({"p": ()}, 1, grads={"p": 1 + 2**-8 + 2**-30})
    result = exact.finish_sums()
    assert result.grads["p"].tolist() == 1 + 2**-8 + 2**-30  # type: ignore[union-attr]
    assert result.exact_weight == 1 and not result.normalized


def test_exact_mean_uses_converted_weight() -> None:
    """Exact mean: c = g * w_D with w_D = conv_bf16(1001) = 1000, W = 1000; result g / S."""
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0, mode="exact")
    acc.accumulate_mean({"p": ()}, 1001, grads={"p": 0.1})
    assert acc.state.total_weight == Fraction(1000)
    result = acc.finish_mean()
    # 0.1 * 1000 / (4 * 1000) = 0.1 / 4: a power-of-two scaling of a float64, exact.
    assert result.grads["p"].tolist() == 0.1 / 4  # type: ignore[union-attr]
    assert result.exact_weight == 1000 and result.weight == 1000.0


def test_exact_result_is_rounded_once_to_float64() -> None:
    """grads equal round_64 of the exact rational Σc/(S·W): here (1 + 2**-60) / 3."""
    acc = ReferenceAccumulator(dtype="float64", loss_scale=1.0, mode="exact")
    acc.accumulate_sum({"p": ()}, 1, grads={"p": 1.0})
    acc.accumulate_sum({"p": ()}, 2, grads={"p": 2.0**-60})
    expected = round_to((1 + Fraction(2) ** -60) / 3, "float64")
    assert acc.finish_mean().grads["p"].tolist() == expected  # type: ignore[union-attr]


def _random_exact_window(precision: int) -> ReferenceResult:
    rng = np.random.default_rng(31)
    acc = ReferenceAccumulator(
        dtype="float16", loss_scale=2.0**10, mode="exact", precision=precision
    )
    params = {"w": (4, 5)}
    for step in range(6):
        grads = {"w": rng.standard_normal((4, 5)) * 2.0 ** int(rng.integers(-30, 30))}
        weight = int(rng.integers(1, 1000))  # W ends up a sum of odd and even counts
        if step % 2:
            acc.accumulate_mean(params, weight, grads=grads)
        else:
            acc.accumulate_sum(params, weight, grads=grads)
    return acc.finish_mean()


def test_exact_mode_at_two_precisions_agrees_after_rounding_to_float64() -> None:
    """precision=128 and 512 give mpfs that round to the same float64 as the exact rational."""
    low, high = _random_exact_window(128), _random_exact_window(512)
    assert bits(low.grads["w"]) == bits(high.grads["w"])
    low_mpf = low.exact_grads["w"].reshape(-1)  # type: ignore[index,union-attr]
    high_mpf = high.exact_grads["w"].reshape(-1)  # type: ignore[index,union-attr]
    for got64, a, b in zip(low.grads["w"].reshape(-1).tolist(), low_mpf, high_mpf, strict=True):  # type: ignore[union-attr]
        assert round_to(a, "float64") == round_to(b, "float64") == got64, got64.hex()
        exact_a, exact_b = mpf_fraction(a), mpf_fraction(b)
        # a is the exact value rounded to 128 bits; b to 512 bits: |a - b| <= ulp_128(a).
        assert abs(exact_a - exact_b) <= abs(exact_a) * Fraction(2) ** -127
        assert a._mpf_[3] <= 128 and b._mpf_[3] <= 512  # significand bits used


def test_exact_grads_carry_the_requested_precision() -> None:
    """A non-dyadic quotient (1/3) uses all `precision` bits and is within 2**-precision of it."""
    for precision in (64, 300):
        acc = ReferenceAccumulator(
            dtype="float32", loss_scale=1.0, mode="exact", precision=precision
        )
        acc.accumulate_sum({"p": ()}, 3, grads={"p": 1.0})
        value = acc.finish_mean().exact_grads["p"].tolist()  # type: ignore[index,union-attr]
        assert value._mpf_[3] == precision
        error = abs(mpf_fraction(value) - Fraction(1, 3))
        assert error <= Fraction(1, 3) * Fraction(2) ** -precision


@pytest.mark.parametrize("dtype", WORK_DTYPES)
@pytest.mark.parametrize("how", ["sums", "mean"])
def test_emulated_equals_exact_when_every_operation_is_exact(dtype: str, how: str) -> None:
    """Small integer gradients, power-of-two S and W: every rounding is exact, so modes agree."""
    rng = np.random.default_rng(77)
    params = {"w": (3, 3), "b": (2,)}
    emulated = ReferenceAccumulator(dtype=dtype, loss_scale=2.0**4)
    exact = ReferenceAccumulator(dtype=dtype, loss_scale=2.0**4, mode="exact")
    for step, weight in enumerate((1, 1, 2, 0, 4)):  # W = 8
        grads = {
            "w": rng.integers(-8, 9, (3, 3)).astype(np.float64),
            "b": None if step == 1 else rng.integers(-8, 9, 2).astype(np.float64),
        }
        for acc in (emulated, exact):
            if step % 2:
                acc.accumulate_mean(params, weight, grads=grads)
            else:
                acc.accumulate_sum(params, weight, grads=grads)
    if how == "sums":
        e, x = emulated.finish_sums(), exact.finish_sums()
    else:
        e, x = emulated.finish_mean(), exact.finish_mean()
    assert x.exact_weight == 8 and e.weight == 8.0
    for name in params:
        assert bits(e.grads[name]) == bits(x.grads[name]), name


def test_exact_mode_refuses_non_finite_gradients() -> None:
    """NaN or inf has no real value: ExactModeError naming parameter and index, state kept."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="exact")
    acc.accumulate_sum({"p": (3,)}, 2, grads={"p": [1.0, 2.0, 3.0]})
    before = snapshot(acc)
    with pytest.raises(ExactModeError, match=r"'p'.*nan.*index 1"):
        acc.accumulate_sum({"p": (3,)}, 1, grads={"p": [1.0, math.nan, 2.0]})
    assert snapshot(acc) == before
    acc.accumulate_sum({"p": (3,)}, 0, grads={"p": [math.inf] * 3})  # zero weight: not read
    assert acc.state.issued == 2 and acc.state.zero_weight == 1


def test_exact_finish_mean_with_zero_weight_raises() -> None:
    """Exact mode also refuses finish_mean on a zero total weight, clearing nothing."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="exact")
    acc.accumulate_mean({"p": ()}, 0, grads={})
    with pytest.raises(ZeroTotalWeightError):
        acc.finish_mean()
    assert acc.state.issued == 1


def test_exact_result_reports_counters_flag_and_every_parameter() -> None:
    """Exact finish_sums/finish_mean report issued, zero_weight, normalized (a real bool) and
    every tracked parameter in order: None for one without a buffer (even when it comes first),
    a float64 array of the rounded exact value and an mpf array for one with a buffer."""
    params = {"a": (2,), "b": (2, 2), "c": ()}
    g_sum = [[1.0, 2.0**-60], [3.0, -4.0]]
    g_mean = [[0.5, 0.1], [0.25, 1.0]]
    # w_D = conv_f32(2) = 2 exactly, so the window holds g_sum + 2 * g_mean; W = 3 + 2 = 5.
    sums = [
        Fraction(s) + 2 * Fraction(m)
        for s, m in zip(np.ravel(g_sum).tolist(), np.ravel(g_mean).tolist(), strict=True)
    ]
    for finish in ("sums", "mean"):
        acc = ReferenceAccumulator(dtype="float32", loss_scale=2.0, mode="exact")
        acc.accumulate_sum(params, 0, grads={"b": [[math.inf] * 2] * 2})  # zero weight: unread
        acc.accumulate_sum(params, 3, grads={"a": None, "b": g_sum})
        acc.accumulate_mean(params, 2, grads={"b": g_mean, "c": None})
        result = acc.finish_sums() if finish == "sums" else acc.finish_mean()
        expected = sums if finish == "sums" else [v / (2 * 5) for v in sums]
        assert result.issued == 3 and result.zero_weight == 1, finish
        assert result.normalized is (finish == "mean")
        assert result.exact_weight == Fraction(5) and result.weight == 5.0
        assert list(result.grads) == ["a", "b", "c"]
        assert result.grads["a"] is None and result.grads["c"] is None
        exact_grads = result.exact_grads
        assert exact_grads is not None and list(exact_grads) == ["a", "b", "c"]
        assert exact_grads["a"] is None and exact_grads["c"] is None
        grads_b, exact_b = result.grads["b"], exact_grads["b"]
        assert grads_b is not None and exact_b is not None
        assert grads_b.dtype == np.float64 and grads_b.shape == (2, 2)
        assert grads_b.reshape(-1).tolist() == [round_to(v, "float64") for v in expected]
        assert exact_b.dtype == object and exact_b.shape == (2, 2)
        for got, want in zip(exact_b.reshape(-1).tolist(), expected, strict=True):
            # 256 bits hold every sum here exactly; the mean's /10 is within 2**-256 relative.
            assert abs(mpf_fraction(got) - want) <= abs(want) * Fraction(2) ** -256
        assert acc.state.issued == 0 and acc.state.zero_weight == 0


def test_exact_found_inf_reports_a_result_beyond_float64s_range() -> None:
    """In exact mode only a value beyond float64's range can be non-finite: two sums of the
    largest float64 exceed it, so finish_sums hands over +inf with found_inf True; the mean of
    the same window (W = 2) is the largest float64 again, finite, with found_inf False."""
    largest = float.fromhex("0x1.fffffffffffffp+1023")
    params = {"w": (2,)}
    acc = ReferenceAccumulator(dtype="float64", loss_scale=1.0, mode="exact")
    for _ in range(2):
        acc.accumulate_sum(params, 1, grads={"w": [largest, 0.5]})
    sums = acc.finish_sums()
    assert sums.grads["w"].tolist() == [math.inf, 1.0]  # type: ignore[union-attr]
    assert sums.found_inf is True
    for _ in range(2):
        acc.accumulate_sum(params, 1, grads={"w": [largest, 0.5]})
    means = acc.finish_mean()
    assert means.grads["w"].tolist() == [largest, 0.5]  # type: ignore[union-attr]
    assert means.found_inf is False
