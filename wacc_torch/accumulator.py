"""Weighted gradient accumulation over unequal microbatches (SPEC §3-§9).

The default evaluation order is the reproducible one of the SPEC: convert then add (sums),
multiply then add (means), and a sequential division by the loss scale and then by the total
weight, each step rounded on its own. ``fused=True`` is an opt-in one-pass mode for means.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wacc_torch._dtypes import (
    check_loss_scale,
    check_work_dtype,
    dtype_name,
    op_dtype,
    to_work_dtype,
)
from wacc_torch.errors import (
    InvalidWeightError,
    ParameterMismatchError,
    ZeroTotalWeightError,
)
from wacc_torch.records import FORMAT_VERSION, check_counters, validate_record

__all__ = [
    "AccumulatedGradients",
    "AccumulatorState",
    "StateDictHandle",
    "WeightedGradientsAccumulator",
    "normalize_sums",
]

Weight = float | torch.Tensor
GradientMapping = Mapping[str, torch.Tensor | None]


@dataclass(frozen=True)
class AccumulatorState:
    """A copy of an accumulator's options and window counters (SPEC §3).

    ``total_weight`` is W, the float64 sum of the counted weights in issue order; ``fused``
    says whether means are accumulated in the opt-in one-pass mode.
    """

    dtype: torch.dtype
    loss_scale: float
    issued: int
    zero_weight: int
    total_weight: float
    fused: bool


@dataclass(frozen=True)
class AccumulatedGradients:
    """What ``finish_sums`` / ``finish_mean`` hand over.

    ``grads`` maps every tracked parameter name to its tensor in the work dtype (the pending
    buffer itself for sums, not a copy), or None when the parameter received no gradient in any
    positive-weight batch of the window. ``normalized`` is False for sums (still scaled by
    ``loss_scale`` and not divided by ``weight``) and True for means.
    """

    grads: dict[str, torch.Tensor | None]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool

    def apply_to(self, module: nn.Module) -> None:
        """Write each gradient into the matching parameter's ``.grad``.

        Each tensor is converted to that parameter's dtype (and device); a None gradient sets
        ``.grad`` to None. Parameters not named in ``grads`` are left alone. When no conversion
        is needed the ``.grad`` is the tensor held here, not a copy. Every name and shape is
        checked before any ``.grad`` is written (:class:`ParameterMismatchError`).
        """
        parameters = dict(module.named_parameters())
        for name, grad in self.grads.items():
            parameter = parameters.get(name)
            if parameter is None:
                raise ParameterMismatchError(f"the module has no parameter named {name!r}")
            if grad is not None and grad.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"gradient {name!r} has shape {list(grad.shape)} but the parameter has "
                    f"shape {list(parameter.shape)}"
                )
        for name, grad in self.grads.items():
            parameter = parameters[name]
            parameter.grad = (
                None if grad is None else grad.to(dtype=parameter.dtype, device=parameter.device)
            )


class StateDictHandle:
    """A pending ``state_dict_async()`` snapshot; :meth:`result` waits for it.

    The device-to-host copies were issued on each buffer's current CUDA stream when the
    snapshot was taken; ``result`` waits on the CUDA events recorded right after them.
    """

    def __init__(self, record: dict[str, Any], events: list[torch.cuda.Event]) -> None:
        self._record = record
        self._events = events

    def done(self) -> bool:
        """Whether every device-to-host copy of the snapshot has completed."""
        return all(event.query() for event in self._events)

    def result(self) -> dict[str, Any]:
        """Wait for the copies and return the record (same content as ``state_dict()``)."""
        for event in self._events:
            event.synchronize()
        return self._record


def _coerce_weight(weight: object) -> float:
    """Return a microbatch weight as a float; refuse anything but a finite real >= 0."""
    if isinstance(weight, torch.Tensor):
        if weight.dim() != 0:
            raise InvalidWeightError(
                f"a tensor weight must be 0-d, got shape {list(weight.shape)}: {weight!r}"
            )
        if weight.dtype == torch.bool or weight.is_complex():
            raise InvalidWeightError(
                f"a tensor weight must be real-valued, got dtype {weight.dtype}: {weight!r}"
            )
        value: object = weight.item()
    else:
        value = weight
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidWeightError(
            f"weight must be a real number or a 0-d real tensor, got {weight!r} "
            f"of type {type(weight).__name__}"
        )
    try:
        number = float(value)
    except OverflowError:
        raise InvalidWeightError(f"weight {weight!r} does not fit a float") from None
    if not math.isfinite(number) or number < 0.0:
        raise InvalidWeightError(f"weight must be finite and >= 0, got {weight!r}")
    return number


def _scalar_tensor(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A 0-d tensor ON the buffers' device: CUDA true division by a CPU scalar would multiply by
    # the reciprocal instead of dividing (SPEC §8).
    return torch.tensor(value, dtype=dtype, device=device)


def normalize_sums(
    grads: Mapping[str, torch.Tensor | None],
    *,
    loss_scale: float,
    total_weight: float,
    in_place: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Divide scaled gradient sums by the loss scale, then by the total weight (SPEC §8).

    Per element, in each tensor's own dtype D: ``y = round_D(g / S)``, then
    ``round_D(round_op(y / round_op(W)))`` with op = float64 for float64 and float32 otherwise.
    The product ``S * W`` is never formed. Both divisors are 0-d tensors on the gradient's
    device. None entries stay None. With ``in_place=True`` the result overwrites the given
    tensors (and the returned dict holds them); otherwise they are left untouched.

    Raises :class:`ZeroTotalWeightError` when ``total_weight == 0``, :class:`InvalidWeightError`
    for a negative or non-finite one, :class:`InvalidLossScaleError` for a loss scale that is not
    finite, > 0 and exactly representable in every gradient's dtype (float64 when every entry is
    None), and :class:`ParameterMismatchError` for a value that is not a tensor of a work dtype.
    """
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
        )
    if isinstance(total_weight, bool) or not isinstance(total_weight, numbers.Real):
        raise InvalidWeightError(f"total_weight must be a real number, got {total_weight!r}")
    try:
        weight = float(total_weight)
    except OverflowError:
        weight = math.inf
    if weight == 0.0:
        raise ZeroTotalWeightError(
            f"cannot normalize by total weight {total_weight!r}: no positive weight was counted"
        )
    if not (math.isfinite(weight) and weight > 0.0):
        raise InvalidWeightError(f"total_weight must be finite and > 0, got {total_weight!r}")
    checked_dtypes: set[torch.dtype] = set()
    for name, grad in grads.items():
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor):
            raise ParameterMismatchError(
                f"gradient {name!r} must be a tensor or None, got {type(grad).__name__}"
            )
        try:
            check_work_dtype(grad.dtype)
        except ValueError:
            raise ParameterMismatchError(
                f"gradient {name!r} has dtype {grad.dtype}, not a work dtype"
            ) from None
        if grad.dtype not in checked_dtypes:
            check_loss_scale(loss_scale, grad.dtype)
            checked_dtypes.add(grad.dtype)
    if not checked_dtypes:
        # No tensor, so no work dtype to check S against; S itself must still be valid (finite,
        # > 0, a float64), which the check in float64 covers.
        check_loss_scale(loss_scale, torch.float64)
    scale = float(loss_scale)

    divisors: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
    normalized: dict[str, torch.Tensor | None] = {}
    for name, grad in grads.items():
        if grad is None:
            normalized[name] = None
            continue
        key = (grad.device, grad.dtype)
        if key not in divisors:
            divisors[key] = (
                _scalar_tensor(scale, grad.dtype, grad.device),
                _scalar_tensor(weight, op_dtype(grad.dtype), grad.device),
            )
        scale_tensor, weight_tensor = divisors[key]
        # y = round_D(g / S): same-dtype 0-d divisor, so no type promotion.
        scaled = grad.div_(scale_tensor) if in_place else torch.div(grad, scale_tensor)
        if grad.dtype == weight_tensor.dtype:
            result = scaled.div_(weight_tensor)
        else:
            # Narrow D: divide explicitly in op(D) = float32 (so a W beyond D's range, e.g.
            # fp16 with W = 70000, stays finite), then round once more into D.
            quotient = scaled.to(weight_tensor.dtype).div_(weight_tensor)
            result = scaled.copy_(quotient)
        normalized[name] = result
    return normalized


@dataclass(frozen=True)
class _Binding:
    """The tracked parameter set: names in registration order, shapes, devices."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    devices: tuple[torch.device, ...]


def _tracked_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's requires_grad parameters in registration order, checked to be accumulable."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    parameters = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not parameters:
        raise ParameterMismatchError(
            f"the module ({type(module).__name__}) has no requires_grad parameter to accumulate"
        )
    for name, parameter in parameters:
        if not parameter.is_floating_point():
            raise ParameterMismatchError(
                f"parameter {name!r} has dtype {parameter.dtype}: only floating-point "
                f"parameters can be accumulated"
            )
    return parameters


class WeightedGradientsAccumulator:
    """Accumulates gradients of unequal microbatches and normalizes them once (SPEC §3-§9).

    Options are keyword-only: ``dtype`` is the work dtype D of the pending buffers (float64,
    float32, float16 or bfloat16), ``loss_scale`` the fixed loss scale S every backward of the
    window used (a finite float > 0 exactly representable in D), ``fused`` selects the opt-in
    one-pass mode for means (``buf.add_(c, alpha=w_D)``, not reproducible across devices).

    Gradients come either from a ``grads`` mapping (name -> tensor or None; a name left out is
    None, i.e. a zero contribution; an unknown name raises) or, when ``grads`` is None, from each
    tracked parameter's ``.grad``, which is then taken out of the module (set to None), also for
    a zero-weight batch, so a stale ``.grad`` can never leak into the next microbatch.

    The tracked set is the module's ``requires_grad`` parameters (names, shapes, devices), bound
    by the first accumulate (a zero-weight one too) or by a load. One buffer per tracked
    parameter is allocated in D, on the parameter's device, at the first non-None gradient in a
    positive-weight batch of the window, starting at +0.0. Any call that raises leaves the
    counters, the buffers and the module's ``.grad`` exactly as they were.
    """

    def __init__(self, *, dtype: torch.dtype, loss_scale: float, fused: bool = False) -> None:
        work_dtype = check_work_dtype(dtype)
        scale = check_loss_scale(loss_scale, work_dtype)
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        self._dtype = work_dtype
        self._loss_scale = scale
        self._fused = fused
        self._binding: _Binding | None = None
        self._pending: dict[str, torch.Tensor] = {}
        self._issued = 0
        self._zero_weight = 0
        self._total_weight = 0.0
        # Events of state_dict_async copies not yet known to be complete (_await_snapshots).
        self._snapshot_events: list[tuple[torch.device, torch.cuda.Event]] = []

    # ----------------------------------------------------------------------------- reading
    @property
    def state(self) -> AccumulatorState:
        """A frozen copy of the options and counters; reading it changes nothing."""
        return AccumulatorState(
            dtype=self._dtype,
            loss_scale=self._loss_scale,
            issued=self._issued,
            zero_weight=self._zero_weight,
            total_weight=self._total_weight,
            fused=self._fused,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dtype={self._dtype}, loss_scale={self._loss_scale!r}, "
            f"fused={self._fused}, issued={self._issued}, zero_weight={self._zero_weight}, "
            f"total_weight={self._total_weight!r})"
        )

    # ---------------------------------------------------------------------- accumulation
    def accumulate_sum(
        self, module: nn.Module, weight: Weight, *, grads: GradientMapping | None = None
    ) -> None:
        """Add the gradients of ``S * sum_t loss_t`` of one microbatch (SPEC §5).

        ``weight`` is the microbatch's effective token/sample count w (a real number or 0-d
        tensor, finite, >= 0). For w > 0 each buffer becomes ``round_D(buf + conv_D(g))`` and W
        becomes ``round_64(W + w)``. For w == 0 no gradient value is read (NaN or inf ones
        included); only ``issued`` and ``zero_weight`` count it.
        """
        self._accumulate(module, grads, weight=weight, mean=False)

    def accumulate_mean(
        self, module: nn.Module, weight: Weight, *, grads: GradientMapping | None = None
    ) -> None:
        """Add the gradients of ``S * mean_t loss_t`` of one microbatch, times its weight (§6).

        The weight counted is ``w_D = conv_D(w)``, what the work dtype makes of w (bfloat16:
        1001 -> 1000). For w > 0, ``t = round_D(conv_D(g) * w_D)`` then
        ``buf = round_D(buf + t)`` (two roundings), and W becomes ``round_64(W + w_D)``; with
        ``fused=True`` the one-pass ``buf.add_(conv_D(g), alpha=w_D)`` is used instead. A w > 0
        whose w_D is 0 or not finite raises :class:`InvalidWeightError`.
        """
        self._accumulate(module, grads, weight=weight, mean=True)

    def _accumulate(
        self,
        module: nn.Module,
        grads: GradientMapping | None,
        *,
        weight: Weight,
        mean: bool,
    ) -> None:
        # Validation order (as the reference model's): the weight's own validity, the module's
        # tracked set, the gradients' structure, then whether a mean weight survives D.
        weight_value = _coerce_weight(weight)
        binding, parameters = self._check_module(module)
        gradients = self._collect_gradients(binding, parameters, grads)
        counted_weight = weight_value
        if mean and weight_value > 0.0:
            counted_weight = to_work_dtype(weight_value, self._dtype)
            if counted_weight == 0.0 or not math.isfinite(counted_weight):
                raise InvalidWeightError(
                    f"weight {weight!r} ({weight_value.hex()}) does not survive the work dtype "
                    f"{self._dtype}: it converts to {counted_weight!r}"
                )
        new_total = self._total_weight + counted_weight
        if not math.isfinite(new_total):
            raise InvalidWeightError(
                f"weight {weight_value!r} makes the total weight overflow "
                f"({self._total_weight!r} + {counted_weight!r})"
            )

        # Everything is validated. Allocate before mutating anything, so that running out of
        # memory leaves the counters, the buffers and the module's .grad as they were.
        new_buffers = (
            {}
            if weight_value == 0.0
            else {
                name: torch.zeros(parameter.shape, dtype=self._dtype, device=parameter.device)
                for (name, parameter), grad in zip(parameters, gradients, strict=True)
                if grad is not None and name not in self._pending
            }
        )
        self._await_snapshots()
        self._binding = binding
        if grads is None:
            for _, parameter in parameters:
                parameter.grad = None
        if weight_value == 0.0:
            self._issued += 1
            self._zero_weight += 1
            return
        self._pending.update(new_buffers)
        for (name, _), grad in zip(parameters, gradients, strict=True):
            if grad is not None:
                self._add(self._pending[name], grad, weight=counted_weight, mean=mean)
        self._issued += 1
        self._total_weight = new_total

    def _add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        # Convert first (conv_D), then operate in D: buffer.add_(grad of another dtype) would be
        # a single rounding in the promoted type instead.
        converted = grad.to(self._dtype)
        if not mean:
            buffer.add_(converted)
        elif self._fused:
            buffer.add_(converted, alpha=weight)
        else:
            # weight is w_D, exactly representable in D, so the scalar multiply is exactly
            # round_D(c * w_D); then a separate add: never an FMA.
            if converted is grad:
                product = converted.mul(weight)
            else:
                product = converted.mul_(weight)  # our own conversion copy: reuse it
            buffer.add_(product)

    def _check_module(self, module: nn.Module) -> tuple[_Binding, list[tuple[str, nn.Parameter]]]:
        """Return the (possibly new) binding and the module's tracked parameters in its order."""
        parameters = _tracked_parameters(module)
        binding = self._binding
        if binding is None:
            return (
                _Binding(
                    names=tuple(name for name, _ in parameters),
                    shapes=tuple(parameter.shape for _, parameter in parameters),
                    devices=tuple(parameter.device for _, parameter in parameters),
                ),
                parameters,
            )
        by_name = dict(parameters)
        tracked = set(binding.names)
        if by_name.keys() != tracked:
            missing = [name for name in binding.names if name not in by_name]
            extra = [name for name in by_name if name not in tracked]
            raise ParameterMismatchError(
                f"the module's requires_grad parameters differ from the tracked set: missing "
                f"{missing!r}, not tracked {extra!r}"
            )
        ordered = [(name, by_name[name]) for name in binding.names]
        for (name, parameter), shape, device in zip(
            ordered, binding.shapes, binding.devices, strict=True
        ):
            if parameter.shape != shape:
                raise ParameterMismatchError(
                    f"parameter {name!r} has shape {list(parameter.shape)}, tracked shape is "
                    f"{list(shape)}"
                )
            if parameter.device != device:
                raise ParameterMismatchError(
                    f"parameter {name!r} is on {parameter.device}, tracked device is {device}"
                )
        return binding, ordered

    @staticmethod
    def _collect_gradients(
        binding: _Binding,
        parameters: list[tuple[str, nn.Parameter]],
        grads: GradientMapping | None,
    ) -> list[torch.Tensor | None]:
        """The gradient of each tracked parameter (None = zero), checked, in binding order."""
        if grads is None:
            candidates = [parameter.grad for _, parameter in parameters]
        else:
            if not isinstance(grads, Mapping):
                raise TypeError(
                    f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
                )
            tracked = set(binding.names)
            unknown = [name for name in grads if name not in tracked]
            if unknown:
                raise ParameterMismatchError(
                    f"grads names parameter(s) {unknown!r} that are not tracked "
                    f"(tracked: {list(binding.names)!r})"
                )
            candidates = [grads.get(name) for name, _ in parameters]
        for (name, parameter), grad in zip(parameters, candidates, strict=True):
            if grad is None:
                continue
            if not isinstance(grad, torch.Tensor):
                raise ParameterMismatchError(
                    f"gradient of {name!r} must be a tensor or None, got {type(grad).__name__}"
                )
            if not grad.is_floating_point():
                raise ParameterMismatchError(
                    f"gradient of {name!r} has dtype {grad.dtype}: a floating dtype is required"
                )
            if grad.layout != torch.strided:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has layout {grad.layout}: only dense (strided) "
                    f"gradients are accepted"
                )
            if grad.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has shape {list(grad.shape)}, the parameter has "
                    f"shape {list(parameter.shape)}"
                )
            if grad.device != parameter.device:
                raise ParameterMismatchError(
                    f"gradient of {name!r} is on {grad.device}, the parameter is on "
                    f"{parameter.device}"
                )
        return [None if grad is None else grad.detach() for grad in candidates]

    # ---------------------------------------------------------------------------- finish
    def finish_sums(self) -> AccumulatedGradients:
        """Hand over the scaled sums and the window's weight W, and start a new window (§7).

        Nothing is divided and nothing is communicated: reduce the sums and the weights across
        ranks yourself, then divide by ``loss_scale`` exactly once and by the reduced weight
        (:func:`normalize_sums` does both). Works on an empty window too (W == 0).
        """
        self._await_snapshots()
        result = AccumulatedGradients(
            grads=self._handover(),
            weight=self._total_weight,
            loss_scale=self._loss_scale,
            issued=self._issued,
            zero_weight=self._zero_weight,
            normalized=False,
        )
        self._reset_window()
        return result

    def finish_mean(self) -> AccumulatedGradients:
        """Divide the sums by S, then by W (:func:`normalize_sums`), and start a new window (§8).

        Raises :class:`ZeroTotalWeightError` when W == 0 (an empty window or only zero-weight
        batches), clearing nothing. The buffers are divided in place and handed over.
        """
        if self._total_weight == 0.0:
            raise ZeroTotalWeightError(
                f"finish_mean on a window with total weight 0.0 (issued={self._issued}, "
                f"zero_weight={self._zero_weight}); nothing was cleared"
            )
        self._await_snapshots()
        grads = normalize_sums(
            self._handover(),
            loss_scale=self._loss_scale,
            total_weight=self._total_weight,
            in_place=True,
        )
        result = AccumulatedGradients(
            grads=grads,
            weight=self._total_weight,
            loss_scale=self._loss_scale,
            issued=self._issued,
            zero_weight=self._zero_weight,
            normalized=True,
        )
        self._reset_window()
        return result

    def _handover(self) -> dict[str, torch.Tensor | None]:
        names = () if self._binding is None else self._binding.names
        return {name: self._pending.get(name) for name in names}

    def _reset_window(self) -> None:
        self._pending = {}
        self._issued = 0
        self._zero_weight = 0
        self._total_weight = 0.0

    # --------------------------------------------------------------------------- records
    def state_dict(self) -> dict[str, Any]:
        """A record of the accumulator: plain Python values and CPU tensor copies (SPEC §9).

        Keys:

        * ``format_version`` (int): record layout version, currently 1.
        * ``dtype`` (str): the work dtype D, torch spelling without ``torch.``
          (``"float32"``, ``"bfloat16"``, ...).
        * ``loss_scale`` (float): S.
        * ``fused`` (bool): whether means use the opt-in one-pass mode.
        * ``issued`` (int): microbatches accumulated in this window, zero-weight ones included.
        * ``zero_weight`` (int): how many of them had weight exactly 0.
        * ``total_weight`` (float): W, the float64 sum of the counted weights.
        * ``param_names`` (list[str]): tracked parameters in registration order; ``[]`` when no
          parameter set is bound yet (such a record loads into any module).
        * ``param_shapes`` (list[list[int]]): their shapes, same order.
        * ``pending`` (dict[str, Tensor]): the buffers allocated so far in this window, as CPU
          tensors of dtype D (copies: later accumulation does not change them). A buffer may
          hold inf or NaN (an overflow in D, a NaN gradient); the record keeps them as they are.

        The record survives ``torch.save`` and ``torch.load(..., weights_only=True)``.
        """
        record = self._record_header()
        record["pending"] = {
            name: buffer.detach().to("cpu", copy=True) for name, buffer in self._pending.items()
        }
        return record

    def state_dict_async(self) -> StateDictHandle:
        """Start a snapshot like :meth:`state_dict` whose device-to-host copies run async.

        CUDA buffers are copied with ``non_blocking=True`` into pinned host memory on their
        device's current stream and a CUDA event is recorded after the copies; ``.result()``
        waits for it. Later accumulation (on any stream) waits for that event first, so the
        snapshot holds the values of this call's moment. CPU buffers are copied synchronously.
        """
        record = self._record_header()
        pending: dict[str, torch.Tensor] = {}
        cuda_devices: list[torch.device] = []
        for name, buffer in self._pending.items():
            if buffer.device.type == "cuda":
                host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
                host.copy_(buffer.detach(), non_blocking=True)
                pending[name] = host
                if buffer.device not in cuda_devices:
                    cuda_devices.append(buffer.device)
            else:
                pending[name] = buffer.detach().to("cpu", copy=True)
        record["pending"] = pending
        events: list[torch.cuda.Event] = []
        for device in cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
            self._snapshot_events.append((device, event))
        return StateDictHandle(record, events)

    def _record_header(self) -> dict[str, Any]:
        binding = self._binding
        return {
            "format_version": FORMAT_VERSION,
            "dtype": dtype_name(self._dtype),
            "loss_scale": self._loss_scale,
            "fused": self._fused,
            "issued": self._issued,
            "zero_weight": self._zero_weight,
            "total_weight": self._total_weight,
            "param_names": [] if binding is None else list(binding.names),
            "param_shapes": [] if binding is None else [list(s) for s in binding.shapes],
        }

    def _await_snapshots(self) -> None:
        # Make the current stream of each device wait for pending snapshot copies before a
        # buffer is changed or handed over, even if the caller switched streams since.
        for device, event in self._snapshot_events:
            torch.cuda.current_stream(device).wait_event(event)
        self._snapshot_events.clear()

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        """Restore counters and pending buffers from ``record`` for ``module`` (SPEC §9).

        Every field is validated first (see :meth:`state_dict` for the keys; ``dtype``,
        ``loss_scale`` and ``fused`` must equal this accumulator's; names and shapes must match
        the module's ``requires_grad`` parameters unless the record binds none; pending buffers
        must be tensors of dtype D for recorded names; counters must be consistent). Any problem
        raises :class:`RecordError` naming the field, leaving the accumulator as it was. The
        module is checked first: one without requires_grad parameters, or with a non-floating
        one, raises :class:`ParameterMismatchError`. A record that binds no parameters leaves
        the accumulator unbound (the next accumulate binds).
        Buffers are copied onto the module's parameters' devices; the record is not aliased.
        """
        parameters = _tracked_parameters(module)
        validated = validate_record(
            record,
            dtype=self._dtype,
            loss_scale=self._loss_scale,
            fused=self._fused,
            tracked=[(name, parameter.shape) for name, parameter in parameters],
        )
        binding: _Binding | None = None
        restored: dict[str, torch.Tensor] = {}
        if validated.param_names:
            device_of = {name: parameter.device for name, parameter in parameters}
            binding = _Binding(
                names=validated.param_names,
                shapes=tuple(torch.Size(shape) for shape in validated.param_shapes),
                devices=tuple(device_of[name] for name in validated.param_names),
            )
            restored = {
                name: buffer.detach().to(device_of[name], copy=True).contiguous()
                for name, buffer in validated.pending.items()
            }
        self._await_snapshots()
        self._binding = binding
        self._pending = restored
        self._issued = validated.issued
        self._zero_weight = validated.zero_weight
        self._total_weight = validated.total_weight

    @classmethod
    def from_pending(
        cls,
        module: nn.Module,
        pending: Mapping[str, torch.Tensor],
        state: AccumulatorState,
    ) -> WeightedGradientsAccumulator:
        """Re-attach saved counters ``state`` to pending buffers the caller already restored.

        ``pending`` maps tracked parameter names to buffers of dtype ``state.dtype`` with the
        parameters' shapes, on the parameters' devices; they are adopted (detached), not copied.
        The new accumulator is bound to the module's ``requires_grad`` parameters. Raises
        :class:`ParameterMismatchError` for a bad buffer (name, shape, dtype, device) and
        :class:`RecordError` for inconsistent counters.
        """
        if not isinstance(state, AccumulatorState):
            raise TypeError(f"state must be an AccumulatorState, got {type(state).__name__}")
        accumulator = cls(dtype=state.dtype, loss_scale=state.loss_scale, fused=state.fused)
        if not isinstance(pending, Mapping):
            raise TypeError(f"pending must be a mapping, got {type(pending).__name__}")
        binding, parameters = accumulator._check_module(module)
        by_name = dict(parameters)
        for name, buffer in pending.items():
            parameter = by_name.get(name)
            if parameter is None:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} is not a tracked parameter of the module"
                )
            if not isinstance(buffer, torch.Tensor) or buffer.layout != torch.strided:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} must be a dense tensor, got "
                    f"{type(buffer).__name__} (layout {getattr(buffer, 'layout', None)})"
                )
            if buffer.dtype != state.dtype:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} has dtype {buffer.dtype}, expected {state.dtype}"
                )
            if buffer.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} has shape {list(buffer.shape)}, the parameter "
                    f"has shape {list(parameter.shape)}"
                )
            if buffer.device != parameter.device:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} is on {buffer.device}, the parameter is on "
                    f"{parameter.device}"
                )
        issued, zero_weight, total_weight = check_counters(
            issued=state.issued,
            zero_weight=state.zero_weight,
            total_weight=state.total_weight,
            has_pending=bool(pending),
            bound=True,
        )
        accumulator._binding = binding
        accumulator._pending = {
            name: pending[name].detach() for name in binding.names if name in pending
        }
        accumulator._issued = issued
        accumulator._zero_weight = zero_weight
        accumulator._total_weight = total_weight
        return accumulator
