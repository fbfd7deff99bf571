"""Structural faults: one gradient of an accumulate step handed in malformed (semantics §5, §11).

A scenario's gradients are well formed by construction. A :class:`Fault` on an
:class:`~wacc_ref.scenario.Accumulate` step says how the judge's runner hands one of them in
instead, and the reference decides the outcome from the fault alone (it never sees a tensor):

* a *refused* fault (:data:`REFUSED_FAULTS`) is a gradient whose structure semantics §5 refuses
  with ``ParameterMismatchError`` (§11: names, shapes, dtype kind, layout or device of a
  gradient disagree with the tracked set), at any weight, zero included (§5 Reading "the
  structure is validated even when ``w == 0``"). The reference is handed a
  :class:`MalformedGradient` in its place, which :func:`wacc_ref.records.gradient_array`
  refuses, so the reference's own check order (§5 Reading: the weight first) decides the class;
* an *accepted* fault (:data:`ACCEPTED_FAULTS`) is the same values in another memory layout, or
  the name left out of the mapping: the step must give exactly what the dense contiguous
  gradient (or a None) gives, and the reference sees exactly that.

========================  ======================================================================
kind                      what the runner hands in for the parameter ``name``
========================  ======================================================================
``broadcast``             its first dimension above 1 cut to 1 (``(1, n)`` for ``(m, n)``): a
                          shape ``buf.add_`` would broadcast
``scalar``                a 0-d tensor (its first value) for a parameter of rank >= 1
``reshaped``              its values in another shape of the same size (flat, or ``(n, 1)``)
``int64``                 the values truncated to ``torch.int64``
``bool``                  ``values != 0`` as ``torch.bool``
``complex``               the values as ``torch.complex128``
``float8_e4m3fnuz``       the values in ``torch.float8_e4m3fnuz``: floating, but not one of the
                          six gradient dtypes of §2 (Reading "gradient dtypes")
``meta``                  the gradient on the ``meta`` device
``sparse``                the gradient in sparse COO layout
``list``                  the values as nested Python lists (not a tensor)
``float``                 its first value as a Python float (not a tensor)
``unknown``               an extra entry for ``name``, which is NOT a tracked parameter
``transposed``            accepted: a transposed view of the values (rank >= 2, last two dims
                          >= 2), not contiguous
``strided``               accepted: every second element of a larger tensor whose other elements
                          are NaN (last dim >= 2), not contiguous
``channels_last``         accepted: the values in ``torch.channels_last`` (rank 4)
``missing``               accepted: the name left out of the mapping (a None contribution, §5)
========================  ======================================================================

A fault is applicable to a parameter only where it means what it says (:func:`fault_problem`):
a broadcast needs a dimension above 1, a transposed view two trailing dimensions of at least 2,
and so on, so that a "non-contiguous" gradient is never contiguous after all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ACCEPTED_FAULTS",
    "FAULT_KINDS",
    "REFUSED_FAULTS",
    "Fault",
    "MalformedGradient",
    "applicable_faults",
    "broadcast_shape",
    "fault_problem",
    "reshaped_shape",
]

REFUSED_FAULTS: tuple[str, ...] = (
    "broadcast",
    "scalar",
    "reshaped",
    "int64",
    "bool",
    "complex",
    "float8_e4m3fnuz",
    "meta",
    "sparse",
    "list",
    "float",
    "unknown",
)
ACCEPTED_FAULTS: tuple[str, ...] = ("transposed", "strided", "channels_last", "missing")
FAULT_KINDS: tuple[str, ...] = (*REFUSED_FAULTS, *ACCEPTED_FAULTS)


@dataclass(frozen=True)
class Fault:
    """Hand the gradient of ``name`` in malformed, as ``kind`` says (see the module docstring).

    For ``unknown``, ``name`` is the extra name, which must not be a tracked parameter; for
    every other kind it is a tracked parameter whose gradient the step holds (not None)."""

    kind: str
    name: str

    @property
    def refused(self) -> bool:
        """Whether semantics §5 refuses the step (``ParameterMismatchError``)."""
        return self.kind in REFUSED_FAULTS


@dataclass(frozen=True)
class MalformedGradient:
    """What the reference is handed for a refused fault's gradient (never a value it reads)."""

    fault: Fault

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        # Never read as values: wacc_ref.records.gradient_array refuses it first.
        raise TypeError(f"a malformed gradient ({self.fault.kind}) has no values")


def broadcast_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with its first dimension above 1 cut to 1 (it broadcasts back to ``shape``)."""
    first = next(k for k, dim in enumerate(shape) if dim > 1)
    return (*shape[:first], 1, *shape[first + 1 :])


def reshaped_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Another shape with ``shape``'s element count: ``(n, 1)`` for a rank-1 one, else flat."""
    return (shape[0], 1) if len(shape) == 1 else (math.prod(shape),)


def fault_problem(fault: Fault, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why ``fault`` does not apply to the parameters ``shapes``, or None when it does."""
    if fault.kind not in FAULT_KINDS:
        return f"unknown fault kind {fault.kind!r}; known: {', '.join(FAULT_KINDS)}"
    if fault.kind == "unknown":
        return f"{fault.name!r} is a tracked parameter" if fault.name in shapes else None
    if fault.name not in shapes:
        return f"{fault.name!r} is not a tracked parameter"
    shape = shapes[fault.name]
    requirement = {
        "broadcast": (any(dim > 1 for dim in shape), "a dimension above 1"),
        "scalar": (len(shape) >= 1, "a rank of at least 1"),
        "transposed": (len(shape) >= 2 and min(shape[-2:]) >= 2, "two last dimensions >= 2"),
        "strided": (len(shape) >= 1 and shape[-1] >= 2, "a last dimension >= 2"),
        "channels_last": (
            len(shape) == 4 and shape[1] >= 2 and shape[2] * shape[3] >= 2,
            "rank 4 with C >= 2 and H * W >= 2",
        ),
    }.get(fault.kind)
    if requirement is not None and not requirement[0]:
        return f"{fault.kind} needs a parameter with {requirement[1]}, {fault.name!r} has {shape}"
    return None


def applicable_faults(shape: tuple[int, ...]) -> tuple[str, ...]:
    """The fault kinds (all but ``unknown``) that apply to a parameter of ``shape``."""
    return tuple(
        kind
        for kind in FAULT_KINDS
        if kind != "unknown" and fault_problem(Fault(kind, "p"), {"p": shape}) is None
    )
