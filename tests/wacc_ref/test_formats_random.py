"""Randomized tests of wacc_ref.formats.round_to against independent implementations.

* Python floats against numpy/ml_dtypes casts, where those are a single rounding: float64 ->
  float32 and float64 -> float16 in numpy; float32 -> bfloat16 / float8 in ml_dtypes (ml_dtypes'
  float64 -> bfloat16 goes through float32, so float32 inputs are used there).
* Fractions (non-dyadic) and mpmath numbers, with huge and tiny exponents, against MPFR (gmpy2)
  with an explicit local IEEE-like context per format.
Samples are drawn from a fixed seed, spread over every exponent range of the target (subnormal,
normal, overflow) and include exact ties.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import gmpy2
import ml_dtypes
import mpmath
import mpmath.libmp
import numpy as np
import numpy.typing as npt
import pytest

from wacc_ref.formats import FORMATS, Format, round_to

SEED = 20240611
FLOAT_SAMPLES = 100_000
EXACT_SAMPLES = 3_000

LIBRARY_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}


def _random_bit_floats(
    rng: np.random.Generator,
    count: int,
    *,
    source: Format,
    target: Format,
) -> npt.NDArray[np.float64]:
    """Random ``source`` values (as float64) spread over the exponent ranges of ``target``.

    Three quarters have exponents within a few binades of ``target``'s range (subnormal to
    overflow), the rest anywhere in ``source``; half of them keep only ``target.precision``
    fraction bits, so that exact ties with ``target`` are frequent.  ±0, ±inf, NaN are appended.
    """
    fraction_bits = source.precision - 1
    bias = 1 - source.emin
    all_ones = 2 * bias + 1  # the biased exponent of inf/NaN
    lo = max(target.emin - target.precision - 3 + bias, 0)
    hi = min(target.emax + 3 + bias, all_ones - 1)
    near = count * 3 // 4
    biased = np.concatenate(
        [rng.integers(lo, hi + 1, near), rng.integers(0, all_ones, count - near)]
    ).astype(np.uint64)
    fraction = rng.integers(0, 2**fraction_bits, count, dtype=np.uint64)
    keep_bits = min(target.precision, fraction_bits)
    tie_mask = np.uint64(((1 << keep_bits) - 1) << (fraction_bits - keep_bits))
    ties = rng.random(count) < 0.5
    fraction[ties] &= tie_mask
    sign = rng.integers(0, 2, count, dtype=np.uint64)
    width = 1 + all_ones.bit_length() + fraction_bits
    bits = (sign << np.uint64(width - 1)) | (biased << np.uint64(fraction_bits)) | fraction
    if source.name == "float64":
        values = bits.view(np.float64)
    else:
        values = bits.astype(np.uint32).view(np.float32).astype(np.float64)
    specials = np.array([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=np.float64)
    result: npt.NDArray[np.float64] = np.concatenate([values, specials])
    return result


def _bit_mismatches(
    inputs: Sequence[object], got: npt.NDArray[np.float64], want: npt.NDArray[np.float64]
) -> list[str]:
    """The first few positions where got and want differ as float64 bit patterns (NaN == NaN)."""
    same = (got.view(np.uint64) == want.view(np.uint64)) | (np.isnan(got) & np.isnan(want))
    out = []
    for index in np.flatnonzero(~same)[:8]:
        x = inputs[index]
        shown = x.hex() if isinstance(x, float) else repr(x)
        out.append(f"x={shown}: got {float(got[index]).hex()}, want {float(want[index]).hex()}")
    return out


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("float64", "float32"),
        ("float64", "float16"),
        ("float32", "bfloat16"),
        ("float32", "float8_e4m3fn"),
        ("float32", "float8_e5m2"),
    ],
)
def test_round_to_matches_library_casts(source: str, target: str) -> None:
    """round_to equals numpy/ml_dtypes' single-rounding cast on 10**5 random values, bit for bit."""
    rng = np.random.default_rng([SEED, FORMATS[source].precision, FORMATS[target].precision])
    values = _random_bit_floats(rng, FLOAT_SAMPLES, source=FORMATS[source], target=FORMATS[target])
    inputs = values.tolist()
    got = np.array([round_to(x, target) for x in inputs], dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = values.astype(source).astype(LIBRARY_DTYPES[target]).astype(np.float64)
    bad = _bit_mismatches(inputs, got, want)
    assert not bad, f"{source} -> {target} (seed {SEED}): {bad}"


# MPFR contexts that model each format.  MPFR writes x = m * 2**e with 0.5 <= m < 1, so its
# emax/emin are one above ours (IEEE emax + 1; smallest subnormal 2**(emin_mpfr - 1)).
def _mpfr_context(fmt: Format) -> gmpy2.context:
    if fmt.name == "float64":
        return gmpy2.ieee(64)
    if fmt.name == "float32":
        return gmpy2.ieee(32)
    if fmt.name == "float16":
        return gmpy2.ieee(16)
    # bfloat16, float8: emax + 1 admits the whole top binade; e4m3fn's short top binade is
    # handled after rounding (anything above max_finite is e4m3fn's overflow, NaN).
    return gmpy2.context(
        precision=fmt.precision,
        emax=fmt.emax + 1,
        emin=fmt.emin - fmt.precision + 2,
        subnormalize=True,
    )


def _mpfr_round(value: Fraction, fmt: Format) -> float:
    """Round the exact rational ``value`` with MPFR in ``fmt``'s context (independent oracle)."""
    with gmpy2.context(_mpfr_context(fmt)):
        rounded = gmpy2.mpfr(gmpy2.mpq(value.numerator, value.denominator))
    result = float(rounded)  # exact: every value of these formats is a float64
    if not fmt.has_inf and (math.isinf(result) or abs(result) > fmt.max_finite):
        return math.nan
    return result


def test_mpfr_contexts_model_the_formats() -> None:
    """The MPFR contexts reproduce each format's max, min subnormal and overflow threshold."""
    for fmt in FORMATS.values():
        assert _mpfr_round(Fraction(fmt.max_finite), fmt) == fmt.max_finite, fmt.name
        assert _mpfr_round(Fraction(fmt.min_subnormal), fmt) == fmt.min_subnormal, fmt.name
        assert _mpfr_round(Fraction(fmt.min_subnormal) / 2, fmt) == 0.0, fmt.name
        assert _mpfr_round(-Fraction(fmt.min_subnormal) * 3 / 4, fmt) == -fmt.min_subnormal
        assert not math.isfinite(_mpfr_round(Fraction(fmt.max_finite) * 2, fmt)), fmt.name


def _random_fractions(rng: np.random.Generator, fmt: Format, count: int) -> list[Fraction]:
    """Non-dyadic rationals with random significands, spread over fmt's range and far beyond.

    A third are near-ties: a midpoint of two format values plus or minus a non-dyadic offset far
    below the spacing (the hardest cases for a rounding routine).
    """
    out = []
    for index in range(count):
        numerator = int(rng.integers(1, 2**62)) * int(rng.integers(1, 2**62))
        denominator = int(rng.integers(1, 2**40)) * 2 + 1  # odd and > 1: not dyadic
        if index % 10 == 0:
            exponent = int(rng.integers(-5000, 5000))  # far outside every format's range
        else:
            exponent = int(rng.integers(fmt.emin - fmt.precision - 4, fmt.emax + 3))
        if index % 3 == 0:
            significand = int(rng.integers(2 ** (fmt.precision), 2 ** (fmt.precision + 1))) | 1
            midpoint = Fraction(significand) * Fraction(2) ** (exponent - fmt.precision)
            offset = Fraction(1, 3 * 2 ** int(rng.integers(1, 80))) * Fraction(2) ** (
                exponent - fmt.precision
            )
            value = midpoint + offset if index % 2 else midpoint - offset
        else:
            scale = Fraction(2) ** (exponent - (numerator.bit_length() - denominator.bit_length()))
            value = Fraction(numerator, denominator) * scale
        out.append(-value if rng.random() < 0.5 else value)
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_to_fractions_matches_mpfr(name: str) -> None:
    """round_to of non-dyadic Fractions (huge, tiny, near-tie) equals MPFR's rounding."""
    fmt = FORMATS[name]
    rng = np.random.default_rng([SEED, len(name), fmt.precision])
    inputs = _random_fractions(rng, fmt, EXACT_SAMPLES)
    got = np.array([round_to(x, fmt) for x in inputs], dtype=np.float64)
    want = np.array([_mpfr_round(x, fmt) for x in inputs], dtype=np.float64)
    bad = _bit_mismatches(inputs, got, want)
    assert not bad, f"{name} (seed {SEED}): {bad}"


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_to_mpf_matches_mpfr(name: str) -> None:
    """round_to of mpmath numbers with 100-300-bit mantissas and wild exponents equals MPFR."""
    fmt = FORMATS[name]
    rng = np.random.default_rng([SEED, len(name), fmt.precision, 7])
    inputs: list[mpmath.mpf] = []
    exact: list[Fraction] = []
    for index in range(EXACT_SAMPLES):
        bits = int(rng.integers(100, 300))
        mantissa = int.from_bytes(rng.bytes((bits + 7) // 8), "little") >> (-bits % 8) | 1
        if index % 10 == 0:
            exponent = int(rng.integers(-(10**5), 10**5))
        else:
            exponent = int(rng.integers(fmt.emin - fmt.precision - 4, fmt.emax + 3)) - bits
        if rng.random() < 0.5:
            mantissa = -mantissa
        # from_man_exp with prec=0 normalizes without rounding (mpf((man, exp)) would round
        # to mpmath's working precision); make_mpf wraps the raw tuple as it is.
        inputs.append(mpmath.mp.make_mpf(mpmath.libmp.from_man_exp(mantissa, exponent, 0)))
        exact.append(Fraction(mantissa) * Fraction(2) ** exponent)
    for value, fraction in zip(inputs, exact, strict=True):
        sign, man, exp, _ = value._mpf_
        assert Fraction((-1) ** sign * int(man)) * Fraction(2) ** int(exp) == fraction
    got = np.array([round_to(x, fmt) for x in inputs], dtype=np.float64)
    want = np.array([_mpfr_round(x, fmt) for x in exact], dtype=np.float64)
    bad = _bit_mismatches(exact, got, want)
    assert not bad, f"{name} (seed {SEED}): {bad}"
