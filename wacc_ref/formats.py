"""Binary floating-point formats and exact round-to-nearest-even into them.

This module is the ground truth of the reference model: every ``round_F`` of semantics §2 is
:func:`round_to`, and every ``conv_D`` is :func:`conv_to`.  It never imports torch.

Exact-rounding algorithm
------------------------
An input is first read *exactly* as a sign and a non-negative rational magnitude:

* a Python ``float`` (or a numpy float of at most 64 bits) as ``mant * 2**exp`` with ``mant`` an
  integer below ``2**53`` (from :func:`math.frexp`, whose fraction scaled by ``2**53`` is an exact
  integer);
* an ``int`` as ``int * 2**0``;
* a :class:`fractions.Fraction` as ``numerator / denominator`` (dyadic when the denominator is a
  power of two);
* an :class:`mpmath.mpf` from its raw ``_mpf_`` tuple ``(sign, man, exp, bc)`` — never through
  ``float()``, which would round.

For a format with precision ``p`` (significand bits, implicit bit included), smallest normal
exponent ``emin`` and largest finite binade ``emax``:

1. ``E = floor(log2(|x|))`` is found with integer bit lengths (one comparison fixes the off-by-one
   for a rational).
2. ``E > emax``: the magnitude is at least ``2**(emax+1)``, beyond every finite value: overflow.
   ``E < emin - p``: the magnitude is below half the smallest subnormal: a zero with the sign of x.
3. The quantum (the weight of the last significand bit) is ``2**q`` with
   ``q = max(E, emin) - (p - 1)``; the ``max`` is gradual underflow: below the normal range the
   quantum stays that of the subnormals.
4. ``|x| / 2**q`` is split exactly into an integer ``m`` and a remainder (a shift and mask for a
   dyadic value, :func:`divmod` for a rational).  ``m`` is incremented when the remainder is more
   than half the quantum, or exactly half and ``m`` is odd (ties to even).  A carry into the next
   binade is harmless: ``m * 2**q`` is still exact.
5. IEEE 754 overflow is judged on that rounded magnitude (rounding with an unbounded exponent
   first): only the top binade ``E == emax`` can exceed ``max_finite``, and it does exactly when
   ``m`` exceeds ``max_finite / 2**q``.  Overflow gives ±inf, or NaN for ``float8_e4m3fn`` (no inf;
   ties at 464 go to the even 448, as IEEE and ml_dtypes do).
6. The result ``m * 2**q`` is formed with :func:`math.ldexp`; every value of every format here is a
   float64, and ``m <= 2**53``, so this step is exact.  A zero result keeps the sign of ``x``.

No step uses floating-point arithmetic on the value, so the result is correct by construction.
The format constants are written exactly with :meth:`float.fromhex` and checked against
``numpy.finfo`` / ``ml_dtypes.finfo`` when the module is imported (:func:`check_format_table`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, TypeAlias

import ml_dtypes
import mpmath
import mpmath.libmp
import numpy as np

__all__ = [
    "FLOAT16_MAX",
    "FLOAT32_MAX",
    "FLOAT64_MAX",
    "BFLOAT16_MAX",
    "FLOAT8_E4M3FN_MAX",
    "FLOAT8_E5M2_MAX",
    "FORMATS",
    "WORK_DTYPES",
    "Format",
    "FormatError",
    "NotRepresentableError",
    "UnknownFormatError",
    "UnsupportedConversionError",
    "check_format_table",
    "conv_to",
    "from_bits",
    "get_format",
    "is_representable",
    "op_format",
    "round_to",
    "same_value_bits",
    "to_bits",
    "ulp",
]


class FormatError(ValueError):
    """Base class of the errors raised by :mod:`wacc_ref.formats` for bad user input."""


class UnknownFormatError(FormatError):
    """A format name that is not one of :data:`FORMATS`."""


class NotRepresentableError(FormatError):
    """A value that is not exactly a value of the requested format."""


class UnsupportedConversionError(FormatError):
    """A conversion that the model does not define (``conv_to`` into a float8 format)."""


@dataclass(frozen=True)
class Format:
    """A binary floating-point format: ``(-1)**s * m * 2**(e - p + 1)`` with gradual underflow."""

    name: str  # torch spelling of the dtype
    precision: int  # p: significand bits including the implicit bit
    emin: int  # exponent of the smallest normal: min_normal == 2.0**emin
    emax: int  # exponent of the largest finite binade
    max_finite: float
    min_normal: float
    min_subnormal: float
    unit_roundoff: float  # u = 2**-p
    has_inf: bool  # False for float8_e4m3fn (overflow gives NaN)


# Largest finite values, written exactly.
FLOAT64_MAX = float.fromhex("0x1.fffffffffffffp+1023")
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")
FLOAT16_MAX = float.fromhex("0x1.ffcp+15")  # 65504
BFLOAT16_MAX = float.fromhex("0x1.fep+127")
FLOAT8_E4M3FN_MAX = float.fromhex("0x1.cp+8")  # 448: S.1111.111 is NaN, so the top binade is short
FLOAT8_E5M2_MAX = float.fromhex("0x1.cp+15")  # 57344

# Smallest normal values.
FLOAT64_MIN_NORMAL = float.fromhex("0x1p-1022")
FLOAT32_MIN_NORMAL = float.fromhex("0x1p-126")
FLOAT16_MIN_NORMAL = float.fromhex("0x1p-14")
BFLOAT16_MIN_NORMAL = float.fromhex("0x1p-126")
FLOAT8_E4M3FN_MIN_NORMAL = float.fromhex("0x1p-6")
FLOAT8_E5M2_MIN_NORMAL = float.fromhex("0x1p-14")

# Smallest subnormal values: 2**(emin - p + 1).
FLOAT64_MIN_SUBNORMAL = float.fromhex("0x1p-1074")
FLOAT32_MIN_SUBNORMAL = float.fromhex("0x1p-149")
FLOAT16_MIN_SUBNORMAL = float.fromhex("0x1p-24")
BFLOAT16_MIN_SUBNORMAL = float.fromhex("0x1p-133")
FLOAT8_E4M3FN_MIN_SUBNORMAL = float.fromhex("0x1p-9")
FLOAT8_E5M2_MIN_SUBNORMAL = float.fromhex("0x1p-16")

# Unit roundoffs u = 2**-p.
FLOAT64_UNIT_ROUNDOFF = float.fromhex("0x1p-53")
FLOAT32_UNIT_ROUNDOFF = float.fromhex("0x1p-24")
FLOAT16_UNIT_ROUNDOFF = float.fromhex("0x1p-11")
BFLOAT16_UNIT_ROUNDOFF = float.fromhex("0x1p-8")
FLOAT8_E4M3FN_UNIT_ROUNDOFF = float.fromhex("0x1p-4")
FLOAT8_E5M2_UNIT_ROUNDOFF = float.fromhex("0x1p-3")

FLOAT64 = Format(
    name="float64",
    precision=53,
    emin=-1022,
    emax=1023,
    max_finite=FLOAT64_MAX,
    min_normal=FLOAT64_MIN_NORMAL,
    min_subnormal=FLOAT64_MIN_SUBNORMAL,
    unit_roundoff=FLOAT64_UNIT_ROUNDOFF,
    has_inf=True,
)
FLOAT32 = Format(
    name="float32",
    precision=24,
    emin=-126,
    emax=127,
    max_finite=FLOAT32_MAX,
    min_normal=FLOAT32_MIN_NORMAL,
    min_subnormal=FLOAT32_MIN_SUBNORMAL,
    unit_roundoff=FLOAT32_UNIT_ROUNDOFF,
    has_inf=True,
)
FLOAT16 = Format(
    name="float16",
    precision=11,
    emin=-14,
    emax=15,
    max_finite=FLOAT16_MAX,
    min_normal=FLOAT16_MIN_NORMAL,
    min_subnormal=FLOAT16_MIN_SUBNORMAL,
    unit_roundoff=FLOAT16_UNIT_ROUNDOFF,
    has_inf=True,
)
BFLOAT16 = Format(
    name="bfloat16",
    precision=8,
    emin=-126,
    emax=127,
    max_finite=BFLOAT16_MAX,
    min_normal=BFLOAT16_MIN_NORMAL,
    min_subnormal=BFLOAT16_MIN_SUBNORMAL,
    unit_roundoff=BFLOAT16_UNIT_ROUNDOFF,
    has_inf=True,
)
FLOAT8_E4M3FN = Format(
    name="float8_e4m3fn",
    precision=4,
    emin=-6,
    emax=8,
    max_finite=FLOAT8_E4M3FN_MAX,
    min_normal=FLOAT8_E4M3FN_MIN_NORMAL,
    min_subnormal=FLOAT8_E4M3FN_MIN_SUBNORMAL,
    unit_roundoff=FLOAT8_E4M3FN_UNIT_ROUNDOFF,
    has_inf=False,
)
FLOAT8_E5M2 = Format(
    name="float8_e5m2",
    precision=3,
    emin=-14,
    emax=15,
    max_finite=FLOAT8_E5M2_MAX,
    min_normal=FLOAT8_E5M2_MIN_NORMAL,
    min_subnormal=FLOAT8_E5M2_MIN_SUBNORMAL,
    unit_roundoff=FLOAT8_E5M2_UNIT_ROUNDOFF,
    has_inf=True,
)

FORMATS: Mapping[str, Format] = MappingProxyType(
    {f.name: f for f in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2)}
)
"""The six formats, keyed by their torch spelling."""

WORK_DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
"""The work dtypes D of semantics §2 (the dtypes a pending buffer may have)."""

# Storage width in bits of each format (sign + exponent field + p - 1 fraction bits).
_STORAGE_BITS: Mapping[str, int] = MappingProxyType(
    {
        "float64": 64,
        "float32": 32,
        "float16": 16,
        "bfloat16": 16,
        "float8_e4m3fn": 8,
        "float8_e5m2": 8,
    }
)

# The numpy / ml_dtypes dtype that stores each format (used only by the import-time check).
_NUMPY_DTYPES: Mapping[str, Any] = MappingProxyType(
    {
        "float64": np.dtype(np.float64),
        "float32": np.dtype(np.float32),
        "float16": np.dtype(np.float16),
        "bfloat16": np.dtype(ml_dtypes.bfloat16),
        "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    }
)

_FLOAT64_MANT_SCALE = float.fromhex("0x1p+53")  # frexp fraction * 2**53 is an exact integer


@dataclass(frozen=True)
class _RoundingParams:
    """Integer constants of a format, precomputed for :func:`round_to`."""

    precision: int
    emin: int
    emax: int
    quantum_min_exp: int  # exponent of the subnormal quantum: emin - p + 1
    top_quantum_exp: int  # quantum exponent of the top binade: emax - p + 1
    max_top_significand: int  # max_finite / 2**top_quantum_exp (an integer)
    overflow_value: float  # +inf, or NaN for formats without inf


def _rounding_params(fmt: Format) -> _RoundingParams:
    top_quantum_exp = fmt.emax - fmt.precision + 1
    max_top_significand = Fraction(fmt.max_finite) / Fraction(2) ** top_quantum_exp
    assert max_top_significand.denominator == 1, fmt
    return _RoundingParams(
        precision=fmt.precision,
        emin=fmt.emin,
        emax=fmt.emax,
        quantum_min_exp=fmt.emin - fmt.precision + 1,
        top_quantum_exp=top_quantum_exp,
        max_top_significand=max_top_significand.numerator,
        overflow_value=math.inf if fmt.has_inf else math.nan,
    )


_PARAMS: Mapping[str, _RoundingParams] = MappingProxyType(
    {name: _rounding_params(f) for name, f in FORMATS.items()}
)


def check_format_table(table: Mapping[str, Format]) -> None:
    """Check every format in ``table`` against ``numpy.finfo`` / ``ml_dtypes.finfo``.

    Raises ``RuntimeError`` naming the format and the field that disagrees.  Run on
    :data:`FORMATS` when the module is imported.
    """
    for name, fmt in table.items():
        if name != fmt.name:
            raise RuntimeError(f"format table key {name!r} holds a format named {fmt.name!r}")
        if name not in _NUMPY_DTYPES:
            raise RuntimeError(f"format {name!r} has no numpy/ml_dtypes counterpart to check")
        dtype = _NUMPY_DTYPES[name]
        from_numpy = name in ("float64", "float32", "float16")
        info: Any = np.finfo(dtype) if from_numpy else ml_dtypes.finfo(dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            inf_survives = bool(np.isinf(np.array(np.inf, dtype=np.float32).astype(dtype)))
        expected: dict[str, object] = {
            "precision": int(info.nmant) + 1,
            "emin": int(info.minexp),
            "emax": int(info.maxexp) - 1,
            "max_finite": float(info.max),
            "min_normal": float(info.smallest_normal),
            "min_subnormal": float(info.smallest_subnormal),
            "unit_roundoff": float(info.eps) / 2,
            "has_inf": inf_survives,
        }
        for field, want in expected.items():
            got = getattr(fmt, field)
            # Compare floats by their exact value (the floats here are never NaN).
            if type(got) is not type(want) or got != want:
                raise RuntimeError(
                    f"format {name!r}: field {field} is {got!r}"
                    + (f" ({got.hex()})" if isinstance(got, float) else "")
                    + f", but {'numpy' if from_numpy else 'ml_dtypes'}.finfo says {want!r}"
                    + (f" ({want.hex()})" if isinstance(want, float) else "")
                )
        if fmt.min_normal != math.ldexp(1.0, fmt.emin):
            raise RuntimeError(f"format {name!r}: min_normal {fmt.min_normal.hex()} != 2**emin")
        if fmt.unit_roundoff != math.ldexp(1.0, -fmt.precision):
            raise RuntimeError(f"format {name!r}: unit_roundoff {fmt.unit_roundoff.hex()} != 2**-p")


check_format_table(FORMATS)


def get_format(fmt: str | Format) -> Format:
    """Return the :class:`Format` named ``fmt`` (a torch dtype spelling), or ``fmt`` itself.

    Raises :class:`UnknownFormatError` (a ``ValueError``) naming an unknown name, and
    ``TypeError`` for anything that is neither a string nor a :class:`Format`.
    """
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str):
        try:
            return FORMATS[fmt]
        except KeyError:
            raise UnknownFormatError(
                f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}"
            ) from None
    raise TypeError(f"format must be a format name or a Format, got {fmt!r} ({type(fmt).__name__})")


def _params(fmt: str | Format) -> _RoundingParams:
    format_ = get_format(fmt)
    params = _PARAMS.get(format_.name)
    # Identity first: the comparison of whole dataclasses is a third of a round_to call.
    if params is None or (
        FORMATS[format_.name] is not format_ and FORMATS[format_.name] != format_
    ):
        # A Format built by the caller: compute its constants (slow path, not cached).
        return _rounding_params(format_)
    return params


def op_format(fmt: str | Format) -> Format:
    """the semantics ``op(D)``: the format PyTorch computes elementwise ops of ``fmt`` in.

    float64 for float64, float32 for every narrower format.
    """
    return FLOAT64 if get_format(fmt).name == "float64" else FLOAT32


def _overflow(negative: bool, params: _RoundingParams) -> float:
    """The result of an overflow (or an infinite input): ±inf, or an unsigned NaN."""
    if params.overflow_value != params.overflow_value:
        return math.nan
    return -math.inf if negative else math.inf


def _round_dyadic(negative: bool, mant: int, exp: int, params: _RoundingParams) -> float:
    """Round ``(-1)**negative * mant * 2**exp`` (``mant > 0``) to nearest, ties to even."""
    magnitude_exp = mant.bit_length() - 1 + exp  # floor(log2(mant * 2**exp))
    if magnitude_exp > params.emax:
        return _overflow(negative, params)
    if magnitude_exp < params.quantum_min_exp - 1:
        # Below half the smallest subnormal: rounds to a zero with the sign of x.
        return -0.0 if negative else 0.0
    quantum_exp = max(magnitude_exp, params.emin) - (params.precision - 1)
    shift = quantum_exp - exp
    if shift <= 0:
        significand = mant << -shift
    else:
        significand = mant >> shift
        remainder = mant & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if remainder > half or (remainder == half and significand & 1):
            significand += 1
    return _finish(negative, significand, quantum_exp, magnitude_exp, params)


def _round_rational(negative: bool, num: int, den: int, params: _RoundingParams) -> float:
    """Round ``(-1)**negative * num / den`` (``num, den > 0``, coprime) to nearest, ties to even."""
    if den & (den - 1) == 0:
        return _round_dyadic(negative, num, 1 - den.bit_length(), params)
    estimate = num.bit_length() - den.bit_length()  # floor(log2(num/den)) is this or one less
    if estimate >= 0:
        below = num < den << estimate
    else:
        below = num << -estimate < den
    magnitude_exp = estimate - 1 if below else estimate
    if magnitude_exp > params.emax:
        return _overflow(negative, params)
    if magnitude_exp < params.quantum_min_exp - 1:
        return -0.0 if negative else 0.0
    quantum_exp = max(magnitude_exp, params.emin) - (params.precision - 1)
    if quantum_exp >= 0:
        divisor = den << quantum_exp
        significand, remainder = divmod(num, divisor)
    else:
        divisor = den
        significand, remainder = divmod(num << -quantum_exp, divisor)
    twice_remainder = 2 * remainder
    # den is not a power of two and num/den is in lowest terms, so x is not dyadic and can never
    # be a tie (a midpoint is a dyadic rational): only "more than half" needs checking.
    assert twice_remainder != divisor, (num, den)
    if twice_remainder > divisor:
        significand += 1
    return _finish(negative, significand, quantum_exp, magnitude_exp, params)


def _finish(
    negative: bool, significand: int, quantum_exp: int, magnitude_exp: int, params: _RoundingParams
) -> float:
    """Apply the overflow rule to the rounded ``significand * 2**quantum_exp`` and build it."""
    if magnitude_exp == params.emax and significand > params.max_top_significand:
        # Only the top binade can round past max_finite (a carry from the binade below lands
        # on 2**emax, which every format holds).
        return _overflow(negative, params)
    if significand == 0:
        return -0.0 if negative else 0.0
    value = math.ldexp(significand, quantum_exp)  # exact: significand <= 2**p <= 2**53
    return -value if negative else value


def _round_float(x: float, params: _RoundingParams) -> float:
    """Round a Python float exactly (fast path: frexp gives the exact dyadic form)."""
    if x != x:
        return math.nan
    if x in (math.inf, -math.inf):
        return _overflow(x < 0.0, params)
    if x == 0.0:
        return x
    fraction, exponent = math.frexp(x)
    negative = fraction < 0.0
    mant = int(abs(fraction) * _FLOAT64_MANT_SCALE)  # exact integer < 2**53
    return _round_dyadic(negative, mant, exponent - 53, params)


def _round_mpf(x: mpmath.mpf, params: _RoundingParams) -> float:
    """Round an mpmath number from its raw (sign, man, exp, bc) tuple, exactly."""
    raw = x._mpf_
    sign, man, exp, _bitcount = raw
    if not man:
        if raw == mpmath.libmp.fnan:
            return math.nan
        if raw in (mpmath.libmp.finf, mpmath.libmp.fninf):
            return _overflow(raw == mpmath.libmp.fninf, params)
        return -0.0 if sign else 0.0  # fzero, or mpmath's rarely seen negative zero
    return _round_dyadic(bool(sign), int(man), int(exp), params)


ExactReal: TypeAlias = float | int | Fraction | mpmath.mpf


def round_to(x: ExactReal, fmt: str | Format) -> float:
    """the semantics ``round_F(x)``: round the exact value of ``x`` to nearest-even in ``fmt``.

    ``x`` may be a Python ``float`` (numpy floats of at most 64 bits included), an ``int``, a
    :class:`fractions.Fraction` or an :class:`mpmath.mpf`; its value is read exactly.  Gradual
    underflow; a result that rounds to zero keeps the sign of ``x``; overflow (judged after
    rounding with an unbounded exponent) gives ±inf, or NaN for ``float8_e4m3fn``; NaN gives NaN;
    ±inf gives ±inf (NaN for ``float8_e4m3fn``).  Returns a Python float holding the value exactly.
    """
    params = _params(fmt)
    if isinstance(x, float):
        if params.precision == 53 and params.emin == -1022 and params.emax == 1023:
            return float(x)  # already a float64 (float() drops any float subclass)
        return _round_float(x, params)
    if isinstance(x, bool):
        raise TypeError(f"round_to needs a real number, got the bool {x!r}")
    if isinstance(x, int | np.integer):
        value = int(x)
        if value == 0:
            return 0.0
        return _round_dyadic(value < 0, abs(value), 0, params)
    if isinstance(x, Fraction):
        if x.numerator == 0:
            return 0.0
        return _round_rational(x.numerator < 0, abs(x.numerator), x.denominator, params)
    if isinstance(x, mpmath.mpf):
        return _round_mpf(x, params)
    if isinstance(x, np.floating) and x.dtype.itemsize <= 8:
        return round_to(float(x), fmt)  # numpy floats of at most 64 bits are exact float64s
    raise TypeError(
        f"round_to needs a float, int, Fraction or mpmath.mpf, got {x!r} ({type(x).__name__})"
    )


def conv_to(x: ExactReal, fmt: str | Format) -> float:
    """``conv_D(x)`` (semantics §2): PyTorch's conversion of a float64 ``x`` into ``fmt``.

    float64 and float32 targets: ``round_to(x, fmt)``.  float16 and bfloat16: PyTorch rounds a
    float64 through float32 first, so ``round_to(round_to(x, "float32"), fmt)``.  A non-float input
    is first rounded to float64 (this models ``torch.tensor(float(x), dtype=D)``).  float8 targets
    raise :class:`UnsupportedConversionError`: float8 is never a work dtype, and PyTorch's
    float8_e4m3fn conversion saturates (500 -> 448) where semantics' ``round_F`` gives NaN.
    """
    target = get_format(fmt)
    if target.name not in WORK_DTYPES:
        raise UnsupportedConversionError(
            f"conv_to into {target.name!r} is not modelled: float8 is only a gradient dtype, never "
            f"a work dtype (and PyTorch's float8_e4m3fn conversion saturates where round_to gives "
            f"NaN); work dtypes are {', '.join(WORK_DTYPES)}"
        )
    x64 = round_to(x, FLOAT64)
    if target.name in ("float16", "bfloat16"):
        return round_to(round_to(x64, FLOAT32), target)
    return round_to(x64, target)


def is_representable(x: float, fmt: str | Format) -> bool:
    """Whether the float ``x`` is exactly a value of ``fmt`` (NaN: always; ±inf: if it has inf)."""
    if not isinstance(x, float):
        raise TypeError(f"is_representable needs a float, got {x!r} ({type(x).__name__})")
    if x != x:
        return True
    return round_to(x, fmt) == x  # ±0 compare equal, and both signs of zero exist in every format


def _storage_bits(format_: Format) -> int:
    """The storage width of one of the six formats (bit layouts exist for those only)."""
    if FORMATS.get(format_.name) != format_:
        raise UnknownFormatError(
            f"no bit layout for {format_!r}: to_bits/from_bits know only {', '.join(FORMATS)}"
        )
    return _STORAGE_BITS[format_.name]


def _float64_bits(x: float) -> int:
    bits: int = struct.unpack("<Q", struct.pack("<d", x))[0]
    return bits


def same_value_bits(a: float, b: float) -> bool:
    """Whether ``a`` and ``b`` have the same float64 bit pattern; every NaN counts as equal.

    Unlike ``==`` it tells ``+0.0`` from ``-0.0`` and matches NaN with NaN.
    """
    if a != a or b != b:
        return a != a and b != b
    return _float64_bits(a) == _float64_bits(b)


def to_bits(x: float, fmt: str | Format) -> int:
    """The bit pattern of ``x`` in ``fmt`` (an unsigned integer of the format's storage width).

    NaN gives the format's canonical quiet NaN (sign clear, exponent all ones, top fraction bit
    set; all ones for ``float8_e4m3fn``).  Raises :class:`NotRepresentableError` if ``x`` is not
    exactly a value of ``fmt``.
    """
    format_ = get_format(fmt)
    if not isinstance(x, float):
        raise TypeError(f"to_bits needs a float, got {x!r} ({type(x).__name__})")
    total_bits = _storage_bits(format_)
    fraction_bits = format_.precision - 1
    exponent_bits = total_bits - 1 - fraction_bits
    exponent_all_ones = (1 << exponent_bits) - 1
    if x != x:
        if format_.has_inf:
            return (exponent_all_ones << fraction_bits) | (1 << (fraction_bits - 1))
        return (1 << (total_bits - 1)) - 1  # e4m3fn: S.1111.111 is its only NaN
    if not is_representable(x, format_):
        raise NotRepresentableError(
            f"{x!r} ({x.hex()}) is not a value of {format_.name}; round it first"
        )
    sign_bit = (1 << (total_bits - 1)) if math.copysign(1.0, x) < 0 else 0
    magnitude = abs(x)
    if magnitude == math.inf:
        return sign_bit | (exponent_all_ones << fraction_bits)
    if magnitude == 0.0:
        return sign_bit
    bias = 1 - format_.emin
    exponent = math.frexp(magnitude)[1] - 1
    if exponent < format_.emin:  # subnormal: biased exponent 0, no implicit bit
        fraction = int(math.ldexp(magnitude, fraction_bits - format_.emin))
        return sign_bit | fraction
    significand = int(math.ldexp(magnitude, fraction_bits - exponent))  # exact, in [2**(p-1), 2**p)
    fraction = significand - (1 << fraction_bits)
    return sign_bit | ((exponent + bias) << fraction_bits) | fraction


def from_bits(bits: int, fmt: str | Format) -> float:
    """The value of the bit pattern ``bits`` (an unsigned integer) in ``fmt``, as a Python float.

    Every NaN pattern gives ``math.nan``.
    """
    format_ = get_format(fmt)
    total_bits = _storage_bits(format_)
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise TypeError(f"from_bits needs an int bit pattern, got {bits!r} ({type(bits).__name__})")
    bits = int(bits)
    if not 0 <= bits < 1 << total_bits:
        raise NotRepresentableError(
            f"bit pattern {bits:#x} does not fit the {total_bits} bits of {format_.name}"
        )
    fraction_bits = format_.precision - 1
    exponent_bits = total_bits - 1 - fraction_bits
    exponent_all_ones = (1 << exponent_bits) - 1
    negative = bool(bits >> (total_bits - 1))
    biased_exponent = (bits >> fraction_bits) & exponent_all_ones
    fraction = bits & ((1 << fraction_bits) - 1)
    if format_.has_inf:
        if biased_exponent == exponent_all_ones:
            if fraction:
                return math.nan
            return -math.inf if negative else math.inf
    elif biased_exponent == exponent_all_ones and fraction == (1 << fraction_bits) - 1:
        return math.nan  # e4m3fn: only S.1111.111 is NaN; the rest of that binade is finite
    if biased_exponent == 0:
        value = math.ldexp(fraction, format_.emin - fraction_bits)
    else:
        exponent = biased_exponent - (1 - format_.emin)
        value = math.ldexp(fraction | (1 << fraction_bits), exponent - fraction_bits)
    return -value if negative else value


def ulp(x: float, fmt: str | Format) -> float:
    """The spacing of ``fmt`` at the finite float ``x``: ``2**(max(E, emin) - p + 1)``.

    ``E = floor(log2(|x|))``; at zero and in the subnormal range this is the smallest subnormal.
    For ``|x|`` beyond ``max_finite`` the same formula is continued (the would-be spacing).
    Raises :class:`NotRepresentableError` for NaN or ±inf.
    """
    format_ = get_format(fmt)
    if not isinstance(x, float):
        raise TypeError(f"ulp needs a float, got {x!r} ({type(x).__name__})")
    if not math.isfinite(x):
        raise NotRepresentableError(f"ulp is defined for finite values only, got {x!r}")
    if x == 0.0:
        return format_.min_subnormal
    exponent = math.frexp(x)[1] - 1
    return math.ldexp(1.0, max(exponent, format_.emin) - format_.precision + 1)
