"""The reference accumulator: semantics §3-§9 and §11, line by line, on exact values (no torch).

:class:`ReferenceAccumulator` has the constructor, methods, counters, errors and records of
``wacc_torch.WeightedGradientsAccumulator`` minus devices.  ``params`` plays the module: an
ordered mapping name -> shape of the parameters that require grad; ``grads`` maps names to
array-likes of floats holding the gradient values exactly (any gradient dtype: ``conv_D`` needs
none, see :func:`wacc_ref.formats.conv_to`).

Modes
-----
``emulated`` (default)
    Every step is semantics' reproducible sequence of roundings, each the exact operation rounded
    once (:mod:`wacc_ref.arith`):

    * sum (§5): ``buf <- round_D(buf + conv_D(g))``; ``W <- round_64(W + w)``;
    * mean (§6): ``t = round_D(conv_D(g) * w_D)``, ``buf <- round_D(buf + t)``;
      ``W <- round_64(W + w_D)``, with ``w_D = conv_D(w)``;
    * finish_mean (§8): ``y = round_D(buf / S)``, ``out = round_D(round_op(y / round_op(W)))``.

    With ``fused=True`` the mean step follows ``fused_variant`` instead, one of the three
    results semantics §6 allows: ``"fma"`` ``round_D(buf + c*w_D)``, ``"op_rounded"``
    ``round_D(round_op(buf + c*w_D))``, ``"two_step"`` the reproducible result; ``c = conv_D(g)``.
``exact``
    No rounding at all (§12.2): contributions ``c_k = g_k`` (sums) or ``g_k * w_D`` (means)
    with ``g`` as handed in (before conversion), ``W`` the exact sum of the counted weights
    (``w``, or ``w_D`` for means).  Pending sums and ``W`` are exact :class:`fractions.Fraction`
    values.  ``finish_*`` return ``grads`` = the exact result rounded ONCE to float64 (from the
    exact rational, so there is no double rounding) and ``exact_grads`` = the exact result rounded
    once to ``precision`` bits as :class:`mpmath.mpf` (the final division ``sum / (S*W)`` is the
    only operation done at that precision, with ``mpmath.libmp`` and an explicit precision).
    NaN or infinite gradients raise :class:`~wacc_ref.errors.ExactModeError`.

Tracked set: ``params`` is matched by name (its order does not matter; the first binding's
order is the records' ``param_names``).  A window with nothing in it (``issued == 0``) binds to
the ``params`` it is given, so the set can change between windows (unfreezing, adapters); inside
a window a change raises :class:`~wacc_ref.errors.ParameterMismatchError`, as in ``wacc_torch``.
Weights and loss scales follow :func:`wacc_ref.records.read_real` (``wacc_torch``'s rule).

Lazy buffers: a parameter's buffer is allocated at +0.0 on its first non-None gradient in a
batch with weight > 0, so a first contribution of -0.0 gives ``round(+0 + -0) = +0``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, TypeVar, cast

import mpmath
import mpmath.libmp
import numpy as np
import numpy.typing as npt

from wacc_ref import arith
from wacc_ref.arith import (
    BitwiseFloat,
    fused_mean_step_accepts,
    fused_mean_step_candidates,
)
from wacc_ref.errors import (
    InvalidLossScaleError,
    ParameterMismatchError,
    RecordError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroTotalWeightError,
)
from wacc_ref.formats import FLOAT64, Format, op_format, round_to
from wacc_ref.records import (
    CHECKSUM_KEY,
    FORMAT_VERSION,
    Binding,
    check_finite_gradient,
    converted_mean_weight,
    format_value,
    record_checksum,
    total_after,
    validate_binding,
    validate_counters,
    validate_gradients,
    validate_loss_scale,
    validate_params,
    validate_pending,
    validate_record,
    validate_weight,
    validate_work_dtype,
)

__all__ = [
    "FUSED_VARIANTS",
    "MODES",
    "BitwiseFloat",
    "ReferenceAccumulator",
    "ReferenceResult",
    "ReferenceState",
    "fused_mean_step_accepts",
    "fused_mean_step_candidates",
]

FusedVariant = Literal["fma", "op_rounded", "two_step"]
Mode = Literal["emulated", "exact"]
FUSED_VARIANTS: tuple[str, ...] = ("fma", "op_rounded", "two_step")
MODES: tuple[str, ...] = ("emulated", "exact")
_MIN_PRECISION = 2  # mpmath needs at least 1 bit; 2 keeps round-to-nearest meaningful
_T = TypeVar("_T")  # what a check returns (refusals_due)


@dataclass(frozen=True)
class ReferenceState:
    """A copy of the accumulator's scalar state (semantics §3); reading it changes nothing.

    ``total_weight`` is a float in ``emulated`` mode and an exact Fraction in ``exact`` mode.
    """

    dtype: str
    loss_scale: float
    issued: int
    zero_weight: int
    total_weight: float | Fraction
    fused: bool


@dataclass(frozen=True)
class ReferenceResult:
    """What ``finish_sums`` / ``finish_mean`` hand over (semantics §7, §8).

    ``grads`` maps every tracked parameter to a float64 array (``None`` for a parameter without
    a buffer in the window).  ``emulated``: the exact D values.  ``exact``: the exact result
    rounded once to float64.  ``exact_grads`` (``exact`` mode only): object arrays of
    :class:`mpmath.mpf`, the exact result rounded once to the accumulator's ``precision``;
    ``exact_weight`` (``exact`` mode only): W as an exact Fraction (``weight`` is W rounded once
    to float64). ``found_inf``: whether any value of ``grads`` is NaN or ±inf (semantics §7, §8;
    in ``exact`` mode only a value beyond float64's range can be).
    """

    grads: dict[str, np.ndarray | None]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool
    exact_grads: dict[str, np.ndarray | None] | None = None
    exact_weight: Fraction | None = None
    found_inf: bool = False


def _found_inf(grads: Mapping[str, np.ndarray | None]) -> bool:
    """semantics §7/§8: whether any handed-over value is NaN or ±inf."""
    return any(not bool(np.isfinite(g).all()) for g in grads.values() if g is not None)


def _object_array(values: list[Fraction], shape: tuple[int, ...]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array.reshape(shape)


def _exact_gradient(name: str, gradient: npt.NDArray[np.float64]) -> np.ndarray:
    check_finite_gradient(name, gradient)
    return _object_array([Fraction(v) for v in gradient.reshape(-1).tolist()], gradient.shape)


def _check_gradual_underflow() -> None:
    """The arithmetic below needs IEEE gradual underflow (as semantics §2 does)."""
    try:
        arith.check_gradual_underflow()
    except RuntimeError as error:
        raise UnsupportedEnvironmentError(str(error)) from None


def _mpf(value: Fraction, precision: int) -> mpmath.mpf:
    """``value`` rounded once to ``precision`` bits, nearest-even, as an mpf (never global prec)."""
    raw = mpmath.libmp.from_rational(value.numerator, value.denominator, precision, "n")
    return mpmath.mpf(raw, prec=precision, rounding="n")


class ReferenceAccumulator:
    """Pure-Python model of ``WeightedGradientsAccumulator`` (§3-§9, §11); see the module doc.

    Options: ``dtype`` the work dtype D (torch spelling), ``loss_scale`` S, ``fused`` (§6 opt-in
    one-pass mean step; declared in ``state``), ``fused_variant`` which of the allowed fused
    results the emulation follows, ``mode`` ``"emulated"`` or ``"exact"``, ``precision`` the
    bits of ``exact_grads`` in exact mode.
    """

    def __init__(
        self,
        *,
        dtype: str,
        loss_scale: float,
        fused: bool = False,
        fused_variant: str = "fma",
        mode: str = "emulated",
        precision: int = 256,
    ) -> None:
        work_dtype = validate_work_dtype(dtype)
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        if fused_variant not in FUSED_VARIANTS:
            raise ValueError(f"fused_variant {fused_variant!r} is not one of {FUSED_VARIANTS}")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if isinstance(precision, bool) or not isinstance(precision, int):
            raise TypeError(f"precision must be an int (bits), got {precision!r}")
        if precision < _MIN_PRECISION:
            raise ValueError(f"precision must be >= {_MIN_PRECISION} bits, got {precision}")
        self._dtype: Format = work_dtype
        self._loss_scale = validate_loss_scale(loss_scale, self._dtype)
        self._fused = fused
        self._fused_variant = cast(FusedVariant, fused_variant)
        self._mode = cast(Mode, mode)
        self._precision = precision
        self._binding: Binding | None = None
        self._pending: dict[str, np.ndarray] = {}
        self._issued = 0
        self._zero_weight = 0
        self._total_weight: float | Fraction = Fraction(0) if self._exact else 0.0

    # -- read-only views ---------------------------------------------------------------------

    @property
    def _exact(self) -> bool:
        return self._mode == "exact"

    @property
    def mode(self) -> str:
        """``"emulated"`` or ``"exact"``."""
        return self._mode

    @property
    def fused_variant(self) -> str:
        """Which semantics §6 fused result the emulation follows when ``fused`` is on."""
        return self._fused_variant

    @property
    def precision(self) -> int:
        """Bits of ``exact_grads`` in exact mode."""
        return self._precision

    @property
    def state(self) -> ReferenceState:
        """A copy of ``dtype, loss_scale, issued, zero_weight, total_weight, fused``."""
        return ReferenceState(
            dtype=self._dtype.name,
            loss_scale=self._loss_scale,
            issued=self._issued,
            zero_weight=self._zero_weight,
            total_weight=self._total_weight,
            fused=self._fused,
        )

    @property
    def param_names(self) -> list[str]:
        """The tracked parameters in registration order (``[]`` while none is bound)."""
        return [name for name, _ in self._binding or ()]

    # -- accumulation --------------------------------------------------------------------------

    def _accumulate(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        grads: Mapping[str, npt.ArrayLike | None],
        *,
        mean: bool,
    ) -> None:
        # Validate everything and compute the new window into locals; commit at the end only.
        w = validate_weight(weight)
        # A window with nothing in it (issued == 0) binds to the current set: the tracked set can
        # change between windows (unfreezing, adapters), never inside one.
        binding = validate_binding(params, self._binding, rebind=self._issued == 0)
        # Structure (names, dtype kinds, shapes) is checked for every call; values are read only
        # for a weight > 0 (semantics §5: a zero-weight batch reads no gradient).
        checked = validate_gradients(grads, binding)
        if w == 0:
            self._binding = binding
            self._issued += 1
            self._zero_weight += 1
            return
        # The environment before any arithmetic, as wacc_torch checks it (semantics §5 Reading:
        # the order of the checks), then whether w_D survives D, then the overflow of W.
        _check_gradual_underflow()
        w_counted = converted_mean_weight(w, self._dtype) if mean else w
        # round_64(W + w), or exact; a W that overflows float64 is refused, as wacc_torch does.
        new_total = total_after(self._total_weight, w, w_counted)
        new_pending = dict(self._pending)
        for name, gradient in checked.items():
            if self._exact:
                new_pending[name] = self._exact_step(name, gradient, w_counted if mean else None)
            else:
                new_pending[name] = self._emulated_step(name, gradient, w_counted if mean else None)
        self._binding = binding
        self._pending = new_pending
        self._total_weight = new_total
        self._issued += 1

    def _emulated_step(
        self, name: str, gradient: npt.NDArray[np.float64], w_d: float | None
    ) -> npt.NDArray[np.float64]:
        d = self._dtype
        old = self._pending.get(name)
        buf = np.zeros(gradient.shape, dtype=np.float64) if old is None else old
        c = arith.conv_array(gradient, d)
        if w_d is None:
            return arith.add_rounded(buf, c, d)
        variant = self._fused_variant if self._fused else "two_step"
        if variant == "fma":
            return arith.fma_rounded(buf, c, w_d, d)
        if variant == "op_rounded":
            return arith.round_array(arith.fma_rounded(buf, c, w_d, op_format(d)), d)
        t = arith.mul_rounded(c, w_d, d)
        return arith.add_rounded(buf, t, d)

    def _exact_step(
        self, name: str, gradient: npt.NDArray[np.float64], w_d: float | None
    ) -> np.ndarray:
        contributions = _exact_gradient(name, gradient).reshape(-1).tolist()
        if w_d is not None:
            weight = Fraction(w_d)
            contributions = [c * weight for c in contributions]
        old = self._pending.get(name)
        if old is not None:
            contributions = [
                a + c for a, c in zip(old.reshape(-1).tolist(), contributions, strict=True)
            ]
        return _object_array(contributions, gradient.shape)

    def accumulate_sum(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        *,
        grads: Mapping[str, npt.ArrayLike | None],
    ) -> None:
        """semantics §5: add a loss-SUM microbatch of token/sample count ``weight``.

        ``w == 0``: only ``issued`` and ``zero_weight`` move (no gradient value is read).
        ``w > 0``: ``buf <- round_D(buf + conv_D(g))`` per element, ``W <- round_64(W + w)``.
        A gradient that is missing or None is a zero contribution.  Raises
        :class:`InvalidWeightError`, :class:`ParameterMismatchError` (or ``ExactModeError``);
        state is unchanged after any raise.
        """
        self._accumulate(params, weight, grads, mean=False)

    def accumulate_mean(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        *,
        grads: Mapping[str, npt.ArrayLike | None],
    ) -> None:
        """§6: add a loss-MEAN microbatch; it contributes ``g * w_D`` with ``w_D = conv_D(w)``.

        Reproducible order: ``t = round_D(conv_D(g) * w_D)``, ``buf <- round_D(buf + t)``,
        ``W <- round_64(W + w_D)`` (or the chosen fused variant).  ``w > 0`` whose ``w_D`` is 0 or
        not finite raises :class:`InvalidWeightError`; state is unchanged after any raise.
        """
        self._accumulate(params, weight, grads, mean=True)

    def refusals_due(
        self,
        params: Mapping[str, tuple[int, ...]],
        weight: float,
        *,
        grads: Mapping[str, npt.ArrayLike | None],
        mean: bool,
    ) -> tuple[str, ...]:
        """Every §11 class an accumulate step with these inputs calls for, in §5's order of the
        checks (the weight's own validity, the parameters and the gradients' structure, then, for
        a weight > 0, whether a mean's ``w_D`` survives ``D`` and whether ``W`` overflows), each
        check judged on its own: what ``accumulate_sum``/``accumulate_mean`` raises is the first.
        A check that needs an earlier one's value (the gradients need the binding, ``w_D`` a valid
        weight) is judged only when that value exists.  Changes nothing.  The judge reads it to
        tell a refusal raised early (its class is due here too) from one raised where none of its
        class is due (semantics §12 Reading: one bug, one finding).
        """
        due: list[str] = []

        def judged(check: Callable[[], _T]) -> _T | None:
            try:
                return check()
            except WeightedAccumulationError as exc:
                if type(exc).__name__ not in due:
                    due.append(type(exc).__name__)
                return None

        w = judged(lambda: validate_weight(weight))
        binding = judged(lambda: validate_binding(params, self._binding, rebind=self._issued == 0))
        if binding is not None:
            judged(lambda: validate_gradients(grads, binding))
        if w is not None and w != 0:
            counted = judged(lambda: converted_mean_weight(w, self._dtype)) if mean else w
            if counted is not None:
                judged(lambda: total_after(self._total_weight, w, counted))
        return tuple(due)

    # -- finishing -----------------------------------------------------------------------------

    def _reset_window(self) -> None:
        self._pending = {}
        self._issued = 0
        self._zero_weight = 0
        self._total_weight = Fraction(0) if self._exact else 0.0

    def _exact_result(self, divisor: Fraction | None, *, normalized: bool) -> ReferenceResult:
        grads: dict[str, np.ndarray | None] = {}
        exact_grads: dict[str, np.ndarray | None] = {}
        for name, shape in self._binding or ():
            buffer = self._pending.get(name)
            if buffer is None:
                grads[name] = exact_grads[name] = None
                continue
            values = [v if divisor is None else v / divisor for v in buffer.reshape(-1).tolist()]
            grads[name] = np.array(
                [round_to(v, FLOAT64) for v in values], dtype=np.float64
            ).reshape(shape)
            mpf_values = np.empty(len(values), dtype=object)
            mpf_values[:] = [_mpf(v, self._precision) for v in values]
            exact_grads[name] = mpf_values.reshape(shape)
        total = cast(Fraction, self._total_weight)
        return ReferenceResult(
            grads=grads,
            weight=round_to(total, FLOAT64),
            loss_scale=self._loss_scale,
            issued=self._issued,
            zero_weight=self._zero_weight,
            normalized=normalized,
            exact_grads=exact_grads,
            exact_weight=total,
            found_inf=_found_inf(grads),
        )

    def set_loss_scale(self, loss_scale: float) -> None:
        """semantics §4 Reading: the loss scale of the window about to start, only while the
        window is empty (else :class:`InvalidLossScaleError` naming both scales), checked like
        the constructor's. Nothing changes on a raise."""
        if self._issued:
            raise InvalidLossScaleError(
                f"set_loss_scale({format_value(loss_scale)}): the window has issued "
                f"{self._issued} microbatch(es) under loss scale {self._loss_scale!r}, and every "
                "backward of a window has one loss scale; finish or discard the window first"
            )
        self._loss_scale = validate_loss_scale(loss_scale, self._dtype)

    def finish_sums(self) -> ReferenceResult:
        """semantics §7: hand over the pending sums (no division) and start a new empty window."""
        if self._exact:
            result = self._exact_result(None, normalized=False)
        else:
            sums = {
                name: (None if name not in self._pending else self._pending[name].copy())
                for name, _ in self._binding or ()
            }
            result = ReferenceResult(
                grads=sums,
                weight=cast(float, self._total_weight),
                loss_scale=self._loss_scale,
                issued=self._issued,
                zero_weight=self._zero_weight,
                normalized=False,
                found_inf=_found_inf(sums),
            )
        self._reset_window()
        return result

    def finish_mean(self) -> ReferenceResult:
        """semantics §8: ``y = round_D(buf / S)``, ``out = round_D(round_op(y / round_op(W)))``.

        Division is sequential (``S * W`` is never formed).  ``W == 0`` raises
        :class:`ZeroTotalWeightError` and clears nothing.  Starts a new empty window.
        """
        if self._total_weight == 0:
            raise ZeroTotalWeightError(
                f"finish_mean on a window with total weight 0 (issued={self._issued}, "
                f"zero_weight={self._zero_weight}); nothing was cleared"
            )
        if self._exact:
            divisor = Fraction(self._loss_scale) * cast(Fraction, self._total_weight)
            result = self._exact_result(divisor, normalized=True)
        else:
            _check_gradual_underflow()
            d = self._dtype
            op = op_format(d)
            weight_op = round_to(cast(float, self._total_weight), op)
            grads: dict[str, np.ndarray | None] = {}
            for name, _ in self._binding or ():
                buffer = self._pending.get(name)
                if buffer is None:
                    grads[name] = None
                    continue
                y = arith.div_rounded(buffer, self._loss_scale, d)
                grads[name] = arith.round_array(arith.div_rounded(y, weight_op, op), d)
            result = ReferenceResult(
                grads=grads,
                weight=cast(float, self._total_weight),
                loss_scale=self._loss_scale,
                issued=self._issued,
                zero_weight=self._zero_weight,
                normalized=True,
                found_inf=_found_inf(grads),
            )
        self._reset_window()
        return result

    # -- records -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """The record of semantics §9 (keys documented in :mod:`wacc_ref.records`); a deep copy."""
        record: dict[str, object] = {
            "format_version": FORMAT_VERSION,
            "dtype": self._dtype.name,
            "loss_scale": self._loss_scale,
            "fused": self._fused,
            "issued": self._issued,
            "zero_weight": self._zero_weight,
            "total_weight": self._total_weight,
            "param_names": [name for name, _ in self._binding or ()],
            "param_shapes": [list(shape) for _, shape in self._binding or ()],
            "pending": {
                name: self._pending[name].copy()
                for name, _ in self._binding or ()
                if name in self._pending
            },
        }
        record[CHECKSUM_KEY] = record_checksum(
            dtype=self._dtype,
            loss_scale=self._loss_scale,
            fused=self._fused,
            issued=self._issued,
            zero_weight=self._zero_weight,
            total_weight=self._total_weight,
            binding=self._binding,
            pending=self._pending,
        )
        return record

    def load_state_dict(
        self, record: Mapping[str, object], params: Mapping[str, tuple[int, ...]]
    ) -> None:
        """semantics §9: restore counters and pending buffers for ``params`` from ``record``.

        Everything is validated first (:class:`RecordError` naming the field;
        :class:`ParameterMismatchError` for malformed ``params``); on any failure the
        accumulator is exactly as it was.  A record that binds no parameters loads with any
        ``params`` and leaves the accumulator unbound.
        """
        loaded = validate_record(
            record,
            params,
            dtype=self._dtype,
            loss_scale=self._loss_scale,
            fused=self._fused,
            exact=self._exact,
        )
        self._binding = loaded.binding
        self._pending = loaded.pending
        self._issued = loaded.issued
        self._zero_weight = loaded.zero_weight
        self._total_weight = loaded.total_weight

    @classmethod
    def from_pending(
        cls,
        params: Mapping[str, tuple[int, ...]],
        pending: Mapping[str, npt.ArrayLike],
        state: ReferenceState,
        *,
        fused_variant: str = "fma",
        mode: str = "emulated",
        precision: int = 256,
    ) -> ReferenceAccumulator:
        """§9: a new accumulator bound to ``params`` that continues ``state`` with ``pending``.

        ``pending`` holds the buffers the caller already restored (only those allocated).
        Names, shapes and values that are not D values raise :class:`ParameterMismatchError`;
        inconsistent counters raise :class:`RecordError`; a bad loss scale in ``state`` raises
        :class:`InvalidLossScaleError`.
        """
        if not isinstance(state, ReferenceState):
            raise TypeError(f"state must be a ReferenceState, got {type(state).__name__}")
        accumulator = cls(
            dtype=state.dtype,
            loss_scale=state.loss_scale,
            fused=state.fused,
            fused_variant=fused_variant,
            mode=mode,
            precision=precision,
        )
        binding = validate_params(params)
        validated = validate_pending(
            pending,
            binding,
            accumulator._dtype,
            exact=accumulator._exact,
            error=ParameterMismatchError,
            field="pending",
        )
        issued, zero_weight, total_weight = validate_counters(
            issued=state.issued,
            zero_weight=state.zero_weight,
            total_weight=state.total_weight,
            bound=True,
            pending_empty=not validated,
            exact=accumulator._exact,
            error=RecordError,
        )
        accumulator._binding = binding
        accumulator._pending = validated
        accumulator._issued = issued
        accumulator._zero_weight = zero_weight
        accumulator._total_weight = total_weight
        return accumulator
