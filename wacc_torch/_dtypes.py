"""Work dtypes, op(D) and the loss-scale check shared by the accumulator and the records."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from types import MappingProxyType

import torch

from wacc_torch.errors import InvalidLossScaleError, WeightedAccumulationError

# Keyed by the torch spelling without the "torch." prefix, as records store it.
WORK_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float64": torch.float64,
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
    }
)
_NAME_OF_DTYPE: Mapping[torch.dtype, str] = MappingProxyType(
    {dtype: name for name, dtype in WORK_DTYPES.items()}
)


def dtype_name(dtype: torch.dtype) -> str:
    """Record spelling of a work dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return _NAME_OF_DTYPE[dtype]


def check_work_dtype(dtype: object) -> torch.dtype:
    """Return ``dtype`` if it is one of the four work dtypes; raise naming it otherwise."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"dtype must be a torch.dtype (one of {', '.join(WORK_DTYPES)}), got {dtype!r} "
            f"of type {type(dtype).__name__}"
        )
    if dtype not in _NAME_OF_DTYPE:
        raise WeightedAccumulationError(
            f"unsupported work dtype {dtype}; expected one of "
            f"{', '.join('torch.' + name for name in WORK_DTYPES)}"
        )
    return dtype


def op_dtype(dtype: torch.dtype) -> torch.dtype:
    """SPEC op(D): the dtype PyTorch computes elementwise ops of ``dtype`` in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_work_dtype(value: float, dtype: torch.dtype) -> float:
    """SPEC conv_D of a Python float, exactly as ``torch.tensor(value, dtype=dtype)`` does it."""
    return float(torch.tensor(value, dtype=dtype).item())


def check_loss_scale(loss_scale: object, dtype: torch.dtype) -> float:
    """Return ``loss_scale`` as a float if it is finite, > 0 and exactly representable in dtype."""
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):
        raise InvalidLossScaleError(
            f"loss_scale must be a real number, got {loss_scale!r} of type "
            f"{type(loss_scale).__name__} (work dtype {dtype})"
        )
    try:
        scale = float(loss_scale)
    except OverflowError:
        raise InvalidLossScaleError(
            f"loss_scale {loss_scale!r} does not fit a float (work dtype {dtype})"
        ) from None
    if not (math.isfinite(scale) and scale > 0.0):
        raise InvalidLossScaleError(
            f"loss_scale must be a finite float > 0, got {scale!r} (work dtype {dtype})"
        )
    if scale != loss_scale:
        raise InvalidLossScaleError(
            f"loss_scale {loss_scale!r} is not exactly representable in float64 "
            f"(work dtype {dtype})"
        )
    converted = to_work_dtype(scale, dtype)
    if converted != scale:
        raise InvalidLossScaleError(
            f"loss_scale {scale!r} ({scale.hex()}) is not exactly representable in {dtype} "
            f"(it converts to {converted!r})"
        )
    return scale
