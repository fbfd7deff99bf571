"""What a loop that weighs each microbatch by its own mean computes, from the truth's float64
per-microbatch gradients: the prediction the framework adapters' numbers are checked against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from wacc.audit.metrics import relative_l2
from wacc.audit.truth import Truth


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
