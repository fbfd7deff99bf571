"""Replayable accumulation scenarios, corrupted records, and step-by-step traces.

A :class:`Scenario` is a complete, self-contained description of one run of an accumulator: the
work dtype ``D``, the gradient dtype ``G``, the loss scale ``S``, the ``fused`` flag, the tracked
parameters (ordered names and shapes) and a sequence of steps:

========================  =============================================================
step                      meaning
========================  =============================================================
``Accumulate("sum")``     ``accumulate_sum(params, weight, grads=...)`` (SPEC §5)
``Accumulate("mean")``    ``accumulate_mean(params, weight, grads=...)`` (SPEC §6)
``Finish("sums")``        ``finish_sums()`` (SPEC §7)
``Finish("mean")``        ``finish_mean()`` (SPEC §8)
``Checkpoint(async)``     take a record: ``state_dict()`` or ``state_dict_async()`` (§9)
``Restore()``             load the most recent checkpoint into a FRESH accumulator (same
                          dtype, loss scale and fused flag) and continue with that one;
                          the data position is the scenario's: no step is replayed
``RestoreCorrupted(k)``   load ``corrupt_record(latest checkpoint, k)`` into the CURRENT
                          accumulator: it must raise ``RecordError`` and change nothing
========================  =============================================================

Gradient values are stored flat, in row-major order, one tuple of Python floats per parameter,
each exactly a value of ``G`` (checked when the scenario is built).  A parameter absent from a
step's ``grads``, or mapped to ``None``, is a zero contribution (SPEC §5).  Weights are arbitrary
Python floats, so that invalid weights (negative, NaN, inf) can be scenario steps too.

Scenarios serialize losslessly to JSON (:func:`to_json`, :func:`from_json`): every float is written
with :meth:`float.hex` (``0x0.0p+0`` and ``-0x0.0p+0`` keep the sign of zero, ``inf``/``-inf`` and
``nan`` are spelled out).  The only thing not kept is the sign and payload of a NaN, which no
comparison in this project looks at (a NaN is a NaN).  A failing scenario can therefore be saved
with ``to_json`` and replayed with ``from_json``.

Traces and how two of them are compared
---------------------------------------
:func:`run_reference` runs a scenario on :class:`wacc_ref.accumulator.ReferenceAccumulator` and
returns a :class:`ScenarioTrace`: one :class:`StepOutcome` per step, holding

* ``error``: the class name of the SPEC error the step raised (``"RecordError"``, ...), or None;
* ``skipped``: True only for a ``RestoreCorrupted`` whose corruption kind does not apply to the
  latest record (see :func:`applicable_corruptions`), which is then not loaded at all;
* ``state``: a :class:`RecordSnapshot` of ``state_dict()`` taken after the step (all counters,
  the bound parameters and every allocated pending buffer, converted exactly to float64);
* ``result``: for finish steps that did not raise, a :class:`FinishOutcome` (the grads of every
  scenario parameter in order, as float64 arrays of the parameter's shape or None, the weight, the
  loss scale, the counters and ``normalized``);
* ``record``: for checkpoint steps, the snapshot of the record that the step produced.

The production side (a harness driving ``wacc_torch``) builds the same structure with
:func:`snapshot_record` and :func:`finish_outcome`, which accept torch tensors by duck typing
(this module never imports torch).  For an asynchronous checkpoint the harness should resolve the
handle (``.result()``) only after the following steps ran (at the restore that uses it, or at the
end), so that accumulation continuing before ``.result()`` is exercised; ``record`` then holds what
``.result()`` returned.

:func:`trace_differences` compares two traces exactly: same number of steps, same op, same error
class (or both None), same ``skipped``, and every number identical as a float64 bit pattern —
``+0.0`` differs from ``-0.0`` — except that every NaN equals every NaN (sign and payload are not
compared, positions are); counters and flags with ``==``; pending buffers keyed by name, so the
order in which an implementation allocated them does not matter.  An empty list means the traces
are identical.  :func:`trace_violations` checks the SPEC's invariants within a single trace (a
raising step changes nothing, a corrupted restore raises ``RecordError``, a restore reproduces the
checkpoint, a checkpoint changes nothing).

:func:`stepwise_differences` is the step-local form of the same comparison: before each step the
reference loads the state the *actual* trace recorded after the previous step, runs the step, and
compares.  It localizes a divergence to one step, and it is the oracle for fused scenarios: with
``fused=True`` a mean step may legitimately give any of three results per element (SPEC §6), and
PyTorch's CPU float16 ``add_(c, alpha=w)`` mixes two of them within one tensor (vectorized chunks
round in float32, the scalar tail rounds the product to float16 first), so no single
``fused_variant`` of :func:`run_reference` matches it; the stepwise oracle accepts, per element,
exactly the SPEC's set.  For float32/float64 on CPU the fused result is the FMA
(``fused_variant="fma"``) and a whole-trace comparison works as well.

Corrupted records
-----------------
:func:`corrupt_record` returns a corrupted copy of a record of either implementation (numpy arrays
or torch tensors as pending buffers; only ``reshape``, ``shape`` and dict/list edits are used, and
the buffers are shared with the input, never written).  Each kind in :data:`CORRUPTION_KINDS` is
listed in :data:`CORRUPTION_FIELDS` with the field that the ``RecordError`` message must name;
for the two pending-buffer kinds that is the parameter's name, given by :func:`corruption_field`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import numpy as np

from wacc_ref import formats
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.arith import fused_mean_step_accepts, fused_mean_step_candidates
from wacc_ref.errors import WeightedAccumulationError
from wacc_ref.records import RECORD_KEYS  # the shared record schema's keys, re-exported

__all__ = [
    "CORRUPTION_FIELDS",
    "CORRUPTION_KINDS",
    "JSON_FORMAT",
    "JSON_VERSION",
    "RECORD_KEYS",
    "UNKNOWN_DTYPE",
    "UNKNOWN_PARAMETER_NAME",
    "UNKNOWN_RECORD_KEY",
    "Accumulate",
    "Checkpoint",
    "CorruptionNotApplicableError",
    "Finish",
    "GradEntries",
    "GradValues",
    "FinishOutcome",
    "RecordSnapshot",
    "Restore",
    "RestoreCorrupted",
    "Scenario",
    "ScenarioError",
    "ScenarioTrace",
    "Step",
    "StepOutcome",
    "applicable_corruptions",
    "buffer_to_float64",
    "corrupt_record",
    "corruption_field",
    "finish_outcome",
    "from_json",
    "record_from_snapshot",
    "run_reference",
    "stepwise_differences",
    "scenarios_identical",
    "snapshot_record",
    "to_json",
    "trace_differences",
    "trace_violations",
    "without_interruptions",
]

JSON_FORMAT = "wacc-scenario"
JSON_VERSION = 1


class ScenarioError(ValueError):
    """A scenario (or its JSON text) that is not well formed; the message names the value."""


class CorruptionNotApplicableError(ValueError):
    """A corruption kind that needs something the record does not have (e.g. a pending buffer)."""


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------

GradValues: TypeAlias = tuple[float, ...] | None
GradEntries: TypeAlias = tuple[tuple[str, GradValues], ...]


def _as_float(value: object, *, what: str) -> float:
    """``value`` as a Python float; only floats (numpy float64 included) are accepted."""
    if isinstance(value, bool) or not isinstance(value, float):
        raise ScenarioError(f"{what} must be a float, got {value!r} ({type(value).__name__})")
    return float(value)


@dataclass(frozen=True)
class Accumulate:
    """``accumulate_sum`` (kind ``"sum"``) or ``accumulate_mean`` (kind ``"mean"``) of one batch.

    ``grads`` holds ``(name, values)`` pairs: ``values`` is the gradient flattened in row-major
    order (a tuple of floats of the parameter's size) or None.  Build it from a mapping with
    :meth:`of`.
    """

    kind: Literal["sum", "mean"]
    weight: float
    grads: GradEntries = ()

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


Step: TypeAlias = Accumulate | Finish | Checkpoint | Restore | RestoreCorrupted


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

    def __post_init__(self) -> None:
        if self.work_dtype not in formats.WORK_DTYPES:
            raise ScenarioError(
                f"work_dtype {self.work_dtype!r} is not one of {', '.join(formats.WORK_DTYPES)}"
            )
        if self.grad_dtype not in formats.FORMATS:
            raise ScenarioError(
                f"grad_dtype {self.grad_dtype!r} is not one of {', '.join(formats.FORMATS)}"
            )
        scale = _as_float(self.loss_scale, what="loss_scale")
        if not (math.isfinite(scale) and scale > 0.0):
            raise ScenarioError(f"loss_scale {scale!r} must be finite and > 0")
        if not formats.is_representable(scale, self.work_dtype):
            raise ScenarioError(
                f"loss_scale {scale!r} ({scale.hex()}) is not representable in {self.work_dtype}"
            )
        object.__setattr__(self, "loss_scale", scale)
        if not isinstance(self.fused, bool):
            raise ScenarioError(f"fused must be a bool, got {self.fused!r}")
        object.__setattr__(self, "parameters", self._checked_parameters())
        object.__setattr__(self, "steps", tuple(self.steps))
        self._check_steps()

    def _checked_parameters(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        checked: list[tuple[str, tuple[int, ...]]] = []
        seen: set[str] = set()
        for entry in self.parameters:
            name, shape = entry
            if not isinstance(name, str) or not name:
                raise ScenarioError(f"parameter name must be a non-empty str, got {name!r}")
            if name in seen:
                raise ScenarioError(f"parameter {name!r} is listed twice")
            seen.add(name)
            dims = tuple(shape)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
                raise ScenarioError(
                    f"shape of parameter {name!r} must be non-negative ints, got {shape!r}"
                )
            checked.append((name, dims))
        if not checked:
            raise ScenarioError("a scenario needs at least one parameter, got none")
        return tuple(checked)

    def _check_steps(self) -> None:
        sizes = {name: _element_count(shape) for name, shape in self.parameters}
        checkpointed = False
        for index, step in enumerate(self.steps):
            if not isinstance(step, Accumulate | Finish | Checkpoint | Restore | RestoreCorrupted):
                raise ScenarioError(f"step {index} is not a scenario step: {step!r}")
            if isinstance(step, Checkpoint):
                checkpointed = True
            elif isinstance(step, Restore | RestoreCorrupted) and not checkpointed:
                raise ScenarioError(f"step {index} ({step.op}) comes before any checkpoint step")
            elif isinstance(step, Accumulate):
                for name, values in step.grads:
                    if name not in sizes:
                        raise ScenarioError(
                            f"step {index}: gradient for unknown parameter {name!r}; "
                            f"parameters: {list(sizes)}"
                        )
                    if values is None:
                        continue
                    if len(values) != sizes[name]:
                        raise ScenarioError(
                            f"step {index}: parameter {name!r} has {sizes[name]} elements, "
                            f"got {len(values)} gradient values"
                        )
                    for position, value in enumerate(values):
                        if not formats.is_representable(value, self.grad_dtype):
                            raise ScenarioError(
                                f"step {index}: gradient value {value!r} ({value.hex()}) of "
                                f"{name!r}[{position}] is not representable in {self.grad_dtype}"
                            )

    @property
    def params(self) -> dict[str, tuple[int, ...]]:
        """The tracked parameters as an ordered mapping name -> shape (the reference's params)."""
        return dict(self.parameters)

    def grad_arrays(self, step: Accumulate) -> dict[str, np.ndarray | None]:
        """The step's gradients as float64 arrays of each parameter's shape (or None).

        Only the names present in the step appear (a missing name is a zero contribution).
        """
        shapes = self.params
        arrays: dict[str, np.ndarray | None] = {}
        for name, values in step.grads:
            if values is None:
                arrays[name] = None
            else:
                arrays[name] = np.array(values, dtype=np.float64).reshape(shapes[name])
        return arrays


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def _hex(value: float) -> str:
    return float.hex(value)


def _unhex(text: object, *, what: str) -> float:
    if not isinstance(text, str):
        raise ScenarioError(f"{what} must be a float.hex string, got {text!r}")
    try:
        return float.fromhex(text)
    except ValueError:
        raise ScenarioError(f"{what} is not a float.hex string: {text!r}") from None


def _step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, Accumulate):
        return {
            "op": step.op,
            "weight": _hex(step.weight),
            "grads": {
                name: (None if values is None else [_hex(v) for v in values])
                for name, values in step.grads
            },
        }
    if isinstance(step, Checkpoint):
        return {"op": step.op, "asynchronous": step.asynchronous}
    if isinstance(step, RestoreCorrupted):
        return {"op": step.op, "kind": step.kind}
    return {"op": step.op}


def to_json(scenario: Scenario, *, indent: int | None = None) -> str:
    """The scenario as JSON text; every float as ``float.hex`` (lossless, ±0 and inf included)."""
    document = {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "work_dtype": scenario.work_dtype,
        "grad_dtype": scenario.grad_dtype,
        "loss_scale": _hex(scenario.loss_scale),
        "fused": scenario.fused,
        "parameters": [{"name": name, "shape": list(shape)} for name, shape in scenario.parameters],
        "steps": [_step_to_json(step) for step in scenario.steps],
    }
    return json.dumps(document, indent=indent, allow_nan=False)


def _expect_keys(obj: object, keys: set[str], *, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ScenarioError(f"{what} must be a JSON object, got {obj!r}")
    missing = keys - obj.keys()
    extra = obj.keys() - keys
    if missing or extra:
        raise ScenarioError(
            f"{what} has missing keys {sorted(missing)} / unknown keys {sorted(extra)}"
        )
    return obj


_STEP_KEYS: Mapping[str, set[str]] = MappingProxyType(
    {
        "accumulate_sum": {"op", "weight", "grads"},
        "accumulate_mean": {"op", "weight", "grads"},
        "finish_sums": {"op"},
        "finish_mean": {"op"},
        "checkpoint": {"op", "asynchronous"},
        "restore": {"op"},
        "restore_corrupted": {"op", "kind"},
    }
)


def _step_from_json(obj: object, index: int) -> Step:
    what = f"step {index}"
    if not isinstance(obj, dict) or obj.get("op") not in _STEP_KEYS:
        raise ScenarioError(f"{what} has no known 'op' ({sorted(_STEP_KEYS)}): {obj!r}")
    op = obj["op"]
    fields = _expect_keys(obj, _STEP_KEYS[op], what=f"{what} ({op})")
    if op in ("accumulate_sum", "accumulate_mean"):
        grads = fields["grads"]
        if not isinstance(grads, dict):
            raise ScenarioError(f"{what}: grads must be an object, got {grads!r}")
        entries: list[tuple[str, GradValues]] = []
        for name, values in grads.items():
            if values is None:
                entries.append((name, None))
            elif isinstance(values, list):
                entries.append(
                    (name, tuple(_unhex(v, what=f"{what}: gradient of {name!r}") for v in values))
                )
            else:
                raise ScenarioError(f"{what}: gradient of {name!r} must be a list or null")
        kind: Literal["sum", "mean"] = "sum" if op == "accumulate_sum" else "mean"
        return Accumulate(
            kind=kind, weight=_unhex(fields["weight"], what=f"{what}: weight"), grads=tuple(entries)
        )
    if op == "finish_sums":
        return Finish("sums")
    if op == "finish_mean":
        return Finish("mean")
    if op == "checkpoint":
        return Checkpoint(asynchronous=fields["asynchronous"])
    if op == "restore":
        return Restore()
    return RestoreCorrupted(kind=fields["kind"])


def from_json(text: str) -> Scenario:
    """The scenario written by :func:`to_json` (validated like any scenario)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"not JSON: {exc}") from None
    keys = {"format", "version", "work_dtype", "grad_dtype", "loss_scale", "fused"}
    keys |= {"parameters", "steps"}
    fields = _expect_keys(document, keys, what="scenario")
    if fields["format"] != JSON_FORMAT or fields["version"] != JSON_VERSION:
        raise ScenarioError(
            f"format {fields['format']!r} version {fields['version']!r} is not "
            f"{JSON_FORMAT!r} version {JSON_VERSION}"
        )
    if not isinstance(fields["parameters"], list) or not isinstance(fields["steps"], list):
        raise ScenarioError("scenario parameters and steps must be lists")
    parameters: list[tuple[str, tuple[int, ...]]] = []
    for position, entry in enumerate(fields["parameters"]):
        param = _expect_keys(entry, {"name", "shape"}, what=f"parameter {position}")
        if not isinstance(param["shape"], list):
            raise ScenarioError(f"parameter {position}: shape must be a list: {param['shape']!r}")
        parameters.append((param["name"], tuple(param["shape"])))
    return Scenario(
        work_dtype=fields["work_dtype"],
        grad_dtype=fields["grad_dtype"],
        loss_scale=_unhex(fields["loss_scale"], what="loss_scale"),
        fused=fields["fused"],
        parameters=tuple(parameters),
        steps=tuple(_step_from_json(step, i) for i, step in enumerate(fields["steps"])),
    )


# ---------------------------------------------------------------------------------------------
# Exact comparison helpers
# ---------------------------------------------------------------------------------------------

# Every NaN is compared as this one pattern (float64 canonical quiet NaN).
_CANONICAL_NAN_BITS = 0x7FF8000000000000


def _float_key(value: float) -> int:
    """The float64 bit pattern of ``value``; every NaN maps to one pattern."""
    if value != value:
        return _CANONICAL_NAN_BITS
    bits: int = struct.unpack("<Q", struct.pack("<d", value))[0]
    return bits


def _array_key(array: np.ndarray) -> tuple[tuple[int, ...], bytes]:
    """Shape and float64 bit patterns of ``array``; every NaN maps to one pattern."""
    values = np.ascontiguousarray(array, dtype=np.float64)
    bits = values.view(np.uint64).copy()
    bits[np.isnan(values)] = np.uint64(_CANONICAL_NAN_BITS)
    return tuple(values.shape), bits.tobytes()


def _step_key(step: Step) -> tuple[object, ...]:
    if isinstance(step, Accumulate):
        grads = tuple(
            (name, None if values is None else tuple(_float_key(v) for v in values))
            for name, values in step.grads
        )
        return (step.op, _float_key(step.weight), grads)
    if isinstance(step, Checkpoint):
        return (step.op, step.asynchronous)
    if isinstance(step, RestoreCorrupted):
        return (step.op, step.kind)
    return (step.op,)


def _scenario_key(scenario: Scenario) -> tuple[object, ...]:
    return (
        scenario.work_dtype,
        scenario.grad_dtype,
        _float_key(scenario.loss_scale),
        scenario.fused,
        scenario.parameters,
        tuple(_step_key(step) for step in scenario.steps),
    )


def scenarios_identical(first: Scenario, second: Scenario) -> bool:
    """Whether two scenarios are equal with floats compared as bit patterns (all NaNs equal)."""
    return _scenario_key(first) == _scenario_key(second)


def _describe_array(array: np.ndarray) -> str:
    flat = np.asarray(array, dtype=np.float64).reshape(-1)
    return "[" + ", ".join(float(v).hex() for v in flat) + f"] shape {tuple(array.shape)}"


def _array_differences(what: str, expected: np.ndarray, actual: np.ndarray) -> list[str]:
    if _array_key(expected) == _array_key(actual):
        return []
    if expected.shape != actual.shape:
        return [f"{what}: shape {tuple(expected.shape)} != {tuple(actual.shape)}"]
    exp_flat = expected.reshape(-1)
    act_flat = actual.reshape(-1)
    lines = []
    for position in range(exp_flat.size):
        e, a = float(exp_flat[position]), float(act_flat[position])
        if _float_key(e) != _float_key(a):
            lines.append(f"{what}[flat {position}]: expected {e.hex()}, got {a.hex()}")
    return lines


# ---------------------------------------------------------------------------------------------
# Snapshots of records and results (either implementation)
# ---------------------------------------------------------------------------------------------


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

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical snapshots (floats as bit patterns)."""
        return (
            self.format_version,
            self.dtype,
            _float_key(self.loss_scale),
            self.fused,
            self.issued,
            self.zero_weight,
            _float_key(self.total_weight),
            self.param_names,
            self.param_shapes,
            tuple((name, _array_key(array)) for name, array in self.pending),
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
            if _float_key(mine) != _float_key(theirs):
                lines.append(f"{what}.{name}: expected {mine.hex()}, got {theirs.hex()}")
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
            lines += _array_differences(
                f"{what}.pending[{name!r}]", mine_pending[name], theirs_pending[name]
            )
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
    )


@dataclass(frozen=True, eq=False)
class FinishOutcome:
    """A finished window in comparable form: every scenario parameter's gradient, in order.

    ``grads`` maps each parameter (scenario order) to a float64 array of its shape, or None when it
    had no buffer in the window.
    """

    grads: tuple[tuple[str, np.ndarray | None], ...]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool

    def key(self) -> tuple[object, ...]:
        """A hashable form: equal keys <=> identical outcomes (floats as bit patterns)."""
        return (
            tuple((name, None if g is None else _array_key(g)) for name, g in self.grads),
            _float_key(self.weight),
            _float_key(self.loss_scale),
            self.issued,
            self.zero_weight,
            self.normalized,
        )

    def differences(self, other: FinishOutcome, *, what: str) -> list[str]:
        """Human-readable differences from ``other`` (empty when identical)."""
        lines: list[str] = []
        for name in ("issued", "zero_weight", "normalized"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs or type(mine) is not type(theirs):
                lines.append(f"{what}.{name}: expected {mine!r}, got {theirs!r}")
        for name in ("weight", "loss_scale"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if _float_key(mine) != _float_key(theirs):
                lines.append(f"{what}.{name}: expected {mine.hex()}, got {theirs.hex()}")
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
                        g if g is None else _describe_array(g) for g in (mine_grad, theirs_grad)
                    ]
                    lines.append(f"{what}.grads[{name!r}]: expected {shown[0]}, got {shown[1]}")
                continue
            lines += _array_differences(f"{what}.grads[{name!r}]", mine_grad, theirs_grad)
        return lines


def finish_outcome(
    result: object,
    parameter_names: Sequence[str],
    *,
    to_float64: Callable[[object], np.ndarray] = buffer_to_float64,
) -> FinishOutcome:
    """A :class:`FinishOutcome` of a finish result of either implementation.

    ``result`` needs the attributes ``grads`` (mapping name -> array/tensor or None), ``weight``,
    ``loss_scale``, ``issued``, ``zero_weight`` and ``normalized`` (``ReferenceResult`` and
    ``wacc_torch.AccumulatedGradients`` both have them).  A parameter missing from ``grads`` is
    recorded as None; a name in ``grads`` that is not in ``parameter_names`` is an error.
    """
    grads: Mapping[str, object] = getattr(result, "grads")  # noqa: B009  # duck-typed
    unknown = [name for name in grads if name not in parameter_names]
    if unknown:
        raise ValueError(f"finish result has grads for unknown parameters {unknown!r}")
    entries: list[tuple[str, np.ndarray | None]] = []
    for name in parameter_names:
        grad = grads.get(name)
        entries.append((name, None if grad is None else to_float64(grad)))
    return FinishOutcome(
        grads=tuple(entries),
        weight=_float_field(getattr(result, "weight")),  # noqa: B009
        loss_scale=_float_field(getattr(result, "loss_scale")),  # noqa: B009
        issued=getattr(result, "issued"),  # noqa: B009
        zero_weight=getattr(result, "zero_weight"),  # noqa: B009
        normalized=getattr(result, "normalized"),  # noqa: B009
    )


# ---------------------------------------------------------------------------------------------
# Traces
# ---------------------------------------------------------------------------------------------


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
        )


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


def trace_differences(
    expected: ScenarioTrace, actual: ScenarioTrace, *, limit: int = 20
) -> list[str]:
    """Every difference between two traces (empty: identical), at most ``limit`` lines.

    Floats are compared as float64 bit patterns (±0 distinguished), every NaN equal to every NaN.
    Each line names the step index and op and shows values as hex floats.
    """
    lines: list[str] = []
    if len(expected) != len(actual):
        lines.append(f"trace length: expected {len(expected)} steps, got {len(actual)}")
    for exp, act in zip(expected.outcomes, actual.outcomes, strict=False):
        what = f"step {exp.index} ({exp.op})"
        if exp.op != act.op or exp.index != act.index:
            lines.append(f"{what}: got step {act.index} ({act.op})")
            break
        lines += _outcome_differences(exp, act, what=what)
        if len(lines) >= limit:
            break
    return lines[:limit]


def trace_violations(trace: ScenarioTrace) -> list[str]:
    """The SPEC invariants a single trace breaks (empty: none).

    * a step that raised left the state exactly as it was (SPEC §11);
    * a checkpoint does not change the state, and its record equals the state (SPEC §9);
    * a restore that did not raise gives exactly the state of the checkpoint it loaded;
    * a corrupted restore that was not skipped raised ``RecordError`` (SPEC §9).
    The state before the first step is not in the trace, so step 0 is never compared with a
    previous state (a checkpoint's record is still compared with its state).
    """
    lines: list[str] = []
    previous: RecordSnapshot | None = None
    latest_record: RecordSnapshot | None = None
    for outcome in trace.outcomes:
        what = f"step {outcome.index} ({outcome.op})"
        if outcome.error is not None and previous is not None:
            lines += previous.differences(outcome.state, what=f"{what} raised but changed state")
        if outcome.op == "checkpoint" and outcome.error is None:
            if previous is not None:
                lines += previous.differences(outcome.state, what=f"{what} changed state")
            if outcome.record is None:
                lines.append(f"{what}: no record")
            else:
                lines += outcome.state.differences(outcome.record, what=f"{what} record")
                latest_record = outcome.record
        if outcome.op == "restore" and outcome.error is None and latest_record is not None:
            lines += latest_record.differences(outcome.state, what=f"{what} restored state")
        if outcome.op == "restore_corrupted" and not outcome.skipped:
            if outcome.error != "RecordError":
                lines.append(f"{what}: expected RecordError, got {outcome.error}")
        previous = outcome.state
    return lines


# ---------------------------------------------------------------------------------------------
# Corrupted records
# ---------------------------------------------------------------------------------------------

# Name used for a pending buffer that belongs to no parameter, and for an unknown record key.
UNKNOWN_PARAMETER_NAME = "__not_a_parameter__"
UNKNOWN_RECORD_KEY = "__unknown_record_key__"
UNKNOWN_DTYPE = "float128"
_PENDING_PARAMETER = "<the parameter's name>"

# kind -> the field the RecordError message must name (a parameter name for the pending kinds).
CORRUPTION_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        # format_version + 1: a version this code does not know.
        "format_version_bad": "format_version",
        # dtype = "float128": not a dtype at all.
        "dtype_unknown": "dtype",
        # dtype = another work dtype (the next one in WORK_DTYPES).
        "dtype_wrong": "dtype",
        # loss_scale doubled (halved if doubling overflows float64).
        "loss_scale_wrong": "loss_scale",
        # fused flag flipped.
        "fused_flipped": "fused",
        # "total_weight" key deleted.
        "missing_key": "total_weight",
        # an extra key UNKNOWN_RECORD_KEY.
        "unknown_key": UNKNOWN_RECORD_KEY,
        # issued = True (a bool is not an int counter).
        "issued_bool": "issued",
        # issued = float(issued).
        "issued_float": "issued",
        # issued = -1.
        "issued_negative": "issued",
        # zero_weight = issued + 1.
        "zero_weight_exceeds_issued": "zero_weight",
        # total_weight = -1.0.
        "total_weight_negative": "total_weight",
        # total_weight = NaN.
        "total_weight_nan": "total_weight",
        # total_weight = +inf.
        "total_weight_inf": "total_weight",
        # zero_weight = issued, no pending buffers, total_weight > 0 (1.0 when it was 0).
        "total_weight_without_weighted_batches": "total_weight",
        # a pending buffer under UNKNOWN_PARAMETER_NAME (a view of an existing buffer);
        # needs a pending buffer.
        "pending_unknown_parameter": UNKNOWN_PARAMETER_NAME,
        # the first pending buffer reshaped (flat / row / 3-d, whichever differs); needs a pending
        # buffer; the message must name that parameter.
        "pending_wrong_shape": _PENDING_PARAMETER,
        # param_shapes one entry longer (or shorter) than param_names.
        "param_lists_length_mismatch": "param_shapes",
        # the first parameter renamed in param_names (and in pending, consistently); needs bound
        # parameters.
        "param_names_wrong": "param_names",
        # the first parameter's shape gets a trailing 1 in param_shapes (and its pending buffer is
        # reshaped to match); needs bound parameters.
        "param_shape_wrong": "param_shapes",
    }
)
CORRUPTION_KINDS: tuple[str, ...] = tuple(CORRUPTION_FIELDS)

_NEEDS_PENDING = frozenset({"pending_unknown_parameter", "pending_wrong_shape"})
_NEEDS_BOUND = frozenset({"param_names_wrong", "param_shape_wrong"})


def _copy_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the record's containers (buffers shared: they are never written)."""
    copied = dict(record)
    if isinstance(record.get("param_names"), list | tuple):
        copied["param_names"] = list(record["param_names"])
    if isinstance(record.get("param_shapes"), list | tuple):
        copied["param_shapes"] = [list(shape) for shape in record["param_shapes"]]
    if isinstance(record.get("pending"), Mapping):
        copied["pending"] = dict(record["pending"])
    return copied


def applicable_corruptions(record: Mapping[str, Any]) -> tuple[str, ...]:
    """The corruption kinds :func:`corrupt_record` can apply to ``record``, in kind order."""
    has_pending = bool(record["pending"])
    bound = bool(record["param_names"])
    return tuple(
        kind
        for kind in CORRUPTION_KINDS
        if (kind not in _NEEDS_PENDING or has_pending) and (kind not in _NEEDS_BOUND or bound)
    )


def _check_kind(record: Mapping[str, Any], kind: str) -> None:
    if kind not in CORRUPTION_FIELDS:
        raise ValueError(f"unknown corruption kind {kind!r}; known: {', '.join(CORRUPTION_KINDS)}")
    if kind not in applicable_corruptions(record):
        need = "a pending buffer" if kind in _NEEDS_PENDING else "bound parameters"
        raise CorruptionNotApplicableError(f"corruption {kind!r} needs {need}; the record has none")


def _first_pending_name(record: Mapping[str, Any]) -> str:
    order = {name: position for position, name in enumerate(record["param_names"])}
    return min(record["pending"], key=lambda name: (order.get(name, len(order)), name))


def corruption_field(record: Mapping[str, Any], kind: str) -> str:
    """The field (or parameter name) that loading ``corrupt_record(record, kind)`` must name."""
    _check_kind(record, kind)
    if kind == "pending_wrong_shape":
        return _first_pending_name(record)
    return CORRUPTION_FIELDS[kind]


def _wrong_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape with the same element count that differs from ``shape`` (distinct ranks 1, 2, 3)."""
    count = _element_count(shape)
    for candidate in ((count,), (1, count), (1, 1, count)):
        if candidate != shape:
            return candidate
    raise AssertionError("unreachable: three shapes of distinct rank")


def corrupt_record(record: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A corrupted copy of ``record`` (numpy or torch buffers); see :data:`CORRUPTION_FIELDS`.

    The input is not modified.  Raises ValueError for an unknown kind and
    :class:`CorruptionNotApplicableError` when the record lacks what the kind needs.
    """
    _check_kind(record, kind)
    out = _copy_record(record)
    if kind == "format_version_bad":
        out["format_version"] = record["format_version"] + 1
    elif kind == "dtype_unknown":
        out["dtype"] = UNKNOWN_DTYPE
    elif kind == "dtype_wrong":
        dtypes = formats.WORK_DTYPES
        current = dtypes.index(record["dtype"]) if record["dtype"] in dtypes else -1
        out["dtype"] = dtypes[(current + 1) % len(dtypes)]
    elif kind == "loss_scale_wrong":
        doubled = record["loss_scale"] * 2.0
        out["loss_scale"] = doubled if math.isfinite(doubled) else record["loss_scale"] / 2.0
    elif kind == "fused_flipped":
        out["fused"] = not record["fused"]
    elif kind == "missing_key":
        del out["total_weight"]
    elif kind == "unknown_key":
        out[UNKNOWN_RECORD_KEY] = 0
    elif kind == "issued_bool":
        out["issued"] = True
    elif kind == "issued_float":
        out["issued"] = float(record["issued"])
    elif kind == "issued_negative":
        out["issued"] = -1
    elif kind == "zero_weight_exceeds_issued":
        out["zero_weight"] = record["issued"] + 1
    elif kind == "total_weight_negative":
        out["total_weight"] = -1.0
    elif kind == "total_weight_nan":
        out["total_weight"] = math.nan
    elif kind == "total_weight_inf":
        out["total_weight"] = math.inf
    elif kind == "total_weight_without_weighted_batches":
        out["zero_weight"] = record["issued"]
        out["pending"] = {}
        weight = record["total_weight"]
        out["total_weight"] = weight if weight > 0 else 1.0
    elif kind == "pending_unknown_parameter":
        donor = out["pending"][_first_pending_name(record)]
        out["pending"][UNKNOWN_PARAMETER_NAME] = donor.reshape(tuple(donor.shape))
    elif kind == "pending_wrong_shape":
        name = _first_pending_name(record)
        buffer = out["pending"][name]
        out["pending"][name] = buffer.reshape(_wrong_shape(tuple(buffer.shape)))
    elif kind == "param_lists_length_mismatch":
        shapes = out["param_shapes"]
        if shapes:
            shapes.pop()
        else:
            shapes.append([1])
    elif kind == "param_names_wrong":
        old = out["param_names"][0]
        new = old + "__renamed"
        out["param_names"][0] = new
        out["pending"] = {(new if name == old else name): b for name, b in out["pending"].items()}
    elif kind == "param_shape_wrong":
        name = out["param_names"][0]
        out["param_shapes"][0] = out["param_shapes"][0] + [1]
        if name in out["pending"]:
            buffer = out["pending"][name]
            out["pending"][name] = buffer.reshape(tuple(buffer.shape) + (1,))
    else:  # pragma: no cover - _check_kind rejected it
        raise AssertionError(kind)
    return out


# ---------------------------------------------------------------------------------------------
# Running a scenario on the reference
# ---------------------------------------------------------------------------------------------


def _reference_factory(
    scenario: Scenario, *, mode: str, fused_variant: str, precision: int
) -> Callable[[], ReferenceAccumulator]:
    def fresh() -> ReferenceAccumulator:
        return ReferenceAccumulator(
            dtype=scenario.work_dtype,
            loss_scale=scenario.loss_scale,
            fused=scenario.fused,
            fused_variant=fused_variant,
            mode=mode,
            precision=precision,
        )

    return fresh


def _run_step(
    scenario: Scenario,
    index: int,
    accumulator: ReferenceAccumulator,
    latest: Mapping[str, Any] | None,
    fresh: Callable[[], ReferenceAccumulator],
) -> tuple[StepOutcome, ReferenceAccumulator, Mapping[str, Any] | None]:
    """Run step ``index`` on ``accumulator``; return its outcome, the accumulator to continue
    with (a fresh one after a restore) and the latest checkpoint record."""
    step = scenario.steps[index]
    params = scenario.params
    error: str | None = None
    skipped = False
    result: FinishOutcome | None = None
    record: RecordSnapshot | None = None
    try:
        if isinstance(step, Accumulate):
            method = (
                accumulator.accumulate_sum if step.kind == "sum" else accumulator.accumulate_mean
            )
            method(params, step.weight, grads=scenario.grad_arrays(step))
        elif isinstance(step, Finish):
            finished = (
                accumulator.finish_sums() if step.kind == "sums" else accumulator.finish_mean()
            )
            result = finish_outcome(finished, list(params))
        elif isinstance(step, Checkpoint):
            latest = accumulator.state_dict()
            record = snapshot_record(latest)
        elif isinstance(step, Restore):
            assert latest is not None  # Scenario validation: a checkpoint came first
            accumulator = fresh()
            accumulator.load_state_dict(latest, params)
        else:
            assert latest is not None
            if step.kind in applicable_corruptions(latest):
                accumulator.load_state_dict(corrupt_record(latest, step.kind), params)
            else:
                skipped = True
    except WeightedAccumulationError as exc:
        error = type(exc).__name__
    outcome = StepOutcome(
        index=index,
        op=step.op,
        error=error,
        skipped=skipped,
        state=snapshot_record(accumulator.state_dict()),
        result=result,
        record=record,
    )
    return outcome, accumulator, latest


def run_reference(
    scenario: Scenario,
    *,
    mode: str = "emulated",
    fused_variant: str = "fma",
    precision: int = 256,
) -> ScenarioTrace:
    """Run ``scenario`` step by step on the reference accumulator and return its trace.

    Only the SPEC's errors (``wacc_ref.errors.WeightedAccumulationError`` and subclasses) are
    caught and recorded; anything else propagates.  ``mode`` (``"emulated"`` or ``"exact"``),
    ``fused_variant`` (``"fma"``, ``"op_rounded"`` or ``"two_step"``, used only when the scenario
    is fused) and ``precision`` go to :class:`~wacc_ref.accumulator.ReferenceAccumulator`, which
    validates them.  In ``"exact"`` mode the snapshots show each exact value rounded once to
    float64.
    """
    fresh = _reference_factory(
        scenario, mode=mode, fused_variant=fused_variant, precision=precision
    )
    accumulator = fresh()
    latest: Mapping[str, Any] | None = None
    outcomes: list[StepOutcome] = []
    for index in range(len(scenario.steps)):
        outcome, accumulator, latest = _run_step(scenario, index, accumulator, latest, fresh)
        outcomes.append(outcome)
    return ScenarioTrace(
        outcomes=tuple(outcomes), implementation=f"wacc_ref/{mode}/{fused_variant}"
    )


def record_from_snapshot(snapshot: RecordSnapshot) -> dict[str, Any]:
    """A record in the shared schema (numpy float64 buffers) holding exactly ``snapshot``."""
    return {
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


def _outcome_differences(expected: StepOutcome, actual: StepOutcome, *, what: str) -> list[str]:
    lines: list[str] = []
    if expected.error != actual.error:
        lines.append(f"{what}: error expected {expected.error}, got {actual.error}")
    if expected.skipped != actual.skipped:
        lines.append(f"{what}: skipped expected {expected.skipped}, got {actual.skipped}")
    lines += expected.state.differences(actual.state, what=f"{what} state")
    if (expected.result is None) != (actual.result is None):
        lines.append(f"{what}: result expected {expected.result is not None}, got {actual.result}")
    elif expected.result is not None and actual.result is not None:
        lines += expected.result.differences(actual.result, what=f"{what} result")
    if (expected.record is None) != (actual.record is None):
        lines.append(f"{what}: record present expected {expected.record is not None}")
    elif expected.record is not None and actual.record is not None:
        lines += expected.record.differences(actual.record, what=f"{what} record")
    return lines


def _fused_mean_differences(
    scenario: Scenario,
    step: Accumulate,
    before: RecordSnapshot | None,
    expected: StepOutcome,
    actual: StepOutcome,
    *,
    what: str,
) -> list[str]:
    """A fused mean step: counters and structure exact, each touched element in the SPEC §6 set."""
    work = scenario.work_dtype
    w_d = formats.conv_to(step.weight, work)
    touched = {name: values for name, values in step.grads if values is not None}
    actual_pending = dict(actual.state.pending)

    def judged_here(name: str, array: np.ndarray) -> bool:
        # A buffer of another shape is left to the exact comparison, which reports it.
        return (
            name in touched and name in actual_pending and actual_pending[name].shape == array.shape
        )

    # Exact comparison of everything else: substitute the actual values of touched buffers.
    masked = dataclasses.replace(
        expected.state,
        pending=tuple(
            (name, actual_pending[name] if judged_here(name, array) else array)
            for name, array in expected.state.pending
        ),
    )
    expected_pending = dict(expected.state.pending)
    lines = _outcome_differences(dataclasses.replace(expected, state=masked), actual, what=what)
    before_pending = dict(before.pending) if before is not None else {}
    for name, values in touched.items():
        if name not in expected_pending or not judged_here(name, expected_pending[name]):
            continue  # a missing buffer or a wrong shape: already reported above
        old = before_pending.get(name)
        observed = actual_pending[name].reshape(-1)
        for position, gradient in enumerate(values):
            buf = 0.0 if old is None else float(old.reshape(-1)[position])
            candidates = fused_mean_step_candidates(buf, formats.conv_to(gradient, work), w_d, work)
            value = float(observed[position])
            if not fused_mean_step_accepts(value, candidates):
                shown = sorted(float(c).hex() for c in candidates)
                lines.append(
                    f"{what} state.pending[{name!r}][flat {position}]: got {value.hex()}, "
                    f"allowed {shown} (buf {buf.hex()}, g {gradient.hex()}, w_D {w_d.hex()})"
                )
    return lines


def stepwise_differences(
    scenario: Scenario, actual: ScenarioTrace, *, limit: int = 20
) -> list[str]:
    """Step-local oracle: every step of ``actual`` against the reference run FROM ``actual``'s own
    state before that step (empty: no difference), at most ``limit`` lines.

    Before step ``i`` the reference loads the state ``actual`` recorded after step ``i - 1``
    (restores load the record ``actual`` reported for the latest checkpoint), runs the step in
    ``emulated`` mode and compares like :func:`trace_differences`.  One exception makes this the
    oracle for fused scenarios: in a fused mean step each touched element may be ANY result SPEC
    §6 allows (``wacc_ref.arith.fused_mean_step_candidates`` of the actual buffer before the step,
    ``conv_D(g)`` and ``w_D``); counters, errors and every other value stay exact.  (PyTorch's
    CPU ``add_(c, alpha=w)`` on float16 gives the op-rounded result in its vectorized chunks and
    the two-step result in the scalar tail of a tensor, so no single variant describes it.)
    A difference is local: it names the first step whose result the reference does not allow.
    """
    params = scenario.params
    fresh = _reference_factory(scenario, mode="emulated", fused_variant="two_step", precision=2)
    lines: list[str] = []
    if len(actual) != len(scenario.steps):
        lines.append(f"trace length: expected {len(scenario.steps)} steps, got {len(actual)}")
    before: RecordSnapshot | None = None
    latest: Mapping[str, Any] | None = None
    for index, outcome in enumerate(actual.outcomes[: len(scenario.steps)]):
        step = scenario.steps[index]
        what = f"step {index} ({step.op})"
        if outcome.op != step.op or outcome.index != index:
            lines.append(f"{what}: got step {outcome.index} ({outcome.op})")
            break
        accumulator = fresh()
        if before is not None:
            try:
                accumulator.load_state_dict(record_from_snapshot(before), params)
            except WeightedAccumulationError as exc:
                lines.append(f"{what}: the state before it does not load into the reference: {exc}")
                break
        expected, _, _ = _run_step(scenario, index, accumulator, latest, fresh)
        fused_mean = isinstance(step, Accumulate) and step.kind == "mean" and scenario.fused
        if (
            fused_mean
            and isinstance(step, Accumulate)
            and expected.error is None
            and step.weight > 0
        ):
            lines += _fused_mean_differences(scenario, step, before, expected, outcome, what=what)
        else:
            lines += _outcome_differences(expected, outcome, what=what)
        if isinstance(step, Checkpoint):
            if outcome.record is None:
                lines.append(f"{what}: the actual trace has no record for this checkpoint")
                break
            latest = record_from_snapshot(outcome.record)
        before = outcome.state
        if len(lines) >= limit:
            break
    return lines[:limit]


def without_interruptions(scenario: Scenario) -> Scenario:
    """The scenario with every checkpoint, restore and corrupted restore removed.

    When every restore comes right after the checkpoint it loads (only checkpoints and corrupted
    restores in between), resume is exact (SPEC §9) and the finish results of both scenarios must
    be identical.
    """
    return Scenario(
        work_dtype=scenario.work_dtype,
        grad_dtype=scenario.grad_dtype,
        loss_scale=scenario.loss_scale,
        fused=scenario.fused,
        parameters=scenario.parameters,
        steps=tuple(s for s in scenario.steps if isinstance(s, Accumulate | Finish)),
    )
