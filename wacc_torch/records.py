"""Records (checkpoints) of a :class:`~wacc_torch.WeightedGradientsAccumulator` (semantics §9).

A record is the dict returned by ``state_dict()``; its keys are documented there. This module
validates records field by field and reads/writes record files. Nothing here mutates an
accumulator: the accumulator validates a whole record first and only then swaps its state in.

Checksum
--------
Every record written carries ``checksum``: ``"sha256:"`` + the SHA-256 hex digest of the
record's canonical bytes, shared with ``wacc_ref.records.record_checksum`` (both packages give
the same checksum for the same state):

1. the UTF-8 of the compact JSON list ``[format_version, dtype, loss_scale.hex(), fused, issued,
   zero_weight, total_weight.hex(), param_names, param_shapes, pending names in param_names
   order]`` (``json.dumps(..., separators=(",", ":"))``);
2. then each pending buffer in that order: its bit patterns in D, little-endian, row-major,
   every NaN written as D's canonical quiet NaN (sign +, top mantissa bit only), because
   the semantics treats all NaNs alike and the reference keeps values, not payloads.

It is verified on load AFTER every field check, so a damaged field is still reported by name
and only a change that leaves a valid-looking record (a flipped mantissa bit, a changed counter
that stays consistent) is caught by the checksum. A record without ``checksum`` (written before
records had one, or assembled by hand) is loaded after the same field checks, unverified: the
layout is otherwise unchanged, so ``format_version`` stays 1 and an older reader refuses a new
record clearly (unknown field ``checksum``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wacc_torch._dtypes import WORK_DTYPES, check_loss_scale, dtype_name
from wacc_torch.errors import InvalidLossScaleError, RecordError

__all__ = [
    "CHECKSUM_KEY",
    "FORMAT_VERSION",
    "RECORD_KEYS",
    "load_record",
    "record_checksum",
    "record_checksum_of",
    "save_record",
]

FORMAT_VERSION = 1
RECORD_KEYS: tuple[str, ...] = (
    "format_version",
    "dtype",
    "loss_scale",
    "fused",
    "issued",
    "zero_weight",
    "total_weight",
    "param_names",
    "param_shapes",
    "pending",
)
# Written into every record, verified when present (see the module docstring).
CHECKSUM_KEY = "checksum"
_CHECKSUM_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")
# Bits of each work dtype as an integer dtype of the same width, and its canonical quiet NaN.
_BITS: Mapping[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF8_0000_0000_0000),
    torch.float32: (torch.int32, 0x7FC0_0000),
    torch.float16: (torch.int16, 0x7E00),
    torch.bfloat16: (torch.int16, 0x7FC0),
}


@dataclass(frozen=True)
class ValidatedRecord:
    """The parts of a validated record that the accumulator restores."""

    issued: int
    zero_weight: int
    total_weight: float
    param_names: tuple[str, ...]
    param_shapes: tuple[tuple[int, ...], ...]
    pending: Mapping[str, torch.Tensor]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_empty_window(record: Mapping[str, Any]) -> bool:
    """Whether ``record`` is of a window that has issued nothing (``issued`` the int 0 and no
    pending buffer): the one record whose loss scale need not be the accumulator's."""
    issued, pending = record["issued"], record["pending"]
    return _is_int(issued) and issued == 0 and isinstance(pending, Mapping) and not pending


def check_counters(
    *, issued: object, zero_weight: object, total_weight: object, has_pending: bool, bound: bool
) -> tuple[int, int, float]:
    """Validate the window counters together; raise :class:`RecordError` naming the field.

    ``bound`` says whether a parameter set is bound: an unbound accumulator has issued nothing.
    """
    if not _is_int(issued):
        raise RecordError(f"field 'issued' must be an int, got {issued!r}")
    if not _is_int(zero_weight):
        raise RecordError(f"field 'zero_weight' must be an int, got {zero_weight!r}")
    assert isinstance(issued, int) and isinstance(zero_weight, int)
    if issued < 0:
        raise RecordError(f"field 'issued' must be >= 0, got {issued!r}")
    if not 0 <= zero_weight <= issued:
        raise RecordError(
            f"field 'zero_weight' must satisfy 0 <= zero_weight <= issued, got "
            f"zero_weight={zero_weight!r}, issued={issued!r}"
        )
    if not _is_real(total_weight):
        raise RecordError(f"field 'total_weight' must be a float, got {total_weight!r}")
    assert isinstance(total_weight, int | float)
    try:
        weight = float(total_weight)
    except OverflowError:
        weight = math.inf
    if weight != total_weight and math.isfinite(weight):
        raise RecordError(f"field 'total_weight' {total_weight!r} is not exactly a float64")
    if not (math.isfinite(weight) and weight >= 0.0):
        raise RecordError(f"field 'total_weight' must be finite and >= 0, got {total_weight!r}")
    if not bound and issued != 0:
        raise RecordError(
            f"field 'issued' is {issued} but no parameter is bound ('param_names' is empty)"
        )
    positive_batches = issued - zero_weight
    if positive_batches == 0 and weight != 0.0:
        raise RecordError(
            f"field 'total_weight' must be 0 when every issued batch had zero weight "
            f"(issued={issued}, zero_weight={zero_weight}), got {total_weight!r}"
        )
    # Every positive-weight batch adds w > 0 and rounding is monotone, so W > 0 after one.
    if positive_batches > 0 and weight == 0.0:
        raise RecordError(
            f"field 'total_weight' must be > 0 after {positive_batches} positive-weight "
            f"batch(es), got {total_weight!r}"
        )
    if positive_batches == 0 and has_pending:
        raise RecordError(
            f"field 'pending' must be empty when no positive-weight batch was issued "
            f"(issued={issued}, zero_weight={zero_weight})"
        )
    return issued, zero_weight, weight


def _check_shape(field: str, index: int, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple | torch.Size) or not all(
        _is_int(size) and size >= 0 for size in shape
    ):
        raise RecordError(
            f"field '{field}'[{index}] must be a list of non-negative ints, got {shape!r}"
        )
    return tuple(int(size) for size in shape)


def validate_record(
    record: object,
    *,
    dtype: torch.dtype,
    loss_scale: float,
    fused: bool,
    tracked: Sequence[tuple[str, torch.Size]],
) -> ValidatedRecord:
    """Check every field of ``record`` against an accumulator and a module's tracked parameters.

    ``tracked`` lists the module's ``requires_grad`` parameters as ``(name, shape)``. Raises
    :class:`RecordError` naming the first bad field; returns the restorable parts otherwise.
    """
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a dict, got {type(record).__name__}")
    unknown = [key for key in record if key not in RECORD_KEYS and key != CHECKSUM_KEY]
    if unknown:
        raise RecordError(f"record has unknown field(s) {unknown!r}")
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise RecordError(f"record lacks field(s) {missing!r}")

    version = record["format_version"]
    if not _is_int(version) or version != FORMAT_VERSION:
        raise RecordError(f"field 'format_version' must be {FORMAT_VERSION}, got {version!r}")
    record_dtype = record["dtype"]
    if not isinstance(record_dtype, str) or record_dtype not in WORK_DTYPES:
        raise RecordError(
            f"field 'dtype' must be one of {', '.join(WORK_DTYPES)}, got {record_dtype!r}"
        )
    if WORK_DTYPES[record_dtype] != dtype:
        raise RecordError(
            f"field 'dtype' is {record_dtype!r} but this accumulator works in {dtype_name(dtype)!r}"
        )
    record_scale = record["loss_scale"]
    if _is_empty_window(record):
        # Nothing of the window was scaled yet: any loss scale of D may continue it (the
        # accumulator keeps its own), as set_loss_scale may change it there (§4, §9).
        try:
            check_loss_scale(record_scale, dtype)
        except InvalidLossScaleError as error:
            raise RecordError(f"field 'loss_scale': {error}") from None
    elif not _is_real(record_scale) or record_scale != loss_scale:
        raise RecordError(
            f"field 'loss_scale' is {record_scale!r} but this accumulator's loss scale is "
            f"{loss_scale!r} (only a record of an empty window, issued == 0, loads at another "
            f"scale)"
        )
    record_fused = record["fused"]
    if not isinstance(record_fused, bool) or record_fused != fused:
        raise RecordError(
            f"field 'fused' is {record_fused!r} but this accumulator has fused={fused!r}"
        )

    names = record["param_names"]
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise RecordError(f"field 'param_names' must be a list of str, got {names!r}")
    if len(set(names)) != len(names):
        raise RecordError(f"field 'param_names' has duplicate names: {names!r}")
    module_shapes = {name: tuple(shape) for name, shape in tracked}
    if names:
        # A record that binds parameters loads only into a module with exactly those.
        missing_in_module = [name for name in names if name not in module_shapes]
        recorded = set(names)
        extra_in_module = [name for name in module_shapes if name not in recorded]
        if missing_in_module or extra_in_module:
            raise RecordError(
                f"field 'param_names' does not match the module's requires_grad parameters: "
                f"missing from the module {missing_in_module!r}, not in the record "
                f"{extra_in_module!r}"
            )
    shapes_field = record["param_shapes"]
    if not isinstance(shapes_field, list | tuple) or len(shapes_field) != len(names):
        raise RecordError(
            f"field 'param_shapes' must be a list with one shape per name "
            f"({len(names)}), got {shapes_field!r}"
        )
    shapes = tuple(
        _check_shape("param_shapes", index, shape) for index, shape in enumerate(shapes_field)
    )
    for name, shape in zip(names, shapes, strict=True):
        if module_shapes[name] != shape:
            raise RecordError(
                f"field 'param_shapes' gives {name!r} shape {list(shape)} but the module's "
                f"parameter has shape {list(module_shapes[name])}"
            )

    pending = record["pending"]
    if not isinstance(pending, Mapping):
        raise RecordError(f"field 'pending' must be a dict, got {type(pending).__name__}")
    shape_of = dict(zip(names, shapes, strict=True))
    for name, buffer in pending.items():
        if name not in shape_of:
            raise RecordError(f"field 'pending' has a buffer {name!r} that is not in 'param_names'")
        if not isinstance(buffer, torch.Tensor):
            raise RecordError(
                f"field 'pending'[{name!r}] must be a tensor, got {type(buffer).__name__}"
            )
        if buffer.layout != torch.strided:
            raise RecordError(
                f"field 'pending'[{name!r}] must be a dense tensor, got layout {buffer.layout}"
            )
        if buffer.is_meta:
            raise RecordError(f"field 'pending'[{name!r}] is a meta tensor: it holds no values")
        if buffer.dtype != dtype:
            raise RecordError(
                f"field 'pending'[{name!r}] has dtype {buffer.dtype}, expected {dtype}"
            )
        if tuple(buffer.shape) != shape_of[name]:
            raise RecordError(
                f"field 'pending'[{name!r}] has shape {list(buffer.shape)}, expected "
                f"{list(shape_of[name])}"
            )
    issued, zero_weight, total_weight = check_counters(
        issued=record["issued"],
        zero_weight=record["zero_weight"],
        total_weight=record["total_weight"],
        has_pending=bool(pending),
        bound=bool(names),
    )
    if CHECKSUM_KEY in record:
        # Last: every field is known to be well formed, so the bytes hashed are well defined.
        stored = record[CHECKSUM_KEY]
        if not isinstance(stored, str) or not _CHECKSUM_PATTERN.fullmatch(stored):
            raise RecordError(
                f"field {CHECKSUM_KEY!r} must be 'sha256:' and 64 hex digits, got {stored!r}"
            )
        computed = record_checksum(
            dtype=dtype,
            loss_scale=float(record_scale),
            fused=record_fused,
            issued=issued,
            zero_weight=zero_weight,
            total_weight=total_weight,
            param_names=names,
            param_shapes=shapes,
            pending=pending,
        )
        if computed != stored:
            raise RecordError(
                f"field {CHECKSUM_KEY!r} does not match the record's content (stored {stored}, "
                f"computed {computed}): the record was changed or damaged after it was written"
            )
    return ValidatedRecord(
        issued=issued,
        zero_weight=zero_weight,
        total_weight=total_weight,
        param_names=tuple(names),
        param_shapes=shapes,
        pending=dict(pending),
    )


def record_checksum(
    *,
    dtype: torch.dtype,
    loss_scale: float,
    fused: bool,
    issued: int,
    zero_weight: int,
    total_weight: float,
    param_names: Sequence[str],
    param_shapes: Sequence[Sequence[int]],
    pending: Mapping[str, torch.Tensor],
) -> str:
    """The ``checksum`` of a record with these fields (canonical bytes: module docstring)."""
    ordered = [name for name in param_names if name in pending]
    header = [
        FORMAT_VERSION,
        dtype_name(dtype),
        float(loss_scale).hex(),
        fused,
        issued,
        zero_weight,
        float(total_weight).hex(),
        list(param_names),
        [[int(size) for size in shape] for shape in param_shapes],
        ordered,
    ]
    digest = hashlib.sha256(json.dumps(header, separators=(",", ":")).encode())
    bits_dtype, canonical_nan = _BITS[dtype]
    for name in ordered:
        buffer = pending[name].detach()
        if buffer.device.type != "cpu":
            buffer = buffer.to("cpu")
        bits = buffer.contiguous().view(bits_dtype)
        # amax propagates NaN and is about 30x cheaper than an isnan mask: build the mask only
        # for a buffer that holds a NaN.
        if buffer.numel() and math.isnan(buffer.amax().item()):
            bits = bits.masked_fill(buffer.isnan(), canonical_nan)
        array = bits.numpy()
        digest.update(np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).data)
    return "sha256:" + digest.hexdigest()


def record_checksum_of(record: Mapping[str, Any]) -> str:
    """:func:`record_checksum` of a well-formed record's own fields (its ``checksum`` ignored).

    To re-seal a record edited on purpose: ``record["checksum"] = record_checksum_of(record)``.
    """
    return record_checksum(
        dtype=WORK_DTYPES[record["dtype"]],
        loss_scale=record["loss_scale"],
        fused=record["fused"],
        issued=record["issued"],
        zero_weight=record["zero_weight"],
        total_weight=record["total_weight"],
        param_names=record["param_names"],
        param_shapes=record["param_shapes"],
        pending=record["pending"],
    )


def save_record(record: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a record (from ``state_dict()`` or ``state_dict_async().result()``) to ``path``."""
    torch.save(dict(record), path)


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a record file written by :func:`save_record`, onto the CPU, without running code.

    The file is read with ``torch.load(..., weights_only=True)``: a pickle payload that would
    import or call anything beyond plain containers and tensors is refused with
    :class:`RecordError`, as is a file that is not a torch archive or a damaged one. The
    returned dict is not validated yet; ``load_state_dict`` does that. ``OSError`` (missing
    file, ...) from opening the file propagates; once it is open, every failure to read a
    record from it (a truncated or damaged archive included) is :class:`RecordError`.
    """
    # Opened here, so that an OSError means the file could not be opened: torch.load's zip
    # reader itself raises OSError (EINVAL) for an archive truncated past its first 4096 bytes
    # or with a damaged end record, which is damage, not a missing file.
    with open(path, "rb") as file:
        try:
            record = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            # A damaged archive fails anywhere in torch.load's zip reader and unpickler, with
            # many types (OSError, UnpicklingError, RuntimeError, UnicodeDecodeError, KeyError,
            # IndexError, struct.error, ...): each means the file holds no readable record.
            raise RecordError(f"record file {os.fspath(path)!r} was refused: {error!r}") from error
    if not isinstance(record, dict) or not all(isinstance(key, str) for key in record):
        raise RecordError(
            f"record file {os.fspath(path)!r} does not hold a dict with str keys "
            f"(got {type(record).__name__})"
        )
    return record
