"""Tests of wacc_ref.bounds: the window error bound of SPEC §12.2 and the tolerance table.

The judge is the reference accumulator: its ``emulated`` mode (every accepted order) must stay
within :func:`window_error_bound` of its ``exact`` mode on random windows; constructed windows
show the bound is nearly attained; deliberately wrong implementations exceed it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import ml_dtypes
import mpmath
import numpy as np
import pytest

from wacc_ref import bounds
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.arith import round_array
from wacc_ref.bounds import (
    KINDS,
    TOLERANCES,
    BoundArgumentError,
    DtypeTolerance,
    error_ratio,
    gamma,
    window_error_bound,
)
from wacc_ref.errors import (
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    ZeroTotalWeightError,
)
from wacc_ref.formats import (
    FORMATS,
    WORK_DTYPES,
    conv_to,
    get_format,
    is_representable,
    op_format,
    round_to,
)

PARAMS = {"p": (4,)}  # the reference accumulator's "module": one parameter of up to 4 elements
WINDOWS_PER_DTYPE = 10_000
MAX_MICROBATCHES = 8
# Fixed seeds, one per work dtype: every random window is reproducible from (seed, index).
SEEDS = {"float64": 0xB0D64, "float32": 0xB0D32, "float16": 0xB0D16, "bfloat16": 0xB0DBF}
GRADIENT_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
# The emulated step orders: (fused, fused_variant); sums ignore the variant (SPEC §5).
VARIANTS = ((False, "two_step"), (True, "fma"), (True, "op_rounded"), (True, "two_step"))
FINISHES = ("sums", "mean")
# exact-mode precision: a sum of <= 8 products g * w_D (<= 53 + 24 significant bits, exponents
# within [-1074 - 133, 1024 + 128]) spans fewer than 2500 bits, so finish_sums is exact.
EXACT_PRECISION = 4096


def _hex(x: float) -> str:
    return float(x).hex()


@dataclass(frozen=True)
class Window:
    """One window: its microbatches in issue order and how it is accumulated and finished."""

    dtype: str
    kind: str  # "sum" or "mean"
    fused: bool
    variant: str
    finish: str  # "sums" (finish_sums, normalized=False) or "mean" (finish_mean)
    loss_scale: float
    weights: tuple[float, ...]
    grads: tuple[np.ndarray | None, ...]  # float64 arrays holding values of grad_dtype
    grad_dtype: str

    def describe(self) -> str:
        """Everything needed to rebuild the window, floats as hex."""
        grads = [None if g is None else [_hex(v) for v in g] for g in self.grads]
        return (
            f"Window(dtype={self.dtype!r}, kind={self.kind!r}, fused={self.fused}, "
            f"variant={self.variant!r}, finish={self.finish!r}, "
            f"loss_scale={_hex(self.loss_scale)}, weights={[_hex(w) for w in self.weights]}, "
            f"grads={grads}, grad_dtype={self.grad_dtype!r})"
        )


def _emulated(window: Window) -> np.ndarray | None:
    """The reference accumulator's emulated result for the window (None: no buffer)."""
    acc = ReferenceAccumulator(
        dtype=window.dtype,
        loss_scale=window.loss_scale,
        fused=window.fused,
        fused_variant=window.variant,
    )
    _feed(acc, window)
    result = acc.finish_sums() if window.finish == "sums" else acc.finish_mean()
    return result.grads["p"]


def _feed(acc: ReferenceAccumulator, window: Window) -> None:
    accumulate = acc.accumulate_sum if window.kind == "sum" else acc.accumulate_mean
    for weight, grad in zip(window.weights, window.grads, strict=True):
        accumulate(PARAMS, weight, grads={"p": grad})


def _exact(window: Window) -> np.ndarray | None:
    """The exact real result Σ c_k / S / W (or Σ c_k) from the exact mode, as Fractions."""
    acc = ReferenceAccumulator(
        dtype=window.dtype, loss_scale=window.loss_scale, mode="exact", precision=EXACT_PRECISION
    )
    _feed(acc, window)
    result = acc.finish_sums()  # exact at this precision (see EXACT_PRECISION)
    sums = None if result.exact_grads is None else result.exact_grads["p"]
    if sums is None:
        return None
    assert result.exact_weight is not None
    values = [_mpf_to_fraction(v) for v in sums.reshape(-1)]
    if window.finish == "mean":
        divisor = Fraction(window.loss_scale) * result.exact_weight
        values = [v / divisor for v in values]
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(sums.shape)


def _mpf_to_fraction(value: mpmath.mpf) -> Fraction:
    sign, mantissa, exponent, _ = value._mpf_  # raw and exact (man_exp drops the sign)
    magnitude = Fraction(int(mantissa)) * Fraction(2) ** int(exponent)
    return -magnitude if sign else magnitude


def _bound(window: Window) -> np.ndarray:
    return window_error_bound(
        kind=window.kind,
        grads=list(window.grads),
        weights=list(window.weights),
        dtype=window.dtype,
        loss_scale=window.loss_scale,
        normalized=window.finish == "mean",
    )


# --- random windows ---------------------------------------------------------------------------


def _random_loss_scale(rng: np.random.Generator, dtype: str) -> float:
    fmt = get_format(dtype)
    top = min(24, fmt.emax)
    choice = rng.integers(4)
    if choice == 0:
        return 1.0
    if choice == 1:  # a power of two, below or above 1
        return math.ldexp(1.0, int(rng.integers(-8, top + 1)))
    # not a power of two: a random value of D in a moderate range
    scale = round_to(float(np.exp2(rng.uniform(-6, top - 1))), dtype)
    return scale if scale > 0 else 1.0


def _random_weight(rng: np.random.Generator, dtype: str, kind: str) -> float:
    choice = rng.integers(10)
    if choice == 0:
        return 0.0
    if choice == 1:  # a non-integer weight (a fraction of a token: still a valid weight)
        return float(rng.uniform(0.01, 100.0))
    top = 1e6
    if kind == "mean" and dtype == "float16":
        top = 60000.0  # conv_D(w) must stay finite (SPEC §6)
    return float(np.floor(np.exp(rng.uniform(0.0, math.log(top)))))


def _random_window(rng: np.random.Generator, dtype: str) -> Window:
    """A random window; magnitudes are chosen so that most contributions stay finite."""
    fmt = get_format(dtype)
    kind = KINDS[rng.integers(len(KINDS))]
    fused, variant = VARIANTS[rng.integers(len(VARIANTS))]
    finish = FINISHES[rng.integers(len(FINISHES))]
    loss_scale = _random_loss_scale(rng, dtype)
    grad_dtype = GRADIENT_DTYPES[rng.integers(len(GRADIENT_DTYPES))]
    grad_fmt = get_format(grad_dtype)
    count = int(rng.integers(1, MAX_MICROBATCHES + 1))
    size = int(rng.integers(1, PARAMS["p"][0] + 1))
    params_size = PARAMS["p"][0]
    weights = [_random_weight(rng, dtype, kind) for _ in range(count)]
    if all(w == 0 for w in weights):
        weights[-1] = 1.0
    # Magnitude regime of the contributions c = g * w_D (log2), per window.
    regime = rng.integers(4)
    if regime == 0:  # typical
        low, high = -6.0, 6.0
    elif regime == 1:  # the whole finite range of D, the subnormal range included
        low, high = fmt.emin - fmt.precision - 2.0, fmt.emax - 6.0
    elif regime == 2:  # around the subnormal range of D
        low, high = fmt.emin - fmt.precision - 2.0, fmt.emin + 3.0
    else:  # cancellation: contributions that nearly cancel in pairs
        low, high = -3.0, 3.0
    grads: list[np.ndarray | None] = []
    previous: np.ndarray | None = None
    for weight in weights:
        if weight == 0:  # never read: NaN proves it
            grads.append(np.full(params_size, math.nan))
            continue
        if rng.integers(10) == 0:
            grads.append(None)
            continue
        multiplier = 1.0 if kind == "sum" else conv_to(weight, dtype)
        exponents = rng.uniform(low, high, size=params_size)
        signs = rng.choice([-1.0, 1.0], size=params_size)
        contribution = signs * np.exp2(exponents)
        if regime == 3 and previous is not None and rng.integers(2) == 0:
            contribution = -previous * (1.0 + rng.uniform(-1e-3, 1e-3, size=params_size))
        previous = contribution
        raw = contribution / multiplier
        raw = np.clip(raw, -grad_fmt.max_finite, grad_fmt.max_finite)
        raw[size:] = 0.0
        grads.append(round_array(raw, grad_fmt))
    return Window(
        dtype=dtype,
        kind=kind,
        fused=fused,
        variant=variant,
        finish=finish,
        loss_scale=loss_scale,
        weights=tuple(weights),
        grads=tuple(grads),
        grad_dtype=grad_dtype,
    )


def _check_random_windows(dtype: str) -> dict[tuple[str, str], float]:
    rng = np.random.default_rng(SEEDS[dtype])
    worst: dict[tuple[str, str], float] = defaultdict(float)
    assessed = 0
    elements = 0
    for index in range(WINDOWS_PER_DTYPE):
        window = _random_window(rng, dtype)
        exact = _exact(window)
        if exact is None:
            continue  # every positive-weight gradient was None: the finished gradient is None
        observed = _emulated(window)
        assert observed is not None
        bound = _bound(window)
        ratio = error_ratio(observed, exact, bound)
        assert ratio <= 1.0, (
            f"seed {SEEDS[dtype]:#x}, window {index}: error/bound = {ratio!r} > 1\n"
            f"{window.describe()}\nobserved={[_hex(v) for v in observed]}\n"
            f"exact={[str(v) for v in exact]}\nbound={[_hex(v) for v in bound]}"
        )
        key = (window.kind, window.finish if window.kind == "sum" else window.finish)
        worst[key] = max(worst[key], ratio)
        assessed += int(np.isfinite(bound).sum())
        elements += bound.size
    worst[("applicable", "fraction")] = assessed / elements
    return dict(worst)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", WORK_DTYPES)
def test_random_windows_stay_within_the_bound(dtype: str) -> None:
    """On 10**4 random windows the emulated result of every accepted order is within the bound."""
    start = time.perf_counter()
    worst = _check_random_windows(dtype)
    elapsed = time.perf_counter() - start
    print(f"\n{dtype}: max error/bound {worst} ({elapsed:.1f} s)")
