"""Prepare, then commit: the marker of a commit phase, and ordinary tensors under inference mode.

Every public mutating call first prepares (validation, conversion, allocation of every buffer and
temporary: anything that may raise) and then commits inside ``with _commit.COMMIT:`` with
operations that cannot fail on validated, prepared inputs (in-place kernels into our own dense
buffers, attribute assignments). So a call that raises, out of memory included, changes nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from types import TracebackType

import torch

__all__ = ["COMMIT", "CommitPhase", "ordinary_tensors"]


class CommitPhase:
    """Marks a commit phase. It does nothing at run time; the fault-injection tests replace
    :data:`COMMIT` (looked up as ``_commit.COMMIT`` at each use, in every module) to tell the
    phases apart."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


COMMIT = CommitPhase()


def ordinary_tensors() -> AbstractContextManager[object]:
    """Buffers, temporaries and handed-over tensors must be ordinary tensors even when the caller
    is in ``torch.inference_mode()``: an inference tensor cannot be updated in place outside it."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return nullcontext()
