"""§9 records for wacc_ref.accumulator: round trips, exact resume, validation, from_pending."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction

import mpmath
import mpmath.libmp
import numpy as np
import pytest

from tests.wacc_ref.test_accumulator import bits, result_bits, snapshot
from wacc_ref.accumulator import ReferenceAccumulator, ReferenceResult
from wacc_ref.errors import InvalidLossScaleError, ParameterMismatchError, RecordError
from wacc_ref.formats import WORK_DTYPES, round_to

PARAMS = {"w": (2, 3), "b": (3,), "unused": (1,)}

Step = tuple[str, float, dict[str, object]]


def six_steps() -> list[Step]:
    """A 6-step window: sums and means, a zero-weight batch with NaN, None and absent grads."""
    rng = np.random.default_rng(9)
    w = [rng.standard_normal((2, 3)) * 2.0**k for k in (-3, 0, 5, -9, 2, 1)]
    b = [rng.standard_normal(3) for _ in range(6)]
    return [
        ("accumulate_sum", 7, {"w": w[0], "b": None}),
        ("accumulate_mean", 1001, {"w": w[1], "b": b[1]}),
        ("accumulate_sum", 0, {"w": np.full((2, 3), math.nan), "b": b[2]}),
        ("accumulate_mean", 3, {"w": -w[3]}),
        ("accumulate_sum", 200, {"w": w[4], "b": -b[4]}),
        ("accumulate_mean", 1, {"w": w[5], "b": b[5] * 2.0**-20}),
    ]


def run(acc: ReferenceAccumulator, steps: list[Step]) -> None:
    for method, weight, grads in steps:
        getattr(acc, method)(PARAMS, weight, grads=grads)


def finish(acc: ReferenceAccumulator, how: str) -> ReferenceResult:
    return acc.finish_mean() if how == "mean" else acc.finish_sums()


def exact_result_key(result: ReferenceResult) -> tuple[object, ...]:
    exact = {
        name: None if g is None else [v._mpf_ for v in g.reshape(-1)]
        for name, g in (result.exact_grads or {}).items()
    }
    return (result_bits(result), exact, result.exact_weight)


CONFIGS = [
    (dtype, fused, variant, mode)
    for dtype in WORK_DTYPES
    for fused, variant in ((False, "fma"), (True, "fma"), (True, "op_rounded"))
    for mode in ("emulated",)
] + [("bfloat16", False, "fma", "exact"), ("float16", True, "fma", "exact")]


def make(dtype: str, fused: bool, variant: str, mode: str) -> ReferenceAccumulator:
    return ReferenceAccumulator(
        dtype=dtype, loss_scale=8.0, fused=fused, fused_variant=variant, mode=mode
    )


@pytest.mark.parametrize(("dtype", "fused", "variant", "mode"), CONFIGS)
@pytest.mark.parametrize("how", ["sums", "mean"])
def test_resume_is_bit_identical_at_every_interruption_point(
    dtype: str, fused: bool, variant: str, mode: str, how: str
) -> None:
    """Checkpoint after k of 6 steps, load into a fresh accumulator, continue: identical result."""
    steps = six_steps()
    reference = make(dtype, fused, variant, mode)
    run(reference, steps)
    expected = exact_result_key(finish(reference, how))
    for k in range(len(steps) + 1):
        first = make(dtype, fused, variant, mode)
        run(first, steps[:k])
        record = copy.deepcopy(first.state_dict())  # as if written to disk and read back
        resumed = make(dtype, fused, variant, mode)
        resumed.load_state_dict(record, PARAMS)
        assert snapshot(resumed) == snapshot(first), f"load after {k} steps"
        run(resumed, steps[k:])
        assert exact_result_key(finish(resumed, how)) == expected, f"resume after {k} steps"
        pending = record["pending"]
        assert isinstance(pending, dict)
        via_pending = ReferenceAccumulator.from_pending(
            PARAMS, pending, first.state, fused_variant=variant, mode=mode
        )
        run(via_pending, steps[k:])
        assert exact_result_key(finish(via_pending, how)) == expected, f"from_pending after {k}"


def test_record_schema_and_documented_keys() -> None:
    """state_dict has exactly the shared schema, with plain values and float64 arrays."""
    acc = make("bfloat16", True, "fma", "emulated")
    run(acc, six_steps()[:2])
    record = acc.state_dict()
    assert list(record) == [
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
        "checksum",
    ]
    assert record["format_version"] == 1 and record["dtype"] == "bfloat16"
    assert isinstance(record["checksum"], str) and record["checksum"].startswith("sha256:")
    assert record["loss_scale"] == 8.0 and record["fused"] is True
    assert record["issued"] == 2 and record["zero_weight"] == 0
    assert record["total_weight"] == 7.0 + 1000.0  # bf16: 1001 counts as 1000
    assert record["param_names"] == ["w", "b", "unused"]
    assert record["param_shapes"] == [[2, 3], [3], [1]]
    pending = record["pending"]
    assert isinstance(pending, dict) and list(pending) == ["w", "b"]
    assert all(v.dtype == np.float64 for v in pending.values())


def test_record_is_a_copy() -> None:
    """Accumulating after state_dict() does not change the record taken before."""
    acc = make("float32", False, "fma", "emulated")
    run(acc, six_steps()[:2])
    record = acc.state_dict()
    frozen = bits(record["pending"]["w"])  # type: ignore[index]
    run(acc, six_steps()[2:])
    assert bits(record["pending"]["w"]) == frozen  # type: ignore[index]
    assert record["issued"] == 2


def test_record_before_anything_binds_nothing_and_loads_anywhere() -> None:
    """An empty record loads with any params, leaving the accumulator unbound."""
    empty = make("float16", False, "fma", "emulated").state_dict()
    assert empty["param_names"] == [] and empty["pending"] == {}
    acc = make("float16", False, "fma", "emulated")
    acc.accumulate_sum({"x": (5,)}, 1, grads={"x": np.ones(5)})
    acc.load_state_dict(empty, {"y": (2,)})
    assert acc.param_names == [] and acc.state.issued == 0
    acc.accumulate_sum({"z": ()}, 2, grads={"z": 1.0})  # binds a new set
    assert acc.param_names == ["z"]


def test_bound_record_needs_the_same_parameters() -> None:
    """A record that binds parameters refuses params with other names or shapes."""
    acc = make("float16", False, "fma", "emulated")
    run(acc, six_steps()[:1])
    record = acc.state_dict()
    fresh = make("float16", False, "fma", "emulated")
    with pytest.raises(RecordError, match="param_names"):
        fresh.load_state_dict(record, {"w": (2, 3), "b": (3,)})
    with pytest.raises(RecordError, match="param_shapes"):
        fresh.load_state_dict(record, {"w": (3, 2), "b": (3,), "unused": (1,)})
    with pytest.raises(ParameterMismatchError):
        fresh.load_state_dict(record, {})


def _valid_record() -> dict[str, object]:
    acc = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    acc.accumulate_sum(PARAMS, 3, grads={"w": np.ones((2, 3))})
    acc.accumulate_sum(PARAMS, 0, grads={})
    return acc.state_dict()


def _with(**changes: object) -> Callable[[dict[str, object]], dict[str, object]]:
    return lambda record: {**record, **changes}


def _pending(value: object) -> Callable[[dict[str, object]], dict[str, object]]:
    return lambda record: {**record, "pending": value}


def _without(key: str) -> Callable[[dict[str, object]], dict[str, object]]:
    return lambda record: {k: v for k, v in record.items() if k != key}


BAD_RECORDS: dict[str, tuple[str, Callable[[dict[str, object]], object]]] = {
    "version 2": ("format_version", _with(format_version=2)),
    "version str": ("format_version", _with(format_version="1")),
    "version bool": ("format_version", _with(format_version=True)),
    "other dtype": ("dtype", _with(dtype="float32")),
    "other loss scale": ("loss_scale", _with(loss_scale=8.0)),
    "nan loss scale": ("loss_scale", _with(loss_scale=math.nan)),
    "fused flag": ("fused", _with(fused=True)),
    "fused int": ("fused", _with(fused=0)),
    "negative issued": ("issued", _with(issued=-1)),
    "float issued": ("issued", _with(issued=2.0)),
    "bool issued": ("issued", _with(issued=True)),
    "zero_weight above issued": ("zero_weight", _with(zero_weight=3)),
    "negative zero_weight": ("zero_weight", _with(zero_weight=-1)),
    "negative weight": ("total_weight", _with(total_weight=-1.0)),
    "nan weight": ("total_weight", _with(total_weight=math.nan)),
    "inf weight": ("total_weight", _with(total_weight=math.inf)),
    "str weight": ("total_weight", _with(total_weight="3")),
    "int weight beyond float64": ("total_weight", _with(total_weight=10**400)),
    "int weight not a float64": ("total_weight", _with(total_weight=2**53 + 1)),
    "fraction weight in emulated mode": ("total_weight", _with(total_weight=Fraction(3))),
    "weight without counted batch": ("total_weight", _with(zero_weight=2)),
    "zero weight with counted batch": ("total_weight", _with(total_weight=0.0)),
    "pending without counted batch": ("pending", _with(zero_weight=2, total_weight=0.0)),
    "names differ": ("param_names", _with(param_names=["w", "b", "other"])),
    "names not str": ("param_names", _with(param_names=["w", "b", 3])),
    "duplicate names": ("param_names", _with(param_names=["w", "w", "b"])),
    "shapes differ": ("param_shapes", _with(param_shapes=[[2, 3], [4], [1]])),
    "shapes count": ("param_shapes", _with(param_shapes=[[2, 3], [3]])),
    "negative dim": ("param_shapes", _with(param_shapes=[[2, -3], [3], [1]])),
    "unbound but issued": ("issued", _with(param_names=[], param_shapes=[], pending={})),
    "pending unknown name": ("pending", _pending({"z": np.ones(1)})),
    "pending shape": ("pending['w']", _pending({"w": np.ones((3, 2))})),
    "pending not fp16": ("pending['w']", _pending({"w": np.full((2, 3), 1 + 2**-12)})),
    "pending int dtype": ("pending['w']", _pending({"w": np.ones((2, 3), dtype=np.int64)})),
    "pending not mapping": ("pending", _pending([np.ones((2, 3))])),
    "missing key": ("pending", _without("pending")),
    "unknown key": ("extra", _with(extra=1)),
    "not a mapping": ("mapping", lambda record: list(record.items())),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bad_record_raises_naming_the_field_and_changes_nothing(case: str) -> None:
    """load_state_dict validates everything first: RecordError naming the field, state kept."""
    field, corrupt = BAD_RECORDS[case]
    acc = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    run(acc, [("accumulate_sum", 2, {"w": np.full((2, 3), 0.5), "b": np.ones(3)})])
    before = snapshot(acc)
    with pytest.raises(RecordError) as info:
        acc.load_state_dict(corrupt(_valid_record()), PARAMS)  # type: ignore[arg-type]
    assert field in str(info.value), f"{case}: {info.value}"
    assert snapshot(acc) == before


def test_valid_record_loads_nan_and_inf_pending_values() -> None:
    """Pending buffers may hold NaN and ±inf (overflowed or NaN-fed buffers) and still load."""
    record = _valid_record()
    record["pending"] = {"w": np.array([[math.nan, math.inf, -math.inf], [0.0, -0.0, 65504.0]])}
    del record["checksum"]  # edited by hand: such a record loads unverified
    acc = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    acc.load_state_dict(record, PARAMS)
    assert bits(acc.state_dict()["pending"]["w"]) == bits(record["pending"]["w"])  # type: ignore[index]


def test_exact_mode_records_round_trip_with_fractions() -> None:
    """Exact-mode records hold Fractions (pending and W) and reload to the same state."""
    acc = ReferenceAccumulator(dtype="bfloat16", loss_scale=2.0, mode="exact")
    run(acc, six_steps()[:3])
    record = acc.state_dict()
    assert isinstance(record["total_weight"], Fraction)
    assert all(isinstance(v, Fraction) for v in record["pending"]["w"].reshape(-1))  # type: ignore[index]
    other = ReferenceAccumulator(dtype="bfloat16", loss_scale=2.0, mode="exact")
    other.load_state_dict(record, PARAMS)
    assert snapshot(other) == snapshot(acc)
    emulated = ReferenceAccumulator(dtype="bfloat16", loss_scale=2.0)
    with pytest.raises(RecordError, match=r"pending\['w'\] has dtype object"):
        emulated.load_state_dict(record, PARAMS)
    with pytest.raises(RecordError, match="total_weight"):
        emulated.load_state_dict({**record, "pending": {}, "zero_weight": 0}, PARAMS)
    before = snapshot(other)
    with pytest.raises(RecordError, match=r"total_weight .*beyond float64"):
        other.load_state_dict({**record, "total_weight": Fraction(2**1024)}, PARAMS)
    assert snapshot(other) == before


def test_from_pending_checks_names_shapes_and_values() -> None:
    """from_pending: bad names/shapes/values -> ParameterMismatchError; bad counters RecordError."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    run(acc, six_steps()[:2])
    state, pending = acc.state, acc.state_dict()["pending"]
    assert isinstance(pending, dict)
    with pytest.raises(ParameterMismatchError, match="'w'"):
        ReferenceAccumulator.from_pending({"b": (3,)}, pending, state)
    with pytest.raises(ParameterMismatchError, match="shape"):
        ReferenceAccumulator.from_pending({**PARAMS, "b": (4,)}, pending, state)
    with pytest.raises(ParameterMismatchError, match="float16"):
        ReferenceAccumulator.from_pending(PARAMS, {**pending, "b": np.full(3, 1 + 2**-12)}, state)
    with pytest.raises(RecordError, match="zero_weight"):
        ReferenceAccumulator.from_pending(PARAMS, pending, replace(state, zero_weight=5))
    with pytest.raises(RecordError, match="total_weight"):
        ReferenceAccumulator.from_pending(PARAMS, pending, replace(state, total_weight=0.0))
    with pytest.raises(InvalidLossScaleError):
        ReferenceAccumulator.from_pending(PARAMS, pending, replace(state, loss_scale=2.0**16))
    with pytest.raises(TypeError):
        ReferenceAccumulator.from_pending(PARAMS, pending, acc.state_dict())  # type: ignore[arg-type]
    restored = ReferenceAccumulator.from_pending(PARAMS, pending, state)
    assert snapshot(restored) == snapshot(acc)


def test_from_pending_errors_name_the_field_and_the_state_type() -> None:
    """from_pending's buffer errors name the field as ``pending['<name>']`` (or ``pending``), and
    a state that is not a ReferenceState is a TypeError naming the type it got."""
    acc = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    run(acc, six_steps()[:2])
    state, pending = acc.state, acc.state_dict()["pending"]
    assert isinstance(pending, dict)
    with pytest.raises(ParameterMismatchError, match=r"^pending\['b'\] has shape \[3\]"):
        ReferenceAccumulator.from_pending({**PARAMS, "b": (4,)}, pending, state)
    with pytest.raises(ParameterMismatchError, match=r"^pending has a buffer for 'w'"):
        ReferenceAccumulator.from_pending({"b": (3,)}, pending, state)
    with pytest.raises(TypeError, match=r"ReferenceState, got dict$"):
        ReferenceAccumulator.from_pending(PARAMS, pending, acc.state_dict())  # type: ignore[arg-type]


def test_from_pending_follows_the_requested_fused_variant() -> None:
    """The accumulator from_pending returns follows its ``fused_variant`` argument (§6).  float16,
    buf = 1, c = (1 + 2**-5) 2**-11 and w = 993/1024 (both float16 values): c * w = 2**-11 + 2**-26,
    so buf + c * w lies just above the tie 1 + 2**-11.  The FMA rounds it once, up; op_rounded
    rounds it to float32 first (the 2**-26 is below half a float32 ulp), then ties to even."""
    c, w = (1 + 2.0**-5) * 2.0**-11, 993 / 1024
    exact = 1 + Fraction(c) * Fraction(w)
    assert exact == 1 + Fraction(1, 2**11) + Fraction(1, 2**26)
    expected = {
        "fma": round_to(exact, "float16"),
        "op_rounded": round_to(round_to(exact, "float32"), "float16"),
    }
    assert expected == {"fma": 1 + 2.0**-10, "op_rounded": 1.0}  # the variants differ here
    acc = ReferenceAccumulator(dtype="float16", loss_scale=1.0, fused=True)
    acc.accumulate_mean({"p": (1,)}, 1.0, grads={"p": np.array([1.0])})  # buf = 1 exactly
    pending = acc.state_dict()["pending"]
    assert isinstance(pending, dict)
    for variant, want in expected.items():
        restored = ReferenceAccumulator.from_pending(
            {"p": (1,)}, pending, acc.state, fused_variant=variant
        )
        assert restored.fused_variant == variant
        restored.accumulate_mean({"p": (1,)}, w, grads={"p": np.array([c])})
        grad = restored.finish_sums().grads["p"]
        assert grad is not None and grad.tolist() == [want], (variant, grad)


def test_from_pending_keeps_the_requested_precision() -> None:
    """In exact mode the accumulator from_pending returns rounds ``exact_grads`` to its
    ``precision`` argument: one sum of g = 1 with weight 3 gives 1/3 rounded once to 64 bits."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0, mode="exact")
    acc.accumulate_sum({"p": (1,)}, 3, grads={"p": np.array([1.0])})
    pending = acc.state_dict()["pending"]
    assert isinstance(pending, dict)
    restored = ReferenceAccumulator.from_pending(
        {"p": (1,)}, pending, acc.state, mode="exact", precision=64
    )
    assert restored.precision == 64
    result = restored.finish_mean()
    assert result.exact_grads is not None
    third = result.exact_grads["p"]
    assert third is not None
    want = mpmath.libmp.from_rational(1, 3, 64, "n")
    assert third[0]._mpf_ == want
    assert want != mpmath.libmp.from_rational(1, 3, 256, "n")  # the default would differ


def test_a_record_of_an_empty_window_loads_at_any_loss_scale_of_d() -> None:
    """semantics §9: a record of a window that issued nothing (here after a finish, bound to
    PARAMS, with its checksum) loads into an accumulator at another loss scale, which keeps its
    own scale and continues exactly like one that never stopped; a record whose window issued a
    batch (one of zero weight included) is refused at another scale, and an empty record whose
    loss_scale is no loss scale of D is refused naming the field, nothing changed."""
    source = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    run(source, six_steps()[:2])
    source.finish_mean()
    record = source.state_dict()
    assert record["issued"] == 0 and record["param_names"] and "checksum" in record
    resumed = ReferenceAccumulator(dtype="float16", loss_scale=8.0)
    resumed.load_state_dict(record, PARAMS)
    assert resumed.state.loss_scale == 8.0 and resumed.state.issued == 0
    never_stopped = ReferenceAccumulator(dtype="float16", loss_scale=8.0)
    for acc in (resumed, never_stopped):
        run(acc, six_steps()[2:])
    assert result_bits(resumed.finish_mean()) == result_bits(never_stopped.finish_mean())

    zero = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    run(zero, [("accumulate_sum", 0, {"w": np.ones((2, 3))})])
    other = ReferenceAccumulator(dtype="float16", loss_scale=8.0)
    with pytest.raises(RecordError, match="loss_scale"):
        other.load_state_dict(zero.state_dict(), PARAMS)
    before = snapshot(other)
    for bad in (-4.0, 0.0, math.inf, 2049.0, "4.0"):
        with pytest.raises(RecordError, match=f"loss_scale.*{bad}"):
            other.load_state_dict({**record, "loss_scale": bad}, PARAMS)
    assert snapshot(other) == before
