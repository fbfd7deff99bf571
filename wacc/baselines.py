"""Baselines shipped with the judge, so that users see what ``wacc check`` catches.

Each baseline is a factory ``make(dtype, loss_scale)`` (the protocol of
:mod:`wacc.judge.implementation`) standing for a piece of real-world code:

* :func:`pixparse_loop`: the ``loss /= accum_steps`` loop (every microbatch weighs the same);
* :func:`scale_times_weight`: one division by ``S * W`` formed in the work dtype;
* :func:`fused_undeclared`: a one-pass ``add_(g, alpha=w)`` while claiming the reproducible order.

They are built on :class:`SpecAccumulator`, the semantics (§3-§9) written plainly and
independently of ``wacc_torch``'s internals (it uses only ``wacc_torch``'s public API: the error
classes, :func:`wacc_torch.normalize_sums`, the result and state types). Its protected hooks are
what a baseline (or a planted bug in the test suite) overrides: the weight check, the weight
counted, the contribution added, the zero-weight batch, the finishing division, the record taken
and the record restored. :func:`spec_accumulator` exposes the correct base itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeGuard

import torch
from torch import nn

from wacc.implementation import wacc_torch_loss_scaler
from wacc_ref.records import RECORD_KEYS
from wacc_torch import (
    FORMAT_VERSION,
    AccumulatedGradients,
    AccumulatorState,
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    RecordError,
    WeightedAccumulationError,
    ZeroTotalWeightError,
    normalize_sums,
)

__all__ = [
    "FusedUndeclared",
    "PixparseLoop",
    "ScaleTimesWeight",
    "SpecAccumulator",
    "fused_undeclared",
    "pixparse_loop",
    "scale_times_weight",
    "spec_accumulator",
]

_WORK_DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Semantics §2 Reading (gradient dtypes): the six formats a gradient may have.
GRADIENT_DTYPES: tuple[torch.dtype, ...] = (
    *_WORK_DTYPES.values(),
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(value: object) -> float | None:
    """``value`` as a finite float, or None (not a real number, NaN, inf, or beyond float64)."""
    try:
        number = float(value) if _is_real(value) else math.nan
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _conv(value: float, dtype: torch.dtype) -> float:
    """conv_D of a Python float, as ``torch.tensor(value, dtype=dtype)`` rounds it."""
    return float(torch.tensor(value, dtype=dtype).item())


class _Snapshot:
    """What ``state_dict_async()`` returns: the record is taken at once (CPU copies)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._record = record

    def result(self) -> dict[str, Any]:
        """The record, as ``state_dict()`` gave it at the call."""
        return self._record


class SpecAccumulator:
    """The semantics written plainly: the baselines' common base (§3-§9, reproducible order).

    ``accumulate_sum`` adds ``conv_D(g)``, ``accumulate_mean`` adds ``round_D(conv_D(g) * w_D)``
    (two roundings), W is the float64 running sum of the counted weights, a zero-weight batch
    reads nothing, ``finish_mean`` divides by S then by W (:func:`wacc_torch.normalize_sums`).
    Records follow ``wacc_torch``'s documented schema (``WeightedGradientsAccumulator.state_dict``)
    and are validated whole before anything changes. Every call that raises leaves the state
    as it was.
    """

    fused = False  # the evaluation order this class claims in ``state.fused``

    def __init__(self, *, dtype: torch.dtype, loss_scale: float) -> None:
        if dtype not in _WORK_DTYPES.values():
            raise WeightedAccumulationError(f"unsupported work dtype {dtype!r}")
        self.dtype = dtype
        self.loss_scale = self.checked_scale(loss_scale)
        self.names: tuple[str, ...] = ()  # the tracked set; () while unbound
        self.shapes: tuple[torch.Size, ...] = ()
        self.pending: dict[str, torch.Tensor] = {}
        self.issued = 0
        self.zero_weight = 0
        self.total_weight = 0.0

    # ------------------------------------------------------------------ hooks
    def checked_scale(self, loss_scale: object) -> float:
        """A loss scale of D (semantics §4), or InvalidLossScaleError naming it."""
        scale = _finite(loss_scale)
        if scale is None or scale <= 0 or scale != loss_scale or _conv(scale, self.dtype) != scale:
            raise InvalidLossScaleError(
                f"loss_scale {loss_scale!r} is not a finite float > 0 exact in {self.dtype}"
            )
        return scale

    def set_loss_scale(self, loss_scale: float) -> None:
        """semantics §13: the next window's scale, only while the window is empty."""
        scale = self.checked_scale(loss_scale)
        if self.issued:
            raise InvalidLossScaleError(
                f"set_loss_scale({loss_scale!r}) on a window of {self.issued} microbatch(es) "
                f"under loss scale {self.loss_scale!r}"
            )
        self.loss_scale = scale

    @property
    def buffer_dtype(self) -> torch.dtype:
        """The dtype of the pending buffers: D."""
        return self.dtype

    def check_weight(self, weight: object) -> float:
        """The weight as a float: a real number or 0-d real tensor, finite and >= 0."""
        value = weight.item() if isinstance(weight, torch.Tensor) and weight.dim() == 0 else weight
        number = _finite(value)
        if number is None or number < 0:
            raise InvalidWeightError(f"weight must be a finite real >= 0, got {weight!r}")
        return number

    def counted_weight(self, weight: float, *, mean: bool) -> float:
        """The weight W counts for a positive-weight batch: w for sums, ``w_D`` for means."""
        if not mean:
            return weight
        converted = _conv(weight, self.dtype)
        if converted == 0 or not math.isfinite(converted):
            raise InvalidWeightError(f"weight {weight!r} does not survive {self.dtype}")
        return converted

    def updated_total(self, counted: float) -> float:
        """``round_64(W + w)``: W is a float64 running sum in issue order."""
        return self.total_weight + counted

    def add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        """``buf <- round_D(buf + c)`` with ``c = conv_D(g)``, or ``round_D(c * w_D)`` for means."""
        contribution = grad.to(self.dtype)
        if mean:
            contribution = contribution * weight  # w_D is exact in D: one rounding
        buffer.add_(contribution)

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        """A dense tensor of one of semantics §2's gradient dtypes, with the parameter's shape
        and device (§5 Readings), else :class:`ParameterMismatchError` naming what differs."""
        if not isinstance(grad, torch.Tensor):
            raise ParameterMismatchError(
                f"gradient of {name!r} must be a tensor or None, got {type(grad).__name__}"
            )
        if grad.dtype not in GRADIENT_DTYPES:
            raise ParameterMismatchError(f"gradient of {name!r} has dtype {grad.dtype}")
        if grad.layout != torch.strided:
            raise ParameterMismatchError(f"gradient of {name!r} has layout {grad.layout}")
        if grad.shape != parameter.shape:
            raise ParameterMismatchError(
                f"gradient of {name!r} has shape {list(grad.shape)}, not {list(parameter.shape)}"
            )
        if grad.device != parameter.device:
            raise ParameterMismatchError(f"gradient of {name!r} is on {grad.device}")

    def skip_zero_weight(self, gradients: Mapping[str, torch.Tensor | None]) -> None:
        """A zero-weight batch: no gradient is read, only the counters move."""
        self.issued += 1
        self.zero_weight += 1

    def normalize(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """Divide the sums by S, then by W, in place (semantics §8)."""
        return normalize_sums(
            grads, loss_scale=self.loss_scale, total_weight=self.total_weight, in_place=True
        )

    def reset_window(self) -> None:
        """Start a new, empty window (the tracked set stays bound)."""
        self.pending = {}
        self.issued = self.zero_weight = 0
        self.total_weight = 0.0

    # ------------------------------------------------------------- accumulation
    @property
    def state(self) -> AccumulatorState:
        """A copy of the options and counters."""
        return AccumulatorState(
            dtype=self.dtype,
            loss_scale=self.loss_scale,
            issued=self.issued,
            zero_weight=self.zero_weight,
            total_weight=self.total_weight,
            fused=self.fused,
        )

    def accumulate_sum(
        self, module: nn.Module, weight: object, *, grads: Mapping[str, Any] | None = None
    ) -> None:
        """Add a loss-SUM microbatch of token count ``weight`` (semantics §5)."""
        self._accumulate(module, weight, grads, mean=False)

    def accumulate_mean(
        self, module: nn.Module, weight: object, *, grads: Mapping[str, Any] | None = None
    ) -> None:
        """Add a loss-MEAN microbatch, times its converted weight ``w_D`` (semantics §6)."""
        self._accumulate(module, weight, grads, mean=True)

    def _tracked(self, module: nn.Module) -> dict[str, nn.Parameter]:
        parameters = {name: p for name, p in module.named_parameters() if p.requires_grad}
        if not parameters or not all(p.is_floating_point() for p in parameters.values()):
            raise ParameterMismatchError("the module needs floating requires_grad parameters")
        return parameters

    def _bind(self, module: nn.Module) -> dict[str, nn.Parameter]:
        parameters = self._tracked(module)
        shapes = tuple(p.shape for p in parameters.values())
        if self.names and (tuple(parameters) != self.names or shapes != self.shapes):
            raise ParameterMismatchError(
                f"the module's parameters {list(parameters)} differ from the tracked set "
                f"{list(self.names)} (or their shapes do)"
            )
        return parameters

    def _accumulate(
        self, module: nn.Module, weight: object, grads: Mapping[str, Any] | None, *, mean: bool
    ) -> None:
        # Validation order of the reference: the weight, the tracked set, the gradients'
        # structure, then whether the weight survives D and keeps W finite.
        value = self.check_weight(weight)
        parameters = self._bind(module)
        if grads is None:
            gradients = {name: p.grad for name, p in parameters.items()}
        else:
            unknown = [name for name in grads if name not in parameters]
            if unknown:
                raise ParameterMismatchError(f"grads names untracked parameter(s) {unknown!r}")
            gradients = {name: grads.get(name) for name in parameters}
        for name, grad in gradients.items():
            if grad is not None:
                self.check_gradient(name, grad, parameters[name])
        counted = self.counted_weight(value, mean=mean) if value != 0 else 0.0
        total = self.updated_total(counted)
        if not math.isfinite(total):
            raise InvalidWeightError(f"weight {weight!r} makes the total weight overflow")
        # Validated: commit.
        self.names = tuple(parameters)
        self.shapes = tuple(p.shape for p in parameters.values())
        if grads is None:
            for parameter in parameters.values():
                parameter.grad = None
        if value == 0:
            self.skip_zero_weight(gradients)
            return
        for name, grad in gradients.items():
            if grad is not None:
                if name not in self.pending:
                    parameter = parameters[name]
                    self.pending[name] = torch.zeros(
                        parameter.shape, dtype=self.buffer_dtype, device=parameter.device
                    )
                self.add(self.pending[name], grad.detach(), weight=counted, mean=mean)
        self.issued += 1
        self.total_weight = total

    # ------------------------------------------------------------------ finish
    def _result(self, grads: dict[str, torch.Tensor | None], *, normalized: bool) -> Any:
        return AccumulatedGradients(
            grads=grads,
            weight=self.total_weight,
            loss_scale=self.loss_scale,
            issued=self.issued,
            zero_weight=self.zero_weight,
            normalized=normalized,
            found_inf=any(
                not bool(torch.isfinite(grad).all()) for grad in grads.values() if grad is not None
            ),
        )

    def finish_sums(self) -> Any:
        """The scaled sums and W, undivided; a new window starts (semantics §7)."""
        result = self._result({n: self.pending.get(n) for n in self.names}, normalized=False)
        self.reset_window()
        return result

    def finish_mean(self) -> Any:
        """The sums divided by S then W; ``ZeroTotalWeightError`` (nothing cleared) if W == 0."""
        if self.total_weight == 0:
            raise ZeroTotalWeightError(f"finish_mean with total weight 0 (issued={self.issued})")
        grads = self.normalize({n: self.pending.get(n) for n in self.names})
        result = self._result(grads, normalized=True)
        self.reset_window()
        return result

    # ----------------------------------------------------------------- records
    def state_dict(self) -> dict[str, Any]:
        """A record in ``wacc_torch``'s documented schema (CPU copies of the buffers)."""
        pending = {name: b.detach().to("cpu", copy=True) for name, b in self.pending.items()}
        return {**self._header(), "pending": pending}

    def _header(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "dtype": str(self.dtype).removeprefix("torch."),
            "loss_scale": self.loss_scale,
            "fused": self.fused,
            "issued": self.issued,
            "zero_weight": self.zero_weight,
            "total_weight": self.total_weight,
            "param_names": list(self.names),
            "param_shapes": [list(shape) for shape in self.shapes],
        }

    def state_dict_async(self) -> _Snapshot:
        """``state_dict()`` behind a handle (the copies are synchronous here)."""
        return _Snapshot(self.state_dict())

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        """Validate ``record`` whole against this accumulator and ``module``, then restore it."""
        parameters = self._tracked(module)
        self.restore(self.validate(record, parameters), parameters)

    def validate(
        self, record: Mapping[str, Any], parameters: Mapping[str, nn.Parameter]
    ) -> dict[str, Any]:
        """``record`` checked field by field (:class:`RecordError` naming the field)."""
        if not isinstance(record, Mapping) or set(record) != set(RECORD_KEYS):
            keys = sorted(map(str, record)) if isinstance(record, Mapping) else record
            raise RecordError(f"a record has exactly the fields {list(RECORD_KEYS)}: {keys!r}")
        expected = self._header()
        for field in ("format_version", "dtype", "loss_scale", "fused"):
            if type(record[field]) is not type(expected[field]) or record[field] != expected[field]:
                raise RecordError(f"field {field!r} is {record[field]!r}, not {expected[field]!r}")
        names, shapes, pending = record["param_names"], record["param_shapes"], record["pending"]
        module_shapes = {name: list(p.shape) for name, p in parameters.items()}
        if (
            not isinstance(names, list)
            or not all(isinstance(name, str) for name in names)
            or (names and set(names) != set(module_shapes))
        ):
            raise RecordError(f"field 'param_names' {names!r} does not match the module")
        if len(set(names)) != len(names):
            raise RecordError(f"field 'param_names' {names!r} has duplicates")
        if not isinstance(shapes, list) or [
            list(shape) if isinstance(shape, list | tuple) else shape for shape in shapes
        ] != [module_shapes[name] for name in names]:
            raise RecordError(f"field 'param_shapes' {shapes!r} does not match 'param_names'")
        if not isinstance(pending, Mapping):
            raise RecordError(f"field 'pending' must be a dict, got {type(pending).__name__}")
        for name, buffer in pending.items():
            if (
                name not in names
                or not isinstance(buffer, torch.Tensor)
                or buffer.layout != torch.strided
                or buffer.is_meta
                or buffer.dtype != self.buffer_dtype
                or list(buffer.shape) != module_shapes[name]
            ):
                raise RecordError(f"field 'pending' has a bad buffer for {name!r}")
        issued, zero, total = record["issued"], record["zero_weight"], record["total_weight"]
        if not _is_int(issued) or issued < 0 or (not names and issued):
            raise RecordError(f"field 'issued' is {issued!r}")
        if not _is_int(zero) or not 0 <= zero <= issued:
            raise RecordError(f"field 'zero_weight' is {zero!r} (issued={issued})")
        weighted = issued - zero > 0
        weight = _finite(total)
        if weight is None or weight != total or weight < 0 or (weight > 0) != weighted:
            raise RecordError(f"field 'total_weight' is {total!r} after {issued - zero} batches")
        if pending and not weighted:
            raise RecordError("field 'pending' holds buffers but no batch had a positive weight")
        return dict(record)

    def restore(self, record: Mapping[str, Any], parameters: Mapping[str, nn.Parameter]) -> None:
        """Swap in a validated record (nothing here can fail)."""
        # A record that binds parameters binds the module's (same set, registration order).
        bound = bool(record["param_names"])
        self.names = tuple(parameters) if bound else ()
        self.shapes = tuple(p.shape for p in parameters.values()) if bound else ()
        self.pending = {
            name: buffer.to(parameters[name].device, copy=True)
            for name, buffer in record["pending"].items()
        }
        self.issued = record["issued"]
        self.zero_weight = record["zero_weight"]
        self.total_weight = float(record["total_weight"])


class PixparseLoop(SpecAccumulator):
    """``loss /= accum_steps`` then ``scaler(loss)`` (pixparse's cruller fine-tuning tasks).

    Every microbatch's mean gradient (a loss-sum microbatch's gradient divided by its own token
    count) weighs the same, whatever its token count (semantics §1): it is summed into a float32
    ``.grad`` (autograd's accumulation in the parameter dtype), the sum is unscaled once at the
    end like ``GradScaler.unscale_`` (a multiplication by ``1/S`` in float32), then divided by
    the number of positive-weight microbatches (``accum_steps``; pixparse divides each loss by
    it before ``backward``, which only moves the rounding).
    The counters stay honest (W counts the tokens), so what diverges is the gradient. The loop
    keeps its window in ``.grad`` and has no records: check it with ``--allow-missing records
    --allow-missing async_records`` to see only the gradients' divergence.
    """

    # No checkpoints (the judge reports these features as unsupported).
    state_dict = None  # type: ignore[assignment]
    state_dict_async = None  # type: ignore[assignment]
    load_state_dict = None  # type: ignore[assignment]

    @property
    def buffer_dtype(self) -> torch.dtype:
        """The parameters' dtype, float32."""
        return torch.float32

    def add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        """``.grad += g`` in float32 (``g / w`` for a loss sum): the weight is ignored."""
        contribution = grad.to(torch.float32)
        buffer.add_(contribution if mean else contribution / weight)

    def normalize(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """``grad * (1/S)`` (``unscale_``), then ``/ accum_steps``."""
        steps = float(self.issued - self.zero_weight)
        return {
            name: None if grad is None else grad.mul_(1.0 / self.loss_scale).div_(steps)
            for name, grad in grads.items()
        }


class ScaleTimesWeight(SpecAccumulator):
    """``grad / (scale * total_weight)`` with both factors in the work dtype.

    The common "divide once" shortcut (e.g. ``p.grad.div_(scaler.get_scale() * n_tokens)`` on
    fp16 gradients): in float16, ``S = 2**15`` and ``W = 4096`` give ``S * W = inf`` and every
    gradient becomes 0, although ``buf / S / W`` is finite.
    """

    def normalize(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """``buf / (conv_D(S) * conv_D(W))``, the product rounded in D."""
        out: dict[str, torch.Tensor | None] = {}
        for name, grad in grads.items():
            if grad is not None:
                scale = torch.tensor(self.loss_scale, dtype=self.dtype, device=grad.device)
                weight = torch.tensor(self.total_weight, dtype=self.dtype, device=grad.device)
                grad = grad.div_(scale * weight)
            out[name] = grad
        return out


class FusedUndeclared(SpecAccumulator):
    """``buf.add_(g.to(D), alpha=w)`` for means while ``state.fused`` is False.

    The one-pass update of most hand-written accumulators (and of ``torch._foreach_add_`` with
    ``alpha``), shipped as if it were the reproducible order. On CPU, float32 contracts it into
    an FMA (one rounding instead of two); float16/bfloat16 round once through float32 in the
    vectorized body of the kernel but twice, like the semantics, in its scalar tail, so on the
    judge's short tensors it shows in float32 (and on longer tensors in float16/bfloat16).
    """

    def add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        """One pass: ``buf.add_(c, alpha=w_D)``."""
        buffer.add_(grad.to(self.dtype), alpha=weight if mean else 1.0)


def spec_accumulator(dtype: torch.dtype, loss_scale: float) -> SpecAccumulator:
    """The semantics written plainly, the baselines' common base (passes every oracle)."""
    return SpecAccumulator(dtype=dtype, loss_scale=loss_scale)


def pixparse_loop(dtype: torch.dtype, loss_scale: float) -> SpecAccumulator:
    """The ``loss /= accum_steps`` loop of pixparse (:class:`PixparseLoop`)."""
    return PixparseLoop(dtype=dtype, loss_scale=loss_scale)


def scale_times_weight(dtype: torch.dtype, loss_scale: float) -> SpecAccumulator:
    """One division by ``S * W`` formed in the work dtype (:class:`ScaleTimesWeight`)."""
    return ScaleTimesWeight(dtype=dtype, loss_scale=loss_scale)


def fused_undeclared(dtype: torch.dtype, loss_scale: float) -> SpecAccumulator:
    """One-pass ``add_(g, alpha=w)`` claiming the reproducible order (:class:`FusedUndeclared`)."""
    return FusedUndeclared(dtype=dtype, loss_scale=loss_scale)


# Every baseline pairs its accumulator with wacc_torch's window loss scaler (the feature
# ``loss_scaler`` of wacc.implementation), so the dynamic-scaling family judges the accumulator.
for _factory in (spec_accumulator, pixparse_loop, scale_times_weight, fused_undeclared):
    _factory.loss_scaler = wacc_torch_loss_scaler  # type: ignore[attr-defined]
