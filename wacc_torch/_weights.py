"""Microbatch weights and window totals: the one rule of every entry point (semantics §4-§6).

Every function of ``wacc_torch`` that takes a weight or a total weight reads it here: the
accumulator's ``accumulate_*`` and ``microbatch``, :func:`~wacc_torch.normalize_sums`, the
distributed helpers, the DDP hook's ``last_microbatch_*`` and ``FSDPWeightedWindow.add_weight``.
Which values count as numbers is :func:`wacc_torch._scalars.read_real`'s rule; what a weight adds
to ``W`` is decided once, by :func:`count_weight`: ``round_64(W + w)`` of the exact sum (an int
beyond 2**53 included), with ``w_D = conv_D(w)`` for a mean.
"""

from __future__ import annotations

import math

import torch

from wacc_torch._dtypes import to_work_dtype
from wacc_torch._environment import check_gradual_underflow, check_readable
from wacc_torch._scalars import add_to_total, as_float64, read_real
from wacc_torch.errors import InvalidWeightError, ZeroTotalWeightError

__all__ = ["count_weight", "read_total_weight", "read_weight"]


def read_weight(weight: object) -> int | float:
    """A microbatch weight, read exactly (an int or a float): a finite real >= 0, else
    :class:`InvalidWeightError` naming it; a subnormal one while subnormals are flushed raises
    :class:`UnsupportedEnvironmentError` (its comparisons with 0 would be wrong)."""
    value = read_real(weight, what="weight", error=InvalidWeightError)
    check_readable(value, "weight")  # before any comparison: FTZ/DAZ would read it as 0
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidWeightError(f"weight must be finite and >= 0, got {weight!r}")
    if value < 0:
        raise InvalidWeightError(f"weight must be finite and >= 0, got {weight!r}")
    return value


def count_weight(
    total: float,
    weight: object,
    value: int | float,
    *,
    dtype: torch.dtype,
    mean: bool,
    caller: str,
) -> tuple[int | float, float]:
    """What a batch of weight ``value`` (read by :func:`read_weight` from ``weight``) counts, and
    the new window total: ``(w, round_64(W + w))``, or ``(w_D, round_64(W + w_D))`` for a mean.

    For ``value > 0`` this is host arithmetic on the CPU (``conv_D`` and ``W + w``), so it first
    refuses flush-to-zero in the calling thread (semantics §11 Reading; ``caller`` names the call
    in the message), then a mean weight whose
    ``w_D`` is 0 or not finite, then a total that overflows float64 (:class:`InvalidWeightError`).
    A zero weight counts nothing and computes nothing: ``(0, total)``.
    """
    if value == 0:
        return value, total
    check_gradual_underflow(caller)
    counted: int | float = value
    if mean:
        # conv_D as PyTorch does it: an int is read through float64 first.
        counted = to_work_dtype(as_float64(value), dtype)
        if counted == 0.0 or not math.isfinite(counted):
            raise InvalidWeightError(
                f"weight {weight!r} does not survive the work dtype {dtype}: it converts to "
                f"{counted!r}"
            )
    new_total = add_to_total(total, counted)
    if not math.isfinite(new_total):
        raise InvalidWeightError(
            f"weight {value!r} makes the total weight overflow ({total!r} + {counted!r})"
        )
    return counted, new_total


def read_total_weight(total_weight: object, *, positive: bool) -> float:
    """A window total ``W`` handed in (a sum of weights): the weight rule, exactly a float64
    (``W`` is a float64 sum), finite, >= 0; with ``positive``, 0 raises
    :class:`ZeroTotalWeightError` (nothing to divide by)."""
    value = read_real(total_weight, what="total_weight", error=InvalidWeightError)
    if positive and value == 0:
        raise ZeroTotalWeightError(
            f"cannot normalize by total weight {total_weight!r}: no positive weight was counted"
        )
    weight = as_float64(value)
    if weight != value and math.isfinite(weight):
        raise InvalidWeightError(
            f"total_weight {total_weight!r} is not exactly a float64 (W is a float64 sum)"
        )
    if not (math.isfinite(weight) and weight >= 0.0):
        raise InvalidWeightError(f"total_weight must be finite and >= 0, got {total_weight!r}")
    return weight
