"""wacc_ref: the exact reference model of the wacc accumulation semantics (never imports torch).

The thin public API; the layers underneath are pure functions with explicit precision:

* :mod:`wacc_ref.formats` — IEEE formats as data (``FORMATS``), ``round_to`` (exact
  round-to-nearest-even with subnormals and overflow) and ``conv_to`` (PyTorch's conversion).
* :mod:`wacc_ref.arith` — correctly rounded elementwise operations and the semantics §6 fused set.
* :mod:`wacc_ref.accumulator` — ``ReferenceAccumulator``, semantics §3–§9 step by step, in
  ``emulated`` or ``exact`` mode; :mod:`wacc_ref.records` validates records.
* :mod:`wacc_ref.bounds` — the tolerance table keyed by dtype and the semantics §12.2 error bound.
* :mod:`wacc_ref.fastpath` — a float64 numpy path with its own proved bound, for large tensors.
* :mod:`wacc_ref.scenario` and :mod:`wacc_ref.strategies` — replayable scenarios, traces and
  Hypothesis strategies (imported on demand: they pull in Hypothesis).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load on first use
    from wacc_ref.accumulator import ReferenceAccumulator, ReferenceResult, ReferenceState
    from wacc_ref.bounds import TOLERANCES, DtypeTolerance, gamma, window_error_bound
    from wacc_ref.errors import (
        ExactModeError,
        InvalidLossScaleError,
        InvalidWeightError,
        ParameterMismatchError,
        RecordError,
        UnsupportedEnvironmentError,
        WeightedAccumulationError,
        ZeroTotalWeightError,
    )
    from wacc_ref.formats import (
        FORMATS,
        WORK_DTYPES,
        Format,
        conv_to,
        get_format,
        op_format,
        round_to,
    )

# name -> the module that defines it. Loaded on first use (PEP 562), so that importing one light
# submodule (wacc_ref.strict_json: the file readers' rules) does not import the whole model
# (numpy, mpmath, gmpy2: about 2 s), and a command answers a bad file at once.
_EXPORTS = {
    **dict.fromkeys(("ReferenceAccumulator", "ReferenceResult", "ReferenceState"),
                    "wacc_ref.accumulator"),
    **dict.fromkeys(("TOLERANCES", "DtypeTolerance", "gamma", "window_error_bound"),
                    "wacc_ref.bounds"),
    **dict.fromkeys(("ExactModeError", "InvalidLossScaleError", "InvalidWeightError",
                     "ParameterMismatchError", "RecordError", "UnsupportedEnvironmentError",
                     "WeightedAccumulationError", "ZeroTotalWeightError"), "wacc_ref.errors"),
    **dict.fromkeys(("FORMATS", "WORK_DTYPES", "Format", "conv_to", "get_format", "op_format",
                     "round_to"), "wacc_ref.formats"),
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (``from wacc_ref import arith``) is imported by Python then
        raise AttributeError(f"module 'wacc_ref' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once
    return value


__all__ = [
    "FORMATS",
    "TOLERANCES",
    "WORK_DTYPES",
    "DtypeTolerance",
    "ExactModeError",
    "Format",
    "InvalidLossScaleError",
    "InvalidWeightError",
    "ParameterMismatchError",
    "RecordError",
    "ReferenceAccumulator",
    "ReferenceResult",
    "ReferenceState",
    "UnsupportedEnvironmentError",
    "WeightedAccumulationError",
    "ZeroTotalWeightError",
    "conv_to",
    "gamma",
    "get_format",
    "op_format",
    "round_to",
    "window_error_bound",
]
