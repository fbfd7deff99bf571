"""Records of a window taken now (``state_dict``) or copied asynchronously (``state_dict_async``).

An asynchronous snapshot issues its device-to-host copies on each buffer's current CUDA stream and
records an event after them; until the window has made every later change wait for those events
(:meth:`Snapshots.await_copies`), a buffer may not be written or handed over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from wacc_torch import _commit
from wacc_torch.errors import RecordError
from wacc_torch.records import CHECKSUM_KEY, record_checksum_of

__all__ = ["Snapshots", "StateDictHandle"]


class StateDictHandle:
    """A pending ``state_dict_async()`` snapshot; :meth:`result` waits for it.

    The device-to-host copies were issued on each buffer's current CUDA stream when the
    snapshot was taken; ``result`` waits on the CUDA events recorded right after them. The
    handle keeps the source buffers alive until then, and each source was marked as used on
    the copy's stream (``record_stream``), so freeing or reusing a buffer (after
    ``finish_sums`` hands it over, on any stream) cannot overwrite it under the copy.
    """

    def __init__(
        self,
        record: dict[str, Any],
        events: list[torch.cuda.Event],
        sources: list[torch.Tensor],
        *,
        checksum: bool = True,
    ) -> None:
        self._record = record
        self._checksum = checksum
        self._events = events
        self._sources: list[torch.Tensor] | None = sources

    def done(self) -> bool:
        """Whether every device-to-host copy of the snapshot has completed."""
        return all(event.query() for event in self._events)

    def result(self) -> dict[str, Any]:
        """Wait for the copies and return the record (same content as ``state_dict()``)."""
        for event in self._events:
            event.synchronize()
        self._sources = None  # the copies are complete: the sources may go
        if self._checksum and CHECKSUM_KEY not in self._record:
            # Only now are the host copies complete, so only now can their bytes be hashed.
            self._record[CHECKSUM_KEY] = record_checksum_of(self._record)
        return self._record


def _refuse_meta(pending: Mapping[str, torch.Tensor]) -> None:
    """A window on the meta device accumulates shapes only (tracing, memory planning): its
    buffers hold no values to write, and a record of them could never be loaded (§11)."""
    for name, buffer in pending.items():
        if buffer.is_meta:
            raise RecordError(
                f"cannot write a record: the buffer of parameter {name!r} is on the meta "
                "device and holds no values"
            )


class Snapshots:
    """The window's snapshots in flight: copies made now or asynchronously, and the events a
    change of a buffer must wait for."""

    def __init__(self) -> None:
        self._events: list[tuple[torch.device, torch.cuda.Event]] = []

    def take(
        self, header: dict[str, Any], pending: Mapping[str, torch.Tensor], *, checksum: bool
    ) -> dict[str, Any]:
        """``header`` with CPU copies of ``pending`` (and the checksum): ``state_dict()``."""
        _refuse_meta(pending)
        record = dict(header)
        with _commit.ordinary_tensors():
            record["pending"] = {
                name: buffer.detach().to("cpu", copy=True) for name, buffer in pending.items()
            }
        if checksum:
            record[CHECKSUM_KEY] = record_checksum_of(record)
        return record

    def take_async(
        self, header: dict[str, Any], pending: Mapping[str, torch.Tensor], *, checksum: bool
    ) -> StateDictHandle:
        """``header`` with copies of ``pending`` made asynchronously: ``state_dict_async()``."""
        _refuse_meta(pending)
        record = dict(header)
        copies: dict[str, torch.Tensor] = {}
        cuda_devices: list[torch.device] = []
        sources: list[torch.Tensor] = []
        with _commit.ordinary_tensors():
            for name, buffer in pending.items():
                if buffer.device.type == "cuda":
                    stream = torch.cuda.current_stream(buffer.device)
                    host = torch.empty(
                        buffer.shape, dtype=buffer.dtype, device="cpu", pin_memory=True
                    )
                    host.copy_(buffer.detach(), non_blocking=True)
                    # The caching allocator must not hand this memory to another stream before
                    # the copy ran, even if the buffer is freed right after this call.
                    buffer.record_stream(stream)
                    sources.append(buffer)
                    copies[name] = host
                    if buffer.device not in cuda_devices:
                        cuda_devices.append(buffer.device)
                else:
                    copies[name] = buffer.detach().to("cpu", copy=True)
        record["pending"] = copies
        events: list[torch.cuda.Event] = []
        for device in cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
            self._events.append((device, event))
        return StateDictHandle(record, events, sources, checksum=checksum)

    def await_copies(self) -> None:
        """Make the current stream of each device wait for the snapshot copies in flight before
        a buffer is changed or handed over, even if the caller switched streams since."""
        for device, event in self._events:
            torch.cuda.current_stream(device).wait_event(event)
        self._events.clear()
