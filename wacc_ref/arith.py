"""Correctly rounded elementwise arithmetic of the reference model: ``round_F(a op b)``.

Every function here returns, for each element, the exact result of one real operation rounded
*once* into a format ``F`` (round to nearest, ties to even, gradual underflow, overflow to ±inf)
— the ``round_F`` of semantics §2 — with IEEE 754 results for NaN, ±inf and signed zeros.  Values
travel as numpy float64 arrays: every value of every format here is exactly a float64.

Three engines compute the same thing; the tests check that they agree bit for bit:

``fraction`` (``exact_*``)
    Ground truth, one element at a time: the operands are read exactly as
    :class:`fractions.Fraction`, the operation is exact, and :func:`wacc_ref.formats.round_to`
    rounds it once.  IEEE special cases (NaN, ±inf, signed zeros) are handled explicitly.  Slow.

``gmpy2`` (:class:`Gmpy2Engine`)
    One element at a time, in C: MPFR computes each operation correctly rounded to the precision
    of ``F``; a *local* gmpy2 context carries ``F``'s exponent range with ``subnormalize=True``
    (MPFR exponents count the significand in [1/2, 1), hence ``emin - p + 2`` and ``emax + 1``).
    The global gmpy2 context is never read or changed.  Used for the elements the vector engine
    cannot prove exact, and for the float64 FMA.

``vector`` (the public ``*_rounded`` functions)
    numpy, whole arrays at once.  For a target ``F`` narrower than float64 the exact result is
    first formed in float64 and *proved* exact with an error-free transformation (TwoSum for a
    sum, Dekker's TwoProduct for a product or for the check ``q * b == a`` of a quotient); those
    elements are then rounded once with :func:`round_array`, an exact float64 -> ``F`` rounding
    (power-of-two scaling, ``numpy.rint``, scaling back: all exact float64 steps).  Elements that
    are not proved exact (a sum of two bfloat16 values 2**100 apart, a quotient by a divisor that
    is not a power of two) go to the gmpy2 engine.  For ``F`` = float64 the native IEEE float64
    operation *is* ``round_64`` of the exact operation; for a float32 quotient of float32 values
    the native IEEE float32 division is ``round_32`` of the exact quotient.  Native arithmetic is
    only trusted with gradual underflow, which :func:`check_gradual_underflow` verifies (a process
    that called ``torch.set_flush_denormal(True)`` would otherwise give wrong reference values).

Error-free transformations are only trusted where they are exact: TwoSum always (an overflow
gives NaN, which proves nothing), TwoProduct only for products of magnitude at least ``2**-968``
(below that its error terms may underflow; such elements go to gmpy2).  The float64 route is
taken for targets with at most 24 significand bits within float32's exponent range (checked by
an assert on the format); the operands may be any float64 values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from functools import cache

import gmpy2
import numpy as np
import numpy.typing as npt

from wacc_ref.formats import FLOAT32, FLOAT64, Format, get_format, op_format, round_to

__all__ = [
    "BitwiseFloat",
    "Gmpy2Engine",
    "add_rounded",
    "check_gradual_underflow",
    "conv_array",
    "div_rounded",
    "exact_add",
    "exact_div",
    "exact_fma",
    "exact_mul",
    "fma_rounded",
    "fused_mean_step_accepts",
    "fused_mean_step_candidates",
    "gmpy2_engine",
    "mul_rounded",
    "round_array",
]

FloatArray = npt.NDArray[np.float64]

# Veltkamp's splitting constant 2**27 + 1 for float64 (Dekker's TwoProduct).
_SPLIT_FACTOR = float.fromhex("0x1.0000002p+27")
_FLOAT64_MIN_NORMAL = float.fromhex("0x1p-1022")
_FLOAT32_MIN_NORMAL = float.fromhex("0x1p-126")
# Smallest product magnitude for which Dekker's TwoProduct is exact (see _product_is_exact).
_TWO_PRODUCT_MIN = float.fromhex("0x1p-968")
# Bit pattern that stands for "any NaN" in BitwiseFloat's hash (NaN payloads are not modelled).
_NAN_HASH = hash(("wacc_ref.arith", "NaN"))


def _is_float64(fmt: Format) -> bool:
    return fmt.precision == FLOAT64.precision and fmt.emin == FLOAT64.emin


def _assert_narrow(fmt: Format) -> None:
    # The float64 route needs operands of at most 24 bits within float32's exponent range so
    # that float64 intermediates neither overflow nor underflow (see the module docstring).
    assert fmt.precision <= FLOAT32.precision and fmt.emin >= FLOAT32.emin, fmt
    assert fmt.emax <= FLOAT32.emax, fmt


def check_gradual_underflow() -> None:
    """Raise ``RuntimeError`` if the FPU flushes subnormals (FTZ/DAZ) in float64 or float32.

    The vector engine trusts native IEEE arithmetic; flush-to-zero (e.g. after
    ``torch.set_flush_denormal(True)`` in the same process) would silently corrupt it.
    """
    half = np.float64(0.5)
    tiny64 = np.float64(_FLOAT64_MIN_NORMAL) * half
    tiny32 = np.float32(_FLOAT32_MIN_NORMAL) * np.float32(half)
    if tiny64 == 0.0 or tiny32 == 0.0 or tiny64 * np.float64(2.0) == 0.0:
        raise RuntimeError(
            "the floating-point unit flushes subnormals to zero (FTZ/DAZ is on, e.g. "
            "torch.set_flush_denormal(True)); the reference arithmetic needs gradual underflow"
        )


# --------------------------------------------------------------------------------------------
# Exact float64 -> F rounding of whole arrays
# --------------------------------------------------------------------------------------------


def round_array(values: npt.ArrayLike, fmt: str | Format) -> FloatArray:
    """``round_F`` of every element of a float64 array (a new array; NaN and ±inf pass through).

    Exact: ``x = m * 2**e`` (``numpy.frexp``), the quantum is ``2**(max(e - 1, emin) - p + 1)``,
    ``x / quantum`` is an exact power-of-two scaling, ``numpy.rint`` rounds it to the nearest
    integer, ties to even, and scaling back is exact.  Overflow (judged on the rounded value)
    gives ±inf, or NaN for a format without inf.  Zeros keep their sign.
    """
    target = get_format(fmt)
    original = np.array(values, dtype=np.float64)  # a copy
    if _is_float64(target):
        return original
    check_gradual_underflow()
    x = original.reshape(-1)
    finite_nonzero = np.isfinite(x) & (x != 0.0)
    xs = x[finite_nonzero]
    _, exponent = np.frexp(xs)  # xs = m * 2**exponent, 0.5 <= |m| < 1
    quantum_exp = np.maximum(exponent - 1, target.emin) - (target.precision - 1)
    with np.errstate(over="ignore"):  # a carry past float64's range is an overflow anyway
        rounded = np.ldexp(np.rint(np.ldexp(xs, -quantum_exp)), quantum_exp)
    overflow = np.abs(rounded) > target.max_finite
    if target.has_inf:
        rounded[overflow] = np.copysign(np.inf, rounded[overflow])
    else:
        rounded[overflow] = np.nan
    x[finite_nonzero] = rounded
    if not target.has_inf:
        x[np.isinf(x)] = np.nan
    return x.reshape(original.shape)


def conv_array(values: npt.ArrayLike, dtype: str | Format) -> FloatArray:
    """``conv_D`` (semantics §2) of every element of a float64 array (see ``formats.conv_to``).

    float64 and float32 targets round once; float16 and bfloat16 round through float32 first,
    as PyTorch's float64 -> float16/bfloat16 conversion does.
    """
    target = get_format(dtype)
    if target.name in ("float16", "bfloat16"):
        return round_array(round_array(values, FLOAT32), target)
    return round_array(values, target)


# --------------------------------------------------------------------------------------------
# Ground truth: exact scalar operations (Fraction + round_to), with IEEE special cases
# --------------------------------------------------------------------------------------------


def _negative(x: float) -> bool:
    return math.copysign(1.0, x) < 0.0


def _signed_zero(negative: bool) -> float:
    return -0.0 if negative else 0.0


def _signed_inf(negative: bool) -> float:
    return -math.inf if negative else math.inf


def _round_finite(value: Fraction, fmt: Format) -> float:
    """Round an exact, finite, nonzero-or-cancelled value (an exact zero sum is +0 under RNE)."""
    if value == 0:
        return 0.0
    return round_to(value, fmt)


def _round_special(x: float, fmt: Format) -> float:
    """``round_F`` of an IEEE special result (NaN or ±inf): NaN, or ±inf (NaN without inf)."""
    return round_to(x, fmt)


def exact_add(a: float, b: float, fmt: str | Format) -> float:
    """``round_F(a + b)`` from the exact sum (IEEE: inf - inf is NaN, -0 + -0 is -0)."""
    target = get_format(fmt)
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if math.isinf(a) or math.isinf(b):
        if math.isinf(a) and math.isinf(b) and _negative(a) != _negative(b):
            return math.nan
        return _round_special(a if math.isinf(a) else b, target)
    if a == 0.0 and b == 0.0:
        return _signed_zero(_negative(a) and _negative(b))
    return _round_finite(Fraction(a) + Fraction(b), target)


def exact_mul(a: float, b: float, fmt: str | Format) -> float:
    """``round_F(a * b)`` from the exact product (IEEE: 0 * inf is NaN; zero signs multiply)."""
    target = get_format(fmt)
    if math.isnan(a) or math.isnan(b):
        return math.nan
    negative = _negative(a) != _negative(b)
    if math.isinf(a) or math.isinf(b):
        if a == 0.0 or b == 0.0:
            return math.nan
        return _round_special(_signed_inf(negative), target)
    if a == 0.0 or b == 0.0:
        return _signed_zero(negative)
    return round_to(Fraction(a) * Fraction(b), target)


def exact_div(a: float, b: float, fmt: str | Format) -> float:
    """``round_F(a / b)`` from the exact quotient (IEEE: x/0 is ±inf, 0/0 and inf/inf NaN)."""
    target = get_format(fmt)
    if math.isnan(a) or math.isnan(b):
        return math.nan
    negative = _negative(a) != _negative(b)
    if math.isinf(a):
        if math.isinf(b):
            return math.nan
        return _round_special(_signed_inf(negative), target)
    if math.isinf(b):
        return _signed_zero(negative)
    if b == 0.0:
        if a == 0.0:
            return math.nan
        return _round_special(_signed_inf(negative), target)
    if a == 0.0:
        return _signed_zero(negative)
    return round_to(Fraction(a) / Fraction(b), target)


def exact_fma(a: float, b: float, c: float, fmt: str | Format) -> float:
    """``round_F(a + b * c)`` with ONE rounding (IEEE fusedMultiplyAdd semantics)."""
    target = get_format(fmt)
    if math.isnan(a) or math.isnan(b) or math.isnan(c):
        return math.nan
    product_negative = _negative(b) != _negative(c)
    if math.isinf(b) or math.isinf(c):
        if b == 0.0 or c == 0.0:
            return math.nan
        if math.isinf(a) and _negative(a) != product_negative:
            return math.nan
        return _round_special(_signed_inf(product_negative), target)
    if math.isinf(a):
        return _round_special(a, target)
    if b == 0.0 or c == 0.0:
        # a + (±0): the zero product keeps IEEE's sign rules for a sum with a zero.
        return exact_add(a, _signed_zero(product_negative), target)
    return _round_finite(Fraction(a) + Fraction(b) * Fraction(c), target)


# --------------------------------------------------------------------------------------------
# gmpy2 engine: MPFR in a local context per format
# --------------------------------------------------------------------------------------------


class Gmpy2Engine:
    """Correctly rounded scalar ``+ * / fma`` into one format, computed by MPFR in C.

    Holds its own gmpy2 context (precision ``p``, exponent range of the format, subnormals,
    round to nearest); the global gmpy2 context is never used.  Operands may be any Python
    floats and are read exactly.  Results are Python floats holding the format value exactly.
    """

    def __init__(self, fmt: str | Format) -> None:
        self.format = get_format(fmt)
        self._context = gmpy2.context(
            precision=self.format.precision,
            # MPFR writes x = 0.1b... * 2**E (significand in [1/2, 1)), IEEE 1.b... * 2**e.
            emin=self.format.emin - self.format.precision + 2,
            emax=self.format.emax + 1,
            subnormalize=True,
            round=gmpy2.RoundToNearest,
        )
        # A Python float operand is converted into the context itself, and subnormalized there
        # relative to 53 bits: it is rounded to a multiple of min_subnormal, which leaves every
        # value of the format (and every such multiple) exact, but not other floats.  Those go in
        # as exact 53-bit MPFR numbers, made in a context with MPFR's widest exponent range.  MPFR
        # takes operands inside the context's range [min_subnormal, 2**(emax+1)) only, so an
        # operation with a finite nonzero operand outside it takes the exact Fraction route.
        # Every float is a multiple of float64's min_subnormal: there, floats always go in as is.
        self._reads_every_float = _is_float64(self.format)
        self._exact_float64 = gmpy2.context(
            precision=53, emin=gmpy2.get_emin_min(), emax=gmpy2.get_emax_max()
        )
        self._operand_low = self.format.min_subnormal
        self._operand_high = math.ldexp(1.0, self.format.emax) * 2.0
        self._per_min_subnormal = 1.0 / self.format.min_subnormal  # a power of two: exact scaling
        # MPFR's range admits the whole top binade; float8_e4m3fn's is short (S.1111.111 is
        # NaN), so a result above its max_finite is that format's overflow, NaN.
        self._short_top_binade = not self.format.has_inf

    def _operands(self, *values: float) -> tuple[object, ...] | None:
        """The operands, read exactly, for the context; None if MPFR cannot take one of them."""
        if self._reads_every_float:
            return values
        low, high = self._operand_low, self._operand_high
        if not all(low <= abs(x) < high or x == 0.0 or not math.isfinite(x) for x in values):
            return None
        scale = self._per_min_subnormal
        if all((x * scale).is_integer() or not math.isfinite(x) for x in values):
            return values
        return tuple(gmpy2.mpfr(x, 53, context=self._exact_float64) for x in values)

    def _finish(self, value: object) -> float:
        result = float(value)  # type: ignore[arg-type]
        if self._short_top_binade and not abs(result) <= self.format.max_finite:
            return math.nan
        return result

    def add(self, a: float, b: float) -> float:
        """``round_F(a + b)``."""
        operands = self._operands(a, b)
        if operands is None:
            return exact_add(a, b, self.format)
        return self._finish(self._context.add(*operands))

    def mul(self, a: float, b: float) -> float:
        """``round_F(a * b)``."""
        operands = self._operands(a, b)
        if operands is None:
            return exact_mul(a, b, self.format)
        return self._finish(self._context.mul(*operands))

    def div(self, a: float, b: float) -> float:
        """``round_F(a / b)``."""
        operands = self._operands(a, b)
        if operands is None:
            return exact_div(a, b, self.format)
        return self._finish(self._context.div(*operands))

    def fma(self, a: float, b: float, c: float) -> float:
        """``round_F(a + b * c)`` with one rounding."""
        operands = self._operands(b, c, a)
        if operands is None:
            return exact_fma(a, b, c, self.format)
        return self._finish(self._context.fma(*operands))


@cache
def _engine(name: str) -> Gmpy2Engine:
    return Gmpy2Engine(name)


def gmpy2_engine(fmt: str | Format) -> Gmpy2Engine:
    """The shared :class:`Gmpy2Engine` of a format (one per format name)."""
    return _engine(get_format(fmt).name)


# --------------------------------------------------------------------------------------------
# Vector engine
# --------------------------------------------------------------------------------------------


def _two_sum_error(a: FloatArray, b: FloatArray, s: FloatArray) -> FloatArray:
    """Knuth's TwoSum: ``a + b - s`` exactly, for ``s = fl64(a + b)`` (finite, no overflow)."""
    b_virtual = s - a
    a_virtual = s - b_virtual
    return (a - a_virtual) + (b - b_virtual)


def _split(x: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Veltkamp's split of float64 ``x`` into two halves of at most 26 bits: ``x = hi + lo``."""
    scaled = _SPLIT_FACTOR * x
    hi = scaled - (scaled - x)
    return hi, x - hi


def _two_product_error(a: FloatArray, b: FloatArray, p: FloatArray) -> FloatArray:
    """Dekker's TwoProduct: ``a * b - p`` exactly, for ``p = fl64(a * b)`` (no over/underflow)."""
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    return ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _product_is_exact(a: FloatArray, b: FloatArray, p: FloatArray) -> npt.NDArray[np.bool_]:
    """Whether ``p = fl64(a * b)`` is proved to be the exact product (finite ``a``, ``b``).

    A zero operand makes ``p`` an exact signed zero.  Otherwise TwoProduct decides, but only where
    it is itself exact: its error terms are multiples of ``2**(e_a + e_b - 104)``, representable
    when ``e_a + e_b >= -970``, which ``|p| >= 2**-968`` guarantees.  Smaller products are left
    unproved (the gmpy2 engine takes them); operands of a format with at most 24 bits and
    float32's exponent range never get there.
    """
    zero_operand = (a == 0.0) | (b == 0.0)
    return zero_operand | ((np.abs(p) >= _TWO_PRODUCT_MIN) & (_two_product_error(a, b, p) == 0.0))


def _as_flat_float64(*operands: npt.ArrayLike) -> tuple[tuple[int, ...], list[FloatArray]]:
    """Broadcast the operands; return the common shape and 1-D float64 copies of each."""
    arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in operands))
    shape = arrays[0].shape
    return shape, [np.array(x, dtype=np.float64).reshape(-1) for x in arrays]


def _finish_vector(
    shape: tuple[int, ...],
    exact: FloatArray,
    proved: npt.NDArray[np.bool_],
    operands: list[FloatArray],
    target: Format,
    fallback: Callable[..., float],
) -> FloatArray:
    """Round the proved-exact elements once; send every other element to the gmpy2 engine."""
    result = round_array(np.where(proved, exact, 0.0), target)
    for index in np.flatnonzero(~proved).tolist():
        result[index] = fallback(*(float(x[index]) for x in operands))
    return result.reshape(shape)


def add_rounded(a: npt.ArrayLike, b: npt.ArrayLike, fmt: str | Format) -> FloatArray:
    """``round_F(a + b)`` elementwise (arrays broadcast; a new float64 array)."""
    target = get_format(fmt)
    shape, (x, y) = _as_flat_float64(a, b)
    with np.errstate(all="ignore"):
        s = x + y
        if _is_float64(target):
            return s.reshape(shape)
        _assert_narrow(target)
        finite = np.isfinite(x) & np.isfinite(y)
        # A special operand gives an IEEE special result, exact by definition.
        proved = ~finite | (_two_sum_error(x, y, s) == 0.0)
    return _finish_vector(shape, s, proved, [x, y], target, gmpy2_engine(target).add)


def mul_rounded(a: npt.ArrayLike, b: npt.ArrayLike, fmt: str | Format) -> FloatArray:
    """``round_F(a * b)`` elementwise (arrays broadcast; a new float64 array)."""
    target = get_format(fmt)
    shape, (x, y) = _as_flat_float64(a, b)
    with np.errstate(all="ignore"):
        p = x * y
        if _is_float64(target):
            return p.reshape(shape)
        _assert_narrow(target)
        finite = np.isfinite(x) & np.isfinite(y)
        proved = ~finite | _product_is_exact(x, y, p)
    return _finish_vector(shape, p, proved, [x, y], target, gmpy2_engine(target).mul)


def div_rounded(a: npt.ArrayLike, b: npt.ArrayLike, fmt: str | Format) -> FloatArray:
    """``round_F(a / b)`` elementwise (arrays broadcast; a new float64 array).

    float64: native IEEE division.  float32 with float32 operands: native IEEE float32 division.
    Narrower: the float64 quotient where ``q * b == a`` is proved exactly, gmpy2 elsewhere.
    """
    target = get_format(fmt)
    shape, (x, y) = _as_flat_float64(a, b)
    with np.errstate(all="ignore"):
        if _is_float64(target):
            return (x / y).reshape(shape)
        _assert_narrow(target)
        if target == FLOAT32:
            x32, y32 = x.astype(np.float32), y.astype(np.float32)
            # Native float32 division is round_32 of the exact quotient of its float32
            # operands; operands that are not float32 values take the exact route instead.
            operands_are_float32 = np.array_equal(x32, x, equal_nan=True) and np.array_equal(
                y32, y, equal_nan=True
            )
            if operands_are_float32:
                check_gradual_underflow()
                return np.asarray(x32 / y32, dtype=np.float64).reshape(shape)
        q = x / y
        finite = np.isfinite(x) & np.isfinite(y)
        # q is exact iff q * b == a exactly: fl64(q * b) == a and no TwoProduct error.  Division
        # by zero gives a non-finite q with finite operands: not proved, gmpy2 decides its sign.
        proved = ~finite | (np.isfinite(q) & (q * y == x) & _product_is_exact(q, y, q * y))
    return _finish_vector(shape, q, proved, [x, y], target, gmpy2_engine(target).div)


def fma_rounded(
    a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike, fmt: str | Format
) -> FloatArray:
    """``round_F(a + b * c)`` elementwise with ONE rounding (a new float64 array)."""
    target = get_format(fmt)
    shape, (x, y, z) = _as_flat_float64(a, b, c)
    engine = gmpy2_engine(target)
    if _is_float64(target):
        # No float64 FMA in numpy: MPFR, element by element.
        fused = [
            engine.fma(a_, b_, c_)
            for a_, b_, c_ in zip(x.tolist(), y.tolist(), z.tolist(), strict=True)
        ]
        return np.array(fused, dtype=np.float64).reshape(shape)
    _assert_narrow(target)
    with np.errstate(all="ignore"):
        p = y * z
        s = x + p
        finite = np.isfinite(x) & np.isfinite(y) & np.isfinite(z)
        product_exact = _product_is_exact(y, z, p)
        sum_exact = _two_sum_error(x, p, s) == 0.0
        # With finite operands and an exact product, a + b*c is exactly s.  Special operands:
        # the float64 a + (b*c) follows the IEEE FMA rules (0*inf NaN, inf - inf NaN).
        proved = ~finite | (product_exact & sum_exact)
    return _finish_vector(shape, s, proved, [x, y, z], target, engine.fma)


# --------------------------------------------------------------------------------------------
# semantics §6 fused mean step: the set of admissible per-element results
# --------------------------------------------------------------------------------------------


class BitwiseFloat(float):
    """A float compared by its float64 value bits: ``+0.0 != -0.0`` and every NaN equals every NaN.

    Used as the elements of :func:`fused_mean_step_candidates` so that a candidate set can hold
    both zeros and can contain NaN.  Test membership with ``BitwiseFloat(x) in candidates`` (or
    :func:`fused_mean_step_accepts`): a plain float NaN never matches, because Python hashes each
    NaN object differently.
    """

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, float):
            return NotImplemented
        mine, theirs = float(self), float(other)
        if math.isnan(mine) or math.isnan(theirs):
            return math.isnan(mine) and math.isnan(theirs)
        return mine == theirs and _negative(mine) == _negative(theirs)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        value = float(self)
        return _NAN_HASH if math.isnan(value) else hash(value)

    def __repr__(self) -> str:
        return f"BitwiseFloat({float(self)!r})"


def fused_mean_step_candidates(buf: float, c: float, w_d: float, dtype: str) -> frozenset[float]:
    """Every result §6 allows for one element of a fused mean step in work dtype ``dtype``.

    ``buf`` is the pending value, ``c = conv_D(g)`` the converted gradient, ``w_d = conv_D(w)``
    the converted weight (all three must be values of ``dtype``).  The set holds
    ``round_D(buf + c*w_d)`` (an FMA in D), ``round_D(round_op(buf + c*w_d))`` and the two-step
    ``round_D(buf + round_D(c*w_d))``, computed by the exact ground-truth engine.

    NaN: any NaN result is represented by one NaN element; elements are :class:`BitwiseFloat`,
    so ``+0.0`` and ``-0.0`` are distinct members and NaN matches NaN.  Check an observed value
    with :func:`fused_mean_step_accepts` (or ``BitwiseFloat(value) in candidates``); a plain
    float probe cannot find a NaN member.
    """
    target = get_format(dtype)
    operands = []
    for name, value in (("buf", buf), ("c", c), ("w_d", w_d)):
        if isinstance(value, bool) or not isinstance(value, float | int):
            raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
        if isinstance(value, int) and round_to(value, FLOAT64) != value:
            raise ValueError(f"{name}={value!r} is not exactly a float64")
        value = float(value)
        if not math.isnan(value) and round_to(value, target) != value:
            raise ValueError(f"{name}={value!r} ({value.hex()}) is not a {target.name} value")
        operands.append(value)
    buf, c, w_d = operands
    fused = exact_fma(buf, c, w_d, target)
    op_rounded = round_to(exact_fma(buf, c, w_d, op_format(target)), target)
    two_step = exact_add(buf, exact_mul(c, w_d, target), target)
    return frozenset(BitwiseFloat(v) for v in (fused, op_rounded, two_step))


def fused_mean_step_accepts(value: float, candidates: frozenset[float]) -> bool:
    """Whether ``value`` is a member of ``candidates`` by value bits (signed zeros, any NaN)."""
    return BitwiseFloat(value) in candidates
