"""Hypothesis strategies for accumulation scenarios (the edge cases semantics §1–§9 are about).

Each strategy is small and named after the family of inputs it reaches:

* :func:`gradient_values` — values exactly representable in a gradient dtype: ±0, subnormals,
  the normal/subnormal boundary, values near ``max_finite``, boundaries of the work dtype (its
  smallest subnormal, its overflow threshold), short dyadics (exact sums), random values over the
  whole exponent range; NaN/inf only when asked.
* :func:`scaled_gradient_values` — loss-scaled gradients: ``S`` times a moderate value, and values
  in the top binade of the work dtype (buffers near overflow).
* :func:`unequal_microbatches` — token counts 1 … 10**6 with a skew (largest/smallest) up to 10**5
  within a window.
* :func:`zero_weights` — windows with explicit zero-weight batches (``0.0`` and ``-0.0``),
  including windows where every batch has weight zero.
* :func:`loss_scales` / :func:`overflow_prone_scales` — powers of two (and a few other exact
  values) representable in ``D``; the overflow-prone ones lie in the top binades of ``D`` so that
  ``S·W`` overflows ``D`` while ``S`` and ``W`` do not (fp16: ``S = 2**15``, ``W = 4096``).
* :func:`checkpoint_interruptions` — checkpoints (sync or async) inserted before any step, each
  optionally followed by corrupted-record restores and by a restore right away or some steps later.
* :func:`scenarios` — complete :class:`~wacc_ref.scenario.Scenario` objects combining them.
* :func:`scaler_options` / :func:`dynamic_scenarios` — dynamic loss scaling (semantics §13):
  several windows, each started with ``set_loss_scale`` at the reference scaler's scale, its
  gradients scaled by that scale (heavy-tailed magnitudes, so some windows overflow), finished
  and decided on with ``update_scaler``; now and then a scale set mid-window or an invalid one,
  and checkpoints anywhere.

Sizes are capped by the named constants below so that a scenario runs on the reference in
milliseconds.  Cancellation (``x`` in one microbatch, ``-x`` in a later one of the same window) is
drawn explicitly by :func:`scenarios`, element by element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
from hypothesis import strategies as st

from wacc_ref import formats
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.corruption import (
    CORRUPTION_KINDS,
)
from wacc_ref.errors import WeightedAccumulationError
from wacc_ref.faults import Fault, applicable_faults
from wacc_ref.scaler import ReferenceLossScaler
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    GradEntries,
    GradValues,
    Restore,
    RestoreCorrupted,
    ScalerOptions,
    Scenario,
    SetLossScale,
    Step,
    UpdateScaler,
)

__all__ = [
    "LARGE_WEIGHTS",
    "MAX_CORRUPTIONS_PER_CHECKPOINT",
    "MAX_INTERRUPTIONS",
    "MAX_PARAMETERS",
    "MAX_PARAMETER_ELEMENTS",
    "MAX_SKEW",
    "MAX_STEPS",
    "MAX_TOKEN_COUNT",
    "MAX_WINDOW_MICROBATCHES",
    "OVERFLOW_SCALE_BINADES",
    "PARAMETER_NAMES",
    "Interruption",
    "checkpoint_interruptions",
    "dynamic_scenarios",
    "faults",
    "gradient_values",
    "loss_scales",
    "overflow_prone_scales",
    "scaled_gradient_values",
    "scaler_options",
    "scenarios",
    "unequal_microbatches",
    "zero_weights",
]

# Size caps (a scenario must run on the reference in milliseconds).
MAX_PARAMETERS = 3  # tracked parameters per scenario
MAX_PARAMETER_ELEMENTS = 4  # elements per parameter
MAX_WINDOW_MICROBATCHES = 8  # accumulate steps per window
MAX_STEPS = 24  # accumulate + finish steps per scenario (interruptions come on top)
MAX_INTERRUPTIONS = 3  # checkpoints inserted per scenario
MAX_CORRUPTIONS_PER_CHECKPOINT = 2  # corrupted restores right after one checkpoint

# Weights: token counts and their spread within a window.
MAX_TOKEN_COUNT = 10**6
MAX_SKEW = 10**5

# Overflow-prone loss scales are 2**k with k in [emax - OVERFLOW_SCALE_BINADES, emax] of D.
OVERFLOW_SCALE_BINADES = 20
# Ordinary loss scales are 2**k with |k| <= ORDINARY_SCALE_EXPONENT (clipped to D).
ORDINARY_SCALE_EXPONENT = 24
# A few loss scales that are not powers of two (exact in every work dtype: at most 7 bits).
NON_POWER_OF_TWO_SCALES = (3.0, 0.75, 1000.0)
# "Moderate" gradient magnitudes: binades 2**-MODERATE_EXPONENT ... 2**MODERATE_EXPONENT.
MODERATE_EXPONENT = 10
# Short dyadics m * 2**k: at most SHORT_DYADIC_BITS significant bits, |k| <= SHORT_DYADIC_EXPONENT.
SHORT_DYADIC_BITS = 6
SHORT_DYADIC_EXPONENT = 8

PARAMETER_NAMES = ("weight", "bias", "encoder.layer.0.weight", "head.bias", "norm.scale")
# The structural family (wacc_ref.faults): a name no scenario tracks, one fault in 4 steps, and
# rank-4 shapes (N, C, H, W) whose channels-last layout is not contiguous.
STRAY_NAME = "stray.weight"
FAULT_ODDS = 4
FOUR_D_SHAPES = ((1, 2, 1, 2), (1, 2, 2, 1))

_ZERO_WEIGHTS = (0.0, -0.0)
_ACCUMULATE_KINDS: dict[str, Literal["sum", "mean"]] = {"sum": "sum", "mean": "mean"}
_FINISH_KINDS: dict[str, Literal["sums", "mean"]] = {"sums": "sums", "mean": "mean"}
# Token totals past float32's exact integers: 2**24 + 1 (W + 1 rounds in float32), and a
# total whose sums with small counts round in float32 (its spacing there is 2**17).
LARGE_WEIGHTS: tuple[float, ...] = (float.fromhex("0x1.000001p+24"), float.fromhex("0x1.8p+40"))
_INVALID_WEIGHTS = (-1.0, -0.5, math.nan, math.inf, -math.inf)


def _check_positive_int(value: int, *, name: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_dtypes(dtypes: Sequence[str], *, name: str, allowed: Sequence[str]) -> tuple[str, ...]:
    chosen = tuple(dtypes)
    if not chosen or any(d not in allowed for d in chosen):
        raise ValueError(f"{name} must be a non-empty selection of {list(allowed)}, got {dtypes!r}")
    return chosen


# ---------------------------------------------------------------------------------------------
# Gradient values
# ---------------------------------------------------------------------------------------------


def _normal_values(fmt: formats.Format, lowest: int, highest: int) -> st.SearchStrategy[float]:
    """Normal values of ``fmt`` with exponents in [lowest, highest] (clipped to the format)."""
    low, high = max(lowest, fmt.emin), min(highest, fmt.emax)
    if low > high:
        return st.nothing()
    fraction_bits = fmt.precision - 1

    def build(sign: bool, exponent: int, fraction: int) -> float:
        # (2**(p-1) + fraction) * 2**(exponent - p + 1): exact in float64 (p <= 53, normal range).
        magnitude = math.ldexp((1 << fraction_bits) + fraction, exponent - fraction_bits)
        return -magnitude if sign else magnitude

    values = st.builds(
        build,
        st.booleans(),
        st.integers(low, high),
        st.integers(0, (1 << fraction_bits) - 1),
    )
    # e4m3fn's top binade is short (its all-ones pattern is NaN): keep only finite values.
    return values.filter(lambda v: abs(v) <= fmt.max_finite)


def _subnormal_values(fmt: formats.Format) -> st.SearchStrategy[float]:
    """Nonzero subnormal values of ``fmt`` (m * min_subnormal, exact in float64)."""
    top = (1 << (fmt.precision - 1)) - 1
    return st.builds(
        lambda sign, m: -m * fmt.min_subnormal if sign else m * fmt.min_subnormal,
        st.booleans(),
        st.integers(1, top),
    )


def _short_dyadics(fmt: formats.Format) -> st.SearchStrategy[float]:
    """m * 2**k with few significant bits: sums of such values are often exact."""
    bits = min(fmt.precision, SHORT_DYADIC_BITS)
    highest = min(SHORT_DYADIC_EXPONENT, fmt.emax - bits)
    return st.builds(
        lambda m, k: math.ldexp(m, k),
        st.integers(-(1 << bits) + 1, (1 << bits) - 1),
        st.integers(-SHORT_DYADIC_EXPONENT, highest),
    )


def _boundary_values(fmt: formats.Format) -> list[float]:
    """±0, smallest/largest subnormal, smallest normal, 1, largest two finite values of ``fmt``."""
    below_max = fmt.max_finite - formats.ulp(fmt.max_finite, fmt)
    magnitudes = [
        fmt.min_subnormal,
        fmt.min_normal - fmt.min_subnormal,
        fmt.min_normal,
        1.0,
        below_max,
        fmt.max_finite,
    ]
    return [0.0, -0.0] + [s * m for m in magnitudes for s in (1.0, -1.0)]


def _work_boundary_values(grad: formats.Format, work: formats.Format) -> list[float]:
    """Values of ``grad`` at the edges of ``work``: its tie-to-zero, subnormal and overflow points.

    Each edge of ``work`` (half its smallest subnormal, 1.5 of it, its largest finite value, the
    overflow tie max + ulp/2, its smallest normal) is rounded into ``grad``; infinite results
    (``grad`` narrower than ``work``) are dropped.
    """
    tie_above_max = work.max_finite + formats.ulp(work.max_finite, work) / 2.0
    edges = [
        work.min_subnormal / 2.0,
        work.min_subnormal * 1.5,
        work.min_normal,
        work.max_finite,
        tie_above_max,
    ]
    values = []
    for edge in edges:
        for signed in (edge, -edge):
            rounded = formats.round_to(signed, grad)
            if math.isfinite(rounded):
                values.append(rounded)
    return values


def gradient_values(
    dtype: str,
    *,
    work_dtype: str | None = None,
    allow_nan: bool = False,
    allow_infinity: bool = False,
) -> st.SearchStrategy[float]:
    """Floats exactly representable in the gradient dtype ``dtype``.

    Reaches ±0, subnormals, the subnormal/normal boundary, values near ``max_finite``, short
    dyadics, moderate values and the whole exponent range; with ``work_dtype``, also values of
    ``dtype`` at the edges of the work dtype (tie-to-zero, overflow threshold).  NaN and ±inf only
    when ``allow_nan`` / ``allow_infinity`` (inf only if the format has one).  Shrinks towards
    short dyadics.
    """
    fmt = formats.get_format(dtype)
    specials = _boundary_values(fmt)
    if work_dtype is not None:
        specials += _work_boundary_values(fmt, formats.get_format(work_dtype))
    branches: list[st.SearchStrategy[float]] = [
        _short_dyadics(fmt),
        _normal_values(fmt, -MODERATE_EXPONENT, MODERATE_EXPONENT),
        st.sampled_from(specials),
        _subnormal_values(fmt),
        _normal_values(fmt, fmt.emin, fmt.emax),
        _normal_values(fmt, fmt.emax, fmt.emax),  # the top binade: near max_finite
    ]
    non_finite: list[float] = []
    if allow_nan:
        non_finite.append(math.nan)
    if allow_infinity and fmt.has_inf:
        non_finite += [math.inf, -math.inf]
    if non_finite:
        branches.append(st.sampled_from(non_finite))
    return st.one_of(branches)


def scaled_gradient_values(
    dtype: str, *, work_dtype: str, loss_scale: float
) -> st.SearchStrategy[float]:
    """Loss-scaled gradients in ``dtype``: ``round(S * x)`` for moderate ``x``, and top-binade
    values of the work dtype (buffers near its overflow), all rounded into ``dtype``.

    Results that overflow ``dtype`` are replaced by its largest finite value (same sign).
    """
    grad = formats.get_format(dtype)
    work = formats.get_format(work_dtype)

    def into_grad(value: float) -> float:
        rounded = formats.round_to(value, grad)
        if math.isfinite(rounded):
            return rounded
        return math.copysign(grad.max_finite, value)

    moderate = _normal_values(formats.get_format("float64"), -MODERATE_EXPONENT, MODERATE_EXPONENT)
    # S * x is a float64 product (exact for a power-of-two S inside float64's range; inf beyond
    # it, which into_grad clamps): only its rounding into the grad dtype matters here.
    scaled = moderate.map(lambda x: into_grad(x * loss_scale))
    near_work_max = _normal_values(work, work.emax - 1, work.emax).map(into_grad)
    return st.one_of(scaled, near_work_max)


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


@st.composite
def unequal_microbatches(
    draw: st.DrawFn,
    *,
    min_size: int = 1,
    max_size: int = MAX_WINDOW_MICROBATCHES,
    max_count: int = MAX_TOKEN_COUNT,
    max_skew: int = MAX_SKEW,
) -> list[int]:
    """Token counts of one window: ints in [1, max_count], largest/smallest <= max_skew.

    The smallest count is drawn first (the semantics' 1, 7, 200, 3 example among the favourites),
    then every count lies in [smallest, min(max_count, smallest * max_skew)], with both ends
    drawn explicitly so that the full skew is reached.
    """
    _check_positive_int(min_size, name="min_size", minimum=0)
    _check_positive_int(max_size, name="max_size", minimum=max(min_size, 1))
    _check_positive_int(max_count, name="max_count")
    _check_positive_int(max_skew, name="max_skew")
    smallest = draw(st.one_of(st.sampled_from((1, 7, 200, 3)), st.integers(1, max_count)))
    smallest = min(smallest, max_count)
    largest = min(max_count, smallest * max_skew)
    count = st.one_of(st.integers(smallest, largest), st.sampled_from((smallest, largest)))
    return draw(st.lists(count, min_size=min_size, max_size=max_size))


@st.composite
def zero_weights(
    draw: st.DrawFn,
    *,
    min_size: int = 1,
    max_size: int = MAX_WINDOW_MICROBATCHES,
    max_count: int = MAX_TOKEN_COUNT,
) -> list[float]:
    """Weights of one window with at least one explicit zero (``0.0`` or ``-0.0``).

    Either every weight is zero (an all-zero window: ``finish_mean`` must raise), or zeros are
    mixed with unequal token counts.
    """
    _check_positive_int(min_size, name="min_size")
    _check_positive_int(max_size, name="max_size", minimum=min_size)
    size = draw(st.integers(min_size, max_size))
    zero = st.sampled_from(_ZERO_WEIGHTS)
    if draw(st.booleans()):
        return [draw(zero) for _ in range(size)]
    counts = draw(unequal_microbatches(min_size=size, max_size=size, max_count=max_count))
    is_zero = draw(st.lists(st.booleans(), min_size=size, max_size=size))
    if not any(is_zero):
        is_zero[draw(st.integers(0, size - 1))] = True
    return [draw(zero) if z else float(c) for z, c in zip(is_zero, counts, strict=True)]


# ---------------------------------------------------------------------------------------------
# Loss scales
# ---------------------------------------------------------------------------------------------


def _power_of_two_scales(
    fmt: formats.Format, lowest: int, highest: int
) -> st.SearchStrategy[float]:
    # Every 2**k with k in [emin - p + 1, emax] is a value of fmt (subnormal ones included).
    low = max(lowest, fmt.emin - fmt.precision + 1)
    high = min(highest, fmt.emax)
    return st.integers(low, high).map(lambda k: math.ldexp(1.0, k))


def loss_scales(dtype: str) -> st.SearchStrategy[float]:
    """Ordinary loss scales of work dtype ``dtype``: 1, powers of two 2**-24 … 2**24 (clipped to
    the dtype), and a few exact non-powers of two (3, 0.75, 1000)."""
    fmt = formats.get_format(dtype)
    return st.one_of(
        st.just(1.0),
        _power_of_two_scales(fmt, -ORDINARY_SCALE_EXPONENT, ORDINARY_SCALE_EXPONENT),
        st.sampled_from([s for s in NON_POWER_OF_TWO_SCALES if formats.is_representable(s, fmt)]),
    )


def overflow_prone_scales(dtype: str) -> st.SearchStrategy[float]:
    """Powers of two S in the top OVERFLOW_SCALE_BINADES binades of work dtype ``dtype``.

    S itself is finite in ``D``; ``S·W`` overflows ``D`` as soon as ``W > max_finite / S``, i.e.
    for W >= 2 at the top scale (fp16: 2**15 · 4096 = 2**27 > 65504), W >= 2**21 at the lowest.
    The top scale is drawn explicitly.
    """
    fmt = formats.get_format(dtype)
    top = math.ldexp(1.0, fmt.emax)
    return st.one_of(
        st.just(top), _power_of_two_scales(fmt, fmt.emax - OVERFLOW_SCALE_BINADES, fmt.emax)
    )


# ---------------------------------------------------------------------------------------------
# Checkpoints and interruptions
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interruption:
    """One checkpoint inserted before base step ``at``, with what follows it.

    ``corruptions`` are corrupted-record restores right after the checkpoint; ``restore_after`` is
    the number of base steps that run before the restore (None: no restore).
    """

    at: int
    asynchronous: bool
    corruptions: tuple[str, ...]
    restore_after: int | None


@st.composite
def checkpoint_interruptions(
    draw: st.DrawFn,
    base_steps: Sequence[Step],
    *,
    max_interruptions: int = MAX_INTERRUPTIONS,
    corruption_kinds: Sequence[str] = CORRUPTION_KINDS,
    max_corruptions: int = MAX_CORRUPTIONS_PER_CHECKPOINT,
) -> tuple[Step, ...]:
    """``base_steps`` with checkpoints inserted at any positions (before the first step, between
    any two, after the last), each sync or async, each optionally followed by corrupted-record
    restores and by a restore — right away (stop and resume) or after some further steps (the
    steps in between are lost, as after a crash; the data position is the caller's).
    """
    _check_positive_int(max_interruptions, name="max_interruptions", minimum=0)
    _check_positive_int(max_corruptions, name="max_corruptions", minimum=0)
    kinds = tuple(corruption_kinds)
    if any(kind not in CORRUPTION_KINDS for kind in kinds):
        raise ValueError(f"unknown corruption kinds in {kinds!r}; known: {CORRUPTION_KINDS}")
    steps = tuple(base_steps)
    count = draw(st.integers(0, max_interruptions))
    inserted: list[list[Step]] = [[] for _ in range(len(steps) + 1)]
    for _ in range(count):
        at = draw(st.integers(0, len(steps)))
        corruptions: tuple[str, ...] = ()
        if kinds and max_corruptions:
            corruptions = tuple(draw(st.lists(st.sampled_from(kinds), max_size=max_corruptions)))
        restore_after = draw(st.one_of(st.none(), st.just(0), st.integers(0, len(steps) - at)))
        interruption = Interruption(at, draw(st.booleans()), corruptions, restore_after)
        inserted[at].append(Checkpoint(asynchronous=interruption.asynchronous))
        inserted[at].extend(RestoreCorrupted(kind) for kind in interruption.corruptions)
        if interruption.restore_after is not None:
            inserted[at + interruption.restore_after].append(Restore())
    result: list[Step] = []
    for position, step in enumerate(steps):
        result.extend(inserted[position])
        result.append(step)
    result.extend(inserted[len(steps)])
    return tuple(result)


# ---------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------


@st.composite
def _shapes(draw: st.DrawFn, *, max_elements: int) -> tuple[int, ...]:
    rank = draw(st.integers(0, 2))
    shape: list[int] = []
    remaining = max_elements
    for _ in range(rank):
        dim = draw(st.integers(1, remaining))
        shape.append(dim)
        remaining //= dim
    return tuple(shape)


def _parameters(
    draw: st.DrawFn, max_parameters: int, max_elements: int, *, structural: bool = False
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    count = draw(st.integers(1, min(max_parameters, len(PARAMETER_NAMES))))
    names = draw(st.permutations(PARAMETER_NAMES))[:count]
    shapes = _shapes(max_elements=max_elements)
    if structural:
        shapes = st.one_of(shapes, st.sampled_from(FOUR_D_SHAPES))
    return tuple((name, draw(shapes)) for name in names)


@st.composite
def faults(
    draw: st.DrawFn, parameters: Sequence[tuple[str, tuple[int, ...]]], grads: GradEntries
) -> Fault:
    """A fault of :mod:`wacc_ref.faults` for a step with ``grads``: any kind that applies to
    a parameter the step holds values for, or an unknown name."""
    shapes = dict(parameters)
    candidates = [
        Fault(kind, name)
        for name, values in grads
        if values is not None
        for kind in applicable_faults(shapes[name])
    ]
    return draw(st.sampled_from([*candidates, Fault("unknown", STRAY_NAME)]))


def _interrupted(
    draw: st.DrawFn, base: list[Step], max_interruptions: int, corruption_kinds: Sequence[str]
) -> tuple[Step, ...]:
    if not max_interruptions:
        return tuple(base)
    return draw(
        checkpoint_interruptions(
            base, max_interruptions=max_interruptions, corruption_kinds=corruption_kinds
        )
    )


@st.composite
def _window_weights(draw: st.DrawFn, *, max_size: int, invalid_weights: bool) -> list[float]:
    weights: list[float]
    if draw(st.booleans()):
        weights = [float(c) for c in draw(unequal_microbatches(max_size=max_size))]
    else:
        weights = draw(zero_weights(max_size=max_size))
    # Rarely (1 in 8 windows): one weight beyond float32's exact integers (2**24), so that a
    # total weight kept in float32 (or any narrower accumulation of W) shows.
    if draw(st.integers(0, 7)) == 0:
        weights[draw(st.integers(0, len(weights) - 1))] = draw(st.sampled_from(LARGE_WEIGHTS))
    # Rarely (1 in 8 windows): replace one weight by an invalid one (InvalidWeightError path).
    if invalid_weights and draw(st.integers(0, 7)) == 0:
        weights[draw(st.integers(0, len(weights) - 1))] = draw(st.sampled_from(_INVALID_WEIGHTS))
    return weights


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    work_dtypes: Sequence[str] = formats.WORK_DTYPES,
    grad_dtypes: Sequence[str] | None = None,
    max_steps: int = MAX_STEPS,
    max_parameters: int = MAX_PARAMETERS,
    max_elements: int = MAX_PARAMETER_ELEMENTS,
    kinds: Sequence[str] = ("sum", "mean"),
    fused: bool | None = None,
    allow_nan: bool = False,
    allow_infinity: bool = False,
    invalid_weights: bool = True,
    max_interruptions: int = MAX_INTERRUPTIONS,
    corruption_kinds: Sequence[str] = CORRUPTION_KINDS,
    dynamic: bool = False,
    structural: bool = False,
) -> Scenario:
    """Complete scenarios: dtypes, loss scale, parameters, windows of microbatches, finishes and
    checkpoint interruptions; with ``dynamic``, :func:`dynamic_scenarios` (which takes the dtypes,
    ``fused``, ``max_interruptions`` and ``corruption_kinds`` and ignores the rest).

    ``grad_dtypes`` defaults to all six formats.  ``max_steps`` caps the accumulate and finish
    steps; interruptions add at most ``max_interruptions * (2 + MAX_CORRUPTIONS_PER_CHECKPOINT)``
    steps.  Windows use sums, means or both (``kinds``), unequal token counts or explicit zero
    weights (all-zero windows included), rarely an invalid weight (``invalid_weights``); each
    window ends with ``finish_sums`` or ``finish_mean``, or is left open.  Gradients come from
    :func:`gradient_values` (and :func:`scaled_gradient_values` when the loss scale is
    overflow-prone); a parameter may be None or absent in a step; an element may repeat the
    negation of one of its earlier values in the window (cancellation).  ``fused`` None draws it.
    With ``structural``, one accumulate step in :data:`FAULT_ODDS` hands a gradient in malformed
    (:func:`faults`), and a parameter may have a rank-4 shape (:data:`FOUR_D_SHAPES`).
    """
    if dynamic:
        return draw(
            dynamic_scenarios(
                work_dtypes=work_dtypes,
                grad_dtypes=grad_dtypes,
                fused=fused,
                max_interruptions=max_interruptions,
                corruption_kinds=corruption_kinds,
            )
        )
    work_choice = _check_dtypes(work_dtypes, name="work_dtypes", allowed=formats.WORK_DTYPES)
    grad_choice = _check_dtypes(
        tuple(formats.FORMATS) if grad_dtypes is None else grad_dtypes,
        name="grad_dtypes",
        allowed=tuple(formats.FORMATS),
    )
    _check_positive_int(max_steps, name="max_steps")
    _check_positive_int(max_parameters, name="max_parameters")
    _check_positive_int(max_elements, name="max_elements")
    kind_choice = tuple(kinds)
    if not kind_choice or any(k not in ("sum", "mean") for k in kind_choice):
        raise ValueError(f"kinds must be a non-empty selection of ('sum', 'mean'), got {kinds!r}")

    work = draw(st.sampled_from(work_choice))
    grad = draw(st.sampled_from(grad_choice))
    overflow_prone = draw(st.booleans())
    scale = draw(overflow_prone_scales(work) if overflow_prone else loss_scales(work))
    is_fused = draw(st.booleans()) if fused is None else fused

    parameters = _parameters(draw, max_parameters, max_elements, structural=structural)

    values = gradient_values(
        grad, work_dtype=work, allow_nan=allow_nan, allow_infinity=allow_infinity
    )
    if overflow_prone:
        values = st.one_of(values, scaled_gradient_values(grad, work_dtype=work, loss_scale=scale))

    base: list[Step] = []
    target = draw(st.integers(1, max_steps))
    while len(base) < target:
        window_kinds = draw(st.sampled_from([(k,) for k in kind_choice] + [kind_choice]))
        weights = draw(
            _window_weights(
                max_size=min(MAX_WINDOW_MICROBATCHES, target - len(base)),
                invalid_weights=invalid_weights,
            )
        )
        history: dict[tuple[str, int], list[float]] = {}
        for weight in weights:
            kind = _ACCUMULATE_KINDS[draw(st.sampled_from(window_kinds))]
            grads: list[tuple[str, GradValues]] = []
            for name, shape in parameters:
                presence = draw(st.sampled_from(("values", "values", "none", "absent")))
                if presence == "absent":
                    continue
                if presence == "none":
                    grads.append((name, None))
                    continue
                element_values: list[float] = []
                for position in range(math.prod(shape)):
                    earlier = history.setdefault((name, position), [])
                    cancel = draw(st.booleans()) if earlier else False
                    if cancel:
                        value = -draw(st.sampled_from(earlier))  # cancels an earlier value
                    else:
                        value = draw(values)
                    earlier.append(value)
                    element_values.append(value)
                grads.append((name, tuple(element_values)))
            fault = None
            if structural and draw(st.integers(1, FAULT_ODDS)) == 1:
                fault = draw(faults(parameters, tuple(grads)))
            base.append(Accumulate(kind=kind, weight=weight, grads=tuple(grads), fault=fault))
        ending = draw(st.sampled_from(("sums", "mean", "open")))
        if ending != "open" and len(base) < max_steps:
            base.append(Finish(_FINISH_KINDS[ending]))

    steps = _interrupted(draw, base, max_interruptions, corruption_kinds)
    return Scenario(
        work_dtype=work,
        grad_dtype=grad,
        loss_scale=scale,
        fused=is_fused,
        parameters=parameters,
        steps=steps,
    )


# ---------------------------------------------------------------------------------------------
# Dynamic loss scaling (semantics §13)
# ---------------------------------------------------------------------------------------------

MAX_DYNAMIC_WINDOWS = 6  # windows per dynamic-scaling scenario
# Factors of the scaler: powers of two, and inexact ones whose products round in D.
GROWTH_FACTORS = (2.0, 4.0, 1.5, 3.0)
BACKOFF_FACTORS = (0.5, 0.25, 0.75, 0.3)
# The heavy tail of a window's unscaled gradients starts at most at 2**HEAVY_TAIL_EXPONENT.
HEAVY_TAIL_EXPONENT = 16
# Set mid-window, or refused anywhere: zero, NaN, inf, a value no work dtype holds exactly.
_BAD_SCALES = (0.0, -1.0, math.nan, math.inf, float.fromhex("0x1.0000000000001p+0"))


@st.composite
def scaler_options(draw: st.DrawFn, dtype: str, init_scale: float) -> ScalerOptions:
    """Options of a window loss scaler for work dtype ``dtype`` starting at ``init_scale``: short
    growth intervals (growth happens within a scenario), hysteresis 1 to 3, power-of-two and
    inexact factors, and sometimes a ``min_scale`` / ``max_scale`` around the start."""
    fmt = formats.get_format(dtype)
    low = high = None
    if draw(st.booleans()):
        low = formats.round_to(init_scale / draw(st.sampled_from((1.0, 4.0, 64.0))), fmt)
        low = low if low > 0 else None
    if draw(st.booleans()):
        high = formats.round_to(init_scale * draw(st.sampled_from((1.0, 4.0, 64.0))), fmt)
        high = high if math.isfinite(high) else None
    return ScalerOptions(
        growth_factor=draw(st.sampled_from(GROWTH_FACTORS)),
        backoff_factor=draw(st.sampled_from(BACKOFF_FACTORS)),
        growth_interval=draw(st.integers(1, 3)),
        # 2 first: Hypothesis starts from (and keeps coming back to) the first choice, and a
        # hysteresis of 1 cannot show the count of overflows since the last growth.
        hysteresis=draw(st.sampled_from((2, 1, 3))),
        min_scale=low,
        max_scale=high,
    )


def _unscaled(exponents: st.SearchStrategy[int]) -> st.SearchStrategy[float]:
    """Signed values of 5 significant bits in the binades ``exponents`` (scaled, then rounded
    to G, they are a window's gradients)."""
    mantissa = st.integers(2**4, 2**5 - 1).map(lambda m: m / 2**4)
    return st.builds(
        lambda sign, m, k: sign * math.ldexp(m, k),
        st.sampled_from((1.0, -1.0)),
        mantissa,
        exponents,
    )


def _window_values(work: formats.Format, scale: float, *, spiky: bool) -> st.SearchStrategy[float]:
    """A window's unscaled gradient values: moderate ones, and in a ``spiky`` window a heavy
    tail reaching D's overflow threshold at this scale (so whether a window overflows depends
    on its own gradients, as in training, and not only on how high the scale is)."""
    moderate = st.integers(-MODERATE_EXPONENT, MODERATE_EXPONENT)
    if not spiky:
        return _unscaled(moderate)
    top = work.emax - math.frexp(scale)[1]  # scale * 2**top is about D's largest binade
    tail = st.integers(min(top - 2, HEAVY_TAIL_EXPONENT), top + 1)
    return _unscaled(st.one_of(moderate, tail))


def _overflowing(work: formats.Format) -> st.SearchStrategy[Fraction]:
    """Scaled gradient values beyond D's largest finite value, exactly: ``±m * 2**(emax + 1)``
    with 5-bit ``m`` in [1, 2) (a float64 D's would not fit a Python float)."""
    return st.builds(
        lambda sign, m: sign * Fraction(m, 2**4) * Fraction(2) ** (work.emax + 1),
        st.sampled_from((1, -1)),
        st.integers(2**4, 2**5 - 1),
    )


@st.composite
def dynamic_scenarios(
    draw: st.DrawFn,
    *,
    work_dtypes: Sequence[str] = formats.WORK_DTYPES,
    grad_dtypes: Sequence[str] | None = None,
    max_windows: int = MAX_DYNAMIC_WINDOWS,
    max_parameters: int = 2,
    max_elements: int = MAX_PARAMETER_ELEMENTS,
    fused: bool | None = None,
    max_interruptions: int = MAX_INTERRUPTIONS,
    corruption_kinds: Sequence[str] = CORRUPTION_KINDS,
) -> Scenario:
    """Dynamic-scaling scenarios (semantics §13): the training loop of a window loss scaler.

    Gradients are in D, or in float32 for a 16-bit D (``grad_dtypes`` to choose). The initial
    scale is ordinary or (one time in four) overflow-prone for D, the scaler's options come from
    :func:`scaler_options`. Each window starts with ``SetLossScale(scale)`` at the reference
    scaler's scale, accumulates microbatches whose gradients are that scale times heavy-tailed
    values rounded to G (so an overflow to ±inf happens, in G or only in the sums or means; some
    spiky windows surely overflow, with a value beyond D's range in their first microbatch),
    finishes, and ends with ``UpdateScaler(found_inf)``, ``found_inf`` being the reference's own
    (:class:`~wacc_ref.accumulator.ReferenceAccumulator` in emulated mode runs the windows while
    they are drawn). Now and then a ``SetLossScale`` comes in the middle of a window or asks for
    a scale no work dtype accepts (both must be refused and change nothing). One window in three
    ends with a checkpoint and a restore (a loop stopped and resumed between windows), and
    further checkpoints go anywhere (:func:`checkpoint_interruptions`), mid-window included.
    """
    work_choice = _check_dtypes(work_dtypes, name="work_dtypes", allowed=formats.WORK_DTYPES)
    _check_positive_int(max_windows, name="max_windows")
    work = draw(st.sampled_from(work_choice))
    fmt = formats.get_format(work)
    if grad_dtypes is None:  # as AMP does: gradients in D, or in float32 for a 16-bit D
        grad = draw(st.sampled_from((work, "float32") if fmt.precision < 24 else (work,)))
    else:
        grad = draw(
            st.sampled_from(
                _check_dtypes(grad_dtypes, name="grad_dtypes", allowed=tuple(formats.FORMATS))
            )
        )
    grad_fmt = formats.get_format(grad)
    # Overflow-prone starts one time in four: every window overflows until the scale backs off.
    init_scale = draw(
        overflow_prone_scales(work) if draw(st.integers(0, 3)) == 0 else loss_scales(work)
    )
    options = draw(scaler_options(work, init_scale))
    is_fused = draw(st.booleans()) if fused is None else fused
    parameters = _parameters(draw, max_parameters, max_elements)
    params = dict(parameters)

    scaler = ReferenceLossScaler(init_scale, **options.as_kwargs(), dtype=work)
    reference = ReferenceAccumulator(dtype=work, loss_scale=init_scale, fused=is_fused)
    base: list[Step] = []
    # Most windows first (Hypothesis starts from the simplest draw, here the longest loop): a
    # scaler's story (overflow, growth, overflow after growth) needs several windows.
    windows = max_windows - draw(st.integers(0, max_windows - 1))
    # Which windows are spiky: one draw for all, so that the pattern varies from window to
    # window (one draw per window tends to repeat itself).
    spikes = draw(st.integers(0, 2**windows - 1))
    # Which spiky windows surely overflow (a gradient beyond D's range at the window's scale in
    # the first microbatch): the heavy tail alone overflows now and then, too rarely for a
    # scaler's story (an overflow, a growth, an overflow) to come up within 100 loops.
    sure = spikes & draw(st.integers(0, 2**windows - 1))
    for window in range(windows):
        scale = scaler.scale
        base.append(SetLossScale(scale))
        reference.set_loss_scale(scale)
        kind = _ACCUMULATE_KINDS[draw(st.sampled_from(("sum", "mean")))]
        unscaled = _window_values(fmt, scale, spiky=bool(spikes >> window & 1))
        spike = _overflowing(fmt) if sure >> window & 1 else None
        for position in range(draw(st.integers(1, 4))):
            if position and draw(st.integers(0, 5)) == 0:
                # A valid new scale set mid-window: refused all the same (the invalid ones
                # come between windows, below).
                doubled = formats.round_to(scale * 2, fmt)
                base.append(SetLossScale(doubled if math.isfinite(doubled) else scale / 2))
            weight = float(draw(st.integers(0 if position else 1, 2**10)))
            grads = {
                name: tuple(
                    formats.round_to(scale * draw(unscaled), grad_fmt)
                    for _ in range(math.prod(shape))
                )
                for name, shape in parameters
            }
            if spike is not None and position == 0:  # weight >= 1: the value is read
                name, values = next(iter(grads.items()))
                grads[name] = (formats.round_to(draw(spike), grad_fmt), *values[1:])
            step = Accumulate.of(kind, weight, grads)
            base.append(step)
            reference_grads = {
                name: None if values is None else _array(values, params[name])
                for name, values in step.grads
            }
            getattr(reference, step.op)(params, step.weight, grads=reference_grads)
        finish = draw(st.sampled_from(("sums", "mean")))
        base.append(Finish(_FINISH_KINDS[finish]))
        try:
            result = reference.finish_sums() if finish == "sums" else reference.finish_mean()
        except WeightedAccumulationError:
            continue  # nothing to decide on: the loop skips the update (a zero total weight)
        base.append(UpdateScaler(result.found_inf))
        scaler.update(result.found_inf)
        if draw(st.integers(0, 7)) == 0:
            base.append(SetLossScale(draw(st.sampled_from(_BAD_SCALES))))
        if max_interruptions and draw(st.integers(0, 2)) == 0:
            # The usual checkpoint of a training loop: between windows, then stop and resume.
            base += [Checkpoint(asynchronous=draw(st.booleans())), Restore()]

    steps = _interrupted(draw, base, max_interruptions, corruption_kinds)
    return Scenario(
        work_dtype=work,
        grad_dtype=grad,
        loss_scale=init_scale,
        fused=is_fused,
        parameters=parameters,
        steps=steps,
        scaler=options,
    )


def _array(values: tuple[float, ...], shape: tuple[int, ...]) -> np.ndarray:
    return np.array(values, dtype=np.float64).reshape(shape)
