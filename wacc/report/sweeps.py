"""The dedicated sweeps behind the report's figures (each deterministic, each run for real).

* :func:`skew_sweep` — relative error of ``wacc_torch`` and of the ``loss /= accum_steps`` loop
  against the exact full-window mean, as the token counts of a 4-microbatch window grow apart;
* :func:`overflow_map` — over loss scale ``S`` x total weight ``W`` per work dtype: where ``S·W``
  overflows (the ``scale_times_weight`` baseline breaks, the sequential division stays exact),
  where the unscaled sum overflows (``buf / S`` breaks for ``S < 1``), where the scaled sum
  itself overflows ``D``, where the true mean overflows ``D``;
* :func:`double_rounding_sweep` — where PyTorch's float64 -> float16/bfloat16 conversion (through
  float32) differs from correct rounding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from wacc.judge.implementation import Implementation, load_implementation
from wacc.judge.verdict import judge
from wacc.report.rows import IMPLEMENTATIONS
from wacc_ref import formats
from wacc_ref.scenario import Accumulate, Finish, Scenario

__all__ = [
    "OVERFLOW_CATEGORIES",
    "SKEWS",
    "OverflowMap",
    "SkewPoint",
    "double_rounding_sweep",
    "overflow_map",
    "skew_sweep",
]

SKEWS: tuple[int, ...] = (1, 7, 20, 50, 200, 1_000, 10_000, 100_000)
_FEATURES = 8  # elements of the swept parameter
_DRAWS = 4  # gradient draws per skew


@dataclass(frozen=True)
class SkewPoint:
    """One window of the skew sweep, judged for one implementation."""

    implementation: str
    work_dtype: str
    skew: int
    draw: int
    max_rel_error: float
    max_ratio: float


def _skew_window(skew: int, draw: int, work_dtype: str) -> Scenario:
    """Token counts (1, 3, 7, skew) (all 1 for skew 1), per-token float32 gradients averaged."""
    counts = (1, 1, 1, 1) if skew == 1 else (1, 3, 7, skew)
    rng = np.random.default_rng(1_000 * skew + draw)
    steps: list[Accumulate | Finish] = []
    for count in counts:
        tokens = rng.standard_normal((count, _FEATURES)).astype(np.float32)
        mean = tokens.mean(axis=0, dtype=np.float64).astype(np.float32)  # what the loss gives
        steps.append(Accumulate.of("mean", float(count), {"weight": [float(v) for v in mean]}))
    steps.append(Finish("mean"))
    return Scenario(
        work_dtype=work_dtype,
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (_FEATURES,)),),
        steps=tuple(steps),
    )


def skew_sweep(
    *,
    implementations: Sequence[str] = ("wacc_torch", "pixparse_loop"),
    work_dtypes: Sequence[str] = ("float32", "bfloat16"),
    specs: Mapping[str, str] = IMPLEMENTATIONS,
) -> list[SkewPoint]:
    """Every skew x draw x work dtype x implementation (a name of ``specs``: the report's own,
    and a user's ``--impl``), judged against the exact mean."""
    points: list[SkewPoint] = []
    for name in implementations:
        implementation = load_implementation(specs[name])
        for work in work_dtypes:
            for skew in SKEWS:
                for draw in range(_DRAWS):
                    verdict = judge(implementation, _skew_window(skew, draw, work))
                    finish = verdict.steps[-1]
                    points.append(
                        SkewPoint(name, work, skew, draw, finish.max_rel_error, finish.max_ratio)
                    )
    return points


OVERFLOW_CATEGORIES: tuple[str, ...] = (
    "all finite: both divisions exact",
    "S·W (or W itself) overflows D: dividing by S·W breaks, sequential division is exact",
    "S < 1 and the unscaled sum W·t overflows D: y = buf / S overflows, sequential division breaks",
    "the scaled sum S·W·t overflows D: no buffer in D holds it",
    "the scaled sum S·W·t underflows D: the gradient is lost (why losses are scaled up)",
    "the true mean t overflows D",
)
MEAN_EXPONENT = -4  # the per-token mean gradient t = 2**-4 of the overflow map


@dataclass(frozen=True)
class OverflowMap:
    """Categories (indices into :data:`OVERFLOW_CATEGORIES`) over log2 S x log2 W."""

    work_dtype: str
    mean_exponent: int  # the true mean gradient is t = 2**mean_exponent
    scale_exponents: tuple[int, ...]
    weight_exponents: tuple[int, ...]
    categories: np.ndarray  # [weight index, scale index]
    checked: int  # finite cells where both implementations ran and matched the category
    # per other implementation (a user's --impl): the cells where wacc_torch's sequential
    # division gives the exact mean and it does not (or raises), [weight index, scale index]
    lost: Mapping[str, np.ndarray] = field(default_factory=dict)


_TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _finish_mean(
    implementation: Implementation, dtype: torch.dtype, scale: float, weight: float, grad: float
) -> float:
    """finish_mean of one accumulate_sum of weight ``weight`` whose gradient is ``grad``."""
    accumulator = implementation.make(dtype, scale)
    module = torch.nn.Module()
    module.register_parameter("weight", torch.nn.Parameter(torch.zeros(())))
    gradient = torch.tensor(grad, dtype=torch.float64)
    accumulator.accumulate_sum(module, weight, grads={"weight": gradient})
    return float(accumulator.finish_mean().grads["weight"])


def _category(scale: Fraction, weight: Fraction, mean: Fraction, fmt: formats.Format) -> int:
    max_d = Fraction(fmt.max_finite)
    if mean > max_d:
        return 5
    if scale * weight * mean > max_d:
        return 3
    if scale * weight * mean < Fraction(fmt.min_subnormal):
        return 4
    if weight * mean > max_d:
        return 2
    if scale * weight > max_d or weight > max_d:
        return 1
    return 0


def overflow_map(
    work_dtype: str, *, cells: int = 25, others: Mapping[str, str] | None = None
) -> OverflowMap:
    """The map for ``work_dtype`` over ``S = 2**s`` x ``W = 2**w`` for a window whose true mean
    gradient is ``t = 2**MEAN_EXPONENT`` (the scaled loss-sum gradient is ``S·W·t``): each cell's
    category (:data:`OVERFLOW_CATEGORIES`, exact rational comparisons with ``max_D``), confirmed
    wherever the buffer is finite by running ``wacc_torch`` (sequential: ``buf / S``, then ``/ W``)
    and ``scale_times_weight`` (one division by ``S·W`` formed in D) on one microbatch. Each of
    ``others`` (name -> IMPL spec) runs on the cells where the sequential division is exact: a
    cell where it is not exact too (or raises) is marked in :attr:`OverflowMap.lost`."""
    fmt = formats.get_format(work_dtype)
    top = fmt.emax + 1  # max_D < 2**top
    # W up to op(D)'s range (beyond it W_op = inf and both divisions break: nothing to map).
    s_low, w_high = -24, min(top + 8, formats.op_format(fmt).emax)
    scale_exponents = tuple(range(s_low, fmt.emax + 1, max(1, (fmt.emax - s_low) // cells)))
    weight_exponents = tuple(range(0, w_high + 1, max(1, w_high // cells)))
    dtype = _TORCH_DTYPES[work_dtype]
    categories = np.zeros((len(weight_exponents), len(scale_exponents)), dtype=int)
    checked = 0
    mean = Fraction(2) ** MEAN_EXPONENT
    # Loaded once: loading imports and probes an implementation (its integrity probe alone
    # writes and reads 33 records), which per cell made the map the report's slowest part.
    sequential_impl = load_implementation(IMPLEMENTATIONS["wacc_torch"])
    product_impl = load_implementation(IMPLEMENTATIONS["scale_times_weight"])
    other_impls = {name: load_implementation(spec) for name, spec in (others or {}).items()}
    lost = {name: np.zeros(categories.shape, dtype=bool) for name in other_impls}
    for i, w_exp in enumerate(weight_exponents):
        for j, s_exp in enumerate(scale_exponents):
            scale, weight = Fraction(2) ** s_exp, Fraction(2) ** w_exp
            category = _category(scale, weight, mean, fmt)
            categories[i, j] = category
            if category == 3 or scale * weight * mean > Fraction(
                formats.FORMATS["float64"].max_finite
            ):
                continue
            args = (dtype, float(scale), float(weight), float(scale * weight * mean))
            sequential = _finish_mean(sequential_impl, *args)
            product = _finish_mean(product_impl, *args)
            max_d = Fraction(fmt.max_finite)
            buffer_ok = category not in (3, 4, 5)
            expected = (  # (sequential, product) exact: every intermediate each one forms fits D
                buffer_ok and weight * mean <= max_d,
                buffer_ok and weight <= max_d and scale * weight <= max_d,
            )
            if ((sequential == float(mean)), (product == float(mean))) != expected:
                raise AssertionError(
                    f"overflow map {work_dtype}: S=2**{s_exp}, W=2**{w_exp}, category "
                    f"{category}: sequential {sequential!r}, S·W {product!r}, exact {float(mean)!r}"
                )
            checked += 1
            for name, other in other_impls.items():
                if expected[0]:
                    try:
                        lost[name][i, j] = _finish_mean(other, *args) != float(mean)
                    except Exception:  # the user's implementation may raise anything
                        lost[name][i, j] = True
    return OverflowMap(
        work_dtype, MEAN_EXPONENT, scale_exponents, weight_exponents, categories, checked, lost
    )


@dataclass(frozen=True)
class DoubleRounding:
    """Where conv_D (through float32) and round_D differ, by distance from a D midpoint."""

    work_dtype: str
    offsets: tuple[float, ...]  # |x - midpoint| in units of float32's ulp at the midpoint
    fraction_differing: tuple[float, ...]  # per offset: the share of midpoints where they differ
    torch_checked: int  # samples where torch's own conversion was compared with conv_D


def double_rounding_sweep(work_dtype: str, *, midpoints: int = 64) -> DoubleRounding:
    """For random midpoints m of ``work_dtype`` in [1, 2) and offsets d above and below them,
    the share of x = m ± d where PyTorch's conversion differs from correct rounding."""
    fmt = formats.get_format(work_dtype)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[work_dtype]
    rng = np.random.default_rng(7)
    spacing = 2.0 ** (1 - fmt.precision)  # ulp of D in [1, 2)
    ulp32 = 2.0**-23
    offsets = tuple(2.0**k for k in range(-28, 4))
    fractions: list[float] = []
    checked = 0
    for offset in offsets:
        differ = 0
        total = 0
        for index in rng.integers(0, 2 ** (fmt.precision - 1), size=midpoints).tolist():
            midpoint = 1.0 + (index + 0.5) * spacing
            for sign in (1.0, -1.0):
                x = midpoint + sign * offset * ulp32
                converted = formats.conv_to(x, work_dtype)
                correct = formats.round_to(x, work_dtype)
                through_torch = float(torch.tensor(x, dtype=torch.float64).to(dtype))
                if through_torch != converted:
                    raise AssertionError(
                        f"torch converts {x.hex()} to {through_torch}, conv_D {converted}"
                    )
                checked += 1
                differ += converted != correct
                total += 1
        fractions.append(differ / total)
    return DoubleRounding(work_dtype, offsets, tuple(fractions), checked)
