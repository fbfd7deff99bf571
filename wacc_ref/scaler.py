"""The reference model of the window loss scaler (semantics §13): decisions and scales, exactly.

:class:`ReferenceLossScaler` is ``wacc_torch.WindowLossScaler`` without torch: the same options,
the same validation classes, the same ``update`` rule, and every new scale computed as
GradScaler computes it: the exact product rounded to float64, then to D, both roundings by
:func:`wacc_ref.formats.round_to`. The suite runs both on the same
overflow decisions and compares the scales bit for bit; the judge's dynamic-scaling scenarios
(issue 17) take their expected scale sequence from it.
"""

from __future__ import annotations

import math
from fractions import Fraction

from wacc_ref.errors import InvalidLossScaleError, WeightedAccumulationError
from wacc_ref.formats import FLOAT64, Format, round_to
from wacc_ref.records import format_value, read_real, validate_loss_scale, validate_work_dtype

__all__ = ["ReferenceLossScaler"]


def _factor(value: object, *, what: str, above_one: bool) -> float:
    number = read_real(value, what=what, error=WeightedAccumulationError)
    wanted = "> 1" if above_one else "strictly between 0 and 1"
    if isinstance(number, float) and not math.isfinite(number):
        raise WeightedAccumulationError(
            f"{what} must be a finite number {wanted}, got {format_value(value)}"
        )
    if not (number > 1 if above_one else 0 < number < 1):
        raise WeightedAccumulationError(
            f"{what} must be a finite number {wanted}, got {format_value(value)}"
        )
    # An int beyond float64's range (10**400, 2**1024) is not a float64 either: round_64 gives inf.
    as_float64 = round_to(number, FLOAT64)
    if not math.isfinite(as_float64) or Fraction(number) != Fraction(as_float64):
        raise WeightedAccumulationError(f"{what} {format_value(value)} is not exactly a float64")
    return float(number)


def _count(value: object, *, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 1, got {value!r}")
    if value < 1:
        raise WeightedAccumulationError(f"{what} must be an int >= 1, got {value!r}")
    return value


class ReferenceLossScaler:
    """semantics §13 for a work dtype named in torch's spelling (``"float16"``, ...)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dtype: str = "float32",
    ) -> None:
        fmt = validate_work_dtype(dtype)
        scale = validate_loss_scale(init_scale, fmt)
        self._growth = _factor(growth_factor, what="growth_factor", above_one=True)
        self._backoff = _factor(backoff_factor, what="backoff_factor", above_one=False)
        self._interval = _count(growth_interval, what="growth_interval")
        self._hysteresis = _count(hysteresis, what="hysteresis")
        low = None if min_scale is None else validate_loss_scale(min_scale, fmt)
        high = None if max_scale is None else validate_loss_scale(max_scale, fmt)
        if low is not None and high is not None and low > high:
            raise InvalidLossScaleError(f"min_scale {low!r} is above max_scale {high!r}")
        if (low is not None and scale < low) or (high is not None and scale > high):
            raise InvalidLossScaleError(
                f"init_scale {scale!r} is outside [min_scale, max_scale] = [{low!r}, {high!r}]"
            )
        self._format: Format = fmt
        self._scale = scale
        self._min = low
        self._max = high
        self._growth_tracker = 0
        self._hysteresis_left = self._hysteresis

    @property
    def scale(self) -> float:
        """The next window's loss scale (a finite value > 0 of D)."""
        return self._scale

    @property
    def growth_tracker(self) -> int:
        """Clean windows since the last change of the run."""
        return self._growth_tracker

    @property
    def hysteresis_left(self) -> int:
        """Overflows still absorbed before a backoff."""
        return self._hysteresis_left

    def update(self, found_inf: bool) -> bool:
        """semantics §13: whether the window may be applied; sets the next window's scale."""
        if not isinstance(found_inf, bool):
            raise TypeError(f"found_inf must be a bool, got {found_inf!r}")
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_left = max(0, self._hysteresis_left - 1)
            if self._hysteresis_left == 0:
                self._scale = self._next(self._backoff)
            return False
        self._growth_tracker += 1
        if self._growth_tracker == self._interval:
            self._growth_tracker = 0
            self._hysteresis_left = self._hysteresis
            self._scale = self._next(self._growth)
        return True

    def _next(self, factor: float) -> float:
        # semantics §13: round_D(round_64(scale × factor)), GradScaler's two roundings.
        product = round_to(Fraction(self._scale) * Fraction(factor), FLOAT64)
        proposed = round_to(product, self._format)
        if math.isinf(proposed):
            return self._scale if self._max is None else self._max
        if proposed == 0.0:
            return self._scale if self._min is None else self._min
        if self._max is not None and proposed > self._max:
            return self._max
        if self._min is not None and proposed < self._min:
            return self._min
        return proposed
