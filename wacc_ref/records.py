"""Validation of user input for the reference model: loss scale, weights, parameters, records.

Record (``state_dict``) schema — the same keys as ``wacc_torch``:

``format_version`` (int)
    :data:`FORMAT_VERSION` (1).
``dtype`` (str)
    The work dtype D in torch spelling (``"float64"``, ``"float32"``, ``"float16"``,
    ``"bfloat16"``).
``loss_scale`` (float)
    The loss scale S.
``fused`` (bool)
    Whether the accumulator runs the opt-in fused mean step of semantics §6.
``issued`` (int)
    Microbatches accumulated in the window, zero-weight ones included.
``zero_weight`` (int)
    How many of them had weight exactly 0.
``total_weight`` (float; a :class:`fractions.Fraction` in ``exact`` mode)
    W, the running total of the counted weights.
``param_names`` (list[str])
    The tracked parameters in registration order; ``[]`` while none is bound.
``param_shapes`` (list[list[int]])
    Their shapes, in the same order.
``pending`` (dict[str, numpy.ndarray])
    Only the buffers allocated so far, in registration order.  ``emulated``: float64 arrays
    holding exact D values (NaN and ±inf included).  ``exact``: object arrays of
    :class:`fractions.Fraction` (exact sums; never NaN or inf).
``checksum`` (str)
    ``"sha256:"`` + the SHA-256 of the record's canonical bytes, the same as ``wacc_torch``'s
    for the same state (:func:`record_checksum`).  Written into every record; verified on load
    after every field check (so a damaged field is still named); a record without it (older, or
    built by hand, e.g. ``wacc_ref.traces.record_from_snapshot``) loads unverified, with
    ``format_version`` unchanged at 1.

Numbers (weights, loss scales) follow one rule, :func:`read_real`, the same as ``wacc_torch``'s.

Every check here runs before anything is mutated; the caller commits only a fully validated
result.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import ml_dtypes
import numpy as np
import numpy.typing as npt

from wacc_ref.arith import round_array
from wacc_ref.errors import (
    ExactModeError,
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    RecordError,
    WeightedAccumulationError,
)
from wacc_ref.faults import MalformedGradient
from wacc_ref.formats import FLOAT64, WORK_DTYPES, Format, conv_to, get_format, round_to

__all__ = [
    "CHECKSUM_KEY",
    "FORMAT_VERSION",
    "RECORD_KEYS",
    "Binding",
    "ValidatedRecord",
    "check_finite_gradient",
    "converted_mean_weight",
    "format_value",
    "gradient_array",
    "read_real",
    "record_checksum",
    "total_after",
    "validate_binding",
    "validate_counters",
    "validate_gradients",
    "validate_loss_scale",
    "validate_params",
    "validate_pending",
    "validate_record",
    "validate_weight",
    "validate_work_dtype",
]

FORMAT_VERSION = 1
RECORD_KEYS: tuple[str, ...] = (
    "format_version",
    "dtype",
    "loss_scale",
    "fused",
    "issued",
    "zero_weight",
    "total_weight",
    "param_names",
    "param_shapes",
    "pending",
)

CHECKSUM_KEY = "checksum"
_CHECKSUM_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")

Binding = tuple[tuple[str, tuple[int, ...]], ...]
"""The tracked parameter set: ``(name, shape)`` pairs in registration order."""

# Names of the float dtypes a number may have (numpy and ml_dtypes spell them like torch).
_SCALAR_FLOAT_NAMES = frozenset(
    ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
)
# Floating dtypes a gradient may arrive in whose values numpy converts to float64 exactly.
_NUMPY_FLOAT_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.float16,
        np.float32,
        np.float64,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
    )
)


@dataclass(frozen=True)
class ValidatedRecord:
    """A record that passed every check, in the accumulator's internal representation."""

    binding: Binding | None
    pending: dict[str, np.ndarray]
    issued: int
    zero_weight: int
    total_weight: float | Fraction


def format_value(value: object) -> str:
    """``repr`` of a value, with its hex form for a float (so that a message reproduces it)."""
    return f"{value!r} ({value.hex()})" if isinstance(value, float) else repr(value)


def validate_work_dtype(dtype: object) -> Format:
    """The work dtype ``D`` named ``dtype`` (semantics §2); ``ValueError`` naming anything else."""
    if not isinstance(dtype, str) or dtype not in WORK_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not a work dtype; work dtypes: {WORK_DTYPES}")
    return get_format(dtype)


def read_real(value: object, *, what: str, error: type[WeightedAccumulationError]) -> int | float:
    """``value`` as an exact Python int or float; ``error`` naming ``what`` if it is refused.

    The rule (the same as ``wacc_torch._scalars.read_real``): a Python ``int`` (not ``bool``) or
    ``float``; a numpy scalar or 0-d array (the reference's counterpart of a 0-d tensor) whose
    dtype is an integer of at most 64 bits or one of the six formats (float64, float32, float16,
    bfloat16, float8_e4m3fn, float8_e5m2).  Refused: bools, complex, Fraction, Decimal,
    ``numpy.longdouble`` (wider than float64: reading it would round), strings, sequences,
    arrays that are not 0-d.  Accepted values are read exactly (no rounding); NaN, inf and
    negatives come back as they are.
    """
    if isinstance(value, bool | np.bool_):
        raise error(f"{what} must be a real number, got the bool {value!r}")
    if isinstance(value, int | float) and not isinstance(value, np.generic):
        return value
    if isinstance(value, np.generic | np.ndarray):
        if isinstance(value, np.ndarray) and value.ndim != 0:
            raise error(f"an array {what} must be 0-d, got shape {list(value.shape)}: {value!r}")
        dtype = value.dtype
        if dtype.kind in "iu" and dtype.itemsize <= 8:
            return int(value.item())
        if dtype.name in _SCALAR_FLOAT_NAMES:
            return float(value.item())
        raise error(
            f"{what} {value!r} has numpy dtype {dtype}: only integers of at most 64 bits and the "
            f"formats {', '.join(sorted(_SCALAR_FLOAT_NAMES))} are read exactly"
        )
    raise error(
        f"{what} must be a Python int or float, a numpy scalar or a 0-d array of a real dtype of "
        f"at most 64 bits, got {value!r} of type {type(value).__name__}"
    )


def validate_loss_scale(loss_scale: object, dtype: Format) -> float:
    """semantics §4: a finite value > 0, exactly representable in D (types: :func:`read_real`)."""
    problem = None
    try:
        value = read_real(loss_scale, what="loss_scale", error=InvalidLossScaleError)
    except InvalidLossScaleError as error:
        raise InvalidLossScaleError(f"{error} (work dtype {dtype.name})") from None
    if isinstance(value, float) and not math.isfinite(value):
        problem = "is not finite"
    elif not value > 0:
        problem = "is not > 0"
    else:
        exact_value = Fraction(value)
        rounded = round_to(exact_value, dtype)
        if not math.isfinite(rounded) or Fraction(rounded) != exact_value:
            problem = f"is not exactly representable in {dtype.name}"
    if problem is not None:
        raise InvalidLossScaleError(
            f"loss_scale {format_value(loss_scale)} {problem}; it must be a finite value > 0 "
            f"exactly representable in the work dtype {dtype.name}"
        )
    return float(value)


def validate_weight(weight: object) -> int | float:
    """A weight is a finite number >= 0 (:func:`read_real`); returned exactly (int or float)."""
    value = read_real(weight, what="weight", error=InvalidWeightError)
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
        raise InvalidWeightError(f"weight must be a finite number >= 0, got {format_value(value)}")
    return value


def converted_mean_weight(weight: int | float, dtype: Format) -> float:
    """semantics §6 ``w_D = conv_D(w)`` of a weight ``w > 0`` (an int is read through float64, as
    PyTorch's ``torch.tensor(w, dtype=D)`` does).

    Raises :class:`InvalidWeightError` naming ``w`` and ``w_D`` when ``w_D`` is 0 or not finite
    (the weight does not survive the work dtype).
    """
    converted = conv_to(weight, dtype)
    if converted == 0 or not math.isfinite(converted):
        raise InvalidWeightError(
            f"weight {format_value(weight)} becomes {format_value(converted)} in "
            f"{dtype.name}: it does not survive the work dtype"
        )
    return converted


def total_after(
    total: float | Fraction, weight: int | float, counted: int | float
) -> float | Fraction:
    """The total weight after counting ``counted`` for ``weight``: ``round_64(W + counted)``, one
    rounding of the exact sum (an int beyond 2**53 is not rounded on its own first).

    Exact for a Fraction ``W`` (exact mode).  Raises :class:`InvalidWeightError` naming the weight
    if the total overflows float64: such a ``W`` could never be recorded (§9 needs a finite
    one).
    """
    new_total: float | Fraction
    if isinstance(total, Fraction):
        new_total = total + Fraction(counted)
    elif isinstance(counted, float):
        new_total = total + counted  # both float64: IEEE addition rounds the exact sum once
    else:
        new_total = round_to(Fraction(total) + counted, FLOAT64)
    if not math.isfinite(round_to(new_total, FLOAT64)):
        raise InvalidWeightError(
            f"weight {format_value(weight)} makes the total weight overflow float64 "
            f"({format_value(round_to(total, FLOAT64))} + {format_value(counted)})"
        )
    return new_total


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _shape(value: object, *, what: str, error: type[WeightedAccumulationError]) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise error(f"{what} must be a sequence of non-negative ints, got {value!r}")
    dims = list(value)
    if not all(_is_int(d) and int(d) >= 0 for d in dims):
        raise error(f"{what} must be a sequence of non-negative ints, got {value!r}")
    return tuple(int(d) for d in dims)


def validate_params(params: object) -> Binding:
    """Check a parameter mapping (name -> shape, registration order) and return its binding.

    Raises :class:`ParameterMismatchError` for a non-mapping, an empty mapping, a non-string
    name or a malformed shape.
    """
    if not isinstance(params, Mapping):
        raise ParameterMismatchError(
            f"params must be a mapping name -> shape, got {params!r} ({type(params).__name__})"
        )
    if not params:
        raise ParameterMismatchError("params is empty: there is no parameter to accumulate")
    binding = []
    for name, shape in params.items():
        if not isinstance(name, str):
            raise ParameterMismatchError(f"parameter name {name!r} is not a str")
        checked = _shape(shape, what=f"shape of {name!r}", error=ParameterMismatchError)
        binding.append((name, checked))
    return tuple(binding)


def _as_array(value: object, *, what: str, error: type[WeightedAccumulationError]) -> np.ndarray:
    """``np.asarray(value)``, with numpy's own refusals (a ragged list, a tensor numpy cannot
    read such as a torch bfloat16 one, ...) turned into ``error`` naming ``what``."""
    try:
        return np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as problem:
        raise error(
            f"{what} cannot be read as an array ({type(value).__name__}): {problem}"
        ) from None


def gradient_array(name: str, value: object, shape: tuple[int, ...]) -> npt.NDArray[np.float64]:
    """The float64 array of a gradient, exactly; :class:`ParameterMismatchError` otherwise.

    Accepted: floating arrays (numpy float16/32/64, ml_dtypes bfloat16/float8) and array-likes of
    Python floats.  Integer, bool, complex and object dtypes are refused (PyTorch refuses a
    non-floating ``.grad``), as is a shape other than the parameter's.
    """
    if isinstance(value, MalformedGradient):  # a scenario's refused fault (wacc_ref.faults)
        raise ParameterMismatchError(
            f"gradient of {name!r} is malformed ({value.fault.kind}): semantics §5 refuses it"
        )
    array = _as_array(value, what=f"gradient of {name!r}", error=ParameterMismatchError)
    if array.dtype not in _NUMPY_FLOAT_DTYPES:
        raise ParameterMismatchError(
            f"gradient of {name!r} has dtype {array.dtype}, not a floating dtype of at most 64 bits"
        )
    if array.shape != shape:
        raise ParameterMismatchError(
            f"gradient of {name!r} has shape {list(array.shape)}, the parameter has {list(shape)}"
        )
    return np.array(array, dtype=np.float64)


def validate_binding(params: object, tracked: Binding | None, *, rebind: bool = False) -> Binding:
    """:func:`validate_params`, then check the binding against the ``tracked`` set.

    Parameters are matched by NAME (as ``wacc_torch`` matches a module's): the order of
    ``params`` does not matter and the tracked order (the records' ``param_names``) is kept.
    ``rebind=True`` (a window with nothing in it) takes ``params`` as the new set instead.
    :class:`ParameterMismatchError` naming the differences when a set is tracked (not ``None``)
    and ``params`` differs from it in names or shapes; a tracked name missing from ``params``
    is reported as no longer trainable (frozen or removed).
    """
    binding = validate_params(params)
    if tracked is None or rebind:
        return binding
    given = dict(binding)
    shapes = dict(tracked)
    if given.keys() != shapes.keys():
        gone = [name for name in shapes if name not in given]
        extra = [name for name in given if name not in shapes]
        problems = []
        if gone:
            problems.append(f"no longer trainable (frozen or removed) since it was bound: {gone!r}")
        if extra:
            problems.append(f"trainable but not tracked: {extra!r}")
        raise ParameterMismatchError(
            f"params changed in the middle of a window; parameter(s) {'; '.join(problems)}. The "
            f"tracked set can change only between windows (after finish_sums/finish_mean)"
        )
    for name, shape in tracked:
        if given[name] != shape:
            raise ParameterMismatchError(
                f"parameter {name!r} has shape {list(given[name])}, tracked shape is "
                f"{list(shape)} (mid-window)"
            )
    return tracked


def validate_gradients(grads: object, binding: Binding) -> dict[str, npt.NDArray[np.float64]]:
    """The non-None gradients of ``grads`` as exact float64 arrays, in ``binding`` order.

    ``TypeError`` for a non-mapping; :class:`ParameterMismatchError` for a name that is not
    tracked, or a gradient that :func:`gradient_array` refuses.  Absent names count as None.
    """
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"grads must be a mapping name -> gradient or None, got {type(grads).__name__}"
        )
    shapes = dict(binding)
    for name in grads:
        if name not in shapes:
            raise ParameterMismatchError(
                f"grads has a gradient for {name!r}, which is not a tracked parameter "
                f"(tracked: {list(shapes)})"
            )
    return {
        name: gradient_array(name, grads[name], shape)
        for name, shape in binding
        if grads.get(name) is not None
    }


def check_finite_gradient(name: str, gradient: npt.NDArray[np.float64]) -> None:
    """:class:`ExactModeError` naming the first NaN or ±inf of ``gradient`` and its flat index."""
    flat = gradient.reshape(-1)
    not_finite = np.flatnonzero(~np.isfinite(flat))
    if not_finite.size:
        index = int(not_finite[0])
        raise ExactModeError(
            f"gradient of {name!r} holds {float(flat[index])!r} at flat index {index}; the exact "
            f"mode models real numbers only"
        )


def _exact_element(value: object, *, what: str, error: type[WeightedAccumulationError]) -> Fraction:
    if isinstance(value, Fraction):
        return value
    if _is_int(value):
        return Fraction(int(value))  # type: ignore[call-overload]
    if isinstance(value, float | np.floating) and np.dtype(type(value)).itemsize <= 8:
        if not math.isfinite(value):
            raise error(f"{what} holds {value!r}; the exact mode has no NaN or infinity")
        return Fraction(float(value))
    raise error(f"{what} holds {value!r} ({type(value).__name__}), not an exact real")


def validate_pending(
    pending: object,
    binding: Binding | None,
    dtype: Format,
    *,
    exact: bool,
    error: type[WeightedAccumulationError],
    field: str,
) -> dict[str, np.ndarray]:
    """Check pending buffers against a binding and ``dtype``; return copies in binding order.

    ``emulated`` (``exact=False``): float arrays whose every value is a value of ``dtype``
    (NaN and ±inf allowed), returned as float64.  ``exact``: arrays of exact reals (Fraction,
    int, finite float), returned as object arrays of Fraction.  Raises ``error`` naming
    ``field`` and the parameter.
    """
    if not isinstance(pending, Mapping):
        raise error(f"{field} must be a mapping name -> buffer, got {type(pending).__name__}")
    shapes = dict(binding or ())
    for name in pending:
        if name not in shapes:
            raise error(
                f"{field} has a buffer for {name!r}, which is not a tracked parameter "
                f"(tracked: {list(shapes)})"
            )
    validated: dict[str, np.ndarray] = {}
    for name, shape in binding or ():
        if name not in pending:
            continue
        what = f"{field}[{name!r}]"
        array = _as_array(pending[name], what=what, error=error)
        if array.shape != shape:
            raise error(f"{what} has shape {list(array.shape)}, the parameter has {list(shape)}")
        if exact:
            flat = [_exact_element(v, what=what, error=error) for v in array.reshape(-1).tolist()]
            buffer = np.empty(len(flat), dtype=object)
            buffer[:] = flat
            validated[name] = buffer.reshape(shape)
            continue
        if array.dtype not in _NUMPY_FLOAT_DTYPES:
            raise error(f"{what} has dtype {array.dtype}; a float64 array of {dtype.name} values")
        values = np.array(array, dtype=np.float64)
        rounded = round_array(values, dtype)
        same = (rounded == values) | (np.isnan(rounded) & np.isnan(values))
        if not same.all():
            bad = float(values[~same][0])
            raise error(f"{what} holds {bad!r} ({bad.hex()}), which is not a {dtype.name} value")
        validated[name] = values
    return validated


def validate_counters(
    *,
    issued: object,
    zero_weight: object,
    total_weight: object,
    bound: bool,
    pending_empty: bool,
    exact: bool,
    error: type[WeightedAccumulationError],
) -> tuple[int, int, float | Fraction]:
    """Check the window counters for consistency; return them as ``(issued, zero_weight, W)``.

    ``issued`` and ``zero_weight`` are ints (not bools) with ``0 <= zero_weight <= issued``;
    ``W`` is finite and ``>= 0`` (a float, or in ``exact`` mode also a Fraction or int).  A
    window of zero-weight batches only has ``W == 0`` and no buffer; one with a counted batch has
    ``W > 0`` (each counted weight is > 0); an unbound accumulator has issued nothing.
    """
    if not _is_int(issued):
        raise error(f"issued must be an int, got {issued!r} ({type(issued).__name__})")
    if not _is_int(zero_weight):
        raise error(
            f"zero_weight must be an int, got {zero_weight!r} ({type(zero_weight).__name__})"
        )
    issued_, zero_weight_ = int(issued), int(zero_weight)  # type: ignore[call-overload]
    if issued_ < 0:
        raise error(f"issued must be >= 0, got {issued_}")
    if not 0 <= zero_weight_ <= issued_:
        raise error(f"zero_weight must be in [0, issued={issued_}], got {zero_weight_}")
    weight: float | Fraction
    if exact and isinstance(total_weight, Fraction):
        weight = total_weight
    elif exact and _is_int(total_weight):
        weight = Fraction(int(total_weight))  # type: ignore[call-overload]
    elif isinstance(total_weight, float | np.floating):
        if np.dtype(type(total_weight)).itemsize > 8 or not math.isfinite(total_weight):
            raise error(f"total_weight must be a finite float >= 0, got {total_weight!r}")
        weight = Fraction(float(total_weight)) if exact else float(total_weight)
    elif _is_int(total_weight):
        as_int = int(total_weight)  # type: ignore[call-overload]
        weight = round_to(as_int, FLOAT64)  # never raises, unlike float(int) beyond 2**1024
        if weight != as_int:
            raise error(f"total_weight {total_weight!r} is not exactly a float64")
    else:
        raise error(
            f"total_weight must be a finite float >= 0, got {total_weight!r} "
            f"({type(total_weight).__name__})"
        )
    if weight < 0:
        raise error(f"total_weight must be >= 0, got {total_weight!r}")
    if not math.isfinite(round_to(weight, FLOAT64)):
        # The accumulator refuses a weight that makes W overflow float64 (exact mode included).
        raise error(f"total_weight {total_weight!r} is beyond float64's range")
    if not bound and issued_ != 0:
        raise error(f"issued is {issued_} but no parameter is bound (param_names is empty)")
    if issued_ == zero_weight_:
        if weight != 0:
            raise error(
                f"total_weight is {total_weight!r} but every one of the {issued_} issued "
                f"batches had weight 0 (zero_weight == issued)"
            )
        if not pending_empty:
            raise error(
                f"pending holds buffers but every one of the {issued_} issued batches had "
                f"weight 0 (zero_weight == issued)"
            )
    elif weight == 0:
        raise error(
            f"total_weight is 0 but {issued_ - zero_weight_} batches had a weight > 0 "
            f"(issued={issued_}, zero_weight={zero_weight_})"
        )
    return issued_, zero_weight_, weight


def _record_binding(record: Mapping[str, object]) -> Binding | None:
    names, shapes = record["param_names"], record["param_shapes"]
    if isinstance(names, str | bytes) or not isinstance(names, Sequence):
        raise RecordError(f"param_names must be a list of str, got {names!r}")
    if not all(isinstance(n, str) for n in names):
        raise RecordError(f"param_names must be a list of str, got {names!r}")
    if len(set(names)) != len(names):
        raise RecordError(f"param_names has duplicates: {list(names)!r}")
    if isinstance(shapes, str | bytes) or not isinstance(shapes, Sequence):
        raise RecordError(f"param_shapes must be a list of shapes, got {shapes!r}")
    if len(shapes) != len(names):
        raise RecordError(
            f"param_shapes has {len(shapes)} entries but param_names has {len(names)}"
        )
    parsed = tuple(
        _shape(s, what=f"param_shapes entry of {n!r}", error=RecordError)
        for n, s in zip(names, shapes, strict=True)
    )
    if not names:
        return None
    return tuple(zip(names, parsed, strict=True))


def validate_record(
    record: object,
    params: object,
    *,
    dtype: Format,
    loss_scale: float,
    fused: bool,
    exact: bool,
) -> ValidatedRecord:
    """Check a record against this accumulator's fixed options and ``params``; return it parsed.

    ``params`` is checked first (:class:`ParameterMismatchError`); every record problem raises
    :class:`RecordError` naming the field.  A record that binds no parameters loads with any
    ``params`` (and leaves the accumulator unbound); one that binds parameters must name exactly
    ``params``, in order, with the same shapes.
    """
    binding_of_params = validate_params(params)
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a mapping, got {type(record).__name__}")
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise RecordError(f"record lacks the field(s) {missing}")
    unknown = [k for k in record if k not in RECORD_KEYS and k != CHECKSUM_KEY]
    if unknown:
        raise RecordError(f"record has unknown field(s) {unknown!r}")
    version = record["format_version"]
    if not _is_int(version) or version != FORMAT_VERSION:
        raise RecordError(f"format_version is {version!r}; this reader knows {FORMAT_VERSION}")
    if not isinstance(record["dtype"], str) or record["dtype"] != dtype.name:
        raise RecordError(f"dtype is {record['dtype']!r}; this accumulator works in {dtype.name!r}")
    scale = record["loss_scale"]
    issued, pending_field = record["issued"], record["pending"]
    if _is_int(issued) and issued == 0 and isinstance(pending_field, Mapping) and not pending_field:
        # An empty window: nothing was scaled yet, so any loss scale of D may continue it (the
        # accumulator keeps its own), as set_loss_scale may change it there (§4, §9).
        try:
            validate_loss_scale(scale, dtype)
        except InvalidLossScaleError as error:
            raise RecordError(f"loss_scale: {error}") from None
    elif (
        isinstance(scale, bool)
        or not isinstance(scale, float | int)
        or (math.isnan(scale) or scale != loss_scale)
    ):
        raise RecordError(
            f"loss_scale is {scale!r}; this accumulator's loss scale is {loss_scale!r} (only a "
            f"record of an empty window, issued == 0, loads at another scale)"
        )
    if not isinstance(record["fused"], bool) or record["fused"] != fused:
        raise RecordError(f"fused is {record['fused']!r}; this accumulator has fused={fused}")
    binding = _record_binding(record)
    if binding is not None:
        # Matched by name, as wacc_torch matches a module's parameters; the record's order stays.
        shapes_of_params = dict(binding_of_params)
        if {n for n, _ in binding} != shapes_of_params.keys():
            raise RecordError(
                f"param_names {[n for n, _ in binding]!r} do not match the parameters "
                f"{list(shapes_of_params)!r}"
            )
        if any(shapes_of_params[n] != shape for n, shape in binding):
            raise RecordError(
                f"param_shapes {[list(s) for _, s in binding]!r} do not match the parameters' "
                f"shapes {[list(shapes_of_params[n]) for n, _ in binding]!r}"
            )
    pending = validate_pending(
        record["pending"], binding, dtype, exact=exact, error=RecordError, field="pending"
    )
    issued, zero_weight, total_weight = validate_counters(
        issued=record["issued"],
        zero_weight=record["zero_weight"],
        total_weight=record["total_weight"],
        bound=binding is not None,
        pending_empty=not pending,
        exact=exact,
        error=RecordError,
    )
    if CHECKSUM_KEY in record:
        # Last: every field is well formed now, so the bytes hashed are well defined.
        stored = record[CHECKSUM_KEY]
        if not isinstance(stored, str) or not _CHECKSUM_PATTERN.fullmatch(stored):
            raise RecordError(f"checksum must be 'sha256:' and 64 hex digits, got {stored!r}")
        computed = record_checksum(
            dtype=dtype,
            loss_scale=float(scale),
            fused=fused,
            issued=issued,
            zero_weight=zero_weight,
            total_weight=total_weight,
            binding=binding,
            pending=pending,
        )
        if computed != stored:
            raise RecordError(
                f"checksum does not match the record's content (stored {stored}, computed "
                f"{computed}): the record was changed or damaged after it was written"
            )
    return ValidatedRecord(
        binding=binding,
        pending=pending,
        issued=issued,
        zero_weight=zero_weight,
        total_weight=total_weight,
    )


# Each work dtype: the numpy dtype holding its values and its canonical quiet NaN's bits (sign +,
# top mantissa bit only).
_BITS: Mapping[str, tuple[npt.DTypeLike, int]] = {
    "float64": (np.float64, 0x7FF8_0000_0000_0000),
    "float32": (np.float32, 0x7FC0_0000),
    "float16": (np.float16, 0x7E00),
    "bfloat16": (ml_dtypes.bfloat16, 0x7FC0),
}


def _float_text(value: float | Fraction) -> str:
    # A float64 as its hex form (lossless); an exact-mode Fraction as "numerator/denominator".
    if isinstance(value, Fraction):
        return f"{value.numerator}/{value.denominator}"
    return float(value).hex()


def record_checksum(
    *,
    dtype: Format,
    loss_scale: float,
    fused: bool,
    issued: int,
    zero_weight: int,
    total_weight: float | Fraction,
    binding: Binding | None,
    pending: Mapping[str, np.ndarray],
) -> str:
    """``"sha256:"`` + the SHA-256 of a record's canonical bytes (shared with ``wacc_torch``).

    The bytes: the UTF-8 of the compact JSON list ``[format_version, dtype, loss_scale.hex(),
    fused, issued, zero_weight, total_weight.hex(), param_names, param_shapes, pending names in
    param_names order]``, then each pending buffer in that order as its bit patterns in D,
    little-endian, row-major, every NaN as D's canonical quiet NaN (the semantics treats all NaNs
    alike and this model keeps values, not payloads).  ``pending`` holds validated buffers
    (float64 arrays of D values; in ``exact`` mode object arrays of Fractions, hashed as the
    ASCII of ``numerator/denominator,`` per element, a layout ``wacc_torch`` never writes).
    """
    names = [name for name, _ in binding or ()]
    ordered = [name for name in names if name in pending]
    header = [
        FORMAT_VERSION,
        dtype.name,
        float(loss_scale).hex(),
        fused,
        issued,
        zero_weight,
        _float_text(total_weight),
        names,
        [list(shape) for _, shape in binding or ()],
        ordered,
    ]
    digest = hashlib.sha256(json.dumps(header, separators=(",", ":")).encode())
    for name in ordered:
        values = pending[name]
        if values.dtype == object:
            digest.update("".join(f"{_float_text(v)}," for v in values.reshape(-1)).encode())
            continue
        value_dtype, canonical_nan = _BITS[dtype.name]
        in_d = values.astype(value_dtype)  # exact: validated buffers hold D values only
        bits = in_d.view(np.dtype(f"u{in_d.dtype.itemsize}"))
        bits[np.isnan(values)] = canonical_nan
        digest.update(np.ascontiguousarray(bits, dtype=bits.dtype.newbyteorder("<")).data)
    return "sha256:" + digest.hexdigest()
