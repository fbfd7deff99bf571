"""The error bound of a reduced mean across ranks, derived from its operation sequence."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from wacc_ref.bounds import TOLERANCES, gamma


def reduced_mean_bound(
    *,
    exact_sum: Fraction,
    rank_sum_bounds: Sequence[Fraction],
    rank_buffers_abs: Fraction,
    exact_weight: Fraction,
    weight_op: Fraction,
    loss_scale: float,
    dtype_name: str,
) -> Fraction:
    """Bound on |out - X/(S W)| where ``out = round_D(round_op(round_D(s / S) / W_op))``,
    ``s`` the SUM across the ``R = len(rank_sum_bounds)`` ranks of their buffers ``buf_r`` and
    ``|buf_r - X_r| <= B_r`` (``rank_sum_bounds``, from
    :func:`wacc_ref.bounds.window_error_bound` with ``normalized=False``), ``X = Σ X_r``;
    ``rank_buffers_abs`` is ``Σ |buf_r|`` (the actual buffers).

    Standard model with gradual underflow (Higham §2.1), ``S`` a power of two > 1.  The SUM: one
    rank: ``s = buf_0``; two ranks: ``s = (buf_0 + buf_1)(1 + δ_s)``, ``|δ_s| <= u``; more ranks,
    in whatever association order the backend uses: ``s = Σ buf_r + e_s``,
    ``|e_s| <= γ_{R-1} Σ |buf_r|`` (Higham (4.4)); sums of D values have no underflow term.
    Then ``y = s / S + ε_1``, ``|ε_1| <= η`` (scaling by a power of two only underflows);
    ``q = (y / W_op)(1 + δ_2) + ε_2``, ``|δ_2| <= u_op``, ``|ε_2| <= η_op``;
    ``out = q (1 + δ_3) + ε_3``, ``|δ_3| <= u``, ``|ε_3| <= η`` (both 0 when op(D) = D).
    With ``ψ = W / W_op``, ``Δ`` the product of the ``(1 + δ)`` factors in ``[L, U]`` and
    ``e = Σ buf_r - X``: ``out - X/(S W) = X (ψ Δ - 1)/(S W) + (e + e_s) ψ Δ/(S W)
    + ε_1 (1 + δ_2)(1 + δ_3)/W_op + ε_2 (1 + δ_3) + ε_3``, hence the bound below.  Computed
    exactly.
    """
    ranks = len(rank_sum_bounds)
    tolerance = TOLERANCES[dtype_name]
    u = Fraction(tolerance.unit_roundoff)
    eta = tolerance.underflow_unit_exact
    u_op = Fraction(tolerance.op_unit_roundoff)
    eta_op = tolerance.op_underflow_unit_exact
    u_3, eta_3 = (Fraction(0), Fraction(0)) if tolerance.op_dtype == dtype_name else (u, eta)
    u_s = u if ranks == 2 else Fraction(0)
    sum_error = Fraction(gamma(ranks - 1, dtype_name)) * rank_buffers_abs if ranks > 2 else 0
    scale = Fraction(loss_scale)
    psi = exact_weight / weight_op
    upper = psi * (1 + u_s) * (1 + u_op) * (1 + u_3)
    lower = psi * (1 - u_s) * (1 - u_op) * (1 - u_3)
    return (
        abs(exact_sum) * max(upper - 1, 1 - lower) / (scale * exact_weight)
        + (sum(rank_sum_bounds, Fraction(0)) + sum_error) * upper / (scale * exact_weight)
        + eta * (1 + u_op) * (1 + u_3) / weight_op
        + eta_op * (1 + u_3)
        + eta_3
    )
