"""The acceptance rule for numbers (weights, total weights, loss scales) and exact W updates.

One rule, shared in spirit with ``wacc_ref.records.read_real`` (the suite checks that both
accept exactly the same inputs and raise the same class):

* accepted: a Python ``int`` (not ``bool``) or ``float``; a numpy scalar or 0-d numpy array, and
  a 0-d torch tensor, whose dtype is a numpy/torch integer of at most 64 bits or one of the six
  floating formats the reference models (float64, float32, float16, bfloat16, float8_e4m3fn,
  float8_e5m2);
* refused (with the caller's §11 error class): ``bool``, complex, ``Fraction``, ``Decimal``,
  ``numpy.longdouble`` and every other type, tensors/arrays that are not 0-d.

Every accepted value is read EXACTLY, as a Python ``int`` or ``float`` (each accepted float
format is a subset of float64); nothing is rounded on the way in. What semantics then does with it
is explicit: ``W <- round_64(W + w)`` of the exact sum (:func:`add_to_total`), ``w_D = conv_D(w)``
for a mean (PyTorch's conversion, which reads an int through float64).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from wacc_torch.errors import WeightedAccumulationError

__all__ = ["FLOAT_DTYPES", "add_to_total", "as_float64", "read_real"]

FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
_INT_DTYPES = frozenset(
    {
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
    }
)
_NUMPY_FLOAT_NAMES = frozenset(dtype_name.split(".")[-1] for dtype_name in map(str, FLOAT_DTYPES))
# Above this magnitude an int is not necessarily exactly a float64 (2**53 + 1 is not).
_EXACT_INT_LIMIT = 2**53


def _numpy_dtype_accepted(dtype: np.dtype) -> bool:
    if dtype.kind in "iu":
        return dtype.itemsize <= 8
    # numpy float16/32/64 and ml_dtypes' bfloat16/float8 spell their names like torch.
    return dtype.name in _NUMPY_FLOAT_NAMES


def read_real(value: object, *, what: str, error: type[WeightedAccumulationError]) -> int | float:
    """``value`` as an exact Python int or float under the module's rule; ``error`` otherwise.

    ``what`` names the argument in the message (``"weight"``, ``"loss_scale"``, ...). The value
    is not range-checked here (NaN, inf and negatives come back as they are).
    """
    if isinstance(value, bool | np.bool_):
        raise error(f"{what} must be a real number, got the bool {value!r}")
    if isinstance(value, int | float) and not isinstance(value, np.generic):
        return value  # Python int or float (np.float64 is a float subclass: handled below)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise error(f"a tensor {what} must be 0-d, got shape {list(value.shape)}: {value!r}")
        if value.dtype not in FLOAT_DTYPES and value.dtype not in _INT_DTYPES:
            raise error(
                f"a tensor {what} must have a real dtype of at most 64 bits, got {value.dtype}: "
                f"{value!r}"
            )
        if value.is_meta:
            raise error(f"a tensor {what} on the meta device holds no value: {value!r}")
        item = value.item()  # exact: int for integer dtypes, float for the six formats
        return item if isinstance(item, int) else float(item)
    if isinstance(value, np.generic | np.ndarray):
        if isinstance(value, np.ndarray) and value.ndim != 0:
            raise error(f"an array {what} must be 0-d, got shape {list(value.shape)}: {value!r}")
        if not _numpy_dtype_accepted(value.dtype):
            raise error(
                f"{what} {value!r} has numpy dtype {value.dtype}: only integers of at most 64 "
                f"bits and the formats float64, float32, float16, bfloat16, float8_e4m3fn, "
                f"float8_e5m2 are read exactly"
            )
        item = value.item()
        return int(item) if value.dtype.kind in "iu" else float(item)
    raise error(
        f"{what} must be a Python int or float, a numpy scalar or a 0-d array/tensor of a real "
        f"dtype of at most 64 bits, got {value!r} of type {type(value).__name__}"
    )


def as_float64(value: int | float) -> float:
    """``round_64(value)``; +-inf beyond float64's range (never raises)."""
    if isinstance(value, float):
        return value
    try:
        return float(value)  # Python rounds an int to the nearest float64, ties to even
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def add_to_total(total: float, weight: int | float) -> float:
    """``round_64(total + weight)`` of the EXACT sum (one rounding, +-inf on overflow)."""
    if isinstance(weight, float) or abs(weight) <= _EXACT_INT_LIMIT:
        return total + float(weight)  # both exactly float64: IEEE addition rounds once
    exact = Fraction(total) + weight
    try:
        return float(exact)  # int / int true division: correctly rounded
    except OverflowError:
        return math.inf if exact > 0 else -math.inf
