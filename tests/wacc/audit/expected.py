"""What a loop that weighs each microbatch by its own mean computes, from the truth's float64
per-microbatch gradients: the prediction the framework adapters' numbers are checked against, and
how close a measured number must be to it.

Tolerances (every one derived here, none typed by hand).  A prediction is a weighted sum
``P = Σ_k w_k g_k`` of the truth's per-microbatch loss-sum gradients ``g_k`` (float64).  A loop
that computes it in a dtype ``D`` forms each term with at most three roundings (``g_k``
converted to ``D``, the weight ``w_k``, the product or the division by ``n_k``), adds the ``K``
terms in some order (at most ``K − 1`` roundings on any term's path, also when each rank sums its
own and an all-reduce sums the ranks) and scales at most twice (the loop's ``1 / K``, a
data-parallel mean's ``1 / R``): ``K + 4`` roundings in ``D`` along each term's path, so by
Higham's Lemma 3.1 (summation of perturbed terms, any order)
``|fl_D(P) − P| ≤ γ_{K+4}(D) Σ_k |w_k g_k|`` per element, γ from :func:`wacc_ref.bounds.gamma`
(the suite's table).  The float64 prediction computed here carries the same with
``D = float64``, so a run in ``D`` and the prediction differ by at most :func:`prediction_bound`
``= (γ_{K+4}(D) + γ_{K+4}(float64)) Σ_k |w_k g_k|``.  This is the
contract the audit's verdict applies to the truth (``‖F − T‖₂ / ‖B‖₂ ≤ 1``, normwise,
:func:`wacc.audit.metrics.normwise_ratio`) applied to the prediction, with the bound of the
prediction's own weights (the audit's :func:`wacc.audit.metrics.bound_for` bounds the true
weights ``1 / N``; a loop weighing a small microbatch by ``1 / (K n_k) > 1 / N`` carries more
rounding than that).  Like the audit's, the bound covers the window's sums, not the rounding
inside one backward; it is read normwise for the same reason (metrics' docstring)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from wacc.audit.metrics import bound_for, relative_l2
from wacc.audit.truth import Truth
from wacc_ref.bounds import gamma

Terms = Sequence[tuple[float, NDArray[np.float64]]]  # (w_k, g_k) of a prediction Σ_k w_k g_k


def mean_weighted_terms(
    truth: Truth, factor: float, microbatches: Sequence[int] | None = None
) -> list[tuple[float, NDArray[np.float64]]]:
    """The terms ``(factor / n_k, g_k)`` of :func:`mean_weighted` (zero-target microbatches
    contribute nothing)."""
    ks = range(len(truth.targets)) if microbatches is None else microbatches
    return [(factor / truth.targets[k], truth.microbatch_sums[k]) for k in ks if truth.targets[k]]


def mean_weighted(
    truth: Truth, factor: float, microbatches: Sequence[int] | None = None
) -> NDArray[np.float64]:
    """``factor * Σ_k g_k / n_k`` over ``microbatches`` (default: all) in float64: each
    microbatch's mean-loss gradient, a zero-target microbatch contributing nothing (the gradient of
    a 0/0 mean over no targets is zero: nothing reaches the logits)."""
    ks = range(len(truth.targets)) if microbatches is None else microbatches
    total = np.zeros_like(truth.gradient)
    for k in ks:
        if truth.targets[k]:
            total += truth.microbatch_sums[k] / truth.targets[k]
    return factor * total


def mean_weighted_error(
    truth: Truth, factor: float, microbatches: Sequence[int] | None = None
) -> float:
    """The relative L2 error of :func:`mean_weighted` against the truth."""
    return relative_l2(mean_weighted(truth, factor, microbatches), truth.gradient)


def prediction_bound(terms: Terms, dtype: str) -> NDArray[np.float64]:
    """Per element, how far a run in ``dtype`` may be from the float64 prediction
    ``Σ_k w_k g_k``: ``(γ_{K+4}(dtype) + γ_{K+4}(float64)) Σ_k |w_k g_k|`` (module docstring)."""
    count = len(terms) + 4
    spread = np.sum([np.abs(w * g) for w, g in terms], axis=0)
    # Σ|w g| is itself a float64 sum of K non-negative terms: γ_K(float64) more covers it.
    scale = (gamma(count, dtype) + gamma(count, "float64")) * (1 + gamma(len(terms), "float64"))
    return np.asarray(scale * spread, dtype=np.float64)


def prediction_ratio(
    observed: NDArray[np.float64], prediction: NDArray[np.float64], bound: NDArray[np.float64]
) -> float:
    """``‖observed − prediction‖₂ / ‖bound‖₂``: at most 1 for a run that computes the prediction
    (:func:`prediction_bound`)."""
    return float(np.linalg.norm(observed - prediction) / np.linalg.norm(bound))


def assert_close_to_prediction(
    observed: NDArray[np.float64], prediction: NDArray[np.float64], bound: NDArray[np.float64]
) -> None:
    """The observed gradient is the prediction to rounding: :func:`prediction_ratio` ≤ 1."""
    ratio = prediction_ratio(observed, prediction, bound)
    assert ratio <= 1.0, f"‖observed − prediction‖ / ‖bound‖ = {ratio!r} > 1"


def rel_l2_tolerance(
    bound: NDArray[np.float64],
    truth: NDArray[np.float64],
    *values: float,
    truth_bound: NDArray[np.float64] | None = None,
) -> float:
    """How far two relative L2 errors against ``truth`` may be apart when the gradients they
    measure are within ``bound`` of each other (normwise): ``|‖O − T‖ − ‖P − T‖| ≤ ‖O − P‖ ≤
    ‖B‖`` (triangle inequality) gives ``‖B‖ / ‖T‖``.  With ``truth_bound``, the second number is
    taken against another evaluation ``T'`` of the truth, ``‖T − T'‖ ≤ δ = ‖truth_bound‖``:
    ``‖P − T'‖ ∈ ‖P − T‖ ± δ`` and ``‖T'‖ ∈ ‖T‖ ± δ`` move ``r = ‖P − T‖ / ‖T‖`` by at most
    ``(1 + r) δ / (‖T‖ − δ)``, ``r`` the largest of ``values``.  Each number in ``values`` adds
    its own float64 evaluation (``n`` squares summed, two norms, a subtraction and a division:
    relative error at most ``γ_{2n+4}(float64)``)."""
    evaluation = gamma(2 * truth.size + 4, "float64")
    norm = float(np.linalg.norm(truth))
    reach = float(np.linalg.norm(bound)) / norm
    if truth_bound is not None:
        delta = float(np.linalg.norm(truth_bound))
        reach += (1 + max(abs(v) for v in values)) * delta / (norm - delta)
    return reach * (1 + evaluation) + evaluation * sum(abs(v) for v in values)


def assert_rel_l2_matches(
    measured: float, predicted: float, bound: NDArray[np.float64], truth: NDArray[np.float64]
) -> None:
    """``measured`` and ``predicted`` relative L2 errors against ``truth`` of two gradients
    within ``bound`` of each other agree to :func:`rel_l2_tolerance`."""
    tolerance = rel_l2_tolerance(bound, truth, measured, predicted)
    assert abs(measured - predicted) <= tolerance, (measured, predicted, tolerance)


# The reproducers print their number as ``{error:.<digits>g}`` (repro_templates/common.py).
(PRINTED_DIGITS,) = {
    int(d)
    for d in re.findall(
        r"\{error:\.(\d+)g\}",
        (Path(__file__).resolve().parents[3] / "wacc/audit/repro_templates/common.py").read_text(
            encoding="utf-8"
        ),
    )
}


def printed_precision(value: float, significant: int) -> float:
    """Half a unit in the last digit of ``value`` printed with ``significant`` significant
    digits (``f"{value:.{significant}g}"``): how far the printed number may be from ``value``."""
    if value == 0 or not math.isfinite(value):
        return 0.0
    return 0.5 * 10.0 ** (math.floor(math.log10(abs(value))) - significant + 1)


def assert_mean_weighted_error(
    measured: float,
    truth: Truth,
    factor: float,
    dtype: str,
    microbatches: Sequence[int] | None = None,
) -> float:
    """A run in ``dtype`` measured :func:`mean_weighted_error` (to :func:`rel_l2_tolerance` of
    :func:`prediction_bound` on the prediction's terms); returns the prediction."""
    predicted = mean_weighted_error(truth, factor, microbatches)
    bound = prediction_bound(mean_weighted_terms(truth, factor, microbatches), dtype)
    assert_rel_l2_matches(measured, predicted, bound, truth.gradient)
    return predicted


def truth_terms(truth: Truth) -> list[tuple[float, NDArray[np.float64]]]:
    """The terms ``(1 / N, g_k)`` of the truth itself, ``N = Σ_k n_k`` (every microbatch)."""
    total = sum(truth.targets)
    return [(1 / total, g) for g in truth.microbatch_sums]


def float64_ratio_limit(truth: Truth, dtype: str) -> float:
    """The largest ``semantic_ratio`` (``‖F − T‖₂ / ‖bound_for(truth, dtype)‖₂``, the audit's
    normwise reading) of a float64 run that computes the truth's own weighting: ``‖F − T‖ ≤
    ‖prediction_bound(truth_terms, float64)‖`` (the run and ``T`` are two float64 evaluations of
    ``Σ_k g_k / N``)."""
    reach = float(np.linalg.norm(prediction_bound(truth_terms(truth), "float64")))
    finite = bound_for(truth, dtype)
    return reach / float(np.linalg.norm(finite[np.isfinite(finite)]))
