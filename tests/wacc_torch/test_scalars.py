"""Reading real numbers (``wacc_torch._scalars``): exact values, messages naming the offending
value, and ``round_64(W + w)`` of the exact sum with +-inf on overflow."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from wacc_torch._scalars import add_to_total, read_real
from wacc_torch.errors import InvalidWeightError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.tensor(2**53 + 1, dtype=torch.int64), 2**53 + 1),
        (torch.tensor(-(2**63), dtype=torch.int64), -(2**63)),
        (torch.tensor(255, dtype=torch.uint8), 255),
        (np.int64(2**53 + 1), 2**53 + 1),
        (np.array(2**63 - 1, dtype=np.int64), 2**63 - 1),
    ],
    ids=["int64-2**53+1", "int64-min", "uint8-255", "np-int64", "np-0d-int64-max"],
)
def test_integer_tensors_and_numpy_integers_are_read_as_exact_ints(
    value: object, expected: int
) -> None:
    """A 0-d integer tensor or numpy integer is read as the Python int it holds (not through
    float64, which would round 2**53 + 1 and 2**63 - 1)."""
    read = read_real(value, what="weight", error=InvalidWeightError)
    assert type(read) is int
    assert read == expected


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (torch.tensor(1.5, device="meta"), r"weight.*meta"),
        (np.array([1.0, 2.0]), r"weight.*shape \[2\]"),
        (1 + 2j, r"\(1\+2j\).*\bcomplex\b"),
        (Fraction(1, 3), r"Fraction\(1, 3\).*\bFraction\b"),
        ("0.5", r"'0\.5'.*\bstr\b"),
    ],
    ids=["meta-tensor", "1d-array", "complex", "fraction", "str"],
)
def test_refusals_name_the_offending_value_and_its_type(value: object, pattern: str) -> None:
    """A value outside the rule (a meta tensor, an array that is not 0-d, another type) raises
    the caller's error class with a message naming the argument, the value and, for a wrong
    type, the type's name."""
    with pytest.raises(InvalidWeightError, match=pattern):
        read_real(value, what="weight", error=InvalidWeightError)


@pytest.mark.parametrize(
    ("total", "weight", "expected"),
    [
        (0.0, 2**1024, math.inf),  # the exact sum is beyond float64's largest finite value
        (-1.0, 2**1024, math.inf),
        (0.0, -(2**1024), -math.inf),
        (1.0, -(2**1030), -math.inf),
        (1.0, 2**53 + 1, float(2**53 + 2)),  # exact sum 2**53 + 2: representable, no rounding
    ],
    ids=["pos", "pos-from-negative-total", "neg", "neg-from-positive-total", "exact"],
)
def test_add_to_total_rounds_the_exact_sum_once_with_signed_overflow(
    total: float, weight: int, expected: float
) -> None:
    """add_to_total is round_64 of the exact sum: one rounding, and +inf or -inf (the exact
    sum's sign) when it is beyond float64's range."""
    assert add_to_total(total, weight) == expected
