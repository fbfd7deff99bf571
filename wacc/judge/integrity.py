"""Record integrity, a declared feature (semantics §9 Reading "integrity"): whether an
implementation's records refuse a changed byte, found by a probe, and the corruptions that only
such a check can refuse.

Most corruptions of a record are refused by validating its fields: a missing key, a wrong type, a
counter out of range, a file cut short. A byte flipped inside a buffer's data is not: every value
is a valid value, so only an integrity check (a checksum) can tell. Those corruptions are judged
only for an implementation that has the feature ``checksum``; without it they are skipped and the
implementation is reported ``unsupported: checksum`` (allowed with ``--allow-missing checksum``),
whatever the layout of its records:

* records in the documented layout (:data:`wacc_ref.records.RECORD_KEYS`): the kinds of
  :data:`wacc_ref.corruption.CHECKSUM_KINDS`, which need the ``checksum`` field;
* records of any other layout (opaque): ``flipped_byte_file`` (a byte of the saved file flipped,
  where the file still loads and holds something else).

The probe (:func:`probe_integrity`) decides the feature the same way for both layouts: it takes
a record of a small window, flips one byte at :data:`PROBE_FLIPS` places of its saved file, and
loads every flipped file that still loads and differs into a fresh accumulator; the records have
integrity when at least one such load was tried and every one was refused with a §11 error.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wacc.judge.modules import module_of
from wacc_ref.corruption import CHECKSUM_KINDS
from wacc_ref.records import RECORD_KEYS

__all__ = [
    "OPAQUE_INTEGRITY_KINDS",
    "PROBE_FLIPS",
    "SCHEMA_INTEGRITY_KINDS",
    "IntegrityProbe",
    "flip_byte",
    "follows_schema",
    "load_bytes",
    "probe_integrity",
    "same_record",
    "save_bytes",
]

SCHEMA_INTEGRITY_KINDS: tuple[str, ...] = tuple(sorted(CHECKSUM_KINDS))
OPAQUE_INTEGRITY_KINDS: tuple[str, ...] = ("flipped_byte_file",)
# Flipped places in the probe record's file: its buffer (256 float32, 1 KiB) is most of the file,
# so about half of them land in values that still load.
PROBE_FLIPS = 32
_PROBE_ELEMENTS = 256


def follows_schema(record: object) -> bool:
    """Whether ``record`` has ``wacc_torch``'s documented layout (its keys, tensor buffers)."""
    if not isinstance(record, Mapping) or not set(RECORD_KEYS) <= set(record):
        return False
    pending = record["pending"]
    return isinstance(pending, Mapping) and all(
        isinstance(buffer, torch.Tensor) for buffer in pending.values()
    )


def save_bytes(record: object) -> bytes:
    """``record`` as ``torch.save`` writes it to a file."""
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def load_bytes(data: bytes) -> Any:
    """A saved record read back as the judge does (``torch.load(weights_only=True)``)."""
    return torch.load(io.BytesIO(data), weights_only=True)


def flip_byte(data: bytes, position: int) -> bytes:
    """``data`` with every bit of the byte at ``position`` flipped."""
    if not 0 <= position < len(data):
        raise ValueError(f"position {position} is outside the {len(data)} bytes")
    flipped = bytearray(data)
    flipped[position] ^= 0xFF
    return bytes(flipped)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s values in row-major order, whatever its layout and strides (a
    sparse tensor by its dense values, a stride-0 or other non-contiguous one by a copy)."""
    values = tensor.detach().cpu()
    if values.layout != torch.strided:
        values = values.to_dense()
    return values.contiguous().reshape(-1).view(torch.uint8)


def same_record(first: object, second: object) -> bool:
    """Deep equality of two records (tensors bit for bit, NaN positions included, and of the
    same layout). A record is the implementation's: whatever its tensors hold, this answers."""
    if isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor):
        if (first.dtype, first.shape, first.layout) != (second.dtype, second.shape, second.layout):
            return False
        try:
            return torch.equal(_bits(first), _bits(second))
        except Exception:  # a tensor whose values cannot be read back (meta, quantized...):
            return False  # taken as changed, so that what the implementation does is judged
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        return first.keys() == second.keys() and all(
            same_record(first[key], second[key]) for key in first
        )
    if isinstance(first, list | tuple) and isinstance(second, list | tuple):
        return len(first) == len(second) and all(
            same_record(a, b) for a, b in zip(first, second, strict=True)
        )
    return type(first) is type(second) and (first == second or first != first)


@dataclass(frozen=True)
class IntegrityProbe:
    """What :func:`probe_integrity` saw.

    ``layout`` is ``"schema"`` or ``"opaque"`` (``""`` when no record could be taken, and
    ``problem`` says why); ``refused`` and ``accepted`` count the flipped files that loaded,
    differed and were refused with a §11 error or not (an accepted one, or another exception).
    """

    layout: str
    refused: int = 0
    accepted: int = 0
    problem: str = ""

    @property
    def has_integrity(self) -> bool:
        """Whether every changed record the probe tried was refused (and it tried one)."""
        return self.refused > 0 and self.accepted == 0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The corruptions only an integrity check refuses, for records of this layout."""
        return SCHEMA_INTEGRITY_KINDS if self.layout == "schema" else OPAQUE_INTEGRITY_KINDS

    def describe(self) -> str:
        """Why the records lack the feature, in words (empty when they have it)."""
        if self.has_integrity:
            return ""
        if self.problem:
            return f"no probe record could be checked ({self.problem})"
        layout = "in the documented layout" if self.layout == "schema" else "of its own layout"
        if self.accepted:
            return (
                f"records {layout} carry no integrity check: {self.accepted} of "
                f"{self.accepted + self.refused} probe records with a flipped byte loaded "
                "without a §11 error"
            )
        return f"no flipped byte of a probe record {layout} reached the implementation"


def probe_integrity(
    factory: Callable[[torch.dtype, float], Any], *, refusal: Callable[[BaseException], bool]
) -> IntegrityProbe:
    """Whether ``factory``'s records refuse a flipped byte (see the module docstring).

    ``refusal(exc)`` says whether an exception counts as a §11 error. The factory, its
    accumulate, ``state_dict`` and ``load_state_dict`` are called on float32 tensors on the CPU
    with a loss scale of 1; any exception from the first three ends the probe with a problem.
    """
    values = torch.arange(1, _PROBE_ELEMENTS + 1, dtype=torch.float32) / 7

    def fresh() -> tuple[Any, nn.Module]:
        module = module_of({"w": nn.Parameter(torch.zeros(_PROBE_ELEMENTS))})
        return factory(torch.float32, 1.0), module

    try:
        accumulator, module = fresh()
        accumulator.accumulate_sum(module, 1.0, grads={"w": values})
        record = accumulator.state_dict()
        data = save_bytes(record)
        original = load_bytes(data)
        layout = "schema" if follows_schema(record) else "opaque"
    except Exception as exc:  # the implementation under test may raise anything
        return IntegrityProbe(layout="", problem=f"{type(exc).__name__}: {exc}")
    refused = accepted = 0
    for place in range(PROBE_FLIPS):
        try:
            loaded = load_bytes(flip_byte(data, (2 * place + 1) * len(data) // (2 * PROBE_FLIPS)))
        except Exception:  # the file no longer loads: refused before any implementation
            continue
        if same_record(loaded, original):
            continue
        try:
            target, target_module = fresh()
            target.load_state_dict(loaded, target_module)
        except Exception as exc:
            if refusal(exc):
                refused += 1
                continue
        accepted += 1
    return IntegrityProbe(layout=layout, refused=refused, accepted=accepted)
