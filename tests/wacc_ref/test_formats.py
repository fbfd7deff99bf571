"""Unit tests of wacc_ref.formats: constants, API contract, edge cases of round_to and conv_to."""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction
from typing import Any

import ml_dtypes
import mpmath
import mpmath.libmp
import numpy as np
import pytest

from wacc_ref import formats
from wacc_ref.formats import (
    FORMATS,
    WORK_DTYPES,
    Format,
    check_format_table,
    conv_to,
    from_bits,
    get_format,
    is_representable,
    op_format,
    round_to,
    same_value_bits,
    to_bits,
    ulp,
)

ALL_FORMAT_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
NUMPY_DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}


def _describe(x: object) -> str:
    """A reproducible spelling of a test input (hex for floats)."""
    if isinstance(x, float):
        return f"{x!r} ({x.hex()})"
    return repr(x)


def _assert_same(got: float, want: float, context: str) -> None:
    assert same_value_bits(got, want), f"{context}: got {_describe(got)}, want {_describe(want)}"


def _library_round(value: float, name: str) -> float:
    """numpy/ml_dtypes rounding of a float32-representable value (one rounding)."""
    assert float(np.float32(value)) == value or math.isnan(value), value
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.array([value], dtype=np.float32).astype(NUMPY_DTYPES[name])[0])


# --- the format table -----------------------------------------------------------------------


def test_format_table_has_the_six_formats() -> None:
    """FORMATS holds exactly the six named formats, keyed by their own names."""
    assert tuple(FORMATS) == ALL_FORMAT_NAMES
    assert all(FORMATS[name].name == name for name in FORMATS)
    assert WORK_DTYPES == ("float64", "float32", "float16", "bfloat16")


def test_format_table_matches_finfo() -> None:
    """The shipped table passes the numpy/ml_dtypes finfo check (also run at import)."""
    check_format_table(FORMATS)


@pytest.mark.parametrize("name", ALL_FORMAT_NAMES)
def test_format_constants_are_consistent(name: str) -> None:
    """min_subnormal = 2**(emin-p+1), min_normal = 2**emin, u = 2**-p, max in binade emax."""
    fmt = FORMATS[name]
    assert fmt.min_subnormal == math.ldexp(1.0, fmt.emin - fmt.precision + 1), name
    assert fmt.min_normal == math.ldexp(1.0, fmt.emin), name
    assert fmt.unit_roundoff == math.ldexp(1.0, -fmt.precision), name
    assert math.frexp(fmt.max_finite)[1] - 1 == fmt.emax, name
    assert is_representable(fmt.max_finite, fmt), name


WRONG_FIELD_VALUES = [
    ("float16", "max_finite", float.fromhex("0x1.ffep+15")),
    ("float16", "precision", 10),
    ("float32", "emin", -125),
    ("bfloat16", "emax", 128),
    ("bfloat16", "min_normal", float.fromhex("0x1p-127")),
    ("float64", "min_subnormal", float.fromhex("0x1p-1073")),
    ("float8_e4m3fn", "has_inf", True),
    ("float8_e5m2", "unit_roundoff", float.fromhex("0x1p-4")),
    ("float8_e4m3fn", "max_finite", float.fromhex("0x1.ep+8")),
]


@pytest.mark.parametrize(("name", "field", "wrong"), WRONG_FIELD_VALUES)
def test_check_format_table_rejects_a_wrong_constant(name: str, field: str, wrong: object) -> None:
    """A table with one deliberately wrong constant raises RuntimeError naming format and field."""
    table = dict(FORMATS)
    changes: dict[str, Any] = {field: wrong}
    table[name] = dataclasses.replace(FORMATS[name], **changes)
    with pytest.raises(RuntimeError, match=rf"{name}.*{field}"):
        check_format_table(table)


def test_check_format_table_rejects_a_misfiled_format() -> None:
    """A format stored under another format's name is reported."""
    table = dict(FORMATS)
    table["float16"] = FORMATS["bfloat16"]
    with pytest.raises(RuntimeError, match="float16"):
        check_format_table(table)


def test_get_format_by_name_and_identity() -> None:
    """get_format maps names to the table entries and returns Format objects unchanged."""
    for name in ALL_FORMAT_NAMES:
        assert get_format(name) is FORMATS[name]
        assert get_format(FORMATS[name]) is FORMATS[name]


def test_get_format_rejects_unknown_name() -> None:
    """An unknown format name raises a ValueError naming it."""
    with pytest.raises(formats.UnknownFormatError, match="'float128'"):
        get_format("float128")
    with pytest.raises(ValueError, match="'torch.float16'"):
        get_format("torch.float16")
    with pytest.raises(TypeError, match="16"):
        get_format(16)  # type: ignore[arg-type]


def test_op_format() -> None:
    """op(D) is float64 for float64 and float32 for every narrower format."""
    assert op_format("float64") is FORMATS["float64"]
    for name in ALL_FORMAT_NAMES[1:]:
        assert op_format(name) is FORMATS["float32"], name


# --- round_to: edge cases --------------------------------------------------------------------


def _next_up_fraction(fmt: Format) -> Fraction:
    """The would-be value after max_finite (one more top-binade quantum)."""
    return Fraction(fmt.max_finite) + Fraction(ulp(fmt.max_finite, fmt))


@pytest.mark.parametrize("name", ALL_FORMAT_NAMES)
def test_overflow_threshold(name: str) -> None:
    """Just below the overflow midpoint gives max_finite, just above overflows, tie goes even."""
    fmt = FORMATS[name]
    overflow = math.inf if fmt.has_inf else math.nan
    threshold = (Fraction(fmt.max_finite) + _next_up_fraction(fmt)) / 2
    tiny = Fraction(1, 3 * 2**200)
    for sign in (1, -1):
        signed_overflow = overflow * sign if fmt.has_inf else math.nan
        below = sign * (threshold - tiny)
        above = sign * (threshold + tiny)
        _assert_same(round_to(below, fmt), sign * fmt.max_finite, f"{name} round_to({below})")
        _assert_same(round_to(above, fmt), signed_overflow, f"{name} round_to({above})")
        # IEEE: the tie rounds to the even one of max_finite and the would-be next value.
        max_is_even = to_bits(fmt.max_finite, fmt) % 2 == 0
        tie_want = sign * fmt.max_finite if max_is_even else signed_overflow
        _assert_same(round_to(sign * threshold, fmt), tie_want, f"{name} tie {sign * threshold}")
    _assert_same(round_to(math.inf, fmt), overflow, f"{name} round_to(inf)")
    _assert_same(
        round_to(-math.inf, fmt), -overflow if fmt.has_inf else math.nan, f"{name} round_to(-inf)"
    )


def test_overflow_examples_from_the_issue() -> None:
    """float16 65519.99.. -> 65504, 65520 -> inf; e4m3fn 463.99 -> 448, 464 (a tie) -> 448."""
    assert round_to(Fraction(65520) - Fraction(1, 10**30), "float16") == 65504.0
    assert round_to(65519.99, "float16") == 65504.0
    assert round_to(65520.0, "float16") == math.inf
    assert round_to(-65520, "float16") == -math.inf
    assert round_to(463.99, "float8_e4m3fn") == 448.0
    # 464 is the midpoint of 448 (S.1111.110, even) and the would-be 480 (S.1111.111, odd):
    # round-to-nearest-even with an unbounded exponent gives 448; ml_dtypes agrees.
    assert round_to(464.0, "float8_e4m3fn") == 448.0 == _library_round(464.0, "float8_e4m3fn")
    above = float.fromhex("0x1.d00002p+8")  # 464 plus one float32 ulp
    assert math.isnan(round_to(above, "float8_e4m3fn"))
    assert math.isnan(_library_round(above, "float8_e4m3fn"))
    assert round_to(float.fromhex("0x1.ffp+127"), "bfloat16") == math.inf
    assert round_to(float.fromhex("0x1.fefffep+127"), "bfloat16") == formats.BFLOAT16_MAX


@pytest.mark.parametrize("name", ALL_FORMAT_NAMES)
def test_signed_zero_and_underflow(name: str) -> None:
    """Results that round to zero keep the sign of x; half the smallest subnormal ties to zero."""
    fmt = FORMATS[name]
    half_min = Fraction(fmt.min_subnormal) / 2
    tiny = Fraction(1, 3 * 2**2000)
    for sign in (1, -1):
        signed_zero = math.copysign(0.0, sign)
        _assert_same(round_to(sign * half_min, fmt), signed_zero, f"{name} half min_subnormal")
        _assert_same(round_to(sign * tiny, fmt), signed_zero, f"{name} tiny")
        _assert_same(
            round_to(sign * (half_min + tiny), fmt), sign * fmt.min_subnormal, f"{name} > half"
        )
        _assert_same(round_to(signed_zero, fmt), signed_zero, f"{name} signed zero")
        mpf_tiny = mpmath.mpf((sign * 3, -(10**6)))
        _assert_same(round_to(mpf_tiny, fmt), signed_zero, f"{name} mpf 3*2**-1e6")
    _assert_same(round_to(0, fmt), 0.0, f"{name} int 0")
    _assert_same(round_to(Fraction(0), fmt), 0.0, f"{name} Fraction 0")
    _assert_same(round_to(mpmath.mpf(0), fmt), 0.0, f"{name} mpf 0")
    # mpmath's constructor normalizes -0 to +0; make_mpf keeps the raw negative-zero tuple.
    negative_zero_mpf = mpmath.mp.make_mpf(mpmath.libmp.fnzero)
    _assert_same(round_to(negative_zero_mpf, fmt), -0.0, f"{name} mpf -0")


@pytest.mark.parametrize("name", ALL_FORMAT_NAMES)
def test_nan_and_infinite_inputs(name: str) -> None:
    """NaN gives NaN; ±inf (float or mpf) gives ±inf, or NaN without inf; huge values overflow."""
    fmt = FORMATS[name]
    assert math.isnan(round_to(math.nan, fmt))
    assert math.isnan(round_to(mpmath.mpf("nan"), fmt))
    for sign in (1, -1):
        want = sign * math.inf if fmt.has_inf else math.nan
        _assert_same(round_to(mpmath.mpf(sign * mpmath.inf), fmt), want, f"{name} mpf inf")
        _assert_same(round_to(sign * 10**400, fmt), want, f"{name} int 10**400")
        _assert_same(round_to(mpmath.mpf((sign, 10**6)), fmt), want, f"{name} mpf 2**1e6")
        _assert_same(round_to(Fraction(sign * 10**400, 7), fmt), want, f"{name} Fraction huge")


def _exact_mpf(mantissa: int, exponent: int) -> mpmath.mpf:
    """mantissa * 2**exponent as an mpf, unrounded (mpmath.mpf((m, e)) rounds to 53 bits)."""
    return mpmath.mp.make_mpf(mpmath.libmp.from_man_exp(mantissa, exponent, 0))


def test_exact_inputs_are_read_exactly() -> None:
    """Ints, Fractions and mpfs are rounded from their exact values, not from float(x)."""
    # 2**53 + 1 is a float64 tie (even: 2**53); plus 2**-100 it must round up.
    assert round_to(2**53 + 1, "float64") == 2.0**53
    assert round_to(Fraction(2**153 + 2**100 + 1, 2**100), "float64") == 2.0**53 + 2
    assert round_to(_exact_mpf(2**153 + 2**100 + 1, -100), "float64") == 2.0**53 + 2
    # Around the float64 tie 1 + 2**-53 only the 2**-300 tail decides: above rounds up, below down.
    assert round_to(_exact_mpf(2**300 + 2**247 + 1, -300), "float64") == 1.0 + 2.0**-52
    assert round_to(_exact_mpf(2**300 + 2**247 - 1, -300), "float64") == 1.0
    # 1 + 2**-24 + 2**-80 is just above the float32 tie 1 + 2**-24: rounds up.
    above_tie = Fraction(1) + Fraction(1, 2**24) + Fraction(1, 2**80)
    assert round_to(above_tie, "float32") == 1.0 + 2.0**-23
    assert round_to(Fraction(1, 3), "float32") == float.fromhex("0x1.555556p-2")
    assert round_to(Fraction(-1, 3), "float16") == -float.fromhex("0x1.554p-2")
    assert round_to(Fraction(2, 3), "bfloat16") == float.fromhex("0x1.56p-1")
    assert round_to(np.float32(0.1), "float32") == float(np.float32(0.1))
    assert round_to(np.int64(-3), "float8_e5m2") == -3.0


def test_round_to_rejects_non_reals() -> None:
    """bool, str, complex and wider-than-float64 numpy inputs raise TypeError naming the value."""
    bad_inputs: list[object] = [True, "1.0", 1j]
    if np.dtype(np.longdouble).itemsize > 8:
        bad_inputs.append(np.longdouble(1))  # not exactly a float64 in general: refused
    for bad in bad_inputs:
        with pytest.raises(TypeError, match=re.escape(repr(bad))):
            round_to(bad, "float32")


def test_spec_conv_example() -> None:
    """semantics §2: conv_bf16(1 + 2**-8 + 2**-30) is 1.0, the correctly rounded value 1.0078125."""
    x = 1 + 2**-8 + 2**-30
    assert conv_to(x, "bfloat16") == 1.0
    assert round_to(x, "bfloat16") == 1.0078125
    # float16 double-rounds too: 1 + 2**-11 + 2**-30 -> float32 tie -> even 1.0.
    y = 1 + 2**-11 + 2**-30
    assert conv_to(y, "float16") == 1.0
    assert round_to(y, "float16") == 1.0 + 2**-10


def test_conv_to_rounds_exact_inputs_to_float64_first() -> None:
    """conv_to reads a non-float input as float(x): 1 + 2**-24 + 2**-80 -> float32 gives 1.0."""
    x = Fraction(1) + Fraction(1, 2**24) + Fraction(1, 2**80)
    assert conv_to(x, "float32") == 1.0  # float64 drops 2**-80, leaving a float32 tie
    assert round_to(x, "float32") == 1.0 + 2**-23
    for name in WORK_DTYPES:
        assert conv_to(x, name) == conv_to(float(x), name), name


def test_conv_to_rejects_float8_targets() -> None:
    """conv_to into a float8 format raises, naming the format and saying why."""
    for name in ("float8_e4m3fn", "float8_e5m2"):
        with pytest.raises(formats.UnsupportedConversionError, match=f"'{name}'.*work dtype"):
            conv_to(1.0, name)


def test_conv_to_is_round_to_for_wide_targets() -> None:
    """For float32/float64 targets conv_to equals round_to (one rounding of a float64)."""
    for x in (0.1, 1 + 2**-24 + 2**-40, 3.0e38, 3.5e38, -1e-46, 1e-300):
        for name in ("float64", "float32"):
            _assert_same(conv_to(x, name), round_to(x, name), f"conv_to({_describe(x)}, {name})")


# --- bits, representability, ulp ---------------------------------------------------------------


def test_to_bits_and_from_bits_examples() -> None:
    """Known bit patterns: 1.0, -2.0, max, min subnormal, -0.0, inf, canonical NaN."""
    assert to_bits(1.0, "float16") == 0x3C00
    assert to_bits(-2.0, "bfloat16") == 0xC000
    assert to_bits(65504.0, "float16") == 0x7BFF
    assert to_bits(448.0, "float8_e4m3fn") == 0x7E
    assert to_bits(57344.0, "float8_e5m2") == 0x7B
    assert to_bits(2.0**-24, "float16") == 0x0001
    assert to_bits(-0.0, "float32") == 0x80000000
    assert to_bits(math.inf, "float8_e5m2") == 0x7C
    assert to_bits(math.nan, "float64") == 0x7FF8000000000000
    assert to_bits(math.nan, "float8_e4m3fn") == 0x7F
    assert from_bits(0x7F80, "bfloat16") == math.inf
    assert math.isnan(from_bits(0xFF, "float8_e4m3fn"))
    assert from_bits(0xFE, "float8_e4m3fn") == -448.0
    assert from_bits(0x7C, "float8_e4m3fn") == 384.0  # no inf in e4m3fn: exponent 1111 is finite


@pytest.mark.parametrize("name", ALL_FORMAT_NAMES)
def test_canonical_nan_matches_library(name: str) -> None:
    """to_bits(nan) is the NaN pattern numpy/ml_dtypes produce for a NaN."""
    width = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
    dtype = np.dtype(NUMPY_DTYPES[name])
    library_bits = int(
        np.array([math.nan], dtype=np.float32).astype(dtype).view(width[8 * dtype.itemsize])[0]
    )
    assert to_bits(math.nan, name) == library_bits, f"{name}: {library_bits:#x}"


def test_to_bits_rejects_unrepresentable() -> None:
    """to_bits of a value outside the format raises, naming the value in hex."""
    with pytest.raises(formats.NotRepresentableError, match=re.escape((0.1).hex())):
        to_bits(0.1, "float32")
    with pytest.raises(formats.NotRepresentableError, match="inf"):
        to_bits(math.inf, "float8_e4m3fn")
    with pytest.raises(TypeError, match="'1'"):
        to_bits("1", "float32")  # type: ignore[arg-type]


def test_custom_formats_round_but_have_no_bit_layout() -> None:
    """round_to accepts a caller-built Format; to_bits/from_bits refuse it, naming it."""
    custom_format = dataclasses.replace(FORMATS["float16"], name="custom16")
    assert round_to(65519.0, custom_format) == 65504.0
    assert round_to(Fraction(1, 3), custom_format) == round_to(Fraction(1, 3), "float16")
    with pytest.raises(formats.UnknownFormatError, match="custom16"):
        to_bits(1.0, custom_format)
    with pytest.raises(formats.UnknownFormatError, match="custom16"):
        from_bits(0x3C00, custom_format)


def test_from_bits_rejects_out_of_range_patterns() -> None:
    """A pattern wider than the format, negative, or not an int raises naming it."""
    with pytest.raises(formats.NotRepresentableError, match="0x10000"):
        from_bits(0x10000, "float16")
    with pytest.raises(formats.NotRepresentableError, match="-0x1"):
        from_bits(-1, "bfloat16")
    with pytest.raises(TypeError, match="1.0"):
        from_bits(1.0, "float16")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="True"):
        from_bits(True, "float16")


def test_float64_and_float32_bits_match_struct() -> None:
    """to_bits/from_bits for float32/float64 agree with numpy's views on sample values."""
    samples = [0.0, -0.0, 1.0, -1.5, 2.0**-1074, 2.0**-1022, formats.FLOAT64_MAX, 0.1, -1e300]
    for x in samples:
        bits64 = int(np.array([x], dtype=np.float64).view(np.uint64)[0])
        assert to_bits(x, "float64") == bits64, _describe(x)
        _assert_same(from_bits(bits64, "float64"), x, f"from_bits({bits64:#x})")
        x32 = float(np.float32(x)) if abs(x) <= formats.FLOAT32_MAX else None
        if x32 is not None:
            bits32 = int(np.array([x32], dtype=np.float32).view(np.uint32)[0])
            assert to_bits(x32, "float32") == bits32, _describe(x32)
            _assert_same(from_bits(bits32, "float32"), x32, f"from_bits({bits32:#x})")


def test_is_representable() -> None:
    """is_representable: exact values yes, others no; NaN always, inf unless e4m3fn."""
    assert is_representable(1.0 + 2**-10, "float16")
    assert not is_representable(1.0 + 2**-11, "float16")
    assert is_representable(2.0**-133, "bfloat16")
    assert not is_representable(2.0**-134, "bfloat16")
    assert is_representable(-0.0, "float8_e4m3fn")
    assert is_representable(math.nan, "float8_e4m3fn")
    assert not is_representable(math.inf, "float8_e4m3fn")
    assert is_representable(-math.inf, "float8_e5m2")
    assert not is_representable(65520.0, "float16")


def test_same_value_bits() -> None:
    """same_value_bits tells ±0 apart, equates NaNs, and never equates NaN with a number."""
    assert same_value_bits(0.0, 0.0)
    assert not same_value_bits(0.0, -0.0)
    assert same_value_bits(math.nan, -math.nan)
    assert not same_value_bits(math.nan, math.inf)
    assert not same_value_bits(1.0, math.nan)
    assert not same_value_bits(1.0, 1.0 + 2**-52)


def test_ulp_examples_and_errors() -> None:
    """ulp is the binade spacing, the subnormal spacing below emin, and rejects non-finite x."""
    assert ulp(1.0, "float16") == 2.0**-10
    assert ulp(-1.5, "bfloat16") == 2.0**-7
    assert ulp(0.0, "float32") == 2.0**-149
    assert ulp(2.0**-130, "float32") == 2.0**-149
    assert ulp(65504.0, "float16") == 32.0
    assert ulp(448.0, "float8_e4m3fn") == 32.0
    assert ulp(1.0, "float64") == 2.0**-52
    with pytest.raises(formats.NotRepresentableError, match="nan"):
        ulp(math.nan, "float16")
    with pytest.raises(formats.NotRepresentableError, match="inf"):
        ulp(-math.inf, "float16")
