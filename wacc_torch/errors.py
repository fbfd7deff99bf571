"""Exceptions raised by :mod:`wacc_torch` (semantics §11).

Every class derives from :class:`WeightedAccumulationError`, itself a :class:`ValueError`, so a
caller can catch all bad-input errors of the accumulator at once. A call that raises one of them
has left the accumulator, its pending buffers and the module's ``.grad`` exactly as they were.
"""

from __future__ import annotations

__all__ = [
    "InvalidLossScaleError",
    "InvalidWeightError",
    "ParameterMismatchError",
    "RecordError",
    "UnsupportedEnvironmentError",
    "WeightedAccumulationError",
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
