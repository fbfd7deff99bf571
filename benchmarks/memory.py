"""Peak memory by storage lifetimes: a ``TorchDispatchMode`` that logs every storage an op creates.

Process RSS says nothing here (malloc keeps freed pages), and the CPU has no
``max_memory_allocated``. The log records, for every storage an ATen op creates while the mode is
on, its size, when it was created and when it was freed (``weakref.finalize`` on the storage:
PyTorch keeps one Python object per storage alive as long as the storage is), on one clock of
events. A storage is *gradient memory* when, at some sampling point, it is a parameter's ``.grad``
or an accumulator buffer (:meth:`StorageLog.mark`), or when it was created while a frame of the
``wacc_torch`` package was on the Python stack (the accumulator's transients, those made inside its
autograd hooks included), or when the accumulator already held it when the log started
(:meth:`StorageLog.held`: a work tensor or arena kept from an earlier window is memory the step
holds, though no op of the step made it). Peak gradient memory is the maximum over time of the
live bytes of gradient storages; the whole peak counts every logged storage.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PACKAGE = "wacc_torch"


@dataclass
class StorageRecord:
    """One logged storage: bytes, creation and free times (event clock), classification."""

    nbytes: int
    created: int
    freed: int | None = None
    gradient: bool = False


def _in_package_frame(package: str) -> bool:
    frame: FrameType | None = sys._getframe(2)  # skip this helper and __torch_dispatch__
    prefix = package + "."
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == package or name.startswith(prefix):
            return True
        frame = frame.f_back
    return False


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class StorageLog(TorchDispatchMode):
    """Logs the storages ops create while active; see the module docstring for the definitions."""

    def __init__(self, *, package: str = PACKAGE) -> None:
        super().__init__()
        self.package = package
        self.records: list[StorageRecord] = []
        self._live: dict[int, int] = {}  # storage data_ptr -> index of its live record
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _free(self, key: int, index: int) -> None:
        self.records[index].freed = self._tick()
        if self._live.get(key) == index:
            del self._live[key]

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        inputs = {
            _storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        fresh = []
        for tensor in outputs:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self._live or storage.nbytes() == 0:
                continue  # in place, a view of an input, or already logged
            fresh.append((storage, key))
        if fresh:
            gradient = _in_package_frame(self.package)
            for storage, key in fresh:
                index = len(self.records)
                self.records.append(StorageRecord(storage.nbytes(), self._tick(), None, gradient))
                self._live[key] = index
                weakref.finalize(storage, self._free, key, index)
        return out

    def held(self, tensors: Iterable[torch.Tensor]) -> None:
        """Gradient memory that exists before the log starts and is kept (an accumulator's work
        tensor and arenas, made in an earlier window): live from the first event until freed."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._live or storage.nbytes() == 0:
                continue
            index = len(self.records)
            self.records.append(StorageRecord(storage.nbytes(), 0, None, True))
            self._live[key] = index
            weakref.finalize(storage, self._free, key, index)

    def mark(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """A sampling point: the live logged storages of ``tensors`` are gradient memory."""
        for tensor in tensors:
            if tensor is None:
                continue
            index = self._live.get(_storage_key(tensor))
            if index is not None:
                self.records[index].gradient = True

    def peak(self, *, gradient_only: bool) -> int:
        """Maximum over the event clock of the live bytes of (gradient) storages."""
        events: list[tuple[int, int]] = []
        for record in self.records:
            if gradient_only and not record.gradient:
                continue
            events.append((record.created, record.nbytes))
            if record.freed is not None:
                events.append((record.freed, -record.nbytes))
        live = peak = 0
        for _, change in sorted(events):
            live += change
            peak = max(peak, live)
        return peak
