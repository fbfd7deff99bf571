"""Implementations the judge's tests point it at: wrappers of ``wacc_torch``, one deviation each.

Each is a factory ``make(dtype, loss_scale)`` (the protocol of :mod:`wacc.judge.implementation`).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

import wacc_torch
from wacc.implementation import wacc_torch_loss_scaler
from wacc.judge.implementation import Implementation
from wacc.zero_copy import ZeroCopyAdapter
from wacc_torch.zero_copy import ZeroCopyMode


class _Delegating:
    """Forwards every attribute to a real ``wacc_torch`` accumulator."""

    def __init__(self, dtype: torch.dtype, loss_scale: float) -> None:
        self._inner = wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _DoubleUnscale(_Delegating):
    def finish_mean(self) -> wacc_torch.AccumulatedGradients:
        result = self._inner.finish_mean()
        grads = {
            name: None if grad is None else grad / result.loss_scale
            for name, grad in result.grads.items()
        }
        return wacc_torch.AccumulatedGradients(
            grads=grads,
            weight=result.weight,
            loss_scale=result.loss_scale,
            issued=result.issued,
            zero_weight=result.zero_weight,
            normalized=True,
            found_inf=result.found_inf,
        )


def double_unscale(dtype: torch.dtype, loss_scale: float) -> Any:
    """Divides the mean by the loss scale a second time (GradScaler.unscale_ after finish_mean)."""
    return _DoubleUnscale(dtype, loss_scale)


class _CountersOnly:
    """The core API and set_loss_scale only: no records at all."""

    def __init__(self, dtype: torch.dtype, loss_scale: float) -> None:
        inner = wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)
        self.accumulate_sum = inner.accumulate_sum
        self.accumulate_mean = inner.accumulate_mean
        self.finish_sums = inner.finish_sums
        self.finish_mean = inner.finish_mean
        self.set_loss_scale = inner.set_loss_scale
        self._inner = inner

    @property
    def state(self) -> wacc_torch.AccumulatorState:
        return self._inner.state


def counters_only(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, but cannot checkpoint (no state_dict / load_state_dict / state_dict_async)."""
    return _CountersOnly(dtype, loss_scale)


def _opaque(record: Mapping[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(record, buffer)
    blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return {
        "layout": "opaque-1",
        "blob": blob,
        "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
    }


class _OpaqueHandle:
    def __init__(self, handle: wacc_torch.StateDictHandle) -> None:
        self._handle = handle

    def result(self) -> dict[str, Any]:
        return _opaque(self._handle.result())


class _Opaque(_Delegating):
    """Records in a layout of its own: the wacc_torch record serialized into one byte tensor,
    with a SHA-256 so that a flipped byte is detected."""

    def state_dict(self) -> dict[str, Any]:
        return _opaque(self._inner.state_dict())

    def state_dict_async(self) -> _OpaqueHandle:
        return _OpaqueHandle(self._inner.state_dict_async())

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        if not isinstance(record, Mapping) or set(record) != {"layout", "blob", "sha256"}:
            raise wacc_torch.RecordError(
                f"an opaque record has keys layout, blob, sha256: {record}"
            )
        if record["layout"] != "opaque-1" or not isinstance(record["blob"], torch.Tensor):
            raise wacc_torch.RecordError("field 'layout' or 'blob' has the wrong value or type")
        data = record["blob"].numpy().tobytes()
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            raise wacc_torch.RecordError("field 'sha256' does not match the blob: it is damaged")
        try:
            inner = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise wacc_torch.RecordError(f"field 'blob' does not load: {exc}") from None
        self._inner.load_state_dict(inner, module)


def opaque_records(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, with records that do not follow wacc_torch's schema (judged format-agnostically)."""
    return _Opaque(dtype, loss_scale)


class _Ready:
    """An async handle whose record is already taken."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._record = record

    def result(self) -> dict[str, Any]:
        return self._record


class _OpaqueUnchecked(_Delegating):
    """Records of its own layout with no integrity check: the wacc_torch record written without
    its checksum into one byte tensor, loaded back without any hash."""

    def state_dict(self) -> dict[str, Any]:
        return self._wrap(self._inner.state_dict(checksum=False))

    def state_dict_async(self) -> _Ready:
        return _Ready(self.state_dict())

    @staticmethod
    def _wrap(record: Mapping[str, Any]) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(record, buffer)
        blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return {"layout": "unchecked-1", "blob": blob}

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        if not isinstance(record, Mapping) or set(record) != {"layout", "blob"}:
            raise wacc_torch.RecordError(f"an unchecked record has keys layout, blob: {record}")
        if record["layout"] != "unchecked-1" or not isinstance(record["blob"], torch.Tensor):
            raise wacc_torch.RecordError("field 'layout' or 'blob' has the wrong value or type")
        try:
            inner = torch.load(io.BytesIO(record["blob"].numpy().tobytes()), weights_only=True)
        except Exception as exc:
            raise wacc_torch.RecordError(f"field 'blob' does not load: {exc}") from None
        self._inner.load_state_dict(inner, module)


def opaque_unchecked(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, with records of its own layout that carry no integrity check."""
    return _OpaqueUnchecked(dtype, loss_scale)


class _SchemaUnchecked(_Delegating):
    """wacc_torch whose records are in the documented layout without the checksum field."""

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict(checksum=False)

    def state_dict_async(self) -> wacc_torch.StateDictHandle:
        return self._inner.state_dict_async(checksum=False)


def schema_unchecked(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, with records in the documented layout and no checksum."""
    return _SchemaUnchecked(dtype, loss_scale)


class _RefusingWith:
    """Forwards to ``inner``, whose every RecordError on load is raised as ``error`` instead."""

    def __init__(self, inner: Any, error: type[Exception]) -> None:
        self._inner = inner
        self._error = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        try:
            self._inner.load_state_dict(record, module)
        except wacc_torch.RecordError as exc:
            raise self._error(f"refused with {self._error.__name__}: {exc}") from None


def refusing_with(error: type[Exception], *, opaque: bool) -> Implementation:
    """wacc_torch (with schema records, or the opaque ones of :func:`opaque_records`) whose load
    refuses every bad record with ``error`` instead of RecordError."""

    def make(dtype: torch.dtype, loss_scale: float) -> _RefusingWith:
        inner = (
            _Opaque(dtype, loss_scale)
            if opaque
            else wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)
        )
        return _RefusingWith(inner, error)

    make.loss_scaler = wacc_torch_loss_scaler  # type: ignore[attr-defined]
    layout = "opaque" if opaque else "schema"
    return Implementation(
        spec=f"tests.wacc.impls:refusing_with({error.__name__}, {layout})",
        factory=make,
        fused=False,
        missing=(),
    )


def factory_raises(dtype: torch.dtype, loss_scale: float) -> Any:
    """A factory that cannot build anything."""
    raise RuntimeError(f"no accumulator for {dtype} today")


NOT_A_FACTORY = 3


class _OpaqueCredulous(_Opaque):
    """Loads whatever it is handed: a damaged opaque record is silently ignored."""

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        try:
            super().load_state_dict(record, module)
        except wacc_torch.RecordError:
            pass  # the bug: a corrupted record neither raises nor restores


def opaque_credulous(dtype: torch.dtype, loss_scale: float) -> Any:
    """Opaque records, and a load that accepts corrupted ones without complaint."""
    return _OpaqueCredulous(dtype, loss_scale)


class _RaisesOnMean(_Delegating):
    def accumulate_mean(self, module: nn.Module, weight: float, **kwargs: Any) -> None:
        raise RuntimeError("means are not implemented")


def raises_on_mean(dtype: torch.dtype, loss_scale: float) -> Any:
    """Raises an exception outside §11 from every accumulate_mean."""
    return _RaisesOnMean(dtype, loss_scale)


class _NotImplementedMean(_Delegating):
    def accumulate_mean(self, module: nn.Module, weight: float, **kwargs: Any) -> None:
        raise NotImplementedError("means are my text: not written yet")


def not_implemented_mean(dtype: torch.dtype, loss_scale: float) -> Any:
    """Raises ``NotImplementedError`` with a text of its own from every accumulate_mean."""
    return _NotImplementedMean(dtype, loss_scale)


class _StateDictRaises(_Delegating):
    def state_dict(self, **kwargs: Any) -> dict[str, Any]:
        if self._inner.state.issued:
            raise RuntimeError("state_dict cannot write a window with batches in it")
        return self._inner.state_dict(**kwargs)


def state_dict_raises(dtype: torch.dtype, loss_scale: float) -> Any:
    """``state_dict()`` raises an exception outside §11 once a batch is accumulated."""
    return _StateDictRaises(dtype, loss_scale)


class _StateDictAlwaysRaises(_Delegating):
    def state_dict(self, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("this state_dict is broken")


def state_dict_always_raises(dtype: torch.dtype, loss_scale: float) -> Any:
    """``state_dict()`` always raises an exception outside §11 (after a refused step too)."""
    return _StateDictAlwaysRaises(dtype, loss_scale)


class _FailingHandle:
    def result(self) -> dict[str, Any]:
        raise RuntimeError("the async record was lost in transit")


class _AsyncResultRaises(_Delegating):
    def state_dict_async(self, **kwargs: Any) -> _FailingHandle:
        return _FailingHandle()


def async_result_raises(dtype: torch.dtype, loss_scale: float) -> Any:
    """``state_dict_async()`` returns a handle whose ``.result()`` raises (outside §11)."""
    return _AsyncResultRaises(dtype, loss_scale)


class _WithExtraTensor(_Delegating):
    """Records of its own layout: wacc_torch's record and one more tensor of an unusual kind
    (``extra``), checked and dropped on load."""

    def __init__(self, dtype: torch.dtype, loss_scale: float, extra: torch.Tensor) -> None:
        super().__init__(dtype, loss_scale)
        self._extra = extra

    def state_dict(self) -> dict[str, Any]:
        return {"record": self._inner.state_dict(), "extra": self._extra}

    def state_dict_async(self) -> _Ready:
        return _Ready(self.state_dict())

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        if not isinstance(record, Mapping) or set(record) != {"record", "extra"}:
            raise wacc_torch.RecordError(f"a record has keys record, extra: {record}")
        if not isinstance(record["extra"], torch.Tensor):
            raise wacc_torch.RecordError("field 'extra' is not a tensor")
        self._inner.load_state_dict(record["record"], module)


def sparse_record(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, with records of its own layout that hold a sparse COO tensor."""
    return _WithExtraTensor(dtype, loss_scale, torch.tensor([0.0, 2.5, 0.0, -1.0]).to_sparse())


def stride_zero_record(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, with records of its own layout that hold a stride-0 (expanded) tensor."""
    return _WithExtraTensor(dtype, loss_scale, torch.zeros(1).expand(4))


class _StealingZeroCopyMode(ZeroCopyMode):
    """Zero-copy, but the window's first gradient of a parameter becomes its buffer (times the
    weight for a mean) instead of being added to a +0.0 buffer: a -0.0 gradient stays -0.0."""

    def first_gradient(
        self, name: str, parameter: nn.Parameter, grad: torch.Tensor, *, weight: float, mean: bool
    ) -> None:
        buffer = grad * weight if mean else grad.clone()  # the bug: no +0.0 start
        parameter.grad = buffer
        self.window.pending[name] = buffer
        self.owners[name] = parameter
        self.versions[name] = buffer._version


def zero_copy_stealing(dtype: torch.dtype, loss_scale: float) -> Any:
    """The zero-copy mode with a hook that steals the first gradient (skips the +0.0 start)."""
    accumulator = wacc_torch.WeightedGradientsAccumulator(
        dtype=dtype, loss_scale=loss_scale, zero_copy=True
    )
    accumulator._mode = _StealingZeroCopyMode(accumulator._mode.window)
    return ZeroCopyAdapter(accumulator)


@dataclass(frozen=True)
class _ResultWithoutFoundInf:
    """A finished window as an accumulator written before found_inf (semantics §7) reports it."""

    grads: dict[str, torch.Tensor | None]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool


class _NoFoundInf(_Delegating):
    def _without(self, result: wacc_torch.AccumulatedGradients) -> _ResultWithoutFoundInf:
        return _ResultWithoutFoundInf(
            grads=result.grads,
            weight=result.weight,
            loss_scale=result.loss_scale,
            issued=result.issued,
            zero_weight=result.zero_weight,
            normalized=result.normalized,
        )

    def finish_sums(self) -> _ResultWithoutFoundInf:
        return self._without(self._inner.finish_sums())

    def finish_mean(self) -> _ResultWithoutFoundInf:
        return self._without(self._inner.finish_mean())


def no_found_inf(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, but its finished results have no found_inf (the feature is missing)."""
    return _NoFoundInf(dtype, loss_scale)


@dataclass(frozen=True)
class _SeedState:
    """The seed API's state: its counters and options, and no ``fused`` (the fused mode is this
    project's extension)."""

    dtype: torch.dtype
    loss_scale: float
    issued: int
    zero_weight: int
    total_weight: float


class _SeedApi(_NoFoundInf):
    """The seed API alone: records (with a checksum) and async records, finished results
    without found_inf, no set_loss_scale, a state without ``fused``; its factory has no
    loss_scaler."""

    def __getattr__(self, name: str) -> Any:
        if name == "set_loss_scale":  # dynamic loss scaling is not part of the seed API
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def state(self) -> _SeedState:
        inner = self._inner.state
        return _SeedState(inner.dtype, inner.loss_scale, inner.issued, inner.zero_weight,
                          inner.total_weight)  # fmt: skip


def seed_api(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, written to the seed API: no dynamic loss scaling (found_inf, set_loss_scale,
    loss_scaler), which the seed contract leaves out (the loss scale is fixed at setup)."""
    return _SeedApi(dtype, loss_scale)


class _WidensMeans(_Delegating):
    def finish_mean(self) -> wacc_torch.AccumulatedGradients:
        result = self._inner.finish_mean()
        grads = {n: None if g is None else g.float() for n, g in result.grads.items()}
        return replace(result, grads=grads)


def widens_means(dtype: torch.dtype, loss_scale: float) -> Any:
    """Hands finish_mean's means over as float32 whatever D: the values are the right ones
    (widening is exact), the tensors are not the D buffers §8 hands over."""
    return _WidensMeans(dtype, loss_scale)


def no_loss_scaler(dtype: torch.dtype, loss_scale: float) -> Any:
    """Correct, with set_loss_scale, but its factory has no loss_scaler (the feature missing)."""
    return wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)


class _ScalerForgetsRun(wacc_torch.WindowLossScaler):
    """Resumes without its run of clean windows: load_state_dict drops growth_tracker."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict({**state, "growth_tracker": 0})


def scaler_forgets_run(dtype: torch.dtype, loss_scale: float) -> Any:
    """wacc_torch's accumulator with a scaler that loses its clean-window count at a resume."""
    return wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)


def _scaler_forgets_run_scaler(dtype: torch.dtype, init_scale: float, **options: Any) -> Any:
    return _ScalerForgetsRun(init_scale, **options, dtype=dtype)


class _TensorScaler(wacc_torch.WindowLossScaler):
    """Answers with tensors: its scale a one-element float64 tensor, update() a bool tensor."""

    @property
    def scale(self) -> Any:
        return torch.tensor(super().scale, dtype=torch.float64)

    def update(self, found_inf: bool) -> Any:
        return torch.tensor(super().update(found_inf))


def tensor_scaler(dtype: torch.dtype, loss_scale: float) -> Any:
    """wacc_torch's accumulator with a scaler that answers with tensors (update must be bool)."""
    return wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)


def _tensor_scaler_scaler(dtype: torch.dtype, init_scale: float, **options: Any) -> Any:
    return _TensorScaler(init_scale, **options, dtype=dtype)


# Every factory here pairs its accumulator with wacc_torch's window loss scaler (the feature
# loss_scaler), except no_loss_scaler, scaler_forgets_run and seed_api.
for _name, _factory in list(globals().items()):
    if (
        callable(_factory)
        and not _name.startswith("_")
        and getattr(_factory, "__module__", None) == __name__
        and not isinstance(_factory, type)
        and _name
        not in (
            "no_loss_scaler",
            "scaler_forgets_run",
            "refusing_with",
            "tensor_scaler",
            "seed_api",
        )
    ):
        _factory.loss_scaler = wacc_torch_loss_scaler
scaler_forgets_run.loss_scaler = _scaler_forgets_run_scaler  # type: ignore[attr-defined]
tensor_scaler.loss_scaler = _tensor_scaler_scaler  # type: ignore[attr-defined]


def broadcast_accepted(dtype: torch.dtype, loss_scale: float) -> Any:
    """The planted structural bug of :class:`tests.wacc.planted.BroadcastAccepted`: a gradient
    whose shape broadcasts to its parameter's is added."""
    from tests.wacc.planted import BroadcastAccepted

    return BroadcastAccepted(dtype=dtype, loss_scale=loss_scale)
