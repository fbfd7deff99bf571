"""Corrupted copies of accumulator records (semantics §9): what a restore must refuse.

:func:`corrupt_record` returns a corrupted copy of a record of either implementation (numpy arrays
or torch tensors as pending buffers; only ``reshape``, ``shape`` and dict/list edits are used, and
the buffers are shared with the input, never written; ``checksum_mismatch`` changes a copy). Each
kind in :data:`CORRUPTION_KINDS` is listed in :data:`CORRUPTION_FIELDS` with the field that the
``RecordError`` message must name; for the two pending-buffer kinds that is the parameter's name,
given by :func:`corruption_field`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from wacc_ref import formats

__all__ = [
    "CHECKSUM_KINDS",
    "CORRUPTION_FIELDS",
    "CORRUPTION_KINDS",
    "UNKNOWN_DTYPE",
    "UNKNOWN_PARAMETER_NAME",
    "UNKNOWN_RECORD_KEY",
    "CorruptionNotApplicableError",
    "applicable_corruptions",
    "corrupt_record",
    "corruption_field",
]


class CorruptionNotApplicableError(ValueError):
    """A corruption kind that needs something the record does not have (e.g. a pending buffer)."""


UNKNOWN_PARAMETER_NAME = "__not_a_parameter__"
UNKNOWN_RECORD_KEY = "__unknown_record_key__"
UNKNOWN_DTYPE = "float128"
_PENDING_PARAMETER = "<the parameter's name>"

# kind -> the field the RecordError message must name (a parameter name for the pending kinds).
CORRUPTION_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        # format_version + 1: a version this code does not know.
        "format_version_bad": "format_version",
        # dtype = "float128": not a dtype at all.
        "dtype_unknown": "dtype",
        # dtype = another work dtype (the next one in WORK_DTYPES).
        "dtype_wrong": "dtype",
        # loss_scale doubled (halved if doubling overflows float64); in a record of an empty
        # window (issued == 0, no pending), which loads at any loss scale of D (§9), negated.
        "loss_scale_wrong": "loss_scale",
        # fused flag flipped.
        "fused_flipped": "fused",
        # "total_weight" key deleted.
        "missing_key": "total_weight",
        # an extra key UNKNOWN_RECORD_KEY.
        "unknown_key": UNKNOWN_RECORD_KEY,
        # issued = True (a bool is not an int counter).
        "issued_bool": "issued",
        # issued = float(issued).
        "issued_float": "issued",
        # issued = -1.
        "issued_negative": "issued",
        # zero_weight = issued + 1.
        "zero_weight_exceeds_issued": "zero_weight",
        # total_weight = -1.0.
        "total_weight_negative": "total_weight",
        # total_weight = NaN.
        "total_weight_nan": "total_weight",
        # total_weight = +inf.
        "total_weight_inf": "total_weight",
        # zero_weight = issued, no pending buffers, total_weight > 0 (1.0 when it was 0).
        "total_weight_without_weighted_batches": "total_weight",
        # a pending buffer under UNKNOWN_PARAMETER_NAME (a view of an existing buffer);
        # needs a pending buffer.
        "pending_unknown_parameter": UNKNOWN_PARAMETER_NAME,
        # the first pending buffer reshaped (flat / row / 3-d, whichever differs); needs a pending
        # buffer; the message must name that parameter.
        "pending_wrong_shape": _PENDING_PARAMETER,
        # param_shapes one entry longer (or shorter) than param_names.
        "param_lists_length_mismatch": "param_shapes",
        # the first parameter renamed in param_names (and in pending, consistently); needs bound
        # parameters.
        "param_names_wrong": "param_names",
        # the first parameter's shape gets a trailing 1 in param_shapes (and its pending buffer is
        # reshaped to match); needs bound parameters.
        "param_shape_wrong": "param_shapes",
        # one value of the first pending buffer changed (a copy), the checksum kept: a silent
        # corruption only the checksum sees; needs a pending buffer and a checksum.
        "checksum_mismatch": "checksum",
        # checksum = "sha256:xyz" (not 64 hex digits); needs a checksum.
        "checksum_malformed": "checksum",
    }
)
CORRUPTION_KINDS: tuple[str, ...] = tuple(CORRUPTION_FIELDS)

_NEEDS_PENDING = frozenset(
    {"pending_unknown_parameter", "pending_wrong_shape", "checksum_mismatch"}
)
CHECKSUM_KINDS = frozenset({"checksum_mismatch", "checksum_malformed"})  # need a checksum
_NEEDS_BOUND = frozenset({"param_names_wrong", "param_shape_wrong"})


def _copy_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the record's containers (buffers shared: they are never written)."""
    copied = dict(record)
    if isinstance(record.get("param_names"), list | tuple):
        copied["param_names"] = list(record["param_names"])
    if isinstance(record.get("param_shapes"), list | tuple):
        copied["param_shapes"] = [list(shape) for shape in record["param_shapes"]]
    if isinstance(record.get("pending"), Mapping):
        copied["pending"] = dict(record["pending"])
    return copied


def applicable_corruptions(record: Mapping[str, Any]) -> tuple[str, ...]:
    """The corruption kinds :func:`corrupt_record` can apply to ``record``, in kind order."""
    has_pending = bool(record["pending"])
    bound = bool(record["param_names"])
    checksum = "checksum" in record
    return tuple(
        kind
        for kind in CORRUPTION_KINDS
        if (kind not in _NEEDS_PENDING or has_pending)
        and (kind not in _NEEDS_BOUND or bound)
        and (kind not in CHECKSUM_KINDS or checksum)
    )


def _check_kind(record: Mapping[str, Any], kind: str) -> None:
    if kind not in CORRUPTION_FIELDS:
        raise ValueError(f"unknown corruption kind {kind!r}; known: {', '.join(CORRUPTION_KINDS)}")
    if kind not in applicable_corruptions(record):
        need = (
            "a pending buffer and a checksum"
            if kind == "checksum_mismatch"
            else "a checksum"
            if kind in CHECKSUM_KINDS
            else "a pending buffer"
            if kind in _NEEDS_PENDING
            else "bound parameters"
        )
        raise CorruptionNotApplicableError(f"corruption {kind!r} needs {need}; the record has none")


def _first_pending_name(record: Mapping[str, Any]) -> str:
    order = {name: position for position, name in enumerate(record["param_names"])}
    return min(record["pending"], key=lambda name: (order.get(name, len(order)), name))


def corruption_field(record: Mapping[str, Any], kind: str) -> str:
    """The field (or parameter name) that loading ``corrupt_record(record, kind)`` must name."""
    _check_kind(record, kind)
    if kind == "pending_wrong_shape":
        return _first_pending_name(record)
    return CORRUPTION_FIELDS[kind]


def _wrong_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape with the same element count that differs from ``shape`` (distinct ranks 1, 2, 3)."""
    count = math.prod(shape)
    for candidate in ((count,), (1, count), (1, 1, count)):
        if candidate != shape:
            return candidate
    raise AssertionError("unreachable: three shapes of distinct rank")


def corrupt_record(record: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A corrupted copy of ``record`` (numpy or torch buffers); see :data:`CORRUPTION_FIELDS`.

    The input is not modified.  Raises ValueError for an unknown kind and
    :class:`CorruptionNotApplicableError` when the record lacks what the kind needs.
    """
    _check_kind(record, kind)
    out = _copy_record(record)
    if kind == "format_version_bad":
        out["format_version"] = record["format_version"] + 1
    elif kind == "dtype_unknown":
        out["dtype"] = UNKNOWN_DTYPE
    elif kind == "dtype_wrong":
        dtypes = formats.WORK_DTYPES
        current = dtypes.index(record["dtype"]) if record["dtype"] in dtypes else -1
        out["dtype"] = dtypes[(current + 1) % len(dtypes)]
    elif kind == "loss_scale_wrong":
        if record["issued"] == 0 and not record["pending"]:
            # Another valid scale would load (§9): only a scale that is none stays wrong.
            out["loss_scale"] = -record["loss_scale"]
        else:
            doubled = record["loss_scale"] * 2.0
            out["loss_scale"] = doubled if math.isfinite(doubled) else record["loss_scale"] / 2.0
    elif kind == "fused_flipped":
        out["fused"] = not record["fused"]
    elif kind == "missing_key":
        del out["total_weight"]
    elif kind == "unknown_key":
        out[UNKNOWN_RECORD_KEY] = 0
    elif kind == "issued_bool":
        out["issued"] = True
    elif kind == "issued_float":
        out["issued"] = float(record["issued"])
    elif kind == "issued_negative":
        out["issued"] = -1
    elif kind == "zero_weight_exceeds_issued":
        out["zero_weight"] = record["issued"] + 1
    elif kind == "total_weight_negative":
        out["total_weight"] = -1.0
    elif kind == "total_weight_nan":
        out["total_weight"] = math.nan
    elif kind == "total_weight_inf":
        out["total_weight"] = math.inf
    elif kind == "total_weight_without_weighted_batches":
        out["zero_weight"] = record["issued"]
        out["pending"] = {}
        weight = record["total_weight"]
        out["total_weight"] = weight if weight > 0 else 1.0
    elif kind == "pending_unknown_parameter":
        donor = out["pending"][_first_pending_name(record)]
        out["pending"][UNKNOWN_PARAMETER_NAME] = donor.reshape(tuple(donor.shape))
    elif kind == "pending_wrong_shape":
        name = _first_pending_name(record)
        buffer = out["pending"][name]
        out["pending"][name] = buffer.reshape(_wrong_shape(tuple(buffer.shape)))
    elif kind == "param_lists_length_mismatch":
        shapes = out["param_shapes"]
        if shapes:
            shapes.pop()
        else:
            shapes.append([1])
    elif kind == "param_names_wrong":
        old = out["param_names"][0]
        new = old + "__renamed"
        out["param_names"][0] = new
        out["pending"] = {(new if name == old else name): b for name, b in out["pending"].items()}
    elif kind == "param_shape_wrong":
        name = out["param_names"][0]
        out["param_shapes"][0] = out["param_shapes"][0] + [1]
        if name in out["pending"]:
            buffer = out["pending"][name]
            out["pending"][name] = buffer.reshape(tuple(buffer.shape) + (1,))
    elif kind == "checksum_mismatch":
        name = _first_pending_name(record)
        buffer = out["pending"][name]
        changed = buffer.clone() if hasattr(buffer, "clone") else buffer.copy()  # torch or numpy
        flat = changed.reshape(-1)
        flat[0] = 1.0 if float(flat[0]) == 0.0 or float(flat[0]) != float(flat[0]) else 0.0
        out["pending"][name] = changed
    elif kind == "checksum_malformed":
        out["checksum"] = "sha256:xyz"
    else:  # pragma: no cover - _check_kind rejected it
        raise AssertionError(kind)
    return out
