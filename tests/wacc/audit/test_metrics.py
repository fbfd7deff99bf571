"""The audit's error measures."""

from __future__ import annotations

import math

import numpy as np
import torch

from wacc.audit.metrics import (
    bound_for,
    bound_ratio,
    max_relative_element,
    normwise_ratio,
    relative_l2,
)
from wacc.audit.models import MODEL_KINDS
from wacc.audit.truth import compute_truth
from wacc.audit.windows import build_window


def test_relative_errors() -> None:
    """Relative L2 and max relative element error of a known perturbation; NaN reads inf."""
    truth = np.array([1.0, -2.0, 0.0, 4.0])
    observed = truth * np.array([1.5, 1.0, 1.0, 1.0])
    assert relative_l2(observed, truth) == 0.5 / math.sqrt(21.0)
    assert max_relative_element(observed, truth) == 0.5
    assert relative_l2(np.array([math.nan, 0, 0, 0]), truth) == math.inf
    assert max_relative_element(np.array([math.nan, 0, 0, 0]), truth) == math.inf


def test_normwise_within_bound_when_elementwise_is() -> None:
    """An error within the per-element bound everywhere is within it normwise, and a larger
    one beyond it is beyond it in both readings."""
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window("unequal"))
    bound = bound_for(truth, "float32")
    rng = np.random.default_rng(0)
    inside = truth.gradient + bound * rng.uniform(-0.5, 0.5, bound.shape)
    assert bound_ratio(inside, truth, bound) <= 1.0
    assert normwise_ratio(inside, truth, bound) <= 1.0
    outside = truth.gradient + 3 * bound
    assert bound_ratio(outside, truth, bound) > 1.0
    assert normwise_ratio(outside, truth, bound) > 1.0
