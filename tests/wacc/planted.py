"""Planted bugs: :class:`~wacc.baselines.SpecAccumulator` with one deviation each.

Each variant is listed in :data:`PLANTED` with the strategy family and work dtype where the
judge must see it, the oracle that sees it, and the fewest accumulate steps a scenario needs to
show it (``None`` where the generated scenarios of the ci budget do not: the class docstring
says why, and a constructed scenario shows it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from wacc.baselines import FusedUndeclared, ScaleTimesWeight, SpecAccumulator
from wacc.judge.implementation import Implementation
from wacc_torch import (
    InvalidWeightError,
    ParameterMismatchError,
    WindowLossScaler,
    ZeroTotalWeightError,
)


class EqualWeightMean(SpecAccumulator):
    """Every mean microbatch weighs 1 (its gradient added as is, W counts microbatches). The
    weight is still validated (one fault: a weight that does not survive D is refused as the
    semantics say, then counted as 1)."""

    def counted_weight(self, weight: float, *, mean: bool) -> float:
        counted = super().counted_weight(weight, mean=mean)
        return 1.0 if mean else counted


class ZeroWeightNotCounted(SpecAccumulator):
    """A zero-weight batch moves ``issued`` but not ``zero_weight``."""

    def skip_zero_weight(self, gradients: Mapping[str, torch.Tensor | None]) -> None:
        self.issued += 1


class ZeroWeightAddsNaNs(SpecAccumulator):
    """A zero-weight batch's gradient is read and added times 0 (NaN/inf become NaN)."""

    def skip_zero_weight(self, gradients: Mapping[str, torch.Tensor | None]) -> None:
        super().skip_zero_weight(gradients)
        for name, grad in gradients.items():
            if grad is not None and name in self.pending:
                self.pending[name].add_(grad.to(self.dtype) * 0.0)


class ClearOnZeroTotal(SpecAccumulator):
    """``finish_mean`` with W == 0 clears the window before raising."""

    def finish_mean(self) -> Any:
        if self.total_weight == 0:
            self.reset_window()
            raise ZeroTotalWeightError("finish_mean with total weight 0")
        return super().finish_mean()


class RawWeight(SpecAccumulator):
    """Means use the raw weight w, not ``w_D = conv_D(w)`` (bf16: 257 stays 257)."""

    def counted_weight(self, weight: float, *, mean: bool) -> float:
        super().counted_weight(weight, mean=mean)  # the same refusals
        return weight


class DoubleUnscale(SpecAccumulator):
    """``finish_mean`` divides by S a second time (``GradScaler.unscale_`` after it)."""

    def normalize(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        return {
            name: None if grad is None else grad.div_(self.loss_scale)
            for name, grad in super().normalize(grads).items()
        }


class AddBeforeConvert(SpecAccumulator):
    """Sums add the gradient in its own dtype to the buffer: one rounding, not convert-then-add."""

    def add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        if mean:
            super().add(buffer, grad, weight=weight, mean=mean)
        else:
            # PyTorch refuses to promote float8 with another dtype: widen it (exactly) first.
            buffer.add_(grad.float() if grad.element_size() == 1 else grad)


class RecordAliasing(SpecAccumulator):
    """``state_dict()`` hands out the live pending buffers, not copies."""

    def state_dict(self) -> dict[str, Any]:
        record = super().state_dict()
        record["pending"] = dict(self.pending)
        return record


class NonAtomicLoad(SpecAccumulator):
    """``load_state_dict`` sets the counters before it validates the rest of the record."""

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        if isinstance(record, Mapping):
            self.issued = record.get("issued", self.issued)
            self.zero_weight = record.get("zero_weight", self.zero_weight)
        super().load_state_dict(record, module)


class WeightInFloat32(SpecAccumulator):
    """W is kept in float32: wrong once W needs more than 24 bits.

    The generated token counts are integers below 10**6 with at most 8 microbatches per window
    (and 12 machine steps), so W stays below 2**24 and is exact in float32: no generated
    scenario shows this bug; a hand-made window of 2**24 + 1 tokens does.
    """

    def updated_total(self, counted: float) -> float:
        return float(torch.tensor(self.total_weight + counted, dtype=torch.float32))


class FinishSumsWithoutReset(SpecAccumulator):
    """``finish_sums`` leaves the window open (counters and buffers kept)."""

    def finish_sums(self) -> Any:
        return self._result({n: self.pending.get(n) for n in self.names}, normalized=False)


class MeanInFloat32(SpecAccumulator):
    """``finish_mean`` divides in float32 whatever D (wrong for float64)."""

    def normalize(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        return {
            name: None
            if grad is None
            else grad.copy_((grad / self.loss_scale).float() / self.total_weight)
            for name, grad in grads.items()
        }


class ReciprocalDivision(SpecAccumulator):
    """``finish_mean`` multiplies by ``1/W`` instead of dividing by W."""

    def normalize(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = {}
        for name, grad in grads.items():
            if grad is not None:
                op = torch.float64 if self.dtype == torch.float64 else torch.float32
                inverse = 1.0 / torch.tensor(self.total_weight, dtype=op)
                grad = grad.copy_((grad / self.loss_scale).to(op) * inverse)
            out[name] = grad
        return out


class NegativeWeightAccepted(SpecAccumulator):
    """A finite negative weight is accepted (and subtracted from W)."""

    def check_weight(self, weight: object) -> float:
        if isinstance(weight, float) and weight < 0:
            return weight
        return super().check_weight(weight)

    def counted_weight(self, weight: float, *, mean: bool) -> float:
        if weight < 0:
            return float(torch.tensor(weight, dtype=self.dtype)) if mean else weight
        return super().counted_weight(weight, mean=mean)


class ResumeDropsZeroWeight(SpecAccumulator):
    """A restore forgets the ``zero_weight`` counter (sets it to 0)."""

    def restore(self, record: Mapping[str, Any], parameters: Mapping[str, nn.Parameter]) -> None:
        super().restore(record, parameters)
        self.zero_weight = 0


class SumCountsConvertedWeight(SpecAccumulator):
    """Sums count ``conv_D(w)`` in W instead of w (bf16: 257 counts as 256)."""

    def counted_weight(self, weight: float, *, mean: bool) -> float:
        converted = float(torch.tensor(weight, dtype=self.dtype))
        if converted == 0:
            raise InvalidWeightError(f"weight {weight!r} does not survive {self.dtype}")
        return converted


class FoundInfFromInputs(SpecAccumulator):
    """``found_inf`` says whether an incoming gradient was NaN or inf, not the finished values:
    it misses an overflow that only the sum (or the division) creates."""

    saw_non_finite = False

    def add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        self.saw_non_finite = self.saw_non_finite or not bool(torch.isfinite(grad.float()).all())
        super().add(buffer, grad, weight=weight, mean=mean)

    def _result(self, grads: dict[str, torch.Tensor | None], *, normalized: bool) -> Any:
        return replace(super()._result(grads, normalized=normalized), found_inf=self.saw_non_finite)

    def reset_window(self) -> None:
        super().reset_window()
        self.saw_non_finite = False


class ScaleChangedMidWindow(SpecAccumulator):
    """``set_loss_scale`` is accepted in the middle of a window: the batches after it are
    divided by a scale they were not multiplied by (semantics §13: one scale per window)."""

    def set_loss_scale(self, loss_scale: float) -> None:
        self.loss_scale = self.checked_scale(loss_scale)


class HysteresisKeptAtGrowth(WindowLossScaler):
    """The scaler does not restore ``hysteresis_left`` when the scale grows, so the first
    overflow after a growth backs off at once where ``hysteresis`` overflows should be absorbed
    (a backoff applied right after growth).

    It needs hysteresis >= 2 and an overflow, a growth and an overflow in that order: the
    family's windows that surely overflow bring that story within the ci budget on float16
    (shrunk to the three scaler updates alone); ``tests/wacc/test_power.py`` also judges a
    constructed loop."""

    def update(self, found_inf: bool) -> bool:
        left = self._hysteresis_left
        grows = not found_inf and self._growth_tracker + 1 == self._interval
        applied = super().update(found_inf)
        if grows:
            self._hysteresis_left = left
        return applied


class _LazySnapshot:
    def __init__(self, accumulator: SpecAccumulator) -> None:
        self._accumulator = accumulator

    def result(self) -> dict[str, Any]:
        return self._accumulator.state_dict()


class AsyncSnapshotLate(SpecAccumulator):
    """``state_dict_async().result()`` reads the state at ``.result()``, not at the call."""

    def state_dict_async(self) -> Any:
        return _LazySnapshot(self)


# Structural bugs (semantics §5, §11): each skips one check of SpecAccumulator.check_gradient,
# or refuses what §5 accepts. The structural family (wacc_ref.faults) must find each.


class BroadcastAccepted(SpecAccumulator):
    """A gradient whose shape broadcasts to the parameter's ((1, n) for (m, n)) is added."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        if isinstance(grad, torch.Tensor) and grad.shape != parameter.shape:
            if torch.broadcast_shapes(grad.shape, parameter.shape) == parameter.shape:
                grad = grad.expand(parameter.shape)
        super().check_gradient(name, grad, parameter)


class IntegerAccepted(SpecAccumulator):
    """An integer gradient is converted to D and added."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        if isinstance(grad, torch.Tensor) and grad.dtype in (torch.int32, torch.int64):
            grad = grad.to(torch.float32)
        super().check_gradient(name, grad, parameter)


class BoolAccepted(SpecAccumulator):
    """A bool gradient (not a floating dtype) is added as 0.0 / 1.0."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        if isinstance(grad, torch.Tensor) and grad.dtype == torch.bool:
            grad = grad.to(torch.float32)
        super().check_gradient(name, grad, parameter)


class AnyFloatingAccepted(SpecAccumulator):
    """Any floating dtype is accepted (``is_floating_point()``), float8_e4m3fnuz included,
    which §2's Reading "gradient dtypes" refuses."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        if isinstance(grad, torch.Tensor) and grad.is_floating_point():
            grad = grad.to(torch.float32)
        super().check_gradient(name, grad, parameter)


class MetaAccepted(SpecAccumulator):
    """The device is not checked: a ``meta`` gradient reaches the addition."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        if isinstance(grad, torch.Tensor) and grad.device.type == "meta":
            grad = torch.empty_like(grad, device=parameter.device)
        super().check_gradient(name, grad, parameter)


class SparseAccepted(SpecAccumulator):
    """The layout is not checked: a sparse COO gradient is added (``buf.add_`` takes it)."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        if isinstance(grad, torch.Tensor) and grad.layout == torch.sparse_coo:
            grad = grad.to_dense()
        super().check_gradient(name, grad, parameter)


class UnknownNameIgnored(SpecAccumulator):
    """A ``grads`` entry for a name that is not tracked is silently dropped."""

    def accumulate_sum(
        self, module: nn.Module, weight: object, *, grads: Mapping[str, Any] | None = None
    ) -> None:
        super().accumulate_sum(module, weight, grads=self._tracked_only(module, grads))

    def accumulate_mean(
        self, module: nn.Module, weight: object, *, grads: Mapping[str, Any] | None = None
    ) -> None:
        super().accumulate_mean(module, weight, grads=self._tracked_only(module, grads))

    def _tracked_only(
        self, module: nn.Module, grads: Mapping[str, Any] | None
    ) -> Mapping[str, Any] | None:
        names = {name for name, _ in module.named_parameters()}
        return None if grads is None else {k: v for k, v in grads.items() if k in names}


class NonContiguousRefused(SpecAccumulator):
    """A non-contiguous gradient (a transposed view, a strided slice, channels-last) is
    refused, where §5 accepts any dense (strided) one."""

    def check_gradient(self, name: str, grad: object, parameter: nn.Parameter) -> None:
        super().check_gradient(name, grad, parameter)
        if isinstance(grad, torch.Tensor) and not grad.is_contiguous():
            raise ParameterMismatchError(f"gradient of {name!r} is not contiguous")


@dataclass(frozen=True)
class Planted:
    """A planted bug, where it shows, the oracle that sees it, the fewest accumulates it needs."""

    cls: type[SpecAccumulator] | type[WindowLossScaler]
    family: str
    dtype: str
    oracle: str
    fewest: int | None

    @property
    def implementation(self) -> Implementation:
        """The variant as the judge loads an implementation: a SpecAccumulator variant with
        wacc_torch's scaler, or SpecAccumulator with a WindowLossScaler variant."""
        accumulator = self.cls if issubclass(self.cls, SpecAccumulator) else SpecAccumulator
        scaler = self.cls if issubclass(self.cls, WindowLossScaler) else WindowLossScaler

        def make(dtype: torch.dtype, loss_scale: float) -> SpecAccumulator:
            return accumulator(dtype=dtype, loss_scale=loss_scale)

        def loss_scaler(dtype: torch.dtype, init_scale: float, **options: Any) -> Any:
            return scaler(init_scale, **options, dtype=dtype)

        make.loss_scaler = loss_scaler  # type: ignore[attr-defined]
        return Implementation(
            spec=f"planted:{self.cls.__name__}", factory=make, fused=False, missing=()
        )


PLANTED: dict[str, Planted] = {
    planted.cls.__name__: planted
    for planted in (
        Planted(EqualWeightMean, "windows", "float32", "semantics", 1),
        Planted(ScaleTimesWeight, "windows", "float16", "emulation", 1),
        Planted(ZeroWeightNotCounted, "windows", "float32", "semantics", 1),
        Planted(ZeroWeightAddsNaNs, "non_finite", "float32", "emulation", 2),
        Planted(ClearOnZeroTotal, "invalid_weights", "float32", "semantics", 1),
        Planted(RawWeight, "windows", "bfloat16", "semantics", 1),
        Planted(DoubleUnscale, "windows", "float32", "emulation", 1),
        Planted(FusedUndeclared, "windows", "float32", "emulation", 2),
        Planted(AddBeforeConvert, "windows", "bfloat16", "emulation", 1),
        Planted(RecordAliasing, "interruptions", "float32", "semantics", 1),
        Planted(NonAtomicLoad, "interruptions", "float32", "semantics", 0),
        Planted(WeightInFloat32, "windows", "float32", "semantics", None),
        Planted(FinishSumsWithoutReset, "windows", "float32", "semantics", 1),
        Planted(MeanInFloat32, "windows", "float64", "emulation", 1),
        Planted(ReciprocalDivision, "windows", "float32", "emulation", 1),
        Planted(NegativeWeightAccepted, "invalid_weights", "float32", "semantics", 1),
        Planted(ResumeDropsZeroWeight, "interruptions", "float32", "semantics", 1),
        Planted(SumCountsConvertedWeight, "windows", "bfloat16", "semantics", 1),
        Planted(AsyncSnapshotLate, "interruptions", "float32", "semantics", 1),
        Planted(FoundInfFromInputs, "windows", "float16", "semantics", 1),
        Planted(ScaleChangedMidWindow, "dynamic_scaling", "float16", "semantics", 1),
        Planted(HysteresisKeptAtGrowth, "dynamic_scaling", "float16", "semantics", 0),
        Planted(BroadcastAccepted, "structural", "float32", "semantics", 1),
        Planted(IntegerAccepted, "structural", "float32", "semantics", 1),
        Planted(BoolAccepted, "structural", "float32", "semantics", 1),
        Planted(AnyFloatingAccepted, "structural", "float32", "semantics", 1),
        Planted(MetaAccepted, "structural", "float32", "semantics", 1),
        Planted(SparseAccepted, "structural", "float32", "semantics", 1),
        Planted(UnknownNameIgnored, "structural", "float32", "semantics", 1),
        Planted(NonContiguousRefused, "structural", "float32", "semantics", 1),
    )
}

# Factories of two planted bugs, for the commands (``tests.wacc.planted:equal_weight_mean``):
# an accumulator bug of every family and a dynamic-scaling one.
equal_weight_mean = PLANTED["EqualWeightMean"].implementation.factory
scale_changed_mid_window = PLANTED["ScaleChangedMidWindow"].implementation.factory
