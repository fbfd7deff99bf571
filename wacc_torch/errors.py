"""Exceptions raised by :mod:`wacc_torch` (semantics §11).

Every class derives from :class:`WeightedAccumulationError`, itself a :class:`ValueError`, so a
caller can catch all bad-input errors of the accumulator at once. A call that raises one of them
has left the accumulator, its pending buffers and the module's ``.grad`` exactly as they were.
"""

from __future__ import annotations

__all__ = [
    "BrokenWindowError",
    "InvalidLossScaleError",
    "InvalidWeightError",
    "ParameterMismatchError",
    "RecordError",
    "UnsupportedEnvironmentError",
    "WeightedAccumulationError",
    "ZeroCopyError",
    "ZeroTotalWeightError",
]


class WeightedAccumulationError(ValueError):
    """Base class of every error the accumulator raises for bad input or bad state."""


class InvalidLossScaleError(WeightedAccumulationError):
    """The loss scale is not a finite float > 0 exactly representable in the work dtype."""


class InvalidWeightError(WeightedAccumulationError):
    """A microbatch weight is not a finite real number >= 0, or does not survive the work dtype."""


class ParameterMismatchError(WeightedAccumulationError):
    """Parameters or gradients disagree with the tracked set (names, shapes, dtype kind, device)."""


class ZeroTotalWeightError(WeightedAccumulationError):
    """A mean was asked for a window whose total weight is zero."""


class RecordError(WeightedAccumulationError):
    """A record (state_dict) or record file is malformed or does not fit this accumulator."""


class UnsupportedEnvironmentError(WeightedAccumulationError):
    """The floating-point environment would change results (CPU flush-to-zero is on).

    Not one of semantics §11's input errors: it is raised before anything is read or changed, so the
    call can be repeated once the environment is fixed (``torch.set_flush_denormal(False)``).
    """


class ZeroCopyError(WeightedAccumulationError):
    """The zero-copy mode cannot do this here, or was asked for the wrong mode.

    Raised before anything changed; remove the cause and call again: a parameter dtype other
    than D, a ``.grad`` the window does not own on a parameter without a pending buffer, DDP
    outside ``no_sync()``, FSDP, a nested block, the buffered calls on a zero-copy accumulator (or
    ``microbatch`` on a buffered one); inside a block (from the backward): a second gradient for
    one parameter (a second backward, ``retain_graph``, reentrant checkpointing of a parameter
    used inside and outside the checkpoint), ``create_graph=True``, a sparse gradient. Every rule:
    :mod:`wacc_torch.zero_copy`.
    """


class BrokenWindowError(WeightedAccumulationError):
    """The window's ``.grad`` no longer hold its sums (zero-copy mode only).

    A backward that raised inside ``acc.microbatch()`` after some gradient was added (a backward
    cannot be undone), or a pending ``.grad`` changed in place, replaced or removed. Only
    ``discard()`` and ``load_state_dict()`` are accepted until then (a ``.grad`` edited outside a
    block is found again by every call: putting the same tensor back also recovers).
    """
