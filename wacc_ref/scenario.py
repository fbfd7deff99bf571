"""Replayable accumulation scenarios, corrupted records, and step-by-step traces.

A :class:`Scenario` is a complete, self-contained description of one run of an accumulator: the
work dtype ``D``, the gradient dtype ``G``, the loss scale ``S``, the ``fused`` flag, the tracked
parameters (ordered names and shapes) and a sequence of steps:

========================  =============================================================
step                      meaning
========================  =============================================================
``Accumulate("sum")``     ``accumulate_sum(params, weight, grads=...)`` (semantics §5)
``Accumulate("mean")``    ``accumulate_mean(params, weight, grads=...)`` (semantics §6)
``Finish("sums")``        ``finish_sums()`` (semantics §7)
``Finish("mean")``        ``finish_mean()`` (semantics §8)
``Checkpoint(async)``     take a record: ``state_dict()`` or ``state_dict_async()`` (§9)
``Restore()``             load the most recent checkpoint into a FRESH accumulator (same
                          dtype, loss scale and fused flag) and continue with that one;
                          the data position is the scenario's: no step is replayed
``RestoreCorrupted(k)``   load ``corrupt_record(latest checkpoint, k)`` into the CURRENT
                          accumulator: it must raise ``RecordError`` and change nothing
``SetLossScale(s)``       ``set_loss_scale(s)`` (§13): the next window's loss scale; only
                          on an empty window, else ``InvalidLossScaleError``
``UpdateScaler(f)``       ``scaler.update(f)`` on the scenario's window loss scaler (§13),
                          ``f`` the ``found_inf`` of the window it decides on
========================  =============================================================

A scenario with a window loss scaler (``scaler``, :class:`ScalerOptions`; its ``init_scale`` is
the scenario's ``loss_scale``) is a dynamic-scaling scenario: the judge builds the
implementation's scaler from the options and compares every decision and scale of
``UpdateScaler`` with the reference scaler's. ``UpdateScaler`` carries its ``found_inf``, so the
scaler is judged on exactly the decisions the scenario names, whatever the accumulator returned
(the finish steps judge ``found_inf`` itself). ``Restore`` builds the fresh accumulator at the
loss scale in force when the checkpoint was taken (a ``SetLossScale`` that raised changed
nothing), and a fresh scaler loaded with the scaler's state of that moment.

Gradient values are stored flat, in row-major order, one tuple of Python floats per parameter,
each exactly a value of ``G`` (checked when the scenario is built).  A parameter absent from a
step's ``grads``, or mapped to ``None``, is a zero contribution (§5).  Weights are arbitrary
Python floats, so that invalid weights (negative, NaN, inf) can be scenario steps too.

Scenarios serialize losslessly to JSON (:func:`to_json`, :func:`from_json`): every float is
written with :meth:`float.hex` (``0x0.0p+0`` and ``-0x0.0p+0`` keep the sign of zero,
``inf``/``-inf`` and ``nan`` are spelled out).  The only thing not kept is the sign and payload
of a NaN, which no comparison in this project looks at (a NaN is a NaN).  A failing scenario can
therefore be saved with ``to_json`` and replayed with ``from_json``.  The format is version 1;
version 2 adds the ``scaler`` field (an object or null) and the two steps of dynamic scaling,
and is written only for a scenario that has a scaler or such a step (every other scenario's
JSON is what it always was); version 3 is version 2 with a ``fault`` object (``kind``,
``name``) on the accumulate steps that hand a gradient in malformed (:mod:`wacc_ref.faults`,
the structural family), written only for a scenario with such a step.

:func:`from_json` reads strictly, by the rules of :mod:`wacc_ref.strict_json`: exactly the fields
``to_json`` writes, none missing, unknown or repeated; every float spelled exactly as
``float.hex`` writes it (``nan``, ``inf``, ``-0x0.0p+0``, negative weights are scenario data;
``1.8p1``, ``0x1p+0``, ``infinity``, a decimal, and values beyond float64 such as
``0x1.0p+1024`` are refused); ``version``, shape dimensions and the scaler's counts JSON
integers (never ``true``; a dimension below 2**63); ``fused``, ``asynchronous`` and
``found_inf`` ``true``/``false`` (never 0/1).  Every problem is a :class:`ScenarioError` of one
line that starts with the field's path
(``steps[2].grads['w'][0]: ...``).


The step-by-step traces of a run live in :mod:`wacc_ref.traces`, the corrupted records of
``RestoreCorrupted`` in :mod:`wacc_ref.corruption`, and the oracles that compare an
implementation's trace with the reference in :mod:`wacc_ref.oracles`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from wacc_ref import formats
from wacc_ref.bits import float_key
from wacc_ref.corruption import CORRUPTION_KINDS
from wacc_ref.faults import FAULT_KINDS, Fault, MalformedGradient, fault_problem
from wacc_ref.scaler import ReferenceLossScaler
from wacc_ref.strict_json import (
    FieldError,
    expect_bool,
    expect_int,
    expect_list,
    expect_object,
    expect_str,
    field,
    item,
    loads,
    parse_hex,
    shown,
)

__all__ = [
    "JSON_FORMAT",
    "JSON_VERSION",
    "Accumulate",
    "Checkpoint",
    "Fault",
    "Finish",
    "GradEntries",
    "GradValues",
    "Restore",
    "RestoreCorrupted",
    "ScalerOptions",
    "Scenario",
    "ScenarioError",
    "SetLossScale",
    "Step",
    "UpdateScaler",
    "INTERRUPTIONS",
    "JSON_VERSION_DYNAMIC",
    "JSON_VERSION_STRUCTURAL",
    "from_json",
    "is_dynamic",
    "is_structural",
    "scenarios_identical",
    "to_json",
    "without_interruptions",
]

JSON_FORMAT = "wacc-scenario"
JSON_VERSION = 1  # a scenario without a scaler or dynamic-scaling steps (byte for byte as before)
JSON_VERSION_DYNAMIC = 2  # one with them: the "scaler" field (an object or null) and two ops
JSON_VERSION_STRUCTURAL = 3  # version 2 plus a "fault" on accumulate steps (wacc_ref.faults)


class ScenarioError(ValueError):
    """A scenario (or its JSON text) that is not well formed; the message is one line that
    starts with the field's path (``steps[2].weight: ...``) and names the value."""


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------

GradValues: TypeAlias = tuple[float, ...] | None
GradEntries: TypeAlias = tuple[tuple[str, GradValues], ...]


def _as_float(value: object, *, what: str) -> float:
    """``value`` as a Python float; only floats (numpy float64 included) are accepted."""
    if isinstance(value, bool) or not isinstance(value, float):
        raise ScenarioError(f"{what}: must be a float, got {shown(value)} ({type(value).__name__})")
    return float(value)


@dataclass(frozen=True)
class Accumulate:
    """``accumulate_sum`` (kind ``"sum"``) or ``accumulate_mean`` (kind ``"mean"``) of one batch.

    ``grads`` holds ``(name, values)`` pairs: ``values`` is the gradient flattened in row-major
    order (a tuple of floats of the parameter's size) or None.  Build it from a mapping with
    :meth:`of`.  ``fault`` (None: none) hands one gradient in malformed (:mod:`wacc_ref.faults`).
    """

    kind: Literal["sum", "mean"]
    weight: float
    grads: GradEntries = ()
    fault: Fault | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("sum", "mean"):
            raise ScenarioError(f"Accumulate kind must be 'sum' or 'mean', got {self.kind!r}")
        object.__setattr__(self, "weight", _as_float(self.weight, what="weight"))
        entries: list[tuple[str, GradValues]] = []
        for entry in self.grads:
            name, values = entry
            if not isinstance(name, str):
                raise ScenarioError(f"gradient entry name must be a str, got {name!r}")
            if values is not None:
                values = tuple(_as_float(v, what=f"gradient of {name!r}") for v in values)
            entries.append((name, values))
        object.__setattr__(self, "grads", tuple(entries))
        names = [name for name, _ in self.grads]
        if len(set(names)) != len(names):
            raise ScenarioError(f"Accumulate grads name a parameter twice: {names!r}")
        if self.fault is not None and not isinstance(self.fault, Fault):
            raise ScenarioError(f"Accumulate fault must be a Fault or None, got {self.fault!r}")

    @classmethod
    def of(
        cls,
        kind: Literal["sum", "mean"],
        weight: float,
        grads: Mapping[str, Sequence[float] | None],
    ) -> Accumulate:
        """An accumulate step from a mapping name -> flat gradient values (or None)."""
        entries = tuple(
            (name, None if values is None else tuple(values)) for name, values in grads.items()
        )
        return cls(kind=kind, weight=weight, grads=entries)

    @property
    def op(self) -> str:
        """The accumulator method this step calls."""
        return f"accumulate_{self.kind}"

    def grads_mapping(self) -> dict[str, GradValues]:
        """The gradient entries as a dict name -> flat values or None."""
        return dict(self.grads)


@dataclass(frozen=True)
class Finish:
    """``finish_sums()`` (kind ``"sums"``) or ``finish_mean()`` (kind ``"mean"``)."""

    kind: Literal["sums", "mean"]

    def __post_init__(self) -> None:
        if self.kind not in ("sums", "mean"):
            raise ScenarioError(f"Finish kind must be 'sums' or 'mean', got {self.kind!r}")

    @property
    def op(self) -> str:
        """The accumulator method this step calls."""
        return f"finish_{self.kind}"


@dataclass(frozen=True)
class Checkpoint:
    """Take a record: ``state_dict()``, or ``state_dict_async()`` when ``asynchronous``."""

    asynchronous: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.asynchronous, bool):
            raise ScenarioError(
                f"Checkpoint asynchronous must be a bool, got {self.asynchronous!r}"
            )

    @property
    def op(self) -> str:
        """The name of this step in traces."""
        return "checkpoint"


@dataclass(frozen=True)
class Restore:
    """Load the most recent checkpoint into a fresh accumulator and continue with it."""

    @property
    def op(self) -> str:
        """The name of this step in traces."""
        return "restore"


@dataclass(frozen=True)
class RestoreCorrupted:
    """Load a corrupted copy (kind ``kind``) of the latest checkpoint into the current accumulator.

    The load must raise ``RecordError`` naming ``CORRUPTION_FIELDS[kind]`` and change nothing.
    """

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in CORRUPTION_KINDS:
            raise ScenarioError(
                f"unknown corruption kind {self.kind!r}; known: {', '.join(CORRUPTION_KINDS)}"
            )

    @property
    def op(self) -> str:
        """The name of this step in traces."""
        return "restore_corrupted"


@dataclass(frozen=True)
class SetLossScale:
    """``set_loss_scale(loss_scale)``: the next window's loss scale (semantics §13).

    Any float is scenario data (a zero, a NaN or a value D cannot hold must be refused with
    ``InvalidLossScaleError``, as on a window that is not empty)."""

    loss_scale: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_scale", _as_float(self.loss_scale, what="loss_scale"))

    @property
    def op(self) -> str:
        """The accumulator method this step calls."""
        return "set_loss_scale"


@dataclass(frozen=True)
class UpdateScaler:
    """``scaler.update(found_inf)`` on the scenario's window loss scaler (semantics §13)."""

    found_inf: bool

    def __post_init__(self) -> None:
        if not isinstance(self.found_inf, bool):
            raise ScenarioError(f"UpdateScaler found_inf must be a bool, got {self.found_inf!r}")

    @property
    def op(self) -> str:
        """The name of this step in traces."""
        return "update_scaler"


Step: TypeAlias = (
    Accumulate | Finish | Checkpoint | Restore | RestoreCorrupted | SetLossScale | UpdateScaler
)
_STEP_TYPES = (
    Accumulate, Finish, Checkpoint, Restore, RestoreCorrupted, SetLossScale, UpdateScaler
)  # fmt: skip
# The steps without_interruptions() removes: resuming must not change anything the others see.
INTERRUPTIONS = (Checkpoint, Restore, RestoreCorrupted)


@dataclass(frozen=True)
class ScalerOptions:
    """The options of a scenario's window loss scaler (``WindowLossScaler`` without
    ``init_scale``, which is the scenario's ``loss_scale``, and ``dtype``, its work dtype).
    Checked with the scenario, by the reference scaler's own rules (semantics §13)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``WindowLossScaler`` / ``ReferenceLossScaler`` (no init_scale,
        no dtype)."""
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }


# ---------------------------------------------------------------------------------------------
# Scenario
# ---------------------------------------------------------------------------------------------


def _element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class Scenario:
    """One replayable run: dtypes, loss scale, fused flag, tracked parameters and steps.

    Validated on construction (:class:`ScenarioError` naming the offending value): the work dtype
    is one of ``formats.WORK_DTYPES``, the gradient dtype one of ``formats.FORMATS``, the loss
    scale a finite float > 0 exactly representable in the work dtype, parameter names unique and
    non-empty, shapes tuples of non-negative ints, every gradient entry names a parameter and has
    that parameter's element count, every gradient value is exactly a value of the gradient dtype,
    there is at least one parameter, and every restore step comes after a checkpoint step.
    """

    work_dtype: str
    grad_dtype: str
    loss_scale: float
    fused: bool
    parameters: tuple[tuple[str, tuple[int, ...]], ...]
    steps: tuple[Step, ...]
    scaler: ScalerOptions | None = None

    def __post_init__(self) -> None:
        if self.work_dtype not in formats.WORK_DTYPES:
            raise ScenarioError(
                f"work_dtype: {shown(self.work_dtype)} is not one of "
                f"{', '.join(formats.WORK_DTYPES)}"
            )
        if self.grad_dtype not in formats.FORMATS:
            raise ScenarioError(
                f"grad_dtype: {shown(self.grad_dtype)} is not one of {', '.join(formats.FORMATS)}"
            )
        scale = _as_float(self.loss_scale, what="loss_scale")
        if not (math.isfinite(scale) and scale > 0.0):
            raise ScenarioError(f"loss_scale: {scale!r} must be finite and > 0")
        if not formats.is_representable(scale, self.work_dtype):
            raise ScenarioError(
                f"loss_scale: {scale!r} ({scale.hex()}) is not representable in {self.work_dtype}"
            )
        object.__setattr__(self, "loss_scale", scale)
        if not isinstance(self.fused, bool):
            raise ScenarioError(f"fused: must be a bool, got {shown(self.fused)}")
        object.__setattr__(self, "parameters", self._checked_parameters())
        object.__setattr__(self, "steps", tuple(self.steps))
        self._check_scaler()
        self._check_steps()

    def _check_scaler(self) -> None:
        if self.scaler is None:
            return
        if not isinstance(self.scaler, ScalerOptions):
            raise ScenarioError(f"scaler: must be ScalerOptions or None, got {shown(self.scaler)}")
        try:  # the reference scaler's own checks, so both agree on what is a scaler
            ReferenceLossScaler(
                self.loss_scale,
                **self.scaler.as_kwargs(),
                dtype=self.work_dtype,
            )
        except (TypeError, ValueError) as exc:  # WeightedAccumulationError is a ValueError
            raise ScenarioError(f"scaler: {exc}") from None

    def _checked_parameters(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        checked: list[tuple[str, tuple[int, ...]]] = []
        seen: set[str] = set()
        for position, entry in enumerate(self.parameters):
            name, shape = entry
            where = item("parameters", position)
            if not isinstance(name, str) or not name:
                raise ScenarioError(f"{where}.name: must be a non-empty str, got {shown(name)}")
            if name in seen:
                raise ScenarioError(f"{where}.name: parameter {shown(name)} is listed twice")
            seen.add(name)
            dims = tuple(shape)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
                raise ScenarioError(f"{where}.shape: must be non-negative ints, got {shown(shape)}")
            checked.append((name, dims))
        if not checked:
            raise ScenarioError("parameters: a scenario needs at least one parameter, got none")
        return tuple(checked)

    def _check_steps(self) -> None:
        sizes = {name: _element_count(shape) for name, shape in self.parameters}
        checkpointed = False
        for index, step in enumerate(self.steps):
            where = item("steps", index)
            if not isinstance(step, _STEP_TYPES):
                raise ScenarioError(f"{where}: not a scenario step: {shown(step)}")
            if isinstance(step, UpdateScaler) and self.scaler is None:
                raise ScenarioError(f"{where}: update_scaler in a scenario without a scaler")
            if isinstance(step, Checkpoint):
                checkpointed = True
            elif isinstance(step, Restore | RestoreCorrupted) and not checkpointed:
                raise ScenarioError(f"{where}: {step.op} comes before any checkpoint step")
            elif isinstance(step, Accumulate):
                for name, values in step.grads:
                    if name not in sizes:
                        raise ScenarioError(
                            f"{item(f'{where}.grads', name)}: gradient for unknown parameter "
                            f"{shown(name)}; "
                            f"parameters: {shown(list(sizes))}"
                        )
                    if values is None:
                        continue
                    if len(values) != sizes[name]:
                        raise ScenarioError(
                            f"{item(f'{where}.grads', name)}: parameter {shown(name)} has "
                            f"{shown(sizes[name])} elements, "
                            f"got {len(values)} gradient values"
                        )
                    for position, value in enumerate(values):
                        if not formats.is_representable(value, self.grad_dtype):
                            raise ScenarioError(
                                f"{item(item(f'{where}.grads', name), position)}: gradient "
                                f"value {value!r} "
                                f"({value.hex()}) is not representable in {self.grad_dtype}"
                            )
                if step.fault is not None:
                    self._check_fault(step, where)

    def _check_fault(self, step: Accumulate, where: str) -> None:
        assert step.fault is not None
        problem = fault_problem(step.fault, self.params)
        name = step.fault.name
        values = step.grads_mapping().get(name)
        if problem is None and step.fault.kind != "unknown" and values is None:
            # A fault reshapes, retypes or moves the step's values: they must be there.
            problem = f"{step.fault.kind} needs the step's gradient values of {name!r}"
        if problem is not None:
            raise ScenarioError(f"{where}.fault: {problem}")

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        """The tracked parameters as an ordered mapping name -> shape (the reference's params)."""
        return dict(self.parameters)

    def grad_arrays(self, step: Accumulate) -> dict[str, np.ndarray | None]:
        """The step's gradients as float64 arrays of each parameter's shape (or None).

        Only the names present in the step appear (a missing name is a zero contribution).
        These are the gradients an accepted step contributes: a ``missing`` fault's name is left
        out; any other fault is not applied (the runner applies it to the tensors it makes).
        """
        shapes = self.params
        arrays: dict[str, np.ndarray | None] = {}
        left_out = step.fault.name if step.fault and step.fault.kind == "missing" else None
        for name, values in step.grads:
            if name == left_out:
                continue
            if values is None:
                arrays[name] = None
            else:
                arrays[name] = np.array(values, dtype=np.float64).reshape(shapes[name])
        return arrays

    def reference_grads(self, step: Accumulate) -> dict[str, npt.ArrayLike | None]:
        """:meth:`grad_arrays` as the reference must see the step: a refused fault's gradient
        is a :class:`~wacc_ref.faults.MalformedGradient` (an ``unknown`` one an extra name);
        an accepted fault's gradients are :meth:`grad_arrays` themselves."""
        arrays: dict[str, npt.ArrayLike | None] = dict(self.grad_arrays(step))
        if step.fault is not None and step.fault.refused:
            arrays[step.fault.name] = MalformedGradient(step.fault)
        return arrays


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def _hex(value: float) -> str:
    return float.hex(value)


def _step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, Accumulate):
        document: dict[str, Any] = {
            "op": step.op,
            "weight": _hex(step.weight),
            "grads": {
                name: (None if values is None else [_hex(v) for v in values])
                for name, values in step.grads
            },
        }
        if step.fault is not None:  # (version 3 only: a step without a fault keeps its bytes)
            document["fault"] = {"kind": step.fault.kind, "name": step.fault.name}
        return document
    if isinstance(step, Checkpoint):
        return {"op": step.op, "asynchronous": step.asynchronous}
    if isinstance(step, RestoreCorrupted):
        return {"op": step.op, "kind": step.kind}
    if isinstance(step, SetLossScale):
        return {"op": step.op, "loss_scale": _hex(step.loss_scale)}
    if isinstance(step, UpdateScaler):
        return {"op": step.op, "found_inf": step.found_inf}
    return {"op": step.op}


def is_dynamic(scenario: Scenario) -> bool:
    """Whether the scenario has a scaler or a dynamic-scaling step (JSON version 2)."""
    return scenario.scaler is not None or any(
        isinstance(step, SetLossScale | UpdateScaler) for step in scenario.steps
    )


def _scaler_to_json(options: ScalerOptions | None) -> dict[str, Any] | None:
    if options is None:
        return None
    return {
        "growth_factor": _hex(options.growth_factor),
        "backoff_factor": _hex(options.backoff_factor),
        "growth_interval": options.growth_interval,
        "hysteresis": options.hysteresis,
        "min_scale": None if options.min_scale is None else _hex(options.min_scale),
        "max_scale": None if options.max_scale is None else _hex(options.max_scale),
    }


def is_structural(scenario: Scenario) -> bool:
    """Whether a step of the scenario has a fault (JSON version 3)."""
    return any(isinstance(step, Accumulate) and step.fault for step in scenario.steps)


def to_json(scenario: Scenario, *, indent: int | None = None) -> str:
    """The scenario as JSON text; every float as ``float.hex`` (lossless, ±0 and inf included).
    Version 1 unless the scenario is dynamic (:func:`is_dynamic`): then version 2, with
    ``scaler``; version 3 (version 2 with ``fault`` on accumulate steps) when it is structural
    (:func:`is_structural`)."""
    structural = is_structural(scenario)
    dynamic = structural or is_dynamic(scenario)
    version = JSON_VERSION_DYNAMIC if dynamic else JSON_VERSION
    document: dict[str, Any] = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION_STRUCTURAL if structural else version,
        "work_dtype": scenario.work_dtype,
        "grad_dtype": scenario.grad_dtype,
        "loss_scale": _hex(scenario.loss_scale),
        "fused": scenario.fused,
        "parameters": [{"name": name, "shape": list(shape)} for name, shape in scenario.parameters],
        "steps": [_step_to_json(step) for step in scenario.steps],
    }
    if dynamic:
        document["scaler"] = _scaler_to_json(scenario.scaler)
    return json.dumps(document, indent=indent, allow_nan=False)


_MAX_DIM = 2**63 - 1
_MAX_COUNT = 2**63 - 1
_TOP_FIELDS = ("format", "version", "work_dtype", "grad_dtype", "loss_scale", "fused",
               "parameters", "steps")  # fmt: skip
_SCALER_FIELDS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                  "min_scale", "max_scale")  # fmt: skip
_STEP_FIELDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "accumulate_sum": ("op", "weight", "grads"),
        "accumulate_mean": ("op", "weight", "grads"),
        "finish_sums": ("op",),
        "finish_mean": ("op",),
        "checkpoint": ("op", "asynchronous"),
        "restore": ("op",),
        "restore_corrupted": ("op", "kind"),
    }
)
_DYNAMIC_STEP_FIELDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        **_STEP_FIELDS,
        "set_loss_scale": ("op", "loss_scale"),
        "update_scaler": ("op", "found_inf"),
    }
)


def _step_from_json(obj: object, where: str, *, dynamic: bool, structural: bool) -> Step:
    step = expect_object(obj, where)
    if "op" not in step:
        raise FieldError(field(where, "op"), "missing")
    known = _DYNAMIC_STEP_FIELDS if dynamic else _STEP_FIELDS
    op = expect_str(step["op"], field(where, "op"), choices=known)
    faulty = structural and op in ("accumulate_sum", "accumulate_mean") and "fault" in step
    fields = expect_object(step, where, (*known[op], "fault") if faulty else known[op])
    if op == "set_loss_scale":
        return SetLossScale(parse_hex(fields["loss_scale"], field(where, "loss_scale")))
    if op == "update_scaler":
        return UpdateScaler(expect_bool(fields["found_inf"], field(where, "found_inf")))
    if op in ("accumulate_sum", "accumulate_mean"):
        weight = parse_hex(fields["weight"], field(where, "weight"))
        grads_at = field(where, "grads")
        entries: list[tuple[str, GradValues]] = []
        for name, values in expect_object(fields["grads"], grads_at).items():
            at = item(grads_at, name)
            if values is None:
                entries.append((name, None))
            elif isinstance(values, list):
                entries.append(
                    (name, tuple(parse_hex(v, item(at, k)) for k, v in enumerate(values)))
                )
            else:
                raise FieldError(at, f"must be a JSON array or null, got {shown(values)}")
        kind: Literal["sum", "mean"] = "sum" if op == "accumulate_sum" else "mean"
        fault = _fault_from_json(fields["fault"], field(where, "fault")) if faulty else None
        return Accumulate(kind=kind, weight=weight, grads=tuple(entries), fault=fault)
    if op == "finish_sums":
        return Finish("sums")
    if op == "finish_mean":
        return Finish("mean")
    if op == "checkpoint":
        asynchronous = expect_bool(fields["asynchronous"], field(where, "asynchronous"))
        return Checkpoint(asynchronous=asynchronous)
    if op == "restore":
        return Restore()
    return RestoreCorrupted(
        kind=expect_str(fields["kind"], field(where, "kind"), choices=CORRUPTION_KINDS)
    )


def _fault_from_json(obj: object, where: str) -> Fault:
    fault = expect_object(obj, where, ("kind", "name"))
    return Fault(
        kind=expect_str(fault["kind"], field(where, "kind"), choices=FAULT_KINDS),
        name=expect_str(fault["name"], field(where, "name")),
    )


def _from_document(document: object) -> Scenario:
    top = expect_object(document, "")
    # Format and version first: a file of another kind is named as such, not by its first field.
    if top.get("format") != JSON_FORMAT:
        raise FieldError("format", f"must be {JSON_FORMAT!r}, got {shown(top.get('format'))}")
    version = top.get("version")
    # not True, not 1.0
    versions = (JSON_VERSION, JSON_VERSION_DYNAMIC, JSON_VERSION_STRUCTURAL)
    if type(version) is not int or version not in versions:
        raise FieldError(
            "version", f"must be one of {', '.join(map(str, versions))}, got {shown(version)}"
        )
    structural = version == JSON_VERSION_STRUCTURAL
    dynamic = structural or version == JSON_VERSION_DYNAMIC
    expect_object(top, "", (*_TOP_FIELDS, "scaler") if dynamic else _TOP_FIELDS)
    parameters: list[tuple[str, tuple[int, ...]]] = []
    for position, entry in enumerate(expect_list(top["parameters"], "parameters")):
        where = item("parameters", position)
        param = expect_object(entry, where, ("name", "shape"))
        shape_at = field(where, "shape")
        shape = expect_list(param["shape"], shape_at)
        # A dimension numpy and torch can index; it also keeps the element counts small ints.
        dims = tuple(
            expect_int(d, item(shape_at, k), minimum=0, maximum=_MAX_DIM)
            for k, d in enumerate(shape)
        )
        parameters.append((expect_str(param["name"], field(where, "name")), dims))
    steps = expect_list(top["steps"], "steps")
    return Scenario(
        work_dtype=expect_str(top["work_dtype"], "work_dtype"),
        grad_dtype=expect_str(top["grad_dtype"], "grad_dtype"),
        loss_scale=parse_hex(top["loss_scale"], "loss_scale"),
        fused=expect_bool(top["fused"], "fused"),
        parameters=tuple(parameters),
        steps=tuple(
            _step_from_json(step, item("steps", i), dynamic=dynamic, structural=structural)
            for i, step in enumerate(steps)
        ),
        scaler=_scaler_from_json(top["scaler"]) if dynamic else None,
    )


def _scaler_from_json(obj: object) -> ScalerOptions | None:
    if obj is None:
        return None
    fields = expect_object(obj, "scaler", _SCALER_FIELDS)

    def scale(name: str) -> float | None:
        value = fields[name]
        return None if value is None else parse_hex(value, field("scaler", name))

    return ScalerOptions(
        growth_factor=parse_hex(fields["growth_factor"], "scaler.growth_factor"),
        backoff_factor=parse_hex(fields["backoff_factor"], "scaler.backoff_factor"),
        growth_interval=expect_int(
            fields["growth_interval"], "scaler.growth_interval", minimum=1, maximum=_MAX_COUNT
        ),
        hysteresis=expect_int(
            fields["hysteresis"], "scaler.hysteresis", minimum=1, maximum=_MAX_COUNT
        ),
        min_scale=scale("min_scale"),
        max_scale=scale("max_scale"),
    )


def from_json(text: str | bytes) -> Scenario:
    """The scenario written by :func:`to_json`, read strictly and validated like any scenario.

    Every problem is a :class:`ScenarioError` whose one-line message starts with the field's path
    (``steps[2].grads['w'][0]: ...``) and shows the value; the reading rules (floats spelled
    exactly as ``float.hex`` writes them, integers that are JSON integers and never ``true``, no
    missing, unknown or repeated fields) are those of :mod:`wacc_ref.strict_json`.
    """
    try:
        return _from_document(loads(text))
    except FieldError as exc:
        raise ScenarioError(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# Exact identity and transformations
# ---------------------------------------------------------------------------------------------


def _step_key(step: Step) -> tuple[object, ...]:
    if isinstance(step, Accumulate):
        grads = tuple(
            (name, None if values is None else tuple(float_key(v) for v in values))
            for name, values in step.grads
        )
        fault = None if step.fault is None else (step.fault.kind, step.fault.name)
        return (step.op, float_key(step.weight), grads, fault)
    if isinstance(step, Checkpoint):
        return (step.op, step.asynchronous)
    if isinstance(step, RestoreCorrupted):
        return (step.op, step.kind)
    if isinstance(step, SetLossScale):
        return (step.op, float_key(step.loss_scale))
    if isinstance(step, UpdateScaler):
        return (step.op, step.found_inf)
    return (step.op,)


def _scaler_key(options: ScalerOptions | None) -> tuple[object, ...] | None:
    if options is None:
        return None
    return (
        float_key(options.growth_factor),
        float_key(options.backoff_factor),
        options.growth_interval,
        options.hysteresis,
        None if options.min_scale is None else float_key(options.min_scale),
        None if options.max_scale is None else float_key(options.max_scale),
    )


def _scenario_key(scenario: Scenario) -> tuple[object, ...]:
    return (
        scenario.work_dtype,
        scenario.grad_dtype,
        float_key(scenario.loss_scale),
        scenario.fused,
        scenario.parameters,
        tuple(_step_key(step) for step in scenario.steps),
        _scaler_key(scenario.scaler),
    )


def scenarios_identical(first: Scenario, second: Scenario) -> bool:
    """Whether two scenarios are equal with floats compared as bit patterns (all NaNs equal)."""
    return _scenario_key(first) == _scenario_key(second)


def without_interruptions(scenario: Scenario) -> Scenario:
    """The scenario with every checkpoint, restore and corrupted restore removed (the scale and
    scaler steps stay).

    When every restore comes right after the checkpoint it loads (only checkpoints and corrupted
    restores in between), resume is exact (§9) and the finish results of both scenarios must
    be identical.
    """
    return Scenario(
        work_dtype=scenario.work_dtype,
        grad_dtype=scenario.grad_dtype,
        loss_scale=scenario.loss_scale,
        fused=scenario.fused,
        parameters=scenario.parameters,
        steps=tuple(s for s in scenario.steps if not isinstance(s, INTERRUPTIONS)),
        scaler=scenario.scaler,
    )
