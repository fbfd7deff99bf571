"""Step-by-step traces of a scenario run, of either implementation, in comparable form.

:func:`run_reference` runs a scenario on :class:`wacc_ref.accumulator.ReferenceAccumulator` and
returns a :class:`ScenarioTrace`: one :class:`StepOutcome` per step, holding

* ``error``: the class name of the §11 error the step raised (``"RecordError"``, ...), or None;
* ``skipped``: True only for a ``RestoreCorrupted`` whose corruption kind does not apply to the
  latest record (see :func:`applicable_corruptions`), which is then not loaded at all;
* ``state``: a :class:`RecordSnapshot` of ``state_dict()`` taken after the step (all counters,
  the bound parameters and every allocated pending buffer, converted exactly to float64);
* ``result``: for finish steps that did not raise, a :class:`FinishOutcome` (the grads of every
  scenario parameter in order, as float64 arrays of the parameter's shape or None, the weight, the
  loss scale, the counters and ``normalized``);
* ``record``: for checkpoint steps, the snapshot of the record that the step produced;
* ``scaler``: for ``update_scaler`` steps and for restores in a scenario with a scaler, a
  :class:`ScalerSnapshot` (what ``update`` returned, and the scaler's next scale);
* ``due``: the reference's accumulate steps only: every §11 class the step's inputs call for, in
  §5's order of the checks (``error`` is the first; empty when none is due); None where not known
  (other steps, and every step of an implementation's trace).  Not part of :meth:`StepOutcome.key`:
  it says what else was due, not what happened.

The production side (a harness driving ``wacc_torch``) builds the same structure with
:func:`snapshot_record` and :func:`finish_outcome`, which accept torch tensors by duck typing
(this module never imports torch).  For an asynchronous checkpoint the harness should resolve the
handle (``.result()``) only after the following steps ran (at the restore that uses it, or at the
end), so that accumulation continuing before ``.result()`` is exercised; ``record`` then holds what
``.result()`` returned.

"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wacc_ref import formats
from wacc_ref.bits import array_differences, array_key, describe_array, float_key
from wacc_ref.display import shown_format, value_text
from wacc_ref.records import RECORD_KEYS  # the shared record schema's keys, re-exported

__all__ = [
    "RECORD_KEYS",
    "FinishOutcome",
    "RecordSnapshot",
    "ScalerSnapshot",
    "ScenarioTrace",
    "StepOutcome",
    "buffer_to_float64",
    "finish_outcome",
    "record_from_snapshot",
    "snapshot_record",
]


def buffer_to_float64(buffer: object) -> np.ndarray:
    """A float64 numpy copy of a pending buffer or gradient, exactly.

    Accepts numpy arrays (float dtypes, or object arrays of exact values such as Fractions, each
    rounded once to float64 with ``formats.round_to``) and, by duck typing, torch tensors (any
    device and floating dtype: ``.detach().to("cpu").double()``, exact for every work dtype).
    """
    if isinstance(buffer, np.ndarray):
        if buffer.dtype == object:
            flat = [formats.round_to(v, "float64") for v in buffer.reshape(-1)]
            return np.array(flat, dtype=np.float64).reshape(buffer.shape)
        if buffer.dtype.kind != "f" or buffer.dtype.itemsize > 8:
            raise TypeError(f"buffer of numpy dtype {buffer.dtype} is not a float64-exact array")
        return np.array(buffer, dtype=np.float64, copy=True)
    detach = getattr(buffer, "detach", None)
    if callable(detach):
        converted = detach().to("cpu").double()
        return np.array(converted.numpy(), dtype=np.float64, copy=True)
    raise TypeError(f"cannot read a buffer of type {type(buffer).__name__}: {buffer!r}")


@dataclass(frozen=True, eq=False)
class RecordSnapshot:
    """The content of one record (``state_dict()``) in comparable form.

    ``pending`` lists the allocated buffers as float64 arrays (exact copies), ordered like
    ``param_names`` (any names not in ``param_names`` come last, sorted), so that allocation order
    does not matter.  Compare snapshots with :meth:`key` (bit patterns, NaNs all equal).
    """

    format_version: object
    dtype: str
    loss_scale: float
    fused: bool
    issued: int
    zero_weight: int
    total_weight: float
    param_names: tuple[str, ...]
    param_shapes: tuple[tuple[int, ...], ...]
    pending: tuple[tuple[str, np.ndarray], ...]
    checksum: str | None = None  # the record's checksum field (None: a record without one)

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical snapshots (floats as bit patterns)."""
        return (
            self.checksum,
            self.format_version,
            self.dtype,
            float_key(self.loss_scale),
            self.fused,
            self.issued,
            self.zero_weight,
            float_key(self.total_weight),
            self.param_names,
            self.param_shapes,
            tuple((name, array_key(array)) for name, array in self.pending),
        )

    def differences(self, other: RecordSnapshot, *, what: str) -> list[str]:
        """Human-readable differences from ``other`` (empty when identical)."""
        lines: list[str] = []
        for name in ("format_version", "dtype", "fused", "issued", "zero_weight"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs or type(mine) is not type(theirs):
                lines.append(f"{what}.{name}: expected {mine!r}, got {theirs!r}")
        for name in ("loss_scale", "total_weight"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if float_key(mine) != float_key(theirs):
                lines.append(
                    f"{what}.{name}: expected {value_text(mine)}, got {value_text(theirs)}"
                )
        if self.param_names != other.param_names or self.param_shapes != other.param_shapes:
            lines.append(
                f"{what}.params: expected {self.param_names} {self.param_shapes}, "
                f"got {other.param_names} {other.param_shapes}"
            )
        mine_pending, theirs_pending = dict(self.pending), dict(other.pending)
        if mine_pending.keys() != theirs_pending.keys():
            lines.append(
                f"{what}.pending names: expected {sorted(mine_pending)}, "
                f"got {sorted(theirs_pending)}"
            )
        for name in mine_pending.keys() & theirs_pending.keys():
            lines += array_differences(
                f"{what}.pending[{name!r}]", mine_pending[name], theirs_pending[name],
                fmt=shown_format(self.dtype, other.dtype),
            )  # fmt: skip
        # The checksum follows from the content: a line of its own only when all else agrees.
        if not lines and self.checksum != other.checksum:
            lines.append(f"{what}.checksum: expected {self.checksum!r}, got {other.checksum!r}")
        return lines


def _float_field(value: object) -> float:
    if isinstance(value, float | int) and not isinstance(value, bool):
        return float(value)
    return formats.round_to(value, "float64")  # a Fraction or mpf (exact mode): rounded once


def snapshot_record(
    record: Mapping[str, Any],
    *,
    to_float64: Callable[[object], np.ndarray] = buffer_to_float64,
) -> RecordSnapshot:
    """A :class:`RecordSnapshot` of a record of either implementation (torch tensors accepted)."""
    names = tuple(str(name) for name in record["param_names"])
    order = {name: position for position, name in enumerate(names)}
    pending_items = sorted(
        record["pending"].items(), key=lambda item: (order.get(item[0], len(order)), item[0])
    )
    return RecordSnapshot(
        format_version=record["format_version"],
        dtype=str(record["dtype"]),
        loss_scale=_float_field(record["loss_scale"]),
        fused=record["fused"],
        issued=record["issued"],
        zero_weight=record["zero_weight"],
        total_weight=_float_field(record["total_weight"]),
        param_names=names,
        param_shapes=tuple(tuple(int(d) for d in shape) for shape in record["param_shapes"]),
        pending=tuple((name, to_float64(buffer)) for name, buffer in pending_items),
        checksum=record.get("checksum"),
    )


@dataclass(frozen=True, eq=False)
class FinishOutcome:
    """A finished window in comparable form: every scenario parameter's gradient, in order.

    ``grads`` maps each parameter (scenario order) to a float64 array of its shape, or None when it
    had no buffer in the window. ``found_inf`` is what the result reported (semantics §7), None
    when it reports nothing (an implementation without the feature).
    """

    grads: tuple[tuple[str, np.ndarray | None], ...]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool
    found_inf: bool | None = None
    # (name, dtype handed over, work dtype) of every finished tensor not in the work dtype
    # (semantics §7, §8 hand over the D buffers); filled when finish_outcome is given D.
    foreign_dtypes: tuple[tuple[str, str, str], ...] = ()
    # D when finish_outcome is given it: how differences show values (never compared)
    work_dtype: str | None = None

    def holds_non_finite(self) -> bool:
        """Whether any gradient value is NaN or ±inf (what ``found_inf`` must say)."""
        return any(not bool(np.isfinite(g).all()) for _, g in self.grads if g is not None)

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical outcomes (floats as bit patterns)."""
        return (
            tuple((name, None if g is None else array_key(g)) for name, g in self.grads),
            float_key(self.weight),
            float_key(self.loss_scale),
            self.issued,
            self.zero_weight,
            self.normalized,
            self.found_inf,
        )

    def differences(self, other: FinishOutcome, *, what: str) -> list[str]:
        """Human-readable differences from ``other`` (empty when identical; ``found_inf`` is
        compared only when both report it)."""
        lines: list[str] = []
        for name in ("issued", "zero_weight", "normalized"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs or type(mine) is not type(theirs):
                lines.append(f"{what}.{name}: expected {mine!r}, got {theirs!r}")
        if None not in (self.found_inf, other.found_inf) and self.found_inf != other.found_inf:
            lines.append(f"{what}.found_inf: expected {self.found_inf!r}, got {other.found_inf!r}")
        for name in ("weight", "loss_scale"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if float_key(mine) != float_key(theirs):
                lines.append(
                    f"{what}.{name}: expected {value_text(mine)}, got {value_text(theirs)}"
                )
        mine_grads, theirs_grads = dict(self.grads), dict(other.grads)
        if list(mine_grads) != list(theirs_grads):
            lines.append(
                f"{what}.grads names: expected {list(mine_grads)}, got {list(theirs_grads)}"
            )
            return lines
        for name, mine_grad in mine_grads.items():
            theirs_grad = theirs_grads[name]
            if mine_grad is None or theirs_grad is None:
                if (mine_grad is None) != (theirs_grad is None):
                    shown = [
                        g if g is None else describe_array(g) for g in (mine_grad, theirs_grad)
                    ]
                    lines.append(f"{what}.grads[{name!r}]: expected {shown[0]}, got {shown[1]}")
                continue
            lines += array_differences(
                f"{what}.grads[{name!r}]", mine_grad, theirs_grad,
                fmt=shown_format(self.work_dtype, other.work_dtype),
            )  # fmt: skip
        return lines


def finish_outcome(
    result: object,
    parameter_names: Sequence[str],
    *,
    to_float64: Callable[[object], np.ndarray] = buffer_to_float64,
    work_dtype: str | None = None,
) -> FinishOutcome:
    """A :class:`FinishOutcome` of a finish result of either implementation.

    ``result`` needs the attributes ``grads`` (mapping name -> array/tensor or None), ``weight``,
    ``loss_scale``, ``issued``, ``zero_weight`` and ``normalized`` (``ReferenceResult`` and
    ``wacc_torch.AccumulatedGradients`` both have them), and may have ``found_inf`` (a bool).  A
    parameter missing from ``grads`` is recorded as None; a name in ``grads`` that is not in
    ``parameter_names``, or a ``found_inf`` that is not a bool, is an error. With
    ``work_dtype`` (an implementation's result), every tensor whose ``dtype`` is not that work
    dtype is listed in ``foreign_dtypes``.
    """
    grads: Mapping[str, object] = getattr(result, "grads")  # noqa: B009  # duck-typed
    unknown = [name for name in grads if name not in parameter_names]
    if unknown:
        raise ValueError(f"finish result has grads for unknown parameters {unknown!r}")
    found_inf = getattr(result, "found_inf", None)
    if found_inf is not None and not isinstance(found_inf, bool):
        raise ValueError(f"finish result's found_inf must be a bool, got {found_inf!r}")
    entries: list[tuple[str, np.ndarray | None]] = []
    foreign: list[tuple[str, str, str]] = []
    for name in parameter_names:
        grad = grads.get(name)
        entries.append((name, None if grad is None else to_float64(grad)))
        dtype = getattr(grad, "dtype", None)
        if work_dtype is not None and grad is not None:
            spelled = str(dtype).removeprefix("torch.")
            if spelled != work_dtype:
                foreign.append((name, spelled, work_dtype))
    return FinishOutcome(
        grads=tuple(entries),
        weight=_float_field(getattr(result, "weight")),  # noqa: B009
        loss_scale=_float_field(getattr(result, "loss_scale")),  # noqa: B009
        issued=getattr(result, "issued"),  # noqa: B009
        zero_weight=getattr(result, "zero_weight"),  # noqa: B009
        normalized=getattr(result, "normalized"),  # noqa: B009
        found_inf=found_inf,
        foreign_dtypes=tuple(foreign),
        work_dtype=work_dtype,
    )


@dataclass(frozen=True, eq=False)
class StepOutcome:
    """What one scenario step did; see the module docstring for each field."""

    index: int
    op: str
    error: str | None
    skipped: bool
    state: RecordSnapshot
    result: FinishOutcome | None = None
    record: RecordSnapshot | None = None
    scaler: ScalerSnapshot | None = None
    due: tuple[str, ...] | None = None

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical outcomes."""
        return (
            self.index,
            self.op,
            self.error,
            self.skipped,
            self.state.key(),
            None if self.result is None else self.result.key(),
            None if self.record is None else self.record.key(),
            None if self.scaler is None else self.scaler.key(),
        )


@dataclass(frozen=True)
class ScalerSnapshot:
    """What the window loss scaler showed after an ``update_scaler`` step (``applied``: what
    ``update`` returned) or a restore (``applied`` None): the decision and the next scale."""

    applied: object  # a bool from update(); None after a restore
    scale: object  # a float: the next window's scale

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical snapshots (the scale as a bit pattern)."""
        scale = float_key(self.scale) if isinstance(self.scale, float) else self.scale
        return (type(self.applied).__name__, self.applied, type(self.scale).__name__, scale)

    def differences(self, other: ScalerSnapshot, *, what: str) -> list[str]:
        """Human-readable differences from ``other`` (empty when identical)."""
        lines: list[str] = []
        if self.applied is not other.applied:  # None, True, False: identity, so 1 is not True
            lines.append(f"{what}.applied: expected {self.applied!r}, got {other.applied!r}")
        if self.key()[2:] != other.key()[2:]:
            lines.append(f"{what}.scale: expected {_shown(self.scale)}, got {_shown(other.scale)}")
        return lines


def _shown(value: object) -> str:
    return value_text(value) if isinstance(value, float) else f"{value!r} ({type(value).__name__})"


@dataclass(frozen=True, eq=False)
class ScenarioTrace:
    """The outcomes of every step of one scenario run, in order."""

    outcomes: tuple[StepOutcome, ...]
    implementation: str = field(default="")

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical traces (``implementation`` not included)."""
        return tuple(outcome.key() for outcome in self.outcomes)

    def __iter__(self) -> Iterator[StepOutcome]:
        return iter(self.outcomes)

    def __len__(self) -> int:
        return len(self.outcomes)


def record_from_snapshot(snapshot: RecordSnapshot) -> dict[str, Any]:
    """A record in the shared schema (numpy float64 buffers) holding exactly ``snapshot``, with
    its checksum when the snapshot has one (then the load verifies it)."""
    record: dict[str, Any] = {
        "format_version": snapshot.format_version,
        "dtype": snapshot.dtype,
        "loss_scale": snapshot.loss_scale,
        "fused": snapshot.fused,
        "issued": snapshot.issued,
        "zero_weight": snapshot.zero_weight,
        "total_weight": snapshot.total_weight,
        "param_names": list(snapshot.param_names),
        "param_shapes": [list(shape) for shape in snapshot.param_shapes],
        "pending": {name: array.copy() for name, array in snapshot.pending},
    }
    if snapshot.checksum is not None:
        record["checksum"] = snapshot.checksum
    return record
