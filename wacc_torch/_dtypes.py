"""Work dtypes, gradient dtypes, op(D) and the loss-scale check (accumulator and records)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from wacc_torch._environment import check_gradual_underflow, check_readable
from wacc_torch._scalars import FLOAT_DTYPES, read_real
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
# A gradient may come in any of the six formats the reference models; their conversion to every
# work dtype is defined (§2). Others (float4, the fnuz float8 variants, ...) are refused up
# front: PyTorch may not even convert them (float4_e2m1fn_x2 raises NotImplementedError).
GRADIENT_DTYPES: frozenset[torch.dtype] = FLOAT_DTYPES
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
    """§2 op(D): the dtype PyTorch computes elementwise ops of ``dtype`` in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_work_dtype(value: float, dtype: torch.dtype) -> float:
    """§2 conv_D of a Python float, exactly as ``torch.tensor(value, dtype=dtype)`` does it.

    The conversion runs on the CPU in the calling thread: a value below D's smallest normal
    number (a subnormal result) is refused under flush-to-zero
    (:class:`~wacc_torch.errors.UnsupportedEnvironmentError`), where the mode would change it;
    any other value converts alike in every mode.
    """
    if value != 0.0 and abs(value) < torch.finfo(dtype).tiny:
        check_gradual_underflow(f"converting {value!r} to {dtype}")
    # On the CPU explicitly: under torch.set_default_device("cuda") this would be a device
    # round trip (a sync per call), under "meta" it would hold no value at all.
    return float(torch.tensor(value, dtype=dtype, device="cpu").item())


def check_loss_scale(loss_scale: object, dtype: torch.dtype) -> float:
    """Return ``loss_scale`` as a float if it is finite, > 0 and exactly representable in dtype.

    Which types are accepted is :func:`wacc_torch._scalars.read_real`'s rule; the value is read
    exactly, so an int like ``2**53 + 1`` (not a float64) is refused, never rounded.
    """
    try:
        value = read_real(loss_scale, what="loss_scale", error=InvalidLossScaleError)
    except InvalidLossScaleError as error:
        raise InvalidLossScaleError(f"{error} (work dtype {dtype})") from None
    check_readable(value, "loss_scale")  # before any comparison: FTZ/DAZ would read it as 0
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidLossScaleError(
            f"loss_scale must be a finite float > 0, got {value!r} (work dtype {dtype})"
        )
    if not value > 0:
        raise InvalidLossScaleError(
            f"loss_scale must be a finite float > 0, got {loss_scale!r} (work dtype {dtype})"
        )
    try:
        scale = float(value)
    except OverflowError:
        raise InvalidLossScaleError(
            f"loss_scale {loss_scale!r} does not fit a float64 (work dtype {dtype})"
        ) from None
    if scale != value:  # int vs float comparison in Python is exact
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
