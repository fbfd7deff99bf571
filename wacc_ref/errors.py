"""The error hierarchy of the reference model (semantics §11).

``wacc_torch`` defines its own copy with the same names; the suite compares the *class names* of
what the two raise for the same call.  Every class is a ``ValueError``: each one reports bad user
input (an argument, a weight, a record), never an internal failure.
"""

from __future__ import annotations

__all__ = [
    "ExactModeError",
    "InvalidLossScaleError",
    "InvalidWeightError",
    "ParameterMismatchError",
    "RecordError",
    "UnsupportedEnvironmentError",
    "WeightedAccumulationError",
    "ZeroTotalWeightError",
]


class WeightedAccumulationError(ValueError):
    """Base class of every error the accumulator raises for bad input (semantics §11)."""


class InvalidLossScaleError(WeightedAccumulationError):
    """The loss scale is not a finite value > 0 that is exactly representable in the work dtype."""


class InvalidWeightError(WeightedAccumulationError):
    """A weight that is not a finite number >= 0, or a mean weight that does not survive ``D``."""


class ParameterMismatchError(WeightedAccumulationError):
    """Parameter names, shapes or gradient dtype kinds that do not match the tracked set."""


class ZeroTotalWeightError(WeightedAccumulationError):
    """``finish_mean`` on a window whose total weight is zero (nothing is cleared)."""


class RecordError(WeightedAccumulationError):
    """A record (state_dict) that is malformed or does not fit this accumulator."""


class UnsupportedEnvironmentError(WeightedAccumulationError):
    """The floating-point environment would change results: the CPU flushes subnormals (FTZ/DAZ,
    e.g. after ``torch.set_flush_denormal(True)`` in the same process).  Raised before anything
    changes, like ``wacc_torch``'s class of the same name."""


class ExactModeError(WeightedAccumulationError):
    """Reference-only: a non-finite gradient value handed to the ``exact`` (real-number) mode.

    The real-number semantics of semantics §12.2 has no NaN or infinity, so the exact mode refuses
    them instead of inventing a meaning; the emulated mode accepts them as the semantics says.
    """
