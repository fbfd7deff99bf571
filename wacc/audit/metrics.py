"""What the audit measures for one gradient against the truth.

* relative L2 error ``‖F − T‖ / ‖T‖`` and the max relative element error
  ``max_i |F_i − T_i| / |T_i|``, over the elements where a relative error means something (the
  table's: ``T_i`` in ``D``'s normal range and above its own bound ``B_i``, as ``wacc check``
  reads it, :func:`wacc.judge.verdict._rel_error`; where ``B_i ≥ |T_i|`` a microbatch's gradient
  cancels, one spacing off a tiny ``T_i`` reads as 10**12, and the bound judges that element) and
  over every ``T_i ≠ 0`` (``audit.csv`` keeps both);
* the error in units of the bound for the same sums: ``wacc_ref.bounds.window_error_bound`` for
  summing the window's per-microbatch loss-sum gradients ``g_k`` (float64, each converted once
  into the audited dtype ``D``: an ideal, correctly rounded backward) with the true weights
  ``n_k`` and dividing by ``Σ n_k`` in ``D``.  Two readings of it: elementwise,
  ``wacc_ref.bounds.error_ratio`` = ``max_i |F_i − T_i| / B_i``; normwise, ``‖F − T‖₂ / ‖B‖₂``
  (implied by the elementwise one: ``|e_i| ≤ B_i`` for all ``i`` gives ``‖e‖ ≤ ‖B‖``).  The
  elementwise reading is the strict one but explodes on elements where a microbatch's own
  gradient cancels (its bound covers the sums, not the cancellation inside one backward); the
  normwise one is what the table shows.

The truth ``T`` is a float64 sum (error ≈ 2**-50 relative), not the exact real result
``error_ratio`` asks for; next to a float32/bf16/fp16 bound (≥ 2**-24 relative) that difference
is 2**-26 of the unit at most.  A run in ``D`` also carries the rounding of its own forward and
backward, which no bound here covers: its ratio is reported, the verdict is taken on the loop run
in float64 (see :mod:`wacc.audit.runner`).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from numpy.typing import NDArray

from wacc.audit.truth import Truth
from wacc_ref.bounds import error_ratio, window_error_bound
from wacc_ref.formats import get_format

__all__ = [
    "bound_for",
    "bound_ratio",
    "gradient_hash",
    "max_relative_element",
    "meaningful_relative_element",
    "normwise_ratio",
    "relative_l2",
]


def relative_l2(observed: NDArray[np.float64], truth: NDArray[np.float64]) -> float:
    """``‖observed − truth‖₂ / ‖truth‖₂`` (inf/NaN propagate as +inf)."""
    with np.errstate(invalid="ignore", over="ignore"):
        error = float(np.linalg.norm(observed - truth))
    norm = float(np.linalg.norm(truth))
    if not math.isfinite(error):
        return math.inf
    return error / norm if norm > 0 else (0.0 if error == 0 else math.inf)


def max_relative_element(observed: NDArray[np.float64], truth: NDArray[np.float64]) -> float:
    """``max |observed_i − truth_i| / |truth_i|`` over ``truth_i ≠ 0`` (+inf for non-finite)."""
    if not np.all(np.isfinite(observed)):
        return math.inf
    nonzero = truth != 0
    if not nonzero.any():
        return 0.0
    return float(np.max(np.abs(observed[nonzero] - truth[nonzero]) / np.abs(truth[nonzero])))


def meaningful_relative_element(
    observed: NDArray[np.float64],
    truth: NDArray[np.float64],
    bound: NDArray[np.float64],
    dtype: str,
) -> tuple[float, int, float]:
    """``max |observed_i − truth_i| / |truth_i|`` over the elements with ``|truth_i|`` in
    ``dtype``'s normal range and above ``bound_i`` (module docstring), how many those are, and
    ``|truth_i| / max |truth|`` at the maximum (how small the element is next to the gradient's
    largest: a run in ``dtype`` rounds every element by about its unit times that largest, so on
    a small element the relative error is that rounding, not the loop's weighting); +inf, 0, nan
    for a non-finite ``observed``; 0.0, 0, nan when no element qualifies."""
    if not np.all(np.isfinite(observed)):
        return math.inf, 0, math.nan
    magnitude = np.abs(truth)
    with np.errstate(invalid="ignore"):
        meaningful = (magnitude >= get_format(dtype).min_normal) & (magnitude > bound)
    count = int(meaningful.sum())
    if count == 0:
        return 0.0, 0, math.nan
    error = np.abs(observed[meaningful] - truth[meaningful]) / magnitude[meaningful]
    worst = int(np.argmax(error))
    return float(error[worst]), count, float(magnitude[meaningful][worst] / magnitude.max())


def bound_for(truth: Truth, dtype: str) -> NDArray[np.float64]:
    """The per-element bound in ``dtype`` for the window's sums (module docstring)."""
    return window_error_bound(
        kind="sum",
        grads=list(truth.microbatch_sums),
        weights=[float(n) for n in truth.targets],
        dtype=dtype,
        loss_scale=1.0,
        normalized=True,
    )


def bound_ratio(observed: NDArray[np.float64], truth: Truth, bound: NDArray[np.float64]) -> float:
    """``max |observed − T| / bound`` (``wacc_ref.bounds.error_ratio``; +inf for NaN/inf)."""
    return error_ratio(observed, truth.gradient, bound)


def normwise_ratio(
    observed: NDArray[np.float64], truth: Truth, bound: NDArray[np.float64]
) -> float:
    """``‖observed − T‖₂ / ‖bound‖₂`` over the elements with a finite bound (+inf for NaN/inf)."""
    finite = np.isfinite(bound)
    with np.errstate(invalid="ignore", over="ignore"):
        error = float(np.linalg.norm((observed - truth.gradient)[finite]))
    scale = float(np.linalg.norm(bound[finite]))
    if not math.isfinite(error):
        return math.inf
    return error / scale if scale > 0 else (0.0 if error == 0 else math.inf)


def gradient_hash(gradient: NDArray[np.float64]) -> str:
    """SHA-256 of the gradient's bytes (float64, exact for every narrower float)."""
    return hashlib.sha256(np.ascontiguousarray(gradient).tobytes()).hexdigest()
