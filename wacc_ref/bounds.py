r"""Error bounds for a finished window (semantics §12.2) and the suite's tolerance table.

For a window of microbatches the exact result is ``X / S / W`` with ``X = Σ_k c_k`` — all arithmetic
exact, on the gradients *as handed in* (before any conversion): ``c_k = g_k`` for
``accumulate_sum``, ``c_k = g_k · w_D,k`` for ``accumulate_mean`` (``w_D = conv_D(w)``), ``W`` the
exact sum of the weights that §5/§6 count (``w`` for sums, ``w_D`` for means; zero weights count
nothing and their gradients are never read).  :func:`window_error_bound` returns, per element, a
bound ``B`` with ``|result - exact| <= B`` for *every* implementation in the accepted set:
the reproducible two-step order (§5, §6, §8) and the fused variants of §6, where each step of each
element may be any of them independently (the derivation takes, per step, the worst of them).

Notation
--------
``u = 2**-p`` and ``η = min_subnormal / 2`` of the format an operation rounds into (``u, η`` for
``D``; ``u_o, η_o`` for ``op(D)``; ``u_32, η_32`` for float32).  Every rounding obeys the standard
model with gradual underflow (Higham, *Accuracy and Stability*, §2.1)::

    round_F(x) = x (1 + δ) + ε,    |δ| <= u_F,  |ε| <= η_F,  δ ε = 0,

and these exactness facts (each one a property of binary floating point, used to drop terms):

* (E1) a value that is already in ``F`` rounds to itself (``δ = ε = 0``);
* (E2) the sum of two values of ``F`` has ``ε = 0``: in the subnormal range it is exact;
* (E3) multiplying a value of ``F`` by ``2**k``, ``k >= 0``, is exact (overflow excluded below);
  by ``2**k``, ``k < 0``, it has ``δ = 0`` (only underflow, ``|ε| <= η_F``);
* (E4) ``buf`` starts at ``+0``: the two-step order's first addition ``+0 + t`` is exact;
* (E5) a zero contribution (``g == 0`` exactly, or a ``None`` gradient) leaves ``buf`` unchanged
  in every variant (``round(buf + 0) = buf``).  So, per element, only the nonzero contributions
  are steps: ``K`` below counts them, ``j`` numbers them, and the first one meets ``buf == 0``.

A product ``Π(1 + δ_i)`` with ``|δ_i| <= u_i`` lies in ``[Π(1 - u_i), Π(1 + u_i)]``; for ``n``
factors of one format ``Π(1 + u) - 1 <= γ_n = n u / (1 - n u)`` (Higham's Lemma 3.1).  The bound
below keeps the exact products (never larger than the γ form, and exact for mixed formats), so
where this text writes ``(1 + u)**n - 1`` Higham's analysis has ``γ_n``.

Step 1 — conversion ``conv_D(g)`` (per element)
-----------------------------------------------
``conv_D(g) = g φ_c + ε_c`` with ``φ_c ∈ [L_c, U_c]``, ``|ε_c| <= B_c``, by case:

* ``g`` in ``D`` (always for ``D = float64``; E1):          ``U_c = L_c = 1``, ``B_c = 0``;
* ``D = float32``, or ``g`` in float32 but not in ``D``:   ``U_c = 1 + u``, ``L_c = 1 - u``,
  ``B_c = η`` (one rounding);
* ``D`` ∈ {float16, bfloat16} and ``g`` not in float32:   ``round_D(round_32(g))``, two roundings:
  ``U_c = (1 + u_32)(1 + u)``, ``L_c = (1 - u_32)(1 - u)``, ``B_c = η_32 (1 + u) + η``.

Step 2 — the step that adds contribution ``j`` (of the element's ``K``) into ``buf``
-----------------------------------------------------------------------------------
Zero-weight batches are skipped (semantics §5), zero contributions are no steps (E5): ``j = 1..K``
numbers an element's nonzero contributions of positive-weight batches, in issue order.
``m_j = w_D,j`` for means and ``1`` for sums (no product), so ``c_j = g_j m_j`` and
``conv·m = c_j φ_c + ε_c m_j``.  The product ``conv·m`` of the two-step order is rounded with
``(u_p, η_p) = (0, 0)`` if ``m`` is a power of two ``>= 1``, ``(0, η)`` if it is a power of two
``< 1`` (E3), ``(u, η)`` otherwise.  For each accepted variant, the new term's factor interval
``[L_n, U_n]`` and its absolute error ``A_n = a_m m_j + a_0``:

* two-step, ``j = 1``: ``t = round_D(conv·m)``, ``+0 + t`` exact (E4):
  ``U_n = U_c (1 + u_p)``, ``a_m = B_c (1 + u_p)``, ``a_0 = η_p``;
* two-step, ``j >= 2``: then ``round_D(buf + t)``, a sum of two ``D`` values (E2): all of the
  above times ``(1 + u)``, no new ``η``;
* FMA ``round_D(buf + conv·m)``: ``j = 1`` is the two-step's ``t``; ``j >= 2``:
  ``U_n = U_c (1 + u)``, ``a_m = B_c (1 + u)``, ``a_0 = η``;
* op-then-D ``round_D(round_op(buf + conv·m))`` (only differs from FMA when ``op(D) != D``):
  ``j >= 2``: ``U_n = U_c (1 + u_o)(1 + u)``, ``a_m = B_c (1 + u_o)(1 + u)``,
  ``a_0 = η_o (1 + u) + η``; ``j = 1``: ``conv·m`` alone is rounded in ``op`` with the product
  rules above for ``op`` (``u_o, η_o``), then in ``D`` (``u_p, η_p``);
* sums: every value rounded is ``buf + conv``, a sum of two ``D`` values (E2): no ``η`` at all,
  the first step is exact (E4) in every variant, and a later step has ``(1 + u)`` (two-step, FMA)
  or ``(1 + u_o)(1 + u)`` (op-then-D).

The union over variants takes ``max U_n``, ``min L_n``, ``max a_m``, ``max a_0``.  A later step
``i > j`` multiplies everything already in ``buf`` by ``(1 + δ)`` (two-step, FMA) or
``(1 + δ_o)(1 + δ)`` (op-then-D): ``U_p = (1 + u_o')(1 + u)``, ``L_p = (1 - u_o')(1 - u)`` with
``u_o' = u_o`` if ``op(D) != D`` else ``0``; absolute errors grow by at most ``U_p``.  After the
last step, term ``j`` carries ``U_j = U_n U_p**(K-j)``, ``L_j = L_n L_p**(K-j)``,
``A_j = (a_m m_j + a_0) U_p**(K-j)``, so::

    buf = Σ_j c_j φ_j + e,   φ_j ∈ [L_j, U_j],   |e| <= Σ_j A_j.

``normalized=False`` (the ``finish_sums`` buffer against ``X``)::

    B = Σ_j |c_j| max(U_j - 1, 1 - L_j) + Σ_j A_j          (U_j - 1 >= 1 - L_j always).

With ``U_j = (1 + u)**n`` this is Higham's recursive-summation bound ``Σ |c_j| γ_n`` plus the
underflow terms.

Step 3 — the weight sum and the two divisions (``normalized=True``)
------------------------------------------------------------------
``Ŵ`` is the float64 running sum of §3 and ``W_op = round_op(Ŵ)``; both are fixed by the semantics
(no implementation freedom), so their combined relative error is used exactly:
``ψ = W / W_op`` (a rational, computed exactly).  Then, with ``Δ = (1 + δ_1)(1 + δ_2)(1 + δ_3)``::

    y   = round_D(buf / S)   = (buf / S)(1 + δ_1) + ε_1     (u_1, η_1)
    q   = round_op(y / W_op) = (y / W_op)(1 + δ_2) + ε_2    (u_2, η_2) = (u_o, η_o)
    out = round_D(q)         = q (1 + δ_3) + ε_3            (u_3, η_3) = (u, η); (0, 0) if op = D

    out - X/(S W) = Σ_j c_j (φ_j ψ Δ - 1)/(S W) + e ψ Δ/(S W)
                    + ε_1 (1 + δ_2)(1 + δ_3)/W_op + ε_2 (1 + δ_3) + ε_3

    B = Σ_j |c_j| κ_j / (S W) + Σ_j A_j ψ U_Δ / (S W) + η_1 (1 + u_2)(1 + u_3)/W_op
        + η_2 (1 + u_3) + η_3,     κ_j = max(U_j ψ U_Δ - 1, 1 - L_j ψ L_Δ),

``U_Δ = Π(1 + u_i)``, ``L_Δ = Π(1 - u_i)``.  Exactness refinements (E1, E3): ``S`` a power of two
gives ``u_1 = 0`` (and ``η_1 = 0`` if ``S <= 1``); ``W_op`` a power of two gives ``u_2 = 0`` (and
``η_2 = 0`` if ``W_op <= 1``, and then ``q = y 2**k`` is in ``D``: ``u_3 = η_3 = 0``); a
``W_op = 2**k > 1`` gives ``u_3 = 0`` (``q = y 2**-k`` has at most ``p`` significant bits, so
``round_D`` can only underflow).

Overflow: the bound is not applicable where it may happen
---------------------------------------------------------
Every value that any variant rounds is at most ``M = Σ_j |c_j| U_j + Σ_j A_j`` in magnitude (the
factors only grow with later steps), and ``|g_j|`` is what the conversion rounds.  Where
``|g_j| > max_D`` for some ``j``, or ``M > max_D``, or (normalized) ``M > S max_D`` (for ``y``), or
``M > ((max_D - η_2) W_op / (1 + u_2) - η_1) S / (1 + u_1)`` (for ``q`` and ``out``), an
intermediate can overflow and the standard model fails there: those elements get ``+inf`` ("no
bound"); so do elements with a NaN or ±inf gradient in a positive-weight batch, and, for
``normalized=True``, every element when ``Ŵ`` or ``W_op`` is not a finite positive number.  This
test is conservative (``M`` is an upper bound): ``+inf`` may also appear where no overflow happens.

Evaluating the bound without making it too small
------------------------------------------------
Every per-window scalar (``κ_j m_j / (S W)``, ``A_j ψ U_Δ / (S W)``, ``U_j m_j``, the constant
terms, the thresholds; one set per conversion case, first-step flag and count of later steps)
is computed exactly with rationals (``gmpy2.mpq``, exact like :class:`fractions.Fraction` and
much faster) and rounded *up* to a float64 (thresholds *down*): the rounded float is compared
exactly with the rational and moved one step when it is on the wrong side.  The per-element sum
``Σ_j (|g_j| r_j + h_j) + H`` takes ``n = 3K' + 1`` float64 operations (``K'``: the window's
positive-weight batches, at least every element's ``K``) on non-negative numbers,
each with ``δ >= -2**-53`` and an absolute underflow loss below ``2**-1075`` that no later
operation amplifies (only additions follow a product), so the exact value is at most
``(computed + n 2**-1075) / (1 - 2**-53)**n``.  The result is
``computed * (1 + (n + 2) 2**-52) + (n + 1) 2**-1074`` (two more float64 operations, counted):
``1 + (n + 2) 2**-52 >= (1 - 2**-53)**-(n + 2)`` and ``(n + 1) 2**-1074`` covers the
underflow losses.  The magnitude ``M`` is evaluated the same way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import gmpy2
import ml_dtypes
import mpmath
import numpy as np
from numpy.typing import ArrayLike, NDArray

from wacc_ref.errors import (
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    ZeroTotalWeightError,
)
from wacc_ref.formats import FORMATS, WORK_DTYPES, Format, conv_to, get_format, round_to

__all__ = [
    "KINDS",
    "TOLERANCES",
    "BoundArgumentError",
    "DtypeTolerance",
    "error_ratio",
    "gamma",
    "window_error_bound",
]

KINDS: tuple[str, ...] = ("sum", "mean")
"""The accumulate kinds a window can be made of (``accumulate_sum`` / ``accumulate_mean``)."""

_FLOAT64_MAX = float.fromhex("0x1.fffffffffffffp+1023")
_FLOAT64_MIN_SUBNORMAL = float.fromhex("0x1p-1074")
_FLOAT64_EPSILON = float.fromhex("0x1p-52")  # 2 u for float64
_PRESELECTION_FLOOR = float.fromhex("0x1p-900")  # float ratios above it carry <= 2 ulps of error

# Exact rationals for the per-window scalars (mypy sees Any: gmpy2 ships no stubs).
_Q = gmpy2.mpq
_ZERO = _Q(0)
_ONE = _Q(1)


class BoundArgumentError(ValueError):
    """An argument of this module that is neither a weight, a loss scale nor a shape mismatch."""


@dataclass(frozen=True)
class DtypeTolerance:
    """Rounding constants of one work dtype ``D`` and of ``op(D)`` (semantics §2), exactly.

    Every tolerance in the suite is built from these fields; nothing types ``2**-11`` by hand.
    """

    dtype: str  # torch spelling of D
    unit_roundoff: float  # u_D = 2**-p
    underflow_unit: float  # η_D = min_subnormal / 2 rounded UP to a float (float64: 2**-1074)
    underflow_unit_exact: Fraction  # η_D exactly (2**-1075 for float64 is not a float)
    op_dtype: str  # op(D): float64 for float64, float32 otherwise
    op_unit_roundoff: float  # u_op
    op_underflow_unit_exact: Fraction  # η_op exactly
    max_finite: float  # largest finite value of D
    min_normal: float  # smallest normal value of D
    converts_through_float32: bool  # conv_D rounds a float64 twice, through float32 (float16, bf16)


def _round_up(value: Any) -> float:
    """The smallest float64 >= ``value`` (a Fraction or mpq), or +inf beyond the float64 range."""
    try:
        nearest = float(value)  # correctly rounded for Fraction and mpq; checked below anyway
    except OverflowError:
        nearest = math.inf if value > 0 else -math.inf
    if nearest == math.inf:
        return nearest
    if nearest == -math.inf:
        return -_FLOAT64_MAX  # value <= -(max + half an ulp) < -max
    if value > nearest:  # exact comparison of a rational with a float
        return math.nextafter(nearest, math.inf)
    return nearest


def _round_down(value: Any) -> float:
    """The largest float64 <= ``value`` (a Fraction or mpq), or -inf below the float64 range."""
    return -_round_up(-value)


def _make_tolerance(fmt: Format) -> DtypeTolerance:
    op = FORMATS["float64"] if fmt.name == "float64" else FORMATS["float32"]
    underflow_exact = Fraction(fmt.min_subnormal) / 2
    return DtypeTolerance(
        dtype=fmt.name,
        unit_roundoff=fmt.unit_roundoff,
        underflow_unit=_round_up(underflow_exact),
        underflow_unit_exact=underflow_exact,
        op_dtype=op.name,
        op_unit_roundoff=op.unit_roundoff,
        op_underflow_unit_exact=Fraction(op.min_subnormal) / 2,
        max_finite=fmt.max_finite,
        min_normal=fmt.min_normal,
        converts_through_float32=fmt.name in ("float16", "bfloat16"),
    )


TOLERANCES: Mapping[str, DtypeTolerance] = MappingProxyType(
    {name: _make_tolerance(FORMATS[name]) for name in WORK_DTYPES}
)
"""THE tolerance table of the suite, keyed by work dtype (float64, float32, float16, bfloat16)."""


def _tolerance(dtype: object) -> DtypeTolerance:
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a work dtype name (str), got {dtype!r}")
    get_format(dtype)  # an unknown name raises UnknownFormatError naming it
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise BoundArgumentError(
            f"dtype {dtype!r} is not a work dtype; work dtypes are {', '.join(WORK_DTYPES)}"
        ) from None


def gamma(n: int, dtype: str) -> float:
    """Higham's ``γ_n = n u / (1 - n u)`` for ``dtype``'s unit roundoff, rounded up to a float.

    ``dtype`` is any format name of :data:`wacc_ref.formats.FORMATS`.  Raises ``ValueError`` when
    ``n < 0`` or ``n u >= 1`` (γ_n is then undefined), ``TypeError`` for a non-int ``n``.
    """
    fmt = get_format(dtype)
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"gamma needs an int n, got {n!r} ({type(n).__name__})")
    if n < 0:
        raise ValueError(f"gamma needs n >= 0, got n={n}")
    n_u = n * Fraction(fmt.unit_roundoff)
    if n_u >= 1:
        raise ValueError(
            f"gamma({n}, {fmt.name!r}) is undefined: n*u = {n}*{fmt.unit_roundoff.hex()} >= 1"
        )
    return _round_up(n_u / (1 - n_u))


# --- per-element classification -------------------------------------------------------------


def _representable(values: NDArray[np.float64], fmt: Format) -> NDArray[np.bool_]:
    """Whether each finite float64 in ``values`` is exactly a value of ``fmt`` (vectorized)."""
    _, exponent = np.frexp(values)  # values = f * 2**exponent, 0.5 <= |f| < 1 (f = 0 at zero)
    leading = exponent.astype(np.int64) - 1
    quantum_exp = np.maximum(leading, fmt.emin) - (fmt.precision - 1)
    # A power-of-two scaling, exact: it either leaves |value| >= 2**(p-1) (normal range of fmt)
    # or scales up (subnormal range of fmt).  The result is an integer iff the value is in fmt.
    scaled = np.ldexp(values, (-quantum_exp).astype(np.int32))
    is_integer: NDArray[np.bool_] = scaled == np.floor(scaled)
    return is_integer & (np.abs(values) <= fmt.max_finite)


def _conversion_case(values: NDArray[np.float64], tol: DtypeTolerance) -> NDArray[np.intp]:
    """Per element: 0 = conv_D exact, 1 = one rounding, 2 = two roundings (through float32)."""
    if tol.dtype == "float64":
        return np.zeros(values.shape, dtype=np.intp)
    in_target = _representable(values, FORMATS[tol.dtype])
    if not tol.converts_through_float32:
        return np.where(in_target, 0, 1).astype(np.intp)
    in_float32 = _representable(values, FORMATS["float32"])
    return np.where(in_target, 0, np.where(in_float32, 1, 2)).astype(np.intp)


# --- the exact per-window scalars -----------------------------------------------------------


def _q(value: Fraction | float | int) -> Any:
    """``value`` as an exact mpq."""
    if isinstance(value, Fraction):
        return _Q(value.numerator, value.denominator)
    return _Q(value)


@dataclass(frozen=True)
class _Rounding:
    """One rounding ``x (1 + δ) + ε`` with ``|δ| <= rel``, ``|ε| <= absolute`` (exact mpq)."""

    rel: Any
    absolute: Any


_EXACT = _Rounding(_ZERO, _ZERO)


@dataclass(frozen=True)
class _Constants:
    """u, η of D and of op(D) (0 when op(D) == D: no second rounding) as exact mpq."""

    u: Any
    eta: Any
    u_op: Any
    eta_op: Any


@functools.cache
def _constants(dtype: str) -> _Constants:
    tol = TOLERANCES[dtype]
    op_differs = tol.op_dtype != tol.dtype
    return _Constants(
        u=_q(tol.unit_roundoff),
        eta=_q(tol.underflow_unit_exact),
        u_op=_q(tol.op_unit_roundoff) if op_differs else _ZERO,
        eta_op=_q(tol.op_underflow_unit_exact) if op_differs else _ZERO,
    )


@dataclass(frozen=True)
class _TermFactors:
    """Term j after the last step: factor in ``[lower, upper]``, abs error ``a_m * m + a_0``."""

    upper: Any
    lower: Any
    abs_per_multiplier: Any
    abs_constant: Any


def _is_power_of_two(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


def _scaling_rounding(
    factor_is_power_of_two: bool, factor_at_least_one: bool, rel: Any, eta: Any
) -> _Rounding:
    """Rounding of ``x * factor``, ``x`` already in the target format (E3 of the docstring)."""
    if factor_is_power_of_two:
        return _EXACT if factor_at_least_one else _Rounding(_ZERO, eta)
    return _Rounding(rel, eta)


@functools.cache
def _conversion_roundings(dtype: str) -> tuple[tuple[Any, Any, Any], ...]:
    """``(U_c, L_c, B_c)`` for each conversion case (Step 1 of the module docstring)."""
    tol = TOLERANCES[dtype]
    c = _constants(dtype)
    cases = [(_ONE, _ONE, _ZERO)]
    if tol.dtype == "float64":
        return tuple(cases)
    cases.append((1 + c.u, 1 - c.u, c.eta))
    if tol.converts_through_float32:
        u32 = _q(FORMATS["float32"].unit_roundoff)
        eta32 = _q(FORMATS["float32"].min_subnormal) / 2
        cases.append(((1 + u32) * (1 + c.u), (1 - u32) * (1 - c.u), eta32 * (1 + c.u) + c.eta))
    return tuple(cases)


@functools.cache
def _term_factors(
    dtype: str, kind: str, steps_after: int, first: bool, case: int, multiplier_class: int
) -> _TermFactors:
    """Factors of one term after the whole window (Step 2 of the module docstring).

    ``multiplier_class``: 0 = ``m`` a power of two >= 1 (and every sum: no product), 1 = a power
    of two below 1, 2 = anything else.  ``steps_after`` = ``K - j``.
    """
    c = _constants(dtype)
    conv_upper, conv_lower, conv_abs = _conversion_roundings(dtype)[case]
    op_differs = c.u_op != 0

    # Each variant: (U_n, L_n, a_m, a_0) of the new term at this step.
    variants: list[tuple[Any, Any, Any, Any]] = []
    if kind == "sum":
        if first:  # +0 + conv is exact in every variant (E4, E1)
            variants.append((conv_upper, conv_lower, conv_abs, _ZERO))
        else:  # buf + conv: two values of D, so no underflow term in D nor in op(D) (E2)
            for extra in (_ZERO, c.u_op):  # two-step and FMA; op-then-D
                grow, shrink = (1 + extra) * (1 + c.u), (1 - extra) * (1 - c.u)
                variants.append((conv_upper * grow, conv_lower * shrink, conv_abs * grow, _ZERO))
    else:
        product = (_EXACT, _Rounding(_ZERO, c.eta), _Rounding(c.u, c.eta))[multiplier_class]
        product_op = (_EXACT, _Rounding(_ZERO, c.eta_op), _Rounding(c.u_op, c.eta_op))[
            multiplier_class
        ]
        # Two-step: t = round_D(conv*m); the first step's +0 + t is exact (E4), a later
        # buf + t is a sum of two values of D (E2): one more (1 + u), no underflow term.
        # The FMA's first step round_D(+0 + conv*m) is this same t.
        add_up = _ONE if first else 1 + c.u
        add_down = _ONE if first else 1 - c.u
        variants.append(
            (
                conv_upper * (1 + product.rel) * add_up,
                conv_lower * (1 - product.rel) * add_down,
                conv_abs * (1 + product.rel) * add_up,
                product.absolute * add_up,
            )
        )
        if not first:  # FMA: round_D(buf + conv*m), one rounding
            variants.append(
                (conv_upper * (1 + c.u), conv_lower * (1 - c.u), conv_abs * (1 + c.u), c.eta)
            )
        if op_differs:  # op-then-D: round_D(round_op(buf + conv*m))
            inner = product_op if first else _Rounding(c.u_op, c.eta_op)
            outer = product if first else _Rounding(c.u, c.eta)
            grow = (1 + inner.rel) * (1 + outer.rel)
            shrink = (1 - inner.rel) * (1 - outer.rel)
            variants.append(
                (
                    conv_upper * grow,
                    conv_lower * shrink,
                    conv_abs * grow,
                    inner.absolute * (1 + outer.rel) + outer.absolute,
                )
            )
    # Later steps multiply buf by (1 + δ) (two-step, FMA) or (1 + δ_op)(1 + δ) (op-then-D).
    propagate_up = ((1 + c.u_op) * (1 + c.u)) ** steps_after
    propagate_down = ((1 - c.u_op) * (1 - c.u)) ** steps_after
    return _TermFactors(
        upper=max(v[0] for v in variants) * propagate_up,
        lower=min(v[1] for v in variants) * propagate_down,
        abs_per_multiplier=max(v[2] for v in variants) * propagate_up,
        abs_constant=max(v[3] for v in variants) * propagate_up,
    )


# --- input validation -----------------------------------------------------------------------


def _exact_number(value: object, what: str) -> float | int:
    """A real scalar as a Python float or int holding its exact value (finite)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, np.floating) and value.dtype.itemsize > 8:
        raise TypeError(f"{what} {value!r} has more than float64 precision")
    as_float = float(value)
    if not math.isfinite(as_float):
        raise ValueError(f"{what} must be finite, got {as_float!r}")
    return as_float


def _check_loss_scale(loss_scale: object, tol: DtypeTolerance) -> float:
    try:
        scale = _exact_number(loss_scale, "loss_scale")
    except (TypeError, ValueError) as exc:
        raise InvalidLossScaleError(f"invalid loss_scale for {tol.dtype}: {exc}") from None
    in_dtype = round_to(scale, tol.dtype)
    if not scale > 0 or in_dtype != scale:
        raise InvalidLossScaleError(
            f"loss_scale {loss_scale!r} is not a finite value > 0 exactly representable in "
            f"{tol.dtype} (it rounds to {in_dtype!r})"
        )
    return in_dtype


def _effective_weight(weight: object, index: int, kind: str, tol: DtypeTolerance) -> float | int:
    """The weight §5/§6 count: ``w`` (sum) or ``w_D = conv_D(w)`` (mean); 0 for ``w == 0``.

    A float when the value is a float64 (always for means), else the exact int.
    """
    try:
        exact = _exact_number(weight, f"weights[{index}]")
    except ValueError as exc:
        raise InvalidWeightError(str(exc)) from None
    if exact < 0:
        raise InvalidWeightError(f"weights[{index}] = {weight!r} is negative")
    if exact == 0:
        return 0.0
    if kind == "sum":
        # round_to, not float(): an int beyond float64's range is a valid (finite) weight, and
        # float() would raise OverflowError for it.  Ŵ then overflows: no bound (see below).
        if isinstance(exact, int) and round_to(exact, "float64") == exact:
            return float(exact)
        return exact
    converted = conv_to(exact, tol.dtype)
    if converted == 0 or not math.isfinite(converted):
        raise InvalidWeightError(
            f"weights[{index}] = {weight!r} does not survive {tol.dtype}: "
            f"conv_D gives {converted!r}"
        )
    return converted


# --- the bound ------------------------------------------------------------------------------


def _inflate(computed: NDArray[np.float64], operations: int) -> NDArray[np.float64]:
    """An upper bound of the exact value of a non-negative sum of products computed in
    ``operations`` float64 steps (see "Evaluating the bound" in the module docstring)."""
    inflation = 1.0 + (operations + 2) * _FLOAT64_EPSILON  # exact for any realistic count
    underflow_cover = (operations + 1) * _FLOAT64_MIN_SUBNORMAL  # an exact subnormal
    result: NDArray[np.float64] = computed * inflation + underflow_cover
    return result


@dataclass(frozen=True)
class _NormalizedScalars:
    """The window-level constants of Step 3 (module docstring), all exact."""

    inverse_scaled_weight: Any  # 1 / (S W)
    psi_upper: Any  # ψ U_Δ
    psi_lower: Any  # ψ L_Δ
    constant: Any  # η_1 (1 + u_2)(1 + u_3)/W_op + η_2 (1 + u_3) + η_3
    threshold: Any  # M must not exceed this


def _normalized_scalars(
    tol: DtypeTolerance, scale: float, counted_weights: list[float | int]
) -> _NormalizedScalars | None:
    """Ŵ, W_op, ψ and the division constants; None when Ŵ or W_op is not finite and positive."""
    running = 0.0
    for weight in counted_weights:  # semantics §3: W <- round_64(W + w_eff), in issue order
        if isinstance(weight, float):
            running = running + weight  # IEEE addition of two float64: exactly round_64(W + w)
        else:
            running = round_to(Fraction(running) + weight, "float64")
    weight_op = round_to(running, tol.op_dtype)
    if not (math.isfinite(running) and math.isfinite(weight_op) and weight_op > 0):
        return None
    exact_weight = sum((_q(w) for w in counted_weights), _ZERO)
    weight_op_exact = _q(weight_op)
    scale_exact = _q(scale)
    psi = exact_weight / weight_op_exact

    c = _constants(tol.dtype)
    u_op, eta_op = _q(tol.op_unit_roundoff), _q(tol.op_underflow_unit_exact)
    scale_pow2 = _is_power_of_two(scale)
    weight_pow2 = _is_power_of_two(weight_op)
    # y = round_D(buf / S): buf * (1/S), and 1/S >= 1 iff S <= 1.
    first = _scaling_rounding(scale_pow2, scale <= 1, c.u, c.eta)
    # q = round_op(y / W_op), y in D, hence in op(D).
    second = _scaling_rounding(weight_pow2, weight_op <= 1, u_op, eta_op)
    if tol.op_dtype == tol.dtype or second == _EXACT:
        third = _EXACT  # round_D of an op(D) value is the identity; or q = y * 2**k is in D
    elif weight_pow2:
        third = _Rounding(_ZERO, c.eta)  # q = y * 2**-k: at most p bits, only underflow (E3)
    else:
        third = _Rounding(c.u, c.eta)
    delta_upper = (1 + first.rel) * (1 + second.rel) * (1 + third.rel)
    delta_lower = (1 - first.rel) * (1 - second.rel) * (1 - third.rel)
    constant = (
        first.absolute * (1 + second.rel) * (1 + third.rel) / weight_op_exact
        + second.absolute * (1 + third.rel)
        + third.absolute
    )
    max_finite = _q(tol.max_finite)
    quotient_limit = (
        ((max_finite - second.absolute) * weight_op_exact / (1 + second.rel) - first.absolute)
        * scale_exact
        / (1 + first.rel)
    )
    return _NormalizedScalars(
        inverse_scaled_weight=1 / (scale_exact * exact_weight),
        psi_upper=psi * delta_upper,
        psi_lower=psi * delta_lower,
        constant=constant,
        threshold=min(max_finite, max_finite * scale_exact, quotient_limit),
    )


def _term_entries(
    tol: DtypeTolerance,
    kind: str,
    multiplier: float,
    steps_after: int,
    first: bool,
    case: int,
    scalars: _NormalizedScalars | None,
) -> tuple[float, float, float, float]:
    """Per-element coefficients of one term, rounded up: error rate (times |g|), absolute error,
    magnitude rate (times |g|), absolute magnitude (Steps 2-3 of the module docstring)."""
    m_exact = _q(multiplier)
    cls = 0 if kind == "sum" else _multiplier_class(multiplier)
    f = _term_factors(tol.dtype, kind, steps_after, first, case, cls)
    abs_error = f.abs_per_multiplier * m_exact + f.abs_constant  # A_j
    if scalars is not None:
        kappa = max(f.upper * scalars.psi_upper - 1, 1 - f.lower * scalars.psi_lower)
        rate = _round_up(kappa * m_exact * scalars.inverse_scaled_weight)
        absolute = _round_up(abs_error * scalars.psi_upper * scalars.inverse_scaled_weight)
    else:
        rate = _round_up(max(f.upper - 1, 1 - f.lower) * m_exact)
        absolute = _round_up(abs_error)
    return rate, absolute, _round_up(f.upper * m_exact), _round_up(abs_error)


def _multiplier_class(multiplier: float) -> int:
    if _is_power_of_two(multiplier):
        return 0 if multiplier >= 1 else 1
    return 2


def window_error_bound(
    *,
    kind: str | Sequence[str],
    grads: Sequence[ArrayLike | None],
    weights: Sequence[float],
    dtype: str,
    loss_scale: float,
    normalized: bool = True,
) -> NDArray[np.float64]:
    """Per-element bound on ``|result - exact|`` for one finished window (semantics §12.2).

    ``grads[k]`` and ``weights[k]`` are microbatch ``k`` in issue order: the gradient values as
    handed in (any float dtype; read exactly as float64) and the weight ``w``.  A ``None`` gradient
    is a zero contribution; a zero-weight batch is skipped and its gradient never read.  ``kind``
    is ``"sum"`` or ``"mean"`` for the whole window, or one of them per microbatch (a window may
    mix ``accumulate_sum`` and ``accumulate_mean``: the derivation is per term, and a sum term is
    the mean term with no product).  ``normalized=True`` bounds ``finish_mean()`` against
    ``Σ c_k / S / W``; ``normalized=False`` bounds the ``finish_sums()`` buffer against ``Σ c_k``.
    The bound holds for the two-step order and every fused variant of §6 (the derivation is
    the module docstring).  Elements where an intermediate may overflow, or whose gradient is
    NaN/±inf in a positive-weight batch, get ``+inf`` (no bound).

    Raises ``InvalidLossScaleError``, ``InvalidWeightError`` (negative/non-finite weight, or a mean
    weight that does not survive ``D``), ``ParameterMismatchError`` (gradient shapes differ),
    ``ZeroTotalWeightError`` (``normalized=True`` with no positive weight),
    ``BoundArgumentError`` (unknown kind or non-work dtype, lengths differ, no gradient array in
    a positive-weight batch to take the shape from).
    """
    tol = _tolerance(dtype)
    kinds = [kind] * len(weights) if isinstance(kind, str) else list(kind)
    for each in kinds:
        if each not in KINDS:
            raise BoundArgumentError(f"kind must be one of {KINDS}, got {each!r}")
    if len(kinds) != len(weights):
        raise BoundArgumentError(
            f"kinds and weights differ in length: {len(kinds)} kinds, {len(weights)} weights"
        )
    if not isinstance(normalized, bool):
        raise TypeError(f"normalized must be a bool, got {normalized!r}")
    scale = _check_loss_scale(loss_scale, tol)
    if len(grads) != len(weights):
        raise BoundArgumentError(
            f"grads and weights differ in length: {len(grads)} gradients, {len(weights)} weights"
        )
    effective = [_effective_weight(w, k, kinds[k], tol) for k, w in enumerate(weights)]
    positive = [k for k, w in enumerate(effective) if w > 0]

    shape: tuple[int, ...] | None = None
    arrays: list[NDArray[np.float64] | None] = []
    for k in positive:
        grad = grads[k]
        if grad is None:
            arrays.append(None)
            continue
        raw = np.asarray(grad)
        if not _real_float_dtype(raw.dtype) or raw.dtype.itemsize > 8:
            raise BoundArgumentError(
                f"grads[{k}] has dtype {raw.dtype}; a float array of at most 64 bits is needed"
            )
        array = raw.astype(np.float64)
        if shape is None:
            shape = array.shape
        elif array.shape != shape:
            raise ParameterMismatchError(
                f"grads[{k}] has shape {array.shape}, the window's earlier gradients {shape}"
            )
        arrays.append(array)
    if normalized and not positive:
        raise ZeroTotalWeightError(
            f"no positive weight among {len(weights)} microbatches: W == 0, nothing to normalize"
        )
    if shape is None:
        raise BoundArgumentError(
            "no gradient array in a positive-weight batch: the finished gradient is None "
            "(or the window is empty), there is no element to bound"
        )

    count = len(positive)
    multipliers = [1.0 if kinds[k] == "sum" else float(effective[k]) for k in positive]
    term_kinds = [kinds[k] for k in positive]
    n_cases = len(_conversion_roundings(tol.dtype))
    scalars: _NormalizedScalars | None = None
    if normalized:
        scalars = _normalized_scalars(tol, scale, [effective[k] for k in positive])
        if scalars is None:  # Ŵ or W_op is not a finite positive number: no bound anywhere
            return np.full(shape, math.inf)
        constant = scalars.constant
        threshold = scalars.threshold
    else:
        constant = _ZERO
        threshold = _q(tol.max_finite)

    # Per element, a zero contribution (g == 0 or a None gradient) is no step at all (E5): only
    # the nonzero ones count, and the first nonzero one meets buf == 0 (E4).
    nonzero = [
        np.zeros(shape, dtype=bool) if array is None else array != 0.0  # NaN counts as nonzero
        for array in arrays
    ]
    later_counts = [np.zeros(shape, dtype=np.intp) for _ in arrays]
    for j in range(count - 2, -1, -1):
        later_counts[j] = later_counts[j + 1] + nonzero[j + 1]
    seen_before = np.zeros(shape, dtype=bool)

    bound_sum = np.zeros(shape)
    magnitude_sum = np.zeros(shape)
    not_applicable = np.zeros(shape, dtype=bool)
    for j, maybe_array in enumerate(arrays):
        first = ~seen_before
        seen_before = seen_before | nonzero[j]
        if maybe_array is None:
            continue
        array = maybe_array
        finite = np.isfinite(array)
        magnitude = np.where(finite, np.abs(array), 0.0)
        not_applicable |= ~finite | (magnitude > tol.max_finite)
        case = _conversion_case(np.where(finite, array, 0.0), tol)
        # One code per (first, later steps, conversion case): the factor tables are per code.
        code = (first * count + later_counts[j]) * n_cases + case
        codes = np.unique(code[nonzero[j]])
        if codes.size == 0:
            continue  # every element of this gradient is zero: no step anywhere
        table = np.zeros((4, codes.size))
        for column, value in enumerate(codes.tolist()):
            first_code, case_code = divmod(value, n_cases)
            is_first, steps_after = divmod(first_code, count)
            table[:, column] = _term_entries(
                tol, term_kinds[j], multipliers[j], steps_after, bool(is_first), case_code, scalars
            )
        where = np.searchsorted(codes, code)
        # Non-finite elements are already refused; keeping them out avoids 0 * inf.
        counted = nonzero[j] & finite
        entries = np.where(counted, table[:, np.minimum(where, codes.size - 1)], 0.0)
        rate, absolute, size, size_absolute = entries
        with np.errstate(over="ignore"):  # an overflow gives +inf: still an upper bound
            bound_sum += magnitude * rate
            bound_sum += absolute
            magnitude_sum += magnitude * size
            magnitude_sum += size_absolute
    operations = 3 * count + 1
    with np.errstate(over="ignore"):
        bound_sum += _round_up(constant)
        bound = _inflate(bound_sum, operations)
        magnitude_bound = _inflate(magnitude_sum, operations)
    not_applicable |= magnitude_bound > _round_down(threshold)
    not_applicable |= np.isnan(bound)  # 0 * inf from an infinite rate: no finite bound known
    result: NDArray[np.float64] = np.where(not_applicable, math.inf, bound)
    return result


# --- comparing against a bound ----------------------------------------------------------------


def _exact_value(value: Any) -> Fraction | None:
    """The exact value of a float/int/Fraction/mpmath number; None for NaN and ±inf."""
    if isinstance(value, Fraction):
        return value
    if isinstance(value, mpmath.mpf):
        if not mpmath.isfinite(value):
            return None
        # The raw (sign, mantissa, exponent, bitcount) tuple: exact (man_exp drops the sign).
        sign, mantissa, exponent, _ = value._mpf_
        magnitude = Fraction(int(mantissa)) * Fraction(2) ** int(exponent)
        return -magnitude if sign else magnitude
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"expected a real number, got the bool {value!r}")
    # float() also reads "1.5", timedeltas and objects with __float__ (a Decimal, inexactly).
    # Raw bytes and record scalars (np.void, np.record) report kind "V" like ml_dtypes' floats.
    if isinstance(value, str | bytes | np.void) or (
        isinstance(value, np.generic) and value.dtype.kind not in "fiuV"
    ):
        raise TypeError(f"expected a real number, got {value!r} ({type(value).__name__})")
    if isinstance(value, int | np.integer):
        return Fraction(int(value))
    if isinstance(value, np.floating) and value.dtype.itemsize > 8:
        raise TypeError(f"{value!r} is a {value.dtype} wider than float64: not read exactly")
    if isinstance(value, float | np.floating) or (
        isinstance(value, np.generic) and value.dtype.kind == "V"
    ):
        as_float = float(value)
        return Fraction(as_float) if math.isfinite(as_float) else None
    try:  # ml_dtypes scalars (bfloat16, float8): exactly a float64
        as_float = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"expected a real number, got {value!r} ({type(value).__name__})") from None
    return Fraction(as_float) if math.isfinite(as_float) else None


def _real_float_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is a real binary float: numpy's, or one of ml_dtypes' (bfloat16,
    float8, ...). Those report kind "V", and so do raw bytes (np.void), record arrays (np.record,
    a subclass), ml_dtypes' integers (int4, ...: no finfo) and its complex bcomplex32 (whose finfo
    is its real part's)."""
    if dtype.kind == "f":
        return True
    if dtype.kind != "V" or issubclass(dtype.type, np.void):
        return False
    try:
        return bool(ml_dtypes.finfo(dtype).dtype == dtype)
    except (TypeError, ValueError):
        return False


def _as_float64(array: NDArray[Any]) -> NDArray[np.float64] | None:
    """The array as float64 when its dtype is a float format (exact), else None."""
    if array.dtype == object or array.dtype.kind not in "fiuV":
        return None
    if array.dtype.kind in "iu" and array.dtype.itemsize > 4:
        return None  # int64 values may not be float64 values
    try:
        converted: NDArray[np.float64] = array.astype(np.float64)
    except (TypeError, ValueError):
        return None
    return converted


def error_ratio(observed: ArrayLike, exact: ArrayLike | Sequence[Any], bound: ArrayLike) -> float:
    """``max |observed - exact| / bound`` over the elements, computed exactly, as a float.

    ``observed`` is a result (any float dtype), ``exact`` the real-number reference (floats, or
    an object array of ``Fraction``/``mpmath.mpf``), ``bound`` from :func:`window_error_bound`.
    Per element: ``bound == +inf`` (no bound applies) counts 0; ``0/0`` counts 0; a positive error
    over a zero bound, or a NaN/±inf ``observed`` where the bound is finite, counts ``+inf``.
    ``ValueError`` for a NaN or negative bound, a non-finite ``exact`` where the bound is finite,
    or shapes that differ.  The result is the exact maximum ratio rounded *up* to a float (to
    nearest, a ratio of 1 + 2**-60 would read 1.0), so ``error_ratio(...) <= 1`` exactly when
    every error is within its bound.  0.0 when empty.
    """
    obs = np.asarray(observed)
    ref = np.asarray(exact)
    lim = np.asarray(bound, dtype=np.float64)
    if not (obs.shape == ref.shape == lim.shape):
        raise ValueError(
            f"shapes differ: observed {obs.shape}, exact {ref.shape}, bound {lim.shape}"
        )
    invalid = np.isnan(lim) | (lim < 0)
    if invalid.any():
        bad = int(np.flatnonzero(invalid)[0])
        raise ValueError(f"bound element {bad} is {lim.flat[bad]!r}: bounds are >= 0, never NaN")
    candidates = np.flatnonzero(np.isfinite(lim))
    obs64, ref64 = _as_float64(obs), _as_float64(ref)
    if obs64 is not None and ref64 is not None and candidates.size:
        # Float pre-selection: the float ratio is within a few ulps of the exact one, so only
        # elements within 2**-40 of the largest float ratio (or non-finite ones) can be the max.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            diff = np.abs(obs64.flat[candidates] - ref64.flat[candidates])
            approx = np.where(diff == 0, 0.0, diff / lim.flat[candidates])
        suspicious = ~np.isfinite(approx)
        if not suspicious.any():
            top = approx.max()
            if top >= _PRESELECTION_FLOOR:  # below it, quotients may be subnormal: check all
                suspicious = approx >= top * (1 - float.fromhex("0x1p-40"))
            else:
                suspicious = np.ones(approx.shape, dtype=bool)
        candidates = candidates[suspicious]
    worst = Fraction(0)
    for index in candidates:
        limit = Fraction(float(lim.flat[index]))
        reference = _exact_value(ref.flat[index])
        if reference is None:
            raise ValueError(
                f"exact element {index} is {ref.flat[index]!r} where the bound "
                f"{float(lim.flat[index]).hex()} is finite: the exact value must be a real number"
            )
        value = _exact_value(obs.flat[index])
        if value is None:
            return math.inf
        error = abs(value - reference)
        if error == 0:
            continue
        if limit == 0:
            return math.inf
        worst = max(worst, error / limit)
    return _round_up(worst)  # +inf beyond the float64 range
