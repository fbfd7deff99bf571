"""Exhaustive tests of wacc_ref.formats over every bit pattern of the 16- and 8-bit formats.

For float16, bfloat16, float8_e4m3fn and float8_e5m2: every pattern decodes like numpy/ml_dtypes,
round-trips through round_to and to_bits, every midpoint between neighbours rounds to the even
neighbour (or overflows as IEEE says), and midpoints nudged by a tiny exact offset (dyadic or not)
round to the nearer neighbour.  numpy/ml_dtypes casts are the independent judge where they are a
single rounding (float64 -> float16 in numpy; float32 -> bfloat16/float8 in ml_dtypes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from wacc_ref.formats import FORMATS, from_bits, round_to, same_value_bits, to_bits, ulp

SMALL_FORMATS = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
LIBRARY_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16}
# Offsets that move a midpoint towards a neighbour, as fractions of the neighbours' spacing:
# a dyadic one small enough to be invisible at float32 precision for every format here, and a
# non-dyadic one to exercise the rational (divmod) path.
DYADIC_NUDGE = Fraction(1, 2**40)
RATIONAL_NUDGE = Fraction(1, 3 * 2**20)
# A dyadic nudge still exact in float32 for these formats (p <= 11, so p + 1 + 12 <= 24 bits),
# so that ml_dtypes/numpy can judge the nudged midpoints too.
LIBRARY_NUDGE_EXP = -12


def _library_round(values: Sequence[float], name: str, *, via: type) -> npt.NDArray[np.float64]:
    """Round float64 values with numpy/ml_dtypes, passing them through ``via`` exactly first."""
    source = np.array(values, dtype=np.float64)
    exact: npt.NDArray[np.floating] = source.astype(via)
    mismatch = ~((exact.astype(np.float64) == source) | np.isnan(source))
    assert not mismatch.any(), f"not exact in {via.__name__}: {source[mismatch][:5].tolist()}"
    with np.errstate(over="ignore", invalid="ignore"):
        result: npt.NDArray[np.float64] = exact.astype(LIBRARY_DTYPES[name]).astype(np.float64)
    return result


def _library_via(name: str) -> type:
    """The source type whose cast into ``name`` is a single rounding."""
    return np.float64 if name == "float16" else np.float32


def _mismatches(
    inputs: Sequence[object], got: Sequence[float], want: Sequence[float], *, limit: int = 8
) -> list[str]:
    """Describe the first ``limit`` positions where got and want differ as float64 bit patterns."""
    out = []
    for x, g, w in zip(inputs, got, want, strict=True):
        if not same_value_bits(g, w):
            shown = x.hex() if isinstance(x, float) else repr(x)
            out.append(f"x={shown}: got {g.hex()}, want {w.hex()}")
            if len(out) == limit:
                break
    return out


def _all_patterns(name: str) -> tuple[list[int], list[float]]:
    """Every bit pattern of the format and its value decoded by numpy/ml_dtypes."""
    dtype = LIBRARY_DTYPES[name]
    patterns = np.arange(2 ** (8 * dtype.itemsize), dtype=UINT_OF_WIDTH[dtype.itemsize])
    with np.errstate(invalid="ignore"):  # ml_dtypes flags NaN patterns as invalid in the cast
        decoded = patterns.view(dtype).astype(np.float64)
    return patterns.tolist(), decoded.tolist()


def _positive_finite_values(name: str) -> list[float]:
    """The non-negative finite values in increasing order (patterns 0, 1, ... up to max)."""
    max_pattern = to_bits(FORMATS[name].max_finite, name)
    return [from_bits(bits, name) for bits in range(max_pattern + 1)]


@pytest.mark.parametrize("name", SMALL_FORMATS)
def test_from_bits_decodes_like_the_library(name: str) -> None:
    """from_bits(b) equals numpy/ml_dtypes' decoding of b for every pattern b."""
    patterns, decoded = _all_patterns(name)
    got = [from_bits(bits, name) for bits in patterns]
    bad = _mismatches([float(b) for b in patterns], got, decoded)
    assert not bad, f"{name}: {len(bad)} shown: {bad}"


@pytest.mark.parametrize("name", SMALL_FORMATS)
def test_every_value_round_trips(name: str) -> None:
    """Every non-NaN pattern's value is unchanged by round_to and maps back to its pattern."""
    patterns, decoded = _all_patterns(name)
    failures = []
    for bits, value in zip(patterns, decoded, strict=True):
        if math.isnan(value):
            assert math.isnan(from_bits(bits, name)), f"{name}: {bits:#x}"
            continue
        rounded = round_to(value, name)
        back = to_bits(rounded, name)
        if not same_value_bits(rounded, value) or back != bits:
            failures.append(f"{bits:#x} ({value.hex()}): round_to {rounded.hex()}, bits {back:#x}")
    assert not failures, f"{name}: {failures[:8]}"
    nan_patterns = [b for b, v in zip(patterns, decoded, strict=True) if math.isnan(v)]
    want_nan_count = 2 if name == "float8_e4m3fn" else 2 * (2 ** (FORMATS[name].precision - 1) - 1)
    assert len(nan_patterns) == want_nan_count, f"{name}: {len(nan_patterns)} NaN patterns"


def _midpoint_cases(name: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """Positive midpoints (incl. the overflow one) with their lower/upper neighbours and spacing.

    The upper neighbour of the overflow midpoint is the format's overflow result.
    """
    fmt = FORMATS[name]
    values = _positive_finite_values(name)
    lows = values[:-1] + [fmt.max_finite]
    overflow = math.inf if fmt.has_inf else math.nan
    highs = values[1:] + [overflow]
    spacings = [hi - lo for lo, hi in zip(values[:-1], values[1:], strict=True)]
    spacings.append(ulp(fmt.max_finite, fmt))
    # lo + spacing/2 is exact in float64: these formats have at most 11 significand bits.
    mids = [lo + spacing / 2 for lo, spacing in zip(lows, spacings, strict=True)]
    return mids, lows, highs, spacings


@pytest.mark.parametrize("name", SMALL_FORMATS)
def test_midpoints_round_to_even(name: str) -> None:
    """Every midpoint (also max_finite + ulp/2) rounds to the neighbour with an even pattern."""
    fmt = FORMATS[name]
    mids, lows, highs, _ = _midpoint_cases(name)
    max_bits = to_bits(fmt.max_finite, name)
    want = []
    for low, high in zip(lows, highs, strict=True):
        low_bits = to_bits(low, name)
        # Above max_finite the would-be next pattern is max_bits + 1, as for any other pair.
        want.append(low if low_bits % 2 == 0 else high)
        assert low_bits <= max_bits
    got = [round_to(m, name) for m in mids]
    bad = _mismatches(mids, got, want)
    assert not bad, f"{name} positive midpoints: {bad}"
    got_negative = [round_to(-m, name) for m in mids]
    want_negative = [-w if not math.isnan(w) else w for w in want]
    bad = _mismatches([-m for m in mids], got_negative, want_negative)
    assert not bad, f"{name} negative midpoints: {bad}"
    library = _library_round(mids + [-m for m in mids], name, via=_library_via(name)).tolist()
    bad = _mismatches(mids + [-m for m in mids], got + got_negative, library)
    assert not bad, f"{name} midpoints vs numpy/ml_dtypes: {bad}"


def _signed(value: float, negative: bool) -> float:
    """-value for negative (NaN stays NaN), else value."""
    return -value if negative and not math.isnan(value) else value


@pytest.mark.parametrize("name", SMALL_FORMATS)
@pytest.mark.parametrize("nudge", [DYADIC_NUDGE, RATIONAL_NUDGE], ids=["dyadic", "rational"])
def test_nudged_midpoints_round_to_nearer(name: str, nudge: Fraction) -> None:
    """A midpoint plus (minus) a tiny exact offset rounds to the upper (lower) neighbour."""
    mids, lows, highs, spacings = _midpoint_cases(name)
    for negative in (False, True):
        sign = -1 if negative else 1
        inputs: list[Fraction] = []
        want: list[float] = []
        for mid, low, high, spacing in zip(mids, lows, highs, spacings, strict=True):
            offset = nudge * Fraction(spacing)
            inputs += [sign * (Fraction(mid) + offset), sign * (Fraction(mid) - offset)]
            want += [_signed(high, negative), _signed(low, negative)]
        got = [round_to(x, name) for x in inputs]
        bad = _mismatches(inputs, got, want)
        assert not bad, f"{name} nudge {nudge} negative={negative}: {bad}"


@pytest.mark.parametrize("name", SMALL_FORMATS)
def test_nudged_midpoints_match_the_library(name: str) -> None:
    """Midpoints nudged by a float32-exact offset round as numpy/ml_dtypes round them."""
    mids, _, _, spacings = _midpoint_cases(name)
    inputs = []
    for mid, spacing in zip(mids, spacings, strict=True):
        offset = math.ldexp(spacing, LIBRARY_NUDGE_EXP)
        inputs += [mid + offset, mid - offset, -mid - offset, -mid + offset]
    got = [round_to(x, name) for x in inputs]
    want = _library_round(inputs, name, via=_library_via(name)).tolist()
    bad = _mismatches(inputs, got, want)
    assert not bad, f"{name}: {bad}"


@pytest.mark.parametrize("name", SMALL_FORMATS)
def test_ulp_is_the_gap_to_the_next_value(name: str) -> None:
    """For every finite value of magnitude below max, ulp(±x) is the distance to the next value."""
    values = _positive_finite_values(name)
    for value, next_value in zip(values[:-1], values[1:], strict=True):
        gap = next_value - value
        for x in (value, -value):
            assert ulp(x, name) == gap, f"{name} x={x.hex()}: ulp {ulp(x, name).hex()}, gap {gap}"
