"""Run a :class:`wacc_ref.scenario.Scenario` on any implementation and trace it like the reference.

:class:`ImplementationRun` executes a scenario one step at a time on a real ``nn.Module``
(parameters registered under the scenario's dotted names) and returns each step's
:class:`~wacc_ref.traces.StepOutcome`, built with the same snapshot functions as the reference
run, so that the oracles of :mod:`wacc_ref.oracles` compare the two exactly.

* Records are the implementation's own. Every restore round-trips the latest record through a
  real file (``torch.save`` -> ``torch.load(weights_only=True)``) into a fresh instance and a
  fresh module. Asynchronous checkpoints are resolved (``.result()``) only when used or at the
  end, so that accumulation continuing before ``.result()`` is exercised.
* A record that follows ``wacc_torch``'s documented schema (every key of
  :data:`wacc_ref.records.RECORD_KEYS`, tensors as pending buffers) is snapshotted after every
  step (pending buffers compared) and corrupted with the 20 schema kinds of
  :mod:`wacc_ref.corruption`. Any other record is opaque: the state after a step is its counters
  (``state``), and a corrupted restore applies a format-agnostic corruption
  (:data:`AGNOSTIC_CORRUPTIONS`), which must raise an error of the §11 family.
* An accumulate step with a fault (:mod:`wacc_ref.faults`, the structural family) hands that
  gradient in malformed: of another shape, dtype, device or layout, not a tensor, under a name
  that is not tracked, non-contiguous or channels-last, or left out of the mapping.
* The corruptions only an integrity check can refuse (:mod:`wacc.judge.integrity`) are skipped for
  an implementation without the feature ``checksum``, in either layout.
* An exception that is not an error of §11 is recorded as ``"unexpected <Class>"`` (its message
  and the implementation's own file and line in :attr:`ImplementationRun.messages`, the whole
  traceback in :attr:`ImplementationRun.tracebacks`), and a checkpoint or restore step on an
  implementation without records as ``"unsupported: records"``: neither matches the reference,
  so each is a divergence, never a crash of the judge. So is an exception from a call the judge
  makes outside the step's own method (the factory, at the first step; ``state_dict()`` after a
  step and an async handle's ``.result()``: ``"unexpected <Class> from <call>"``; after a step
  that raised itself, ``"<its error>, then unexpected <Class> from <call>"``).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from wacc.judge.exceptions import exception_text
from wacc.judge.implementation import Implementation, error_class
from wacc.judge.integrity import (
    OPAQUE_INTEGRITY_KINDS,
    flip_byte,
    follows_schema,
    load_bytes,
    same_record,
)
from wacc.judge.modules import module_of
from wacc_ref.corruption import CORRUPTION_KINDS, applicable_corruptions, corrupt_record
from wacc_ref.faults import Fault, broadcast_shape, reshaped_shape
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    Scenario,
    SetLossScale,
    UpdateScaler,
)
from wacc_ref.traces import (
    FinishOutcome,
    RecordSnapshot,
    ScalerSnapshot,
    ScenarioTrace,
    StepOutcome,
    finish_outcome,
    snapshot_record,
)

__all__ = [
    "AGNOSTIC_CORRUPTIONS",
    "TORCH_DTYPES",
    "ImplementationRun",
    "build_module",
    "counters_snapshot",
    "follows_schema",
    "in_module_order",
    "run_implementation",
]

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

# Corruptions for records of an unknown layout; scenario kind i maps to entry i mod len.
AGNOSTIC_CORRUPTIONS: tuple[str, ...] = (
    "missing_key",
    "extra_key",
    "wrong_type",
    "truncated_file",
    "flipped_byte_file",
)
_EXTRA_KEY = "__wacc_unknown_key__"


def build_module(
    parameters: Mapping[str, tuple[int, ...]],
    *,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A module whose ``named_parameters()`` are exactly ``parameters`` (dotted names nest), of
    ``dtype``: the run's work dtype D, so that ``found_inf`` of the means, which also speaks of
    the parameters' dtypes (semantics §8), is the reference's, of D."""
    return module_of(
        {
            name: nn.Parameter(torch.zeros(s, dtype=dtype, device=device))
            for name, s in parameters.items()
        }
    )


def in_module_order(scenario: Scenario) -> Scenario:
    """``scenario`` with its parameters listed in the order ``nn.Module`` registers them.

    A module lists its own parameters before its children's, so ``("a.w", "b")`` comes out as
    ``("b", "a.w")``; the record schema keeps registration order, so the reference must see the
    same order to compare records field by field.
    """
    shapes = scenario.params
    module = build_module(shapes, device=torch.device("meta"))
    ordered = tuple((name, shapes[name]) for name, _ in module.named_parameters())
    return dataclasses.replace(scenario, parameters=ordered)


def counters_snapshot(state: Any, work_dtype: str) -> RecordSnapshot:
    """The counters of ``state`` as a snapshot with no parameters and no pending buffers."""
    return RecordSnapshot(
        format_version=None,
        dtype=work_dtype,
        loss_scale=float(state.loss_scale),
        fused=getattr(state, "fused", False),  # none: not declared, the reproducible order
        issued=state.issued,
        zero_weight=state.zero_weight,
        total_weight=float(state.total_weight),
        param_names=(),
        param_shapes=(),
        pending=(),
    )


def _gradient_tensor(values: np.ndarray, grad_dtype: str, device: torch.device) -> torch.Tensor:
    # float64 holds every value of every format exactly and the scenario guarantees the values
    # are representable in G, so this conversion is exact whatever PyTorch's rounding path.
    return torch.tensor(values, dtype=torch.float64).to(TORCH_DTYPES[grad_dtype]).to(device)


def _faulty_gradient(
    fault: Fault, values: np.ndarray, grad_dtype: str, device: torch.device
) -> object:
    """The gradient ``fault`` hands in for ``values`` (the dense values, in the parameter's
    shape), as :mod:`wacc_ref.faults` describes each kind."""
    kind = fault.kind
    dtype = TORCH_DTYPES[grad_dtype]
    first = float(values.reshape(-1)[0]) if values.size else 0.0
    if kind == "list":
        return values.tolist()
    if kind == "float":
        return first
    if kind == "int64":  # truncated; NaN and ±inf (not integers) become 0
        finite = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        truncated = np.trunc(np.clip(finite, -(2.0**62), 2.0**62))
        return torch.tensor(truncated, dtype=torch.int64, device=device)
    if kind == "bool":
        return torch.tensor(values != 0.0, dtype=torch.bool, device=device)
    if kind == "complex":
        return torch.tensor(values, dtype=torch.complex128, device=device)
    if kind == "float8_e4m3fnuz":
        return torch.tensor(values, dtype=torch.float32).to(torch.float8_e4m3fnuz).to(device)
    if kind == "unknown":
        return _gradient_tensor(np.zeros(values.shape), grad_dtype, device)
    if kind == "scalar":
        return _gradient_tensor(np.array(first), grad_dtype, device)
    if kind == "broadcast":  # the dims before the cut one are 1: the slice is a flat prefix
        shape = broadcast_shape(values.shape)
        cut = values.reshape(-1)[: math.prod(shape)].reshape(shape)
        return _gradient_tensor(cut, grad_dtype, device)
    if kind == "reshaped":
        return _gradient_tensor(values.reshape(reshaped_shape(values.shape)), grad_dtype, device)
    dense = _gradient_tensor(values, grad_dtype, device)
    if kind == "meta":
        return dense.to("meta")
    if kind == "sparse":  # (COO has no float8 kernels: built in float32, then converted)
        return (
            dense.float().to_sparse().to(dtype) if dense.element_size() == 1 else dense.to_sparse()
        )
    if kind == "transposed":  # the same values, through a transposed view of their transpose
        return dense.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "strided":  # every second element; the others NaN, so reading them shows
        wide = torch.full((*values.shape[:-1], 2 * values.shape[-1]), math.nan, device=device)
        wide = wide.to(dtype)
        wide[..., ::2] = dense
        return wide[..., ::2]
    if kind == "channels_last":
        return dense.contiguous(memory_format=torch.channels_last)
    raise AssertionError(f"no tensor for fault kind {kind!r}")  # "missing": never handed in


def _wrong_type(value: object) -> object:
    """A value of another type than ``value`` (a str for numbers, a number for the rest)."""
    if isinstance(value, str):
        return 7
    if isinstance(value, bool | int | float):
        return "not a number"
    return 3.5


def _unreadable_state(work_dtype: str) -> RecordSnapshot:
    """The state of a step whose state could not be read (the step's error says why): counters
    no run can have, so that it never passes for the reference's."""
    return RecordSnapshot(
        format_version=None, dtype=work_dtype, loss_scale=math.nan, fused=False, issued=-1,
        zero_weight=-1, total_weight=math.nan, param_names=(), param_shapes=(), pending=(),
    )  # fmt: skip


class _Unsupported(Exception):
    """A step that needs a feature the implementation lacks (recorded, never raised out)."""


class ImplementationRun:
    """One scenario executed step by step on an implementation (see the module docstring)."""

    def __init__(
        self,
        implementation: Implementation,
        scenario: Scenario,
        *,
        device: torch.device,
        scratch: Path,
    ) -> None:
        self.implementation = implementation
        self.scenario = scenario
        self.device = device
        self._scratch = scratch
        self._dtype = TORCH_DTYPES[scenario.work_dtype]
        self._scale = scenario.loss_scale  # in force: the last one set without an error
        # Made by the first step, inside its guard: a factory (or a scaler factory) that raises
        # for this dtype or scale is that step's divergence, not a crash of the judge.
        self.accumulator: Any = None
        self.module = build_module(scenario.params, device=device)
        # The implementation's window loss scaler, made with the run as a loop makes it.
        self.scaler: Any = None
        self._needs_scaler = scenario.scaler is not None and implementation.supports("loss_scaler")
        self._latest: Any = None  # a record, or an async handle not resolved yet
        self._latest_scale = scenario.loss_scale
        self._latest_scaler: Any = None  # the scaler's state_dict() at the latest checkpoint
        self._unresolved: dict[int, tuple[Any, RecordSnapshot]] = {}  # handle, its moment
        self._records: dict[int, RecordSnapshot] = {}
        self._record_objects: dict[int, Any] = {}  # checkpoint index -> the record handed over
        self.outcomes: list[StepOutcome] = []
        self.messages: dict[int, str] = {}  # step index -> the exception's message
        self.tracebacks: dict[int, str] = {}  # step index -> the whole traceback, formatted
        self._late_errors: dict[int, str] = {}  # checkpoint index -> its handle's .result() raise
        self.schema = False  # set by the first record taken

    def _fresh(self, loss_scale: float) -> tuple[Any, nn.Module]:
        accumulator = self.implementation.make(self._dtype, loss_scale)
        module = build_module(self.scenario.params, device=self.device, dtype=self._dtype)
        return accumulator, module

    def _fresh_scaler(self) -> Any:
        options = self.scenario.scaler
        assert options is not None  # Scenario validation: update_scaler needs a scaler
        return self.implementation.make_scaler(
            self._dtype, self.scenario.loss_scale, **options.as_kwargs()
        )

    def _scaler_snapshot(self, applied: object) -> ScalerSnapshot:
        scale = self.scaler.scale
        # A one-element tensor or a float subclass (numpy's) is read as its value; anything
        # else is compared as it is (and differs from the reference's float).
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = float(scale.item())
        elif isinstance(scale, float):
            scale = float(scale)
        else:  # shown, and never equal to a float: the judge compares, it does not crash
            scale = f"{type(scale).__name__} {scale!r}"
        if not (applied is None or isinstance(applied, bool)):
            applied = f"{type(applied).__name__} {applied!r}"  # update() must return a bool
        return ScalerSnapshot(applied=applied, scale=scale)

    def _resolve_latest(self) -> Any:
        if not isinstance(self._latest, Mapping) and hasattr(self._latest, "result"):
            self._latest = self._latest.result()
        return self._latest

    def _snapshot(self, record: Any, *, counters: RecordSnapshot | None = None) -> RecordSnapshot:
        # An opaque record is represented by the counters of the moment it was taken.
        if follows_schema(record):
            return snapshot_record(record)
        if counters is not None:
            return counters
        return counters_snapshot(self.accumulator.state, self.scenario.work_dtype)

    def _state(self, record: Any) -> RecordSnapshot:
        """The state after a step: ``record`` (a ``state_dict()``; None without records)."""
        if record is not None:
            self.schema = follows_schema(record)
            return self._snapshot(record)
        return counters_snapshot(self.accumulator.state, self.scenario.work_dtype)

    def _raised(self, index: int, exc: Exception, *, source: str = "") -> str:
        """Record ``exc`` (raised by the implementation at step ``index``; ``source``: a call
        the judge made after the step itself) and return the step's error.

        The step's own exception is its §11 class or ``unexpected <Class>``; one from a later
        call (the state read after the step, an async handle's ``.result()``) is never an
        outcome the reference can have: ``unexpected <Class> from <source>``.
        """
        message = exception_text(exc) + (f", from {source}" if source else "")
        # A step may raise and then its state read raise too: both are kept, in that order.
        self.messages[index] = "; then ".join(filter(None, (self.messages.get(index), message)))
        self.tracebacks[index] = self.tracebacks.get(index, "") + "".join(
            traceback.format_exception(exc)
        )
        if source:
            return f"unexpected {type(exc).__name__} from {source}"
        spec_error = error_class(exc)
        return spec_error if spec_error is not None else f"unexpected {type(exc).__name__}"

    def _state_after(self, index: int, error: str | None) -> tuple[RecordSnapshot, str | None]:
        """The state after step ``index`` and the step's error: a state read that raises is the
        step's divergence (its counters then come from ``state``, or cannot be read at all)."""
        if self.accumulator is None:  # the factory raised: the step's error says so
            return _unreadable_state(self.scenario.work_dtype), error
        source = "state_dict()" if self.implementation.supports("records") else "state"
        try:
            record = self.accumulator.state_dict() if source == "state_dict()" else None
            source = "reading the record of state_dict()" if record is not None else "state"
            return self._state(record), error
        except Exception as exc:  # an implementation under test may raise anything
            read = self._raised(index, exc, source=source)
            # The step's own error stays (it may be the refusal the semantics demand): what
            # diverged is the state read after it, and the line says both.
            error = read if error is None else f"{error}, then {read}"
        try:
            return counters_snapshot(self.accumulator.state, self.scenario.work_dtype), error
        except Exception:  # the counters cannot be read either: the error above says why
            return _unreadable_state(self.scenario.work_dtype), error

    def _round_trip(self, record: Any, *, damage: str | None = None) -> Any:
        """``record`` through a real file; ``damage`` truncates it or flips a byte first."""
        path = self._scratch / "record.pt"
        torch.save(record, path)
        data = path.read_bytes()
        if damage == "truncated_file":
            data = data[: len(data) // 2]
        elif damage is not None:
            data = flip_byte(data, len(data) // 2)
        return load_bytes(data)

    def _agnostic_corruption(self, record: Mapping[str, Any], kind: str) -> tuple[Any, bool]:
        """(the corrupted record, skipped); skipped when the damage never reaches the impl."""
        agnostic = AGNOSTIC_CORRUPTIONS[CORRUPTION_KINDS.index(kind) % len(AGNOSTIC_CORRUPTIONS)]
        keys = sorted(record, key=str)
        key = keys[CORRUPTION_KINDS.index(kind) % len(keys)] if keys else None
        corrupted = dict(record)
        if agnostic == "missing_key" and key is not None:
            del corrupted[key]
        elif agnostic == "extra_key":
            corrupted[_EXTRA_KEY] = 0
        elif agnostic == "wrong_type" and key is not None:
            corrupted[key] = _wrong_type(record[key])
        elif agnostic in ("truncated_file", "flipped_byte_file"):
            if agnostic in OPAQUE_INTEGRITY_KINDS and not self.implementation.supports("checksum"):
                return None, True  # only an integrity check can refuse it: not judged
            try:
                loaded = self._round_trip(record, damage=agnostic)
            except Exception:  # refused before the implementation saw it: nothing to judge
                return None, True
            if same_record(loaded, record):
                return None, True  # the flipped byte changed nothing that loads
            return loaded, False
        else:
            return None, True
        return corrupted, False

    def step(self, index: int) -> StepOutcome:
        """Run step ``index`` and return (and keep) its outcome."""
        step = self.scenario.steps[index]
        error: str | None = None
        skipped = False
        result: FinishOutcome | None = None
        scaler: ScalerSnapshot | None = None
        try:
            if self.accumulator is None:
                self.accumulator, self.module = self._fresh(self._scale)
            if self._needs_scaler and self.scaler is None:
                self.scaler = self._fresh_scaler()
            if isinstance(step, SetLossScale | UpdateScaler):
                feature = "set_loss_scale" if isinstance(step, SetLossScale) else "loss_scaler"
                if not self.implementation.supports(feature):
                    raise _Unsupported(feature)
            elif not isinstance(step, Accumulate | Finish) and not self.implementation.supports(
                "records"
            ):
                raise _Unsupported("records")
            if isinstance(step, Accumulate):
                arrays = self.scenario.grad_arrays(step)
                grads: dict[str, object] = {
                    name: None
                    if values is None
                    else _gradient_tensor(values, self.scenario.grad_dtype, self.device)
                    for name, values in arrays.items()
                }
                fault = step.fault
                if fault is not None and fault.kind != "missing":  # (missing: left out already)
                    source = arrays.get(fault.name)
                    if source is None:  # unknown: zeros shaped like the first parameter's
                        source = np.zeros(self.scenario.parameters[0][1])
                    grads[fault.name] = _faulty_gradient(
                        fault, source, self.scenario.grad_dtype, self.device
                    )
                method = (
                    self.accumulator.accumulate_sum
                    if step.kind == "sum"
                    else self.accumulator.accumulate_mean
                )
                method(self.module, step.weight, grads=grads)
            elif isinstance(step, Finish):
                finished = (
                    self.accumulator.finish_sums()
                    if step.kind == "sums"
                    else self.accumulator.finish_mean()
                )
                result = finish_outcome(
                    finished, list(self.scenario.params), work_dtype=self.scenario.work_dtype
                )
            elif isinstance(step, Checkpoint):
                if step.asynchronous and self.implementation.supports("async_records"):
                    moment = counters_snapshot(self.accumulator.state, self.scenario.work_dtype)
                    self._latest = self.accumulator.state_dict_async()
                    self._unresolved[index] = (self._latest, moment)
                else:
                    self._latest = self.accumulator.state_dict()
                    self._records[index] = self._snapshot(self._latest)
                    self._record_objects[index] = self._latest
                self._latest_scale = self._scale
                if self.scaler is not None:
                    self._latest_scaler = self.scaler.state_dict()
            elif isinstance(step, Restore):
                record = self._round_trip(self._resolve_latest())
                self.accumulator, self.module = self._fresh(self._latest_scale)
                self.accumulator.load_state_dict(record, self.module)
                self._scale = self._latest_scale
                if self._latest_scaler is not None:
                    # As a training loop resumes: a fresh scaler loads the state saved with the
                    # checkpoint, through the same real file.
                    self.scaler = self._fresh_scaler()
                    self.scaler.load_state_dict(self._round_trip(self._latest_scaler))
                    scaler = self._scaler_snapshot(None)
            elif isinstance(step, SetLossScale):
                self.accumulator.set_loss_scale(step.loss_scale)
                self._scale = step.loss_scale
            elif isinstance(step, UpdateScaler):
                scaler = self._scaler_snapshot(self.scaler.update(step.found_inf))
            else:
                record = self._resolve_latest()
                if follows_schema(record):
                    if step.kind in applicable_corruptions(record):
                        self.accumulator.load_state_dict(
                            corrupt_record(record, step.kind), self.module
                        )
                    else:
                        skipped = True
                else:
                    corrupted, skipped = self._agnostic_corruption(record, step.kind)
                    if not skipped:
                        self.accumulator.load_state_dict(corrupted, self.module)
        except _Unsupported as exc:
            error = f"unsupported: {exc}"
            self.messages[index] = f"the implementation has no {exc} (state_dict / load_state_dict)"
        except Exception as exc:  # an implementation under test may raise anything
            error = self._raised(index, exc)
        state, error = self._state_after(index, error)
        outcome = StepOutcome(
            index=index,
            op=step.op,
            error=error,
            skipped=skipped,
            state=state,
            result=result,
            scaler=scaler,
        )
        self.outcomes.append(outcome)
        return outcome

    def _changed_records(self) -> None:
        """A record of the §9 schema that is not what it was when ``state_dict()`` returned it
        (semantics §9: a copy that later accumulation does not change) is the checkpoint's
        record as it is now: its step then diverges, whatever later step used it."""
        for index, record in self._record_objects.items():
            if not follows_schema(record):  # an opaque record is judged by its loads only
                continue
            try:
                later = self._snapshot(record)
            except Exception:  # changed into something unreadable: the loads judge that
                continue
            if later.key() != self._records[index].key():
                self._records[index] = later
                message = (
                    "the record changed after state_dict() returned it (semantics §9: a copy "
                    "that later accumulation does not change); shown as it was at the end"
                )
                if message not in self.messages.get(index, ""):  # trace() may be called again
                    shown = (self.messages.get(index), message)
                    self.messages[index] = "; then ".join(filter(None, shown))

    def trace(self) -> ScenarioTrace:
        """The outcomes so far, with every async checkpoint resolved into its record."""
        for index, (handle, moment) in list(self._unresolved.items()):
            try:
                self._records[index] = self._snapshot(handle.result(), counters=moment)
            except Exception as exc:  # the checkpoint's divergence, with its text
                source = "state_dict_async().result()"
                self._late_errors[index] = self._raised(index, exc, source=source)
            del self._unresolved[index]
        self._changed_records()
        outcomes = []
        for outcome in self.outcomes:
            if outcome.index in self._late_errors:
                outcome = dataclasses.replace(outcome, error=self._late_errors[outcome.index])
            elif outcome.op == "checkpoint" and outcome.error is None:
                outcome = dataclasses.replace(outcome, record=self._records.get(outcome.index))
            outcomes.append(outcome)
        return ScenarioTrace(
            outcomes=tuple(outcomes), implementation=f"{self.implementation.spec}/{self.device}"
        )


def run_implementation(
    implementation: Implementation, scenario: Scenario, *, device: torch.device | str = "cpu"
) -> tuple[ScenarioTrace, ImplementationRun]:
    """Run every step of ``scenario`` (in module order) and return the trace and the run."""
    run = ImplementationRun(
        implementation, scenario, device=torch.device(device), scratch=_scratch_directory()
    )
    for index in range(len(scenario.steps)):
        run.step(index)
    return run.trace(), run


_SCRATCH = threading.local()


def _scratch_directory() -> Path:
    """This thread's directory for record files, made once and removed at exit.

    A run writes its records one after the other, so one directory per thread serves every run
    of that thread; a new directory per scenario cost about 5 % of ``wacc gate`` (profiled).
    """
    directory: tempfile.TemporaryDirectory[str] | None = getattr(_SCRATCH, "directory", None)
    if directory is None:
        directory = tempfile.TemporaryDirectory(prefix="wacc-judge-")
        _SCRATCH.directory = directory  # its finalizer removes it when the thread's data goes
    return Path(directory.name)
