r"""A float64 numpy fast path for the exact result of semantics §12.2, with a proved error bound.

:class:`Float64Accumulator` computes what the ``exact`` mode of
:class:`~wacc_ref.accumulator.ReferenceAccumulator` computes — contributions ``c_k = g_k`` (sums)
or ``g_k * w_D`` (means, ``w_D = conv_D(w)``) on the gradients as handed in, ``W`` the sum of the
counted weights, result ``sum_k c_k / S / W`` — but in plain float64 numpy arithmetic, so it
scales to large tensors.  Each result comes with a per-element bound on its distance from the
exact real result.

Operation sequence, per element (``fl`` is float64 round-to-nearest):
``p_k = fl(g_k * w_k)`` (means; ``p_k = g_k`` exactly for sums), ``s = fl(...fl(p_1 + p_2)...)``
(recursive summation in issue order), ``Ŵ`` the float64 recursive sum of the ``m`` counted
weights, ``out = fl(fl(s / S) / Ŵ)``.

Error bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §2.2 and
Lemma 3.1, with the underflow model ``fl(x op y) = (x op y)(1 + δ) + η``, ``|δ| <= u``,
``|η| <= η0 = 2**-1075``, where ``η != 0`` only for products and quotients — a sum that lands in
the subnormal range is exact).  With ``u = 2**-53``, ``γ_j = j u / (1 - j u)``, ``n`` the number
of contributions the element received and ``m >= n`` the number of counted weights:

* ``s = Σ_k (c_k (1 + δ_k) + η_k)(1 + θ_{n-1}^{(k)})``;
* ``Ŵ = W (1 + ε)`` with ``1 + ε`` a positive-weighted mean of products of ``m - 1`` factors
  ``1 ± u``, so ``1 / (1 + ε)`` is such a product of ``m - 1`` factors ``(1 + δ)^-1``;
* every ``c_k`` therefore reaches ``out`` multiplied by ``1 + θ_j`` with
  ``j = 1 + (n - 1) + 2 + (m - 1) = n + m + 1`` factors, ``|θ_j| <= γ_j`` (Lemma 3.1), so

  ``|out - Σ c_k / (S W)| <= γ_{n+m+1} A / (S W) + η0 (1 + γ_{n+m+1}) (n / (S W) + 1 / W + 1)``

  with ``A = Σ_k |c_k|``, provided no step overflows (a finite ``out`` with finite ``Ŵ``
  guarantees that).

The computable form replaces the unknowns by upper bounds: ``A <= (Â / (1 - γ_{n-1}) + n η0)
/ (1 - u)`` where ``Â`` is the float64 recursive sum of ``|p_k|``, and ``1 / W <= (1 +
γ_{m-1}) / Ŵ``.  The bound itself is evaluated in float64 on non-negative terms (at most 20
operations: relative error below ``γ_20 < 2**-48``, covered by the factor ``1 + 2**-45``), and
its absolute term uses ``8 η0 = 2**-1072`` instead of ``η0`` to cover underflow while evaluating
it.  For ``finish_sums`` (no division) the same argument gives
``|s - Σ c_k| <= γ_n A + n η0 (1 + γ_n)``.  Elements whose bound cannot be established
(an overflow: non-finite ``out`` or ``Ŵ``) get the bound ``inf``.

Gradients must be finite (the real-number semantics has no NaN or inf):
:class:`~wacc_ref.errors.ExactModeError` otherwise.  Weights, loss scale and parameters are
validated as in the accumulator; a raise leaves the state unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from wacc_ref.bounds import TOLERANCES, gamma
from wacc_ref.errors import ZeroTotalWeightError
from wacc_ref.formats import Format
from wacc_ref.records import (
    Binding,
    check_finite_gradient,
    converted_mean_weight,
    total_after,
    validate_binding,
    validate_gradients,
    validate_loss_scale,
    validate_weight,
    validate_work_dtype,
)

__all__ = ["EVALUATION_SLACK", "FLOAT64_UNIT_ROUNDOFF", "Float64Accumulator", "Float64Result"]

FLOAT64_UNIT_ROUNDOFF = TOLERANCES["float64"].unit_roundoff  # 2**-53
# η0 = 2**-1075 is below the smallest float64; the bound's absolute term uses 8 η0 = 2**-1072.
_UNDERFLOW_ABSOLUTE = float.fromhex("0x1p-1072")
# Covers the float64 evaluation of the (non-negative) bound expression: γ_20 < 2**-48.
EVALUATION_SLACK = 1.0 + float.fromhex("0x1p-45")


def _gamma(count: int) -> float:
    """``γ_count`` for float64, from the suite's one tolerance table (:mod:`wacc_ref.bounds`)."""
    return gamma(count, "float64")


@dataclass(frozen=True)
class Float64Result:
    """A fast-path result: float64 values and per-element absolute error bounds (see module doc).

    ``grads[name]`` and ``bounds[name]`` are ``None`` for a parameter that received no
    contribution.  ``contributions[name]`` is that parameter's ``n``; ``counted`` is ``m``.
    """

    grads: dict[str, np.ndarray | None]
    bounds: dict[str, np.ndarray | None]
    weight: float
    loss_scale: float
    counted: int
    contributions: dict[str, int]
    normalized: bool


class Float64Accumulator:
    """Float64 approximation of the exact mode, for large tensors; see the module docstring.

    ``dtype`` (the work dtype D) is used only for ``w_D = conv_D(w)`` in means and for the loss
    scale check, exactly as in the accumulator.
    """

    def __init__(self, *, dtype: str, loss_scale: float) -> None:
        self._dtype: Format = validate_work_dtype(dtype)
        self._loss_scale = validate_loss_scale(loss_scale, self._dtype)
        self._binding: Binding | None = None
        self._sums: dict[str, np.ndarray] = {}
        self._abs_sums: dict[str, np.ndarray] = {}
        self._contributions: dict[str, int] = {}
        self._counted = 0
        self._total_weight = 0.0

    def _accumulate(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        grads: Mapping[str, npt.ArrayLike | None],
        *,
        mean: bool,
    ) -> None:
        w = validate_weight(weight)
        binding = validate_binding(params, self._binding)
        checked = validate_gradients(grads, binding)
        if w == 0:
            self._binding = binding
            return
        counted = converted_mean_weight(w, self._dtype) if mean else w
        new_total = total_after(self._total_weight, w, counted)
        for name, gradient in checked.items():
            check_finite_gradient(name, gradient)
        new_sums, new_abs = dict(self._sums), dict(self._abs_sums)
        with np.errstate(all="ignore"):
            for name, gradient in checked.items():
                product = gradient * counted if mean else gradient
                if name in new_sums:
                    new_sums[name] = new_sums[name] + product
                    new_abs[name] = new_abs[name] + np.abs(product)
                else:
                    new_sums[name] = product
                    new_abs[name] = np.abs(product)
        self._binding = binding
        self._sums, self._abs_sums = new_sums, new_abs
        for name in checked:
            self._contributions[name] = self._contributions.get(name, 0) + 1
        self._counted += 1
        self._total_weight = float(new_total)

    def accumulate_sum(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        *,
        grads: Mapping[str, npt.ArrayLike | None],
    ) -> None:
        """Add a loss-SUM microbatch: contributions ``g``, weight ``w``."""
        self._accumulate(params, weight, grads, mean=False)

    def accumulate_mean(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        *,
        grads: Mapping[str, npt.ArrayLike | None],
    ) -> None:
        """Add a loss-MEAN microbatch: contributions ``fl(g * w_D)``, weight ``w_D``."""
        self._accumulate(params, weight, grads, mean=True)

    def _reset(self) -> None:
        self._sums, self._abs_sums, self._contributions = {}, {}, {}
        self._counted = 0
        self._total_weight = 0.0

    def _abs_sum_bound(self, name: str) -> np.ndarray:
        n = self._contributions[name]
        u = FLOAT64_UNIT_ROUNDOFF
        bound: np.ndarray = (
            self._abs_sums[name] / (1.0 - _gamma(max(n - 1, 0))) + n * _UNDERFLOW_ABSOLUTE
        ) / (1.0 - u)
        return bound

    def finish_sums(self) -> Float64Result:
        """The float64 sums ``s`` with bounds ``γ_n A + n η0 (1 + γ_n)``; starts a new window."""
        grads: dict[str, np.ndarray | None] = {}
        bounds: dict[str, np.ndarray | None] = {}
        with np.errstate(all="ignore"):
            for name, _ in self._binding or ():
                if name not in self._sums:
                    grads[name] = bounds[name] = None
                    continue
                n = self._contributions[name]
                total = self._sums[name].copy()
                bound = _gamma(n) * self._abs_sum_bound(name) + n * _UNDERFLOW_ABSOLUTE * (
                    1.0 + _gamma(n)
                )
                bound = bound * EVALUATION_SLACK
                grads[name] = total
                bounds[name] = np.where(np.isfinite(total), bound, np.inf)
        result = Float64Result(
            grads=grads,
            bounds=bounds,
            weight=self._total_weight,
            loss_scale=self._loss_scale,
            counted=self._counted,
            contributions=dict(self._contributions),
            normalized=False,
        )
        self._reset()
        return result

    def finish_mean(self) -> Float64Result:
        """``fl(fl(s / S) / Ŵ)`` with the bound of the module docstring; starts a new window.

        ``Ŵ == 0`` raises :class:`ZeroTotalWeightError` and clears nothing.
        """
        if self._total_weight == 0:
            raise ZeroTotalWeightError("finish_mean on a window with total weight 0")
        s, w_hat, m = self._loss_scale, self._total_weight, self._counted
        grads: dict[str, np.ndarray | None] = {}
        bounds: dict[str, np.ndarray | None] = {}
        with np.errstate(all="ignore"):
            inverse_w = (1.0 + _gamma(m - 1)) / w_hat  # >= 1 / W
            for name, _ in self._binding or ():
                if name not in self._sums:
                    grads[name] = bounds[name] = None
                    continue
                n = self._contributions[name]
                g = _gamma(n + m + 1)
                out = (self._sums[name] / s) / w_hat
                bound = g * self._abs_sum_bound(name) / s * inverse_w + _UNDERFLOW_ABSOLUTE * (
                    1.0 + g
                ) * (n / s * inverse_w + inverse_w + 1.0)
                bound = bound * EVALUATION_SLACK
                grads[name] = out
                finite = np.isfinite(out) & math.isfinite(w_hat)
                bounds[name] = np.where(finite, bound, np.inf)
        result = Float64Result(
            grads=grads,
            bounds=bounds,
            weight=w_hat,
            loss_scale=s,
            counted=m,
            contributions=dict(self._contributions),
            normalized=True,
        )
        self._reset()
        return result
