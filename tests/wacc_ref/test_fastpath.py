"""wacc_ref.fastpath: the float64 fast path stays within its documented bound of the exact mode."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.bounds import TOLERANCES, gamma
from wacc_ref.errors import (
    ExactModeError,
    InvalidWeightError,
    ParameterMismatchError,
    ZeroTotalWeightError,
)
from wacc_ref.fastpath import EVALUATION_SLACK, Float64Accumulator

PARAMS = {"w": (6, 7), "b": (7,)}


def _gradient(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind == "cancelling":  # large terms of both signs: the sum is far below Σ|c|
        return rng.standard_normal(shape) * 2.0**40
    if kind == "tiny":  # products land in float64's subnormal range
        return rng.standard_normal(shape) * 2.0**-1060
    scales = np.exp2(rng.integers(-30, 30, shape).astype(np.float64))
    return rng.standard_normal(shape) * scales


def _window(seed: int, dtype: str, kind: str) -> tuple[Float64Accumulator, ReferenceAccumulator]:
    rng = np.random.default_rng(seed)
    fast = Float64Accumulator(dtype=dtype, loss_scale=2.0**7)
    exact = ReferenceAccumulator(dtype=dtype, loss_scale=2.0**7, mode="exact")
    for step in range(int(rng.integers(1, 12))):
        grads = {
            "w": _gradient(rng, (6, 7), kind),
            "b": None if step % 3 == 1 else _gradient(rng, (7,), kind),
        }
        weight = 0 if step % 5 == 4 else float(rng.integers(1, 5000)) / 8
        method = "accumulate_mean" if rng.integers(0, 2) else "accumulate_sum"
        for acc in (fast, exact):
            getattr(acc, method)(PARAMS, weight, grads=grads)
    if fast._counted == 0:  # every batch had weight 0: add one counted batch
        for acc in (fast, exact):
            acc.accumulate_sum(PARAMS, 3, grads={"w": _gradient(rng, (6, 7), kind)})
    return fast, exact


def _exact_values(
    acc: ReferenceAccumulator, *, normalize: bool
) -> dict[str, list[Fraction] | None]:
    record = acc.state_dict()
    divisor = Fraction(acc.state.loss_scale) * acc.state.total_weight if normalize else Fraction(1)
    pending = record["pending"]
    assert isinstance(pending, dict)
    return {
        name: [v / divisor for v in pending[name].reshape(-1).tolist()] if name in pending else None
        for name in PARAMS
    }


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["mixed", "cancelling", "tiny"])
@pytest.mark.parametrize("how", ["mean", "sums"])
def test_fast_path_is_within_its_bound_of_the_exact_result(dtype: str, kind: str, how: str) -> None:
    """|fast - exact| <= documented bound, element by element, on random windows (exact check)."""
    worst = 0.0
    for seed in range(12):
        fast, exact = _window(seed, dtype, kind)
        expected = _exact_values(exact, normalize=how == "mean")
        result = fast.finish_mean() if how == "mean" else fast.finish_sums()
        for name in PARAMS:
            got, bound, want = result.grads[name], result.bounds[name], expected[name]
            assert (got is None) == (want is None) == (bound is None), name
            if got is None or bound is None or want is None:
                continue
            for g, b, w in zip(
                got.reshape(-1).tolist(), bound.reshape(-1).tolist(), want, strict=True
            ):
                assert math.isfinite(b), f"seed {seed} {name}: bound {b!r}"
                error = abs(Fraction(g) - w)
                assert error <= Fraction(b), (
                    f"seed {seed} {name}: fast {g.hex()} exact {float(w).hex()} "
                    f"error {float(error)!r} > bound {b.hex()}"
                )
                if b > 0:
                    worst = max(worst, float(error / Fraction(b)))
    assert worst <= 1.0


def test_bound_is_tight_for_same_sign_contributions() -> None:
    """Without cancellation the bound is within a small factor of γ_{n+m+1} |exact| (useful)."""
    fast = Float64Accumulator(dtype="float32", loss_scale=2.0)
    rng = np.random.default_rng(3)
    for _ in range(10):
        fast.accumulate_mean({"p": (50,)}, 3, grads={"p": rng.uniform(1.0, 2.0, 50)})
    result = fast.finish_mean()
    out, bound = result.grads["p"], result.bounds["p"]
    assert out is not None and bound is not None
    # n = m = 10 and A = Σ|c| = |exact| here, so bound = γ_21 |exact| · F (plus a negligible
    # underflow term), F being the computable form's factors 1/(1-γ_9) · 1/(1-u) · (1+γ_9) and
    # the documented evaluation slack 1 + 2**-45; |out| = |exact| (1 + θ_21); and 1 + γ_8 covers
    # evaluating these few ratios in float64 here.
    g9, g21 = gamma(9, "float64"), gamma(21, "float64")
    factors = (1 + g9) / (1 - g9) / (1 - TOLERANCES["float64"].unit_roundoff) * EVALUATION_SLACK
    relative = bound / np.abs(out)
    assert np.all(relative <= g21 * factors / (1 - g21) * (1 + gamma(8, "float64")))
    assert np.all(relative >= g21 / (1 + g21))


def test_perturbed_result_violates_the_bound() -> None:
    """The check can fail: a result moved by four times its bound lies outside the bound."""
    fast, exact = _window(1, "float32", "mixed")
    want = _exact_values(exact, normalize=True)["w"]
    result = fast.finish_mean()
    got, bound = result.grads["w"], result.bounds["w"]
    assert got is not None and bound is not None and want is not None
    g, b, w = float(got.reshape(-1)[0]), float(bound.reshape(-1)[0]), want[0]
    assert 0 < b < math.inf and abs(Fraction(g) - w) <= Fraction(b), (g.hex(), b.hex())
    moved = g + 4 * b
    assert abs(Fraction(moved) - w) > Fraction(b), (g.hex(), moved.hex(), b.hex())


def test_fast_path_validation() -> None:
    """Non-finite gradients, bad weights and zero total weight raise like the accumulator."""
    fast = Float64Accumulator(dtype="float16", loss_scale=1.0)
    with pytest.raises(ExactModeError, match=r"'p'.*inf.*index 1"):
        fast.accumulate_sum({"p": (2,)}, 1, grads={"p": [1.0, math.inf]})
    with pytest.raises(InvalidWeightError, match=r"70000.*becomes inf.*float16"):
        fast.accumulate_mean({"p": (2,)}, 70000, grads={"p": [1.0, 1.0]})
    with pytest.raises(InvalidWeightError, match="-1"):
        fast.accumulate_sum({"p": (2,)}, -1, grads={})
    fast.accumulate_sum({"p": (2,)}, 0, grads={"p": [math.nan, math.nan]})  # not read
    with pytest.raises(ZeroTotalWeightError):
        fast.finish_mean()


BAD_FAST_CALLS: dict[str, tuple[type[Exception], dict[str, object], float]] = {
    "nan gradient": (ExactModeError, {"p": [1.0, math.nan]}, 1.0),
    "negative weight": (InvalidWeightError, {"p": [1.0, 1.0]}, -2.0),
    "total overflows": (InvalidWeightError, {"p": [1.0, 1.0]}, float.fromhex("0x1p+1023")),
    "untracked name": (ParameterMismatchError, {"q": [1.0, 1.0]}, 1.0),
    "gradient shape": (ParameterMismatchError, {"p": [1.0]}, 1.0),
    "integer gradient": (ParameterMismatchError, {"p": np.array([1, 2])}, 1.0),
}


@pytest.mark.parametrize("case", list(BAD_FAST_CALLS))
def test_fast_path_error_leaves_the_window_unchanged(case: str) -> None:
    """A refused call changes neither the sums, the weight nor the counts (semantics §11)."""
    error, grads, weight = BAD_FAST_CALLS[case]
    params = {"p": (2,)}
    fast, twin = (Float64Accumulator(dtype="float32", loss_scale=4.0) for _ in range(2))
    for acc in (fast, twin):
        acc.accumulate_sum(params, float.fromhex("0x1p+1023"), grads={"p": [3.0, -0.5]})
    with pytest.raises(error):
        fast.accumulate_sum(params, weight, grads=grads)  # type: ignore[arg-type]
    with pytest.raises(
        ParameterMismatchError, match=r"'p' has shape \[3\], tracked shape is \[2\]"
    ):
        fast.accumulate_sum({"p": (3,)}, 1.0, grads={})
    for acc in (fast, twin):
        acc.accumulate_sum(params, 1.0, grads={"p": [1.0, 2.0]})
    got, want = fast.finish_sums(), twin.finish_sums()
    assert got.weight == want.weight and got.contributions == want.contributions, case
    assert got.counted == want.counted == 2, case
    for name in params:
        g, w = got.grads[name], want.grads[name]
        assert g is not None and w is not None
        assert g.view(np.uint64).tolist() == w.view(np.uint64).tolist(), case


def test_overflow_gives_an_infinite_bound() -> None:
    """When float64 overflows the bound cannot hold, and the result says so with inf."""
    fast = Float64Accumulator(dtype="float64", loss_scale=1.0)
    for _ in range(2):
        fast.accumulate_sum({"p": ()}, 1, grads={"p": float.fromhex("0x1.fp+1023")})
    result = fast.finish_mean()
    assert result.bounds["p"].tolist() == math.inf  # type: ignore[union-attr]
