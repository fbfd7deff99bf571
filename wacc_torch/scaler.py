"""A dynamic loss scale decided window by window: :class:`WindowLossScaler` (semantics §13).

A float16 window's scaled sums overflow when the loss scale S is too high; a dynamic scale
starts high, skips a window that overflowed and backs off, and grows again after a run of clean
windows. The semantics allow one S per window, changed only between windows by a call the
caller makes by name, so the scaler is an explicit helper around the accumulator::

    scaler = WindowLossScaler(2.0**15, dtype=torch.float16)   # 2**16 is beyond float16
    acc = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=scaler.scale)
    for window in windows:
        acc.set_loss_scale(scaler.scale)          # the window is empty here
        for batch in window:
            (scaler.scale * loss_sum(batch)).backward()
            acc.accumulate_sum(model, tokens(batch))
        result = acc.finish_mean()
        if scaler.update(result.found_inf):       # False: skip this window
            result.apply_to(model)
            optimizer.step()
        model.zero_grad(set_to_none=True)

Its policy is ``torch.amp.GradScaler``'s at window granularity, with its defaults, plus the
``hysteresis`` of Megatron-LM's ``DynamicGradScaler`` and DeepSpeed's ``DynamicLossScaler``, and
optional bounds. Every scale it produces is exactly representable in the work dtype D (see
:meth:`WindowLossScaler.update` for how a new scale is rounded and when it is not taken).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch

from wacc_torch._dtypes import check_loss_scale, check_work_dtype, dtype_name
from wacc_torch._scalars import read_real
from wacc_torch.errors import InvalidLossScaleError, RecordError, WeightedAccumulationError

__all__ = ["SCALER_KEYS", "WindowLossScaler", "round_to_dtype"]

# Every key of WindowLossScaler.state_dict(), in order (documented in its docstring).
SCALER_KEYS = (
    "format_version",
    "dtype",
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "growth_tracker",
    "hysteresis_left",
)
_FORMAT_VERSION = 1


# (precision p in bits, emin, emax) of each work dtype, checked against torch.finfo at import.
_FORMATS: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float64: (53, -1022, 1023),
    torch.float32: (24, -126, 127),
    torch.float16: (11, -14, 15),
    torch.bfloat16: (8, -126, 127),
}
for _dtype, (_p, _emin, _emax) in _FORMATS.items():
    _info = torch.finfo(_dtype)
    assert _info.eps == 2.0 ** (1 - _p), _dtype
    assert _info.smallest_normal == 2.0**_emin, _dtype
    assert _info.max == (2 - 2.0 ** (1 - _p)) * 2.0**_emax, _dtype


def round_to_dtype(value: Fraction, dtype: torch.dtype) -> float:
    """``round_D(value)`` for a positive rational: round to nearest, ties to even, with
    gradual underflow, and ``inf`` beyond D's range (§2). Computed exactly (no float64 step,
    which could round twice); the result is a float64 holding a value of D."""
    if value <= 0:
        raise ValueError(f"round_to_dtype needs a positive value, got {value}")
    precision, emin, emax = _FORMATS[dtype]
    exponent = value.numerator.bit_length() - value.denominator.bit_length()
    if Fraction(2) ** exponent > value:
        exponent -= 1  # now 2**exponent <= value < 2**(exponent + 1)
    quantum = Fraction(2) ** (max(exponent, emin) - precision + 1)
    steps = value / quantum
    whole = math.floor(steps)
    rest = steps - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    rounded = whole * quantum
    if rounded > (2 - Fraction(2) ** (1 - precision)) * Fraction(2) ** emax:
        return math.inf
    return float(rounded)


def _read_factor(value: object, *, what: str, above_one: bool) -> float:
    """A growth factor (> 1) or backoff factor (0 < f < 1): a finite real read exactly."""
    number = read_real(value, what=what, error=WeightedAccumulationError)
    wanted = "> 1" if above_one else "strictly between 0 and 1"
    if isinstance(number, float) and not math.isfinite(number):
        raise WeightedAccumulationError(f"{what} must be a finite number {wanted}, got {value!r}")
    if not (number > 1 if above_one else 0 < number < 1):
        raise WeightedAccumulationError(f"{what} must be a finite number {wanted}, got {value!r}")
    try:
        factor = float(number)
    except OverflowError:  # an int beyond float64's range (10**400, 2**1024)
        factor = math.inf
    if factor != number:
        raise WeightedAccumulationError(f"{what} {value!r} is not exactly a float64")
    return factor


def _read_count(value: object, *, what: str) -> int:
    """A positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 1, got {value!r}")
    if value < 1:
        raise WeightedAccumulationError(f"{what} must be an int >= 1, got {value!r}")
    return value


class WindowLossScaler:
    """A dynamic loss scale for float16 (or any work dtype), decided once per window.

    ``init_scale`` is the first window's scale; ``growth_factor`` (> 1), ``backoff_factor``
    (0 < f < 1) and ``growth_interval`` (clean windows before a growth) are
    ``torch.amp.GradScaler``'s, with its defaults. ``hysteresis`` (default 1: back off at every
    overflow, as GradScaler) is the number of overflowing windows since the last growth (or the
    start) that back off: the ones before are skipped without changing the scale (Megatron-LM's
    and DeepSpeed's default). ``min_scale`` / ``max_scale`` (default None: unbounded) bound every
    scale. ``dtype`` is the work dtype D of the accumulator the scales are for: every scale is
    exactly representable in it, and so is every bound and ``init_scale`` (else
    :class:`InvalidLossScaleError`, naming the value). The default, float32, is GradScaler's own
    scale dtype and the work dtype of mixed-precision training (float32 parameters and ``.grad``,
    float16 activations, whose overflow reaches the float32 gradients as inf or NaN); with
    ``dtype=torch.float16`` (pure float16 buffers) start at ``2.0**15`` or below.

    Lifecycle: read :attr:`scale`, give it to the accumulator (``set_loss_scale``) while its
    window is empty, accumulate the window, finish it, then :meth:`update` with the finished
    result's ``found_inf`` exactly once: it answers whether the window may be applied and sets the
    next window's scale. Nothing else changes the scale.
    """

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
        dtype: torch.dtype = torch.float32,
    ) -> None:
        work = check_work_dtype(dtype)
        try:
            scale = check_loss_scale(init_scale, work)
        except InvalidLossScaleError as error:
            hint = ""
            if work == torch.float16 and init_scale == 2.0**16:
                hint = " (GradScaler's default 2**16 is beyond float16: start at 2.0**15)"
            raise InvalidLossScaleError(f"init_scale: {error}{hint}") from None
        growth = _read_factor(growth_factor, what="growth_factor", above_one=True)
        backoff = _read_factor(backoff_factor, what="backoff_factor", above_one=False)
        interval = _read_count(growth_interval, what="growth_interval")
        overflows = _read_count(hysteresis, what="hysteresis")
        low = None if min_scale is None else check_loss_scale(min_scale, work)
        high = None if max_scale is None else check_loss_scale(max_scale, work)
        if low is not None and high is not None and low > high:
            raise InvalidLossScaleError(f"min_scale {low!r} is above max_scale {high!r}")
        if (low is not None and scale < low) or (high is not None and scale > high):
            raise InvalidLossScaleError(
                f"init_scale {scale!r} is outside [min_scale, max_scale] = [{low!r}, {high!r}]"
            )
        self._dtype = work
        self._scale = scale
        self._growth = growth
        self._backoff = backoff
        self._interval = interval
        self._hysteresis = overflows
        self._min = low
        self._max = high
        self._growth_tracker = 0
        self._hysteresis_left = overflows

    # ------------------------------------------------------------------------------ reading
    @property
    def scale(self) -> float:
        """The loss scale of the next (or current) window: a finite value > 0 of D."""
        return self._scale

    @property
    def dtype(self) -> torch.dtype:
        """The work dtype every scale is exactly representable in."""
        return self._dtype

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(scale={self._scale!r}, growth_factor={self._growth!r}, "
            f"backoff_factor={self._backoff!r}, growth_interval={self._interval}, "
            f"hysteresis={self._hysteresis}, min_scale={self._min!r}, max_scale={self._max!r}, "
            f"dtype={self._dtype}, growth_tracker={self._growth_tracker}, "
            f"hysteresis_left={self._hysteresis_left})"
        )

    # ------------------------------------------------------------------------------ update
    def update(self, found_inf: bool) -> bool:
        """Decide on the window just finished and set the next window's scale.

        ``found_inf`` is the finished result's (``AccumulatedGradients.found_inf``). Returns True
        when the window may be applied (it did not overflow), False when it must be skipped.

        * Overflow: the run of clean windows restarts (``growth_tracker = 0``) and
          ``hysteresis_left`` drops by one (not below 0); when it reaches 0 the scale backs off to
          ``round_D(round_64(scale * backoff_factor))``, at least ``min_scale``.
        * Clean: ``growth_tracker`` counts it; at ``growth_interval`` it restarts at 0,
          ``hysteresis_left`` is restored to ``hysteresis`` and the scale grows to
          ``round_D(round_64(scale * growth_factor))``, at most ``max_scale``.

        The product is GradScaler's: the float64 product, then rounded to D (each rounding to
        nearest, ties to even; a power-of-two factor never rounds), so for D = float32 every scale
        is ``torch._amp_update_scale_``'s bit for bit. A new scale that D cannot hold is not
        taken: growth beyond D's largest finite value gives ``max_scale`` when set, else the
        scale stays (as GradScaler keeps its scale when growth would make it infinite); a backoff
        that underflows to 0 gives ``min_scale`` when set, else the scale stays. Raises
        ``TypeError`` (nothing changed) when ``found_inf`` is not a bool.
        """
        if not isinstance(found_inf, bool):
            raise TypeError(
                f"found_inf must be a bool (the finished result's .found_inf), got {found_inf!r}"
            )
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
        # GradScaler's arithmetic (_amp_update_scale_, CPU and CUDA): the float64 product of the
        # scale and the float64 factor, then converted to the scale's dtype: two roundings.
        product = self._scale * factor  # round_64 of the exact product (inf past float64's top)
        if product == math.inf or product == 0.0:
            proposed = product
        else:
            proposed = round_to_dtype(Fraction(product), self._dtype)
        if proposed == math.inf:
            return self._scale if self._max is None else self._max
        if proposed == 0.0:
            return self._scale if self._min is None else self._min
        if self._max is not None and proposed > self._max:
            return self._max
        if self._min is not None and proposed < self._min:
            return self._min
        return proposed

    # ----------------------------------------------------------------------------- records
    def state_dict(self) -> dict[str, Any]:
        """The scaler as plain Python values, to save next to the accumulator's record.

        Keys (:data:`SCALER_KEYS`): ``format_version`` (int, 1); ``dtype`` (str, the work dtype
        without ``torch.``); ``scale`` (float, the next window's); ``growth_factor``,
        ``backoff_factor`` (float); ``growth_interval``, ``hysteresis`` (int); ``min_scale``,
        ``max_scale`` (float or None); ``growth_tracker`` (int, clean windows since the last
        change, ``0 <= growth_tracker < growth_interval``); ``hysteresis_left`` (int, overflows
        still absorbed before a backoff, ``0 <= hysteresis_left <= hysteresis``).
        """
        return {
            "format_version": _FORMAT_VERSION,
            "dtype": dtype_name(self._dtype),
            "scale": self._scale,
            "growth_factor": self._growth,
            "backoff_factor": self._backoff,
            "growth_interval": self._interval,
            "hysteresis": self._hysteresis,
            "min_scale": self._min,
            "max_scale": self._max,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`), bit for bit.

        The options in ``state`` (dtype, factors, interval, hysteresis, bounds) must equal this
        scaler's: a scaler built with other options would continue another sequence. Every field
        is checked before anything changes: a missing or unknown key, a wrong type, a value out
        of its range or a differing option raises :class:`RecordError` naming the field.
        """
        if not isinstance(state, Mapping):
            raise RecordError(f"a scaler state must be a mapping, got {type(state).__name__}")
        missing = [key for key in SCALER_KEYS if key not in state]
        unknown = sorted(str(key) for key in state if key not in SCALER_KEYS)
        if missing or unknown:
            raise RecordError(f"scaler state: missing keys {missing}, unknown keys {unknown}")
        mine = self.state_dict()
        for key in ("format_version", "dtype", "growth_interval", "hysteresis"):
            value = state[key]
            if type(value) is not type(mine[key]) or value != mine[key]:
                raise RecordError(
                    f"scaler state field {key!r} is {value!r}, this scaler has {mine[key]!r}"
                )
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = state[key]
            same = value is None if mine[key] is None else type(value) is float
            if not same or value != mine[key]:
                raise RecordError(
                    f"scaler state field {key!r} is {value!r}, this scaler has {mine[key]!r}"
                )
        scale = state["scale"]
        if type(scale) is not float:
            raise RecordError(f"scaler state field 'scale' must be a float, got {scale!r}")
        try:
            check_loss_scale(scale, self._dtype)
        except InvalidLossScaleError as error:
            raise RecordError(f"scaler state field 'scale': {error}") from None
        if (self._min is not None and scale < self._min) or (
            self._max is not None and scale > self._max
        ):
            raise RecordError(
                f"scaler state field 'scale' {scale!r} is outside [min_scale, max_scale] = "
                f"[{self._min!r}, {self._max!r}]"
            )
        for key, top in (
            ("growth_tracker", self._interval - 1),
            ("hysteresis_left", self._hysteresis),
        ):
            value = state[key]
            if type(value) is not int or not 0 <= value <= top:
                raise RecordError(
                    f"scaler state field {key!r} must be an int in [0, {top}], got {value!r}"
                )
        self._scale = scale
        self._growth_tracker = state["growth_tracker"]
        self._hysteresis_left = state["hysteresis_left"]
