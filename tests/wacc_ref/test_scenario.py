"""Tests of wacc_ref.scenario: the scenario data model, JSON, corrupted records and traces."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from wacc_ref import formats
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.corruption import (
    CORRUPTION_FIELDS,
    CORRUPTION_KINDS,
    CorruptionNotApplicableError,
    applicable_corruptions,
    corrupt_record,
    corruption_field,
)
from wacc_ref.errors import RecordError
from wacc_ref.oracles import (
    run_reference,
    stepwise_differences,
    trace_differences,
    trace_violations,
)
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    RestoreCorrupted,
    Scenario,
    ScenarioError,
    from_json,
    scenarios_identical,
    to_json,
    without_interruptions,
)
from wacc_ref.traces import (
    RECORD_KEYS,
    FinishOutcome,
    ScenarioTrace,
    StepOutcome,
    buffer_to_float64,
    record_from_snapshot,
    snapshot_record,
)

TWO_PARAMS = (("weight", (2, 3)), ("bias", (3,)))


def _scenario(steps: tuple[Any, ...], **overrides: Any) -> Scenario:
    options: dict[str, Any] = {
        "work_dtype": "float32",
        "grad_dtype": "float32",
        "loss_scale": 2.0,
        "fused": False,
        "parameters": (("w", (2,)),),
        "steps": steps,
    }
    options.update(overrides)
    return Scenario(**options)


def _bits(value: float) -> str:
    """A float shown so that ±0 and NaN are visible in assertion messages."""
    return float(value).hex()


def _assert_array_bits(actual: np.ndarray | None, expected: list[float], what: str) -> None:
    assert actual is not None, f"{what}: no array"
    got = [float(v) for v in np.asarray(actual).reshape(-1)]
    assert len(got) == len(expected), f"{what}: {got} vs {expected}"
    for position, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert formats.same_value_bits(g, e), (
            f"{what}[{position}]: got {_bits(g)}, expected {_bits(e)}"
        )


# --------------------------------------------------------------------------------------------
# Construction and validation
# --------------------------------------------------------------------------------------------


def test_gradient_not_representable_in_grad_dtype_is_refused_naming_it() -> None:
    """A gradient value that is not a value of the gradient dtype raises ScenarioError naming it."""
    value = 1.0 + 2.0**-30  # needs 31 significand bits: not a float32
    with pytest.raises(ScenarioError, match=re.escape(value.hex())):
        _scenario((Accumulate.of("sum", 1.0, {"w": [1.0, value]}),))


def test_float8_gradient_values_are_validated_against_float8() -> None:
    """A float8_e4m3fn scenario accepts 448 and NaN but refuses 464 and inf (no inf in e4m3fn)."""
    ok = _scenario(
        (Accumulate.of("sum", 1.0, {"w": [448.0, math.nan]}),), grad_dtype="float8_e4m3fn"
    )
    assert ok.grad_dtype == "float8_e4m3fn"
    for bad in (464.0, math.inf):
        with pytest.raises(ScenarioError, match=re.escape(bad.hex())):
            _scenario((Accumulate.of("sum", 1.0, {"w": [bad, 0.0]}),), grad_dtype="float8_e4m3fn")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"work_dtype": "float8_e5m2"}, "float8_e5m2"),
        ({"grad_dtype": "int8"}, "int8"),
        ({"work_dtype": "float16", "loss_scale": 2.0**16}, re.escape((2.0**16).hex())),
        ({"loss_scale": 0.0}, "0.0"),
        ({"loss_scale": math.inf}, "inf"),
        ({"fused": 1}, "fused"),
        ({"parameters": (("w", (2,)), ("w", (3,)))}, "'w'"),
        ({"parameters": (("", (2,)),)}, "''"),
        ({"parameters": (("w", (-1,)),)}, "-1"),
        ({"parameters": ()}, "at least one parameter"),
    ],
)
def test_bad_scenario_fields_are_refused_naming_the_value(
    overrides: dict[str, Any], fragment: str
) -> None:
    """Every malformed scenario field raises ScenarioError whose message names the value."""
    with pytest.raises(ScenarioError, match=fragment):
        _scenario((), **overrides)


def test_bad_steps_are_refused() -> None:
    """Unknown parameters, wrong element counts, non-float values and early restores are refused."""
    with pytest.raises(ScenarioError, match="'nope'"):
        _scenario((Accumulate.of("sum", 1.0, {"nope": [1.0, 2.0]}),))
    with pytest.raises(ScenarioError, match="2 elements"):
        _scenario((Accumulate.of("sum", 1.0, {"w": [1.0]}),))
    with pytest.raises(ScenarioError, match="int"):
        Accumulate.of("sum", 1.0, {"w": [1, 2.0]})
    with pytest.raises(ScenarioError, match="bool"):
        Accumulate(kind="sum", weight=True)
    with pytest.raises(ScenarioError, match="'product'"):
        Accumulate(kind="product", weight=1.0)  # type: ignore[arg-type]
    with pytest.raises(ScenarioError, match="before any checkpoint"):
        _scenario((Restore(),))
    with pytest.raises(ScenarioError, match="before any checkpoint"):
        _scenario((RestoreCorrupted("dtype_wrong"), Checkpoint()))
    with pytest.raises(ScenarioError, match="'no_such_kind'"):
        RestoreCorrupted("no_such_kind")


def test_invalid_weights_are_scenario_data() -> None:
    """Negative, NaN and infinite weights are valid scenario steps (they model error paths)."""
    steps = tuple(Accumulate.of("sum", w, {}) for w in (-1.0, math.nan, math.inf))
    assert len(_scenario(steps).steps) == 3


def test_grad_arrays_have_the_parameter_shapes() -> None:
    """grad_arrays reshapes flat row-major values to each parameter's shape; None stays None."""
    scenario = _scenario(
        (Accumulate.of("sum", 1.0, {"weight": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "bias": None}),),
        parameters=TWO_PARAMS,
    )
    step = scenario.steps[0]
    assert isinstance(step, Accumulate)
    arrays = scenario.grad_arrays(step)
    weight = arrays["weight"]
    assert weight is not None and weight.shape == (2, 3) and weight[1, 0] == 3.0
    assert arrays["bias"] is None


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------

SPECIAL_VALUES = [
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    formats.get_format("float32").min_subnormal,
    -formats.get_format("float32").max_finite,
    1.0 + 2.0**-23,
]


def _special_scenario() -> Scenario:
    return Scenario(
        work_dtype="bfloat16",
        grad_dtype="float32",
        loss_scale=2.0**-3,
        fused=True,
        parameters=(("a", (2, 2)), ("b", ()), ("c", (0,))),
        steps=(
            Accumulate.of("mean", 1001.0, {"a": SPECIAL_VALUES[:4], "b": [SPECIAL_VALUES[4]]}),
            Checkpoint(asynchronous=True),
            Accumulate.of("sum", -0.0, {"a": SPECIAL_VALUES[4:], "b": None, "c": []}),
            RestoreCorrupted("pending_wrong_shape"),
            Restore(),
            Finish("sums"),
            Accumulate.of("sum", math.nan, {}),
            Finish("mean"),
        ),
    )


def test_json_round_trip_keeps_signed_zero_inf_nan_and_subnormals() -> None:
    """to_json/from_json round-trips a scenario with ±0, ±inf, NaN and subnormals bit for bit."""
    scenario = _special_scenario()
    text = to_json(scenario)
    back = from_json(text)
    assert scenarios_identical(back, scenario), text
    assert to_json(back) == text
    step = back.steps[0]
    assert isinstance(step, Accumulate)
    zero_sign = math.copysign(1.0, step.grads_mapping()["a"][1])  # type: ignore[index]
    assert zero_sign == -1.0, text
    assert "-0x0.0p+0" in text and '"nan"' in text and '"-inf"' in text


def test_scenarios_identical_tells_signed_zeros_apart() -> None:
    """scenarios_identical distinguishes +0.0 from -0.0 and treats every NaN as equal."""
    plus = _scenario((Accumulate.of("sum", 1.0, {"w": [0.0, math.nan]}),))
    minus = _scenario((Accumulate.of("sum", 1.0, {"w": [-0.0, math.nan]}),))
    nan_again = _scenario((Accumulate.of("sum", 1.0, {"w": [0.0, -math.nan]}),))
    assert not scenarios_identical(plus, minus)
    assert scenarios_identical(plus, nan_again)


def test_json_is_plain_json_without_float_literals() -> None:
    """Every float in the JSON text is a hex string (no JSON number can lose bits)."""
    document = json.loads(to_json(_special_scenario()))
    assert isinstance(document["loss_scale"], str)
    for step in document["steps"]:
        if "weight" in step:
            assert isinstance(step["weight"], str)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.pop("fused"), "fused"),
        (lambda d: d["steps"][0].update(weight=1001.0), "weight"),
        (lambda d: d["steps"][0].update(weight="0x1.zzp+0"), "0x1.zzp"),
        (lambda d: d["steps"][0].update(op="accumulate_max"), "accumulate_max"),
        (
            lambda d: d["steps"][0]["grads"].update(b=["0x1.0000001p+0"]),
            re.escape(float.fromhex("0x1.0000001p+0").hex()),
        ),
        (lambda d: d["parameters"][0].update(shape=3), "shape"),
    ],
)
def test_from_json_refuses_malformed_documents(edit: Any, fragment: str) -> None:
    """from_json raises ScenarioError naming the bad field or value of a malformed document."""
    document = json.loads(to_json(_special_scenario()))
    edit(document)
    with pytest.raises(ScenarioError, match=fragment):
        from_json(json.dumps(document))


def test_from_json_refuses_non_json() -> None:
    """Text that is not JSON raises ScenarioError."""
    with pytest.raises(ScenarioError, match="not JSON"):
        from_json("{")


# --------------------------------------------------------------------------------------------
# Corrupted records
# --------------------------------------------------------------------------------------------


def _params() -> dict[str, tuple[int, ...]]:
    return dict(TWO_PARAMS)


def _record_with_pending() -> dict[str, object]:
    """A bfloat16 record with a 'weight' buffer, no 'bias' buffer, a zero-weight batch."""
    source = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    source.accumulate_sum(_params(), 5.0, grads={"weight": np.arange(6.0).reshape(2, 3)})
    source.accumulate_sum(_params(), 0.0, grads={})
    return source.state_dict()


def _record_bound_without_pending() -> dict[str, object]:
    source = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    source.accumulate_sum(_params(), 0.0, grads={"bias": np.ones(3)})
    return source.state_dict()


def _record_unbound() -> dict[str, object]:
    return ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0).state_dict()


def _busy_target() -> ReferenceAccumulator:
    """An accumulator with its own window in progress (so 'changes nothing' means something)."""
    target = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    target.accumulate_sum(_params(), 3.0, grads={"bias": np.array([1.0, -0.0, 2.5])})
    return target


RECORDS = {
    "with_pending": _record_with_pending,
    "bound_without_pending": _record_bound_without_pending,
    "unbound": _record_unbound,
}


@pytest.mark.parametrize("record_name", sorted(RECORDS))
def test_uncorrupted_records_load(record_name: str) -> None:
    """Control: each test record loads into a busy target (failures below are the corruption's)."""
    target = _busy_target()
    target.load_state_dict(RECORDS[record_name](), _params())
    assert (
        snapshot_record(target.state_dict()).key() == snapshot_record(RECORDS[record_name]()).key()
    )


@pytest.mark.parametrize("record_name", sorted(RECORDS))
@pytest.mark.parametrize("kind", CORRUPTION_KINDS)
def test_corrupted_record_raises_record_error_naming_the_field_and_changes_nothing(
    record_name: str, kind: str
) -> None:
    """Each applicable corruption makes load_state_dict raise RecordError naming its field, with the
    target accumulator and the input record unchanged."""
    record = RECORDS[record_name]()
    if kind not in applicable_corruptions(record):
        with pytest.raises(CorruptionNotApplicableError, match=kind):
            corrupt_record(record, kind)
        return
    pristine = copy.deepcopy(record)
    corrupted = corrupt_record(record, kind)
    target = _busy_target()
    before = snapshot_record(target.state_dict())
    with pytest.raises(RecordError) as info:
        target.load_state_dict(corrupted, _params())
    expected_field = corruption_field(record, kind)
    assert expected_field in str(info.value), f"{kind}: {info.value}"
    after = snapshot_record(target.state_dict())
    assert before.differences(after, what="target") == []
    assert record.keys() == pristine.keys()
    assert snapshot_record(record).differences(snapshot_record(pristine), what="record") == []
    assert record["param_shapes"] == pristine["param_shapes"]


def test_applicability_follows_what_the_record_holds() -> None:
    """Pending kinds need a pending buffer, parameter kinds need bound parameters; the rest
    always apply."""
    pending_kinds = {"pending_unknown_parameter", "pending_wrong_shape"}
    bound_kinds = {"param_names_wrong", "param_shape_wrong"}
    assert set(applicable_corruptions(_record_with_pending())) == set(CORRUPTION_KINDS)
    assert set(applicable_corruptions(_record_bound_without_pending())) == (
        set(CORRUPTION_KINDS) - pending_kinds
    )
    assert set(applicable_corruptions(_record_unbound())) == (
        set(CORRUPTION_KINDS) - pending_kinds - bound_kinds
    )


def test_every_kind_documents_a_field_and_unknown_kinds_are_refused() -> None:
    """CORRUPTION_FIELDS covers every kind; an unknown kind raises ValueError naming it."""
    assert set(CORRUPTION_FIELDS) == set(CORRUPTION_KINDS)
    assert all(CORRUPTION_FIELDS[kind] for kind in CORRUPTION_KINDS)
    with pytest.raises(ValueError, match="'melted'"):
        corrupt_record(_record_unbound(), "melted")
    assert corruption_field(_record_with_pending(), "pending_wrong_shape") == "weight"


def test_wrong_shape_corruption_keeps_the_values() -> None:
    """pending_wrong_shape only reshapes: same values, a different shape, the input untouched."""
    record = _record_with_pending()
    corrupted = corrupt_record(record, "pending_wrong_shape")
    original = record["pending"]["weight"]  # type: ignore[index]
    changed = corrupted["pending"]["weight"]
    assert changed.shape != original.shape and original.shape == (2, 3)
    assert np.array_equal(changed.reshape(-1), original.reshape(-1))


def test_corrupt_record_works_on_torch_tensor_records() -> None:
    """corrupt_record and snapshot_record handle a production-style record with torch buffers."""
    torch = pytest.importorskip("torch")
    buffer = torch.tensor([[0.5, -0.0, 3.0], [1.0, 2.0**-133, -7.0]], dtype=torch.bfloat16)
    record: dict[str, object] = {
        "format_version": 1,
        "dtype": "bfloat16",
        "loss_scale": 4.0,
        "fused": False,
        "issued": 2,
        "zero_weight": 1,
        "total_weight": 5.0,
        "param_names": ["weight", "bias"],
        "param_shapes": [[2, 3], [3]],
        "pending": {"weight": buffer},
    }
    assert tuple(record) == RECORD_KEYS
    snapshot = snapshot_record(record)
    _assert_array_bits(
        snapshot.pending[0][1], [0.5, -0.0, 3.0, 1.0, 2.0**-133, -7.0], "torch bf16 pending"
    )
    pristine_buffer = buffer.clone()
    for kind in applicable_corruptions(record):
        corrupted = corrupt_record(record, kind)
        assert corrupted is not record
        for value in corrupted["pending"].values():
            assert isinstance(value, torch.Tensor)
    assert torch.equal(buffer, pristine_buffer) and record["param_shapes"] == [[2, 3], [3]]
    wrong = corrupt_record(record, "pending_wrong_shape")["pending"]["weight"]
    assert tuple(wrong.shape) != (2, 3) and torch.equal(wrong.reshape(-1), buffer.reshape(-1))
    renamed = corrupt_record(record, "param_shape_wrong")
    assert renamed["param_shapes"][0] == [2, 3, 1]
    assert tuple(renamed["pending"]["weight"].shape) == (2, 3, 1)


def test_buffer_to_float64_reads_fractions_and_refuses_unknown_types() -> None:
    """Object arrays of Fractions are rounded once to float64; unknown buffer types raise."""
    third = np.empty(2, dtype=object)
    third[:] = [Fraction(1, 3), Fraction(-5, 2)]
    assert buffer_to_float64(third).tolist() == [1 / 3, -2.5]
    with pytest.raises(TypeError, match="list"):
        buffer_to_float64([1.0, 2.0])
    with pytest.raises(TypeError, match="int64"):
        buffer_to_float64(np.arange(3))


# --------------------------------------------------------------------------------------------
# Running scenarios on the reference
# --------------------------------------------------------------------------------------------


def _hand_scenario() -> Scenario:
    """float32, S = 2, one parameter w of 2 elements; every outcome is derived by hand below."""
    return _scenario(
        (
            Accumulate.of("sum", 1.0, {"w": [1.0, -0.0]}),  # 0: buf = [1, +0] (+0 + -0 = +0)
            Accumulate.of("sum", 7.0, {"w": [3.0, -0.0]}),  # 1: buf = [4, +0], W = 8
            Checkpoint(asynchronous=True),  # 2
            RestoreCorrupted("dtype_wrong"),  # 3: RecordError, nothing changes
            Restore(),  # 4: same state, fresh accumulator
            Accumulate.of("sum", 0.0, {"w": [math.nan, math.nan]}),  # 5: zero weight
            Finish("mean"),  # 6: y = [2, +0], out = [0.25, +0]; W = 8
            Finish("mean"),  # 7: empty window: ZeroTotalWeightError
            Accumulate.of("mean", -1.0, {"w": [1.0, 1.0]}),  # 8: InvalidWeightError
            Finish("sums"),  # 9: no buffer: w is None, W = 0
        )
    )


def test_run_reference_matches_a_hand_derived_trace() -> None:
    """Every step's error, counters, buffers and finish results equal values derived by hand."""
    trace = run_reference(_hand_scenario())
    errors = [outcome.error for outcome in trace]
    assert errors == [None] * 3 + ["RecordError"] + [None] * 3 + [
        "ZeroTotalWeightError",
        "InvalidWeightError",
        None,
    ]
    counters = [(o.state.issued, o.state.zero_weight, o.state.total_weight) for o in trace]
    in_window = [(1, 0, 1.0)] + [(2, 0, 8.0)] * 4 + [(3, 1, 8.0)]
    assert counters == in_window + [(0, 0, 0.0)] * 4
    for index in (1, 2, 3, 4, 5):
        pending = dict(trace.outcomes[index].state.pending)
        _assert_array_bits(pending["w"], [4.0, 0.0], f"step {index} pending")
    checkpoint_record = trace.outcomes[2].record
    assert checkpoint_record is not None and checkpoint_record.issued == 2
    mean = trace.outcomes[6].result
    assert mean is not None and mean.normalized and mean.weight == 8.0 and mean.issued == 3
    _assert_array_bits(dict(mean.grads)["w"], [0.25, 0.0], "finish_mean")
    sums = trace.outcomes[9].result
    assert sums is not None and not sums.normalized and sums.weight == 0.0
    assert dict(sums.grads) == {"w": None}
    assert trace.outcomes[6].state.param_names == ("w",)  # the tracked set stays bound
    assert trace_violations(trace) == []


def test_run_reference_mean_uses_the_converted_weight() -> None:
    """bfloat16 mean: weight 1001 counts as 1000 in W and in the product (SPEC §6)."""
    scenario = _scenario(
        (Accumulate.of("mean", 1001.0, {"w": [1.0, 0.5]}), Finish("mean")),
        work_dtype="bfloat16",
        grad_dtype="bfloat16",
        loss_scale=1.0,
    )
    trace = run_reference(scenario)
    assert trace.outcomes[0].state.total_weight == 1000.0
    _assert_array_bits(dict(trace.outcomes[0].state.pending)["w"], [1000.0, 500.0], "pending")
    result = trace.outcomes[1].result
    assert result is not None
    _assert_array_bits(dict(result.grads)["w"], [1.0, 0.5], "finish_mean")


def test_run_reference_follows_the_fused_variant() -> None:
    """float32 fused mean: buf = -1, c = w_D = 1 + 2**-12 gives 2**-11 + 2**-24 with an FMA but
    2**-11 with the two-step order (c * w_D = 1 + 2**-11 + 2**-24 ties to even at 1 + 2**-11)."""
    weight = 1.0 + 2.0**-12
    steps = (
        Accumulate.of("mean", 1.0, {"w": [-1.0, 0.0]}),
        Accumulate.of("mean", weight, {"w": [weight, 0.0]}),
        Finish("sums"),
    )
    fma_value, two_step_value = 2.0**-11 + 2.0**-24, 2.0**-11
    for fused, variant, expected in (
        (True, "fma", fma_value),
        (True, "op_rounded", fma_value),  # op(float32) is float32: the same single rounding
        (True, "two_step", two_step_value),
        (False, "fma", two_step_value),  # not fused: the variant is not used
    ):
        trace = run_reference(_scenario(steps, fused=fused, loss_scale=1.0), fused_variant=variant)
        result = trace.outcomes[2].result
        assert result is not None
        _assert_array_bits(dict(result.grads)["w"], [expected, 0.0], f"{fused=} {variant}")


def test_run_reference_exact_mode_gives_the_real_result_rounded_once() -> None:
    """exact mode: finish_mean equals (Σ g)/S/W of the unconverted gradients, rounded once."""
    g1, g2 = 1.0 + 2.0**-30, 3.0  # float64 gradients: the exact mode uses them unconverted
    scenario = _scenario(
        (
            Accumulate.of("sum", 1.0, {"w": [g1, 1.0]}),
            Accumulate.of("sum", 2.0, {"w": [g2, 1.0]}),
            Checkpoint(),
            Restore(),
            Finish("mean"),
        ),
        grad_dtype="float64",
        work_dtype="bfloat16",
        loss_scale=1.0,
    )
    trace = run_reference(scenario, mode="exact")
    result = trace.outcomes[4].result
    assert result is not None
    expected = [
        formats.round_to((Fraction(g1) + Fraction(g2)) / 3, "float64"),
        formats.round_to(Fraction(2, 3), "float64"),
    ]
    _assert_array_bits(dict(result.grads)["w"], expected, "exact finish_mean")
    assert trace_violations(trace) == []


def test_mid_window_restore_is_bit_identical_to_the_uninterrupted_run() -> None:
    """Checkpoint + restore in the middle of a window changes no finish result (SPEC §9)."""
    tiny = formats.get_format("float16").min_subnormal
    steps = (
        Accumulate.of("mean", 3.0, {"w": [tiny, -1.5]}),
        Checkpoint(),
        RestoreCorrupted("total_weight_nan"),
        Restore(),
        Accumulate.of("mean", 7.0, {"w": [-tiny, 2.0**-3]}),
        Checkpoint(asynchronous=True),
        Restore(),
        Finish("mean"),
    )
    interrupted = _scenario(steps, work_dtype="float16", grad_dtype="float16", loss_scale=8.0)
    plain = without_interruptions(interrupted)
    assert [s.op for s in plain.steps] == ["accumulate_mean", "accumulate_mean", "finish_mean"]
    got = [o.result for o in run_reference(interrupted) if o.result is not None]
    want = [o.result for o in run_reference(plain) if o.result is not None]
    assert len(got) == len(want) == 1
    assert got[0].differences(want[0], what="finish_mean") == []


def test_run_reference_is_deterministic() -> None:
    """Two runs of the same scenario give identical traces (keys equal, no differences)."""
    first, second = run_reference(_special_scenario()), run_reference(_special_scenario())
    assert first.key() == second.key()
    assert trace_differences(first, second) == []
    assert trace_violations(first) == []


# --------------------------------------------------------------------------------------------
# Trace comparison and invariants
# --------------------------------------------------------------------------------------------


def _replace_result_grad(
    trace: ScenarioTrace, index: int, name: str, values: list[float]
) -> ScenarioTrace:
    outcomes = list(trace.outcomes)
    old = outcomes[index]
    assert old.result is not None
    grads = tuple(
        (n, np.array(values).reshape(g.shape) if n == name and g is not None else g)
        for n, g in old.result.grads
    )
    result = FinishOutcome(
        grads=grads,
        weight=old.result.weight,
        loss_scale=old.result.loss_scale,
        issued=old.result.issued,
        zero_weight=old.result.zero_weight,
        normalized=old.result.normalized,
    )
    outcomes[index] = StepOutcome(
        index=old.index,
        op=old.op,
        error=old.error,
        skipped=old.skipped,
        state=old.state,
        result=result,
        record=old.record,
    )
    return ScenarioTrace(outcomes=tuple(outcomes))


def test_trace_differences_sees_a_sign_of_zero_but_not_a_nan_payload() -> None:
    """A -0.0 where +0.0 was expected is a difference (shown in hex); NaN vs NaN is not."""
    trace = run_reference(_hand_scenario())
    flipped = _replace_result_grad(trace, 6, "w", [0.25, -0.0])
    lines = trace_differences(trace, flipped)
    assert len(lines) == 1 and "step 6 (finish_mean)" in lines[0] and "-0x0.0p+0" in lines[0]
    nan_scenario = _scenario((Accumulate.of("sum", 1.0, {"w": [math.nan, 1.0]}), Finish("sums")))
    nan_trace = run_reference(nan_scenario)
    negative_nan = _replace_result_grad(nan_trace, 1, "w", [-math.nan, 1.0])
    assert trace_differences(nan_trace, negative_nan) == []


def test_trace_differences_sees_error_and_length_mismatches() -> None:
    """A different error class or a missing step is reported."""
    trace = run_reference(_hand_scenario())
    shorter = ScenarioTrace(outcomes=trace.outcomes[:-1])
    assert any("trace length" in line for line in trace_differences(trace, shorter))
    outcomes = list(trace.outcomes)
    old = outcomes[7]
    outcomes[7] = StepOutcome(
        index=old.index, op=old.op, error=None, skipped=False, state=old.state, result=None
    )
    lines = trace_differences(trace, ScenarioTrace(outcomes=tuple(outcomes)))
    assert lines == ["step 7 (finish_mean): error expected ZeroTotalWeightError, got None"]


def test_trace_violations_catches_a_raise_that_changed_state() -> None:
    """trace_violations reports an erroring step whose state differs from the one before it, and
    a corrupted restore that did not raise RecordError."""
    trace = run_reference(_hand_scenario())
    outcomes = list(trace.outcomes)
    raised = outcomes[7]  # ZeroTotalWeightError; give it the state of step 5 (a different window)
    outcomes[7] = StepOutcome(
        index=raised.index,
        op=raised.op,
        error=raised.error,
        skipped=False,
        state=outcomes[5].state,
    )
    corrupted = outcomes[3]
    outcomes[3] = StepOutcome(
        index=corrupted.index, op=corrupted.op, error=None, skipped=False, state=corrupted.state
    )
    lines = trace_violations(ScenarioTrace(outcomes=tuple(outcomes)))
    assert any(line.startswith("step 7 (finish_mean) raised but changed state") for line in lines)
    assert "step 3 (restore_corrupted): expected RecordError, got None" in lines


def test_snapshot_order_of_pending_does_not_matter() -> None:
    """Pending buffers are compared by name: the record's allocation order is irrelevant."""
    record = _record_with_pending()
    pending: Mapping[str, np.ndarray] = {"weight": np.zeros((2, 3)), "bias": np.ones(3)}
    forward = dict(record, pending=dict(pending))
    backward = dict(record, pending=dict(reversed(list(pending.items()))))
    assert snapshot_record(forward).key() == snapshot_record(backward).key()


# --------------------------------------------------------------------------------------------
# The step-local oracle
# --------------------------------------------------------------------------------------------


def _fp16_fused_scenario() -> Scenario:
    """fp16 fused mean: buf = 62, then c = -62 with w_D = 1057.  Exactly, buf + c*w_D = 62 - 65534
    = -65472 = -2046 * 32, a float16 value; but round_16(c*w_D) = round_16(-65534) overflows
    (|x| >= 65520), so the two-step result is -inf while FMA and op-rounded give -65472."""
    return _scenario(
        (
            Accumulate.of("mean", 1.0, {"w": [62.0, 1.0]}),
            Accumulate.of("mean", 1057.0, {"w": [-62.0, 0.0]}),
            Finish("sums"),
        ),
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=1.0,
        fused=True,
    )


def test_stepwise_oracle_accepts_each_allowed_fused_result() -> None:
    """Traces following the op-rounded and the two-step fused results differ from each other,
    but each passes the stepwise oracle (SPEC §6 allows both)."""
    scenario = _fp16_fused_scenario()
    op_rounded = run_reference(scenario, fused_variant="op_rounded")
    two_step = run_reference(scenario, fused_variant="two_step")
    _assert_array_bits(dict(op_rounded.outcomes[1].state.pending)["w"], [-65472.0, 1.0], "op")
    _assert_array_bits(dict(two_step.outcomes[1].state.pending)["w"], [-math.inf, 1.0], "two")
    assert trace_differences(op_rounded, two_step) != []
    for trace in (op_rounded, two_step, run_reference(scenario, fused_variant="fma")):
        assert stepwise_differences(scenario, trace) == [], trace.implementation


def _replace_state_pending(
    trace: ScenarioTrace, index: int, name: str, values: list[float]
) -> ScenarioTrace:
    outcomes = list(trace.outcomes)
    old = outcomes[index]
    pending = tuple(
        (n, np.array(values).reshape(a.shape) if n == name else a) for n, a in old.state.pending
    )
    state = dataclasses.replace(old.state, pending=pending)
    outcomes[index] = dataclasses.replace(old, state=state)
    return ScenarioTrace(outcomes=tuple(outcomes))


def test_stepwise_oracle_refuses_a_fused_result_outside_the_allowed_set() -> None:
    """A fused mean element that is none of the three SPEC §6 results is reported with the
    allowed values; the next step is judged from the actual (tampered) state."""
    scenario = _fp16_fused_scenario()
    tampered = _replace_state_pending(run_reference(scenario), 1, "w", [-65440.0, 1.0])
    lines = stepwise_differences(scenario, tampered)
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 1 (accumulate_mean) state.pending['w'][flat 0]: got ")
    assert "-0x1.ff80000000000p+15" in lines[0] and "'-inf'" in lines[0], lines[0]
    # finish_sums is judged from the tampered buffer, which the actual trace did not hand over.
    assert lines[1].startswith("step 2 (finish_sums) result.grads['w'][flat 0]: expected -0x1.ff4")


def test_stepwise_oracle_reports_a_fused_buffer_of_the_wrong_shape_at_its_step() -> None:
    """A fused mean step whose buffer holds allowed values in another shape (same element count)
    is reported at that step, as a shape difference."""
    scenario = _fp16_fused_scenario()
    trace = run_reference(scenario)
    outcomes = list(trace.outcomes)
    state = outcomes[1].state
    reshaped = tuple((name, array.reshape(1, -1)) for name, array in state.pending)
    outcomes[1] = dataclasses.replace(
        outcomes[1], state=dataclasses.replace(state, pending=reshaped)
    )
    lines = stepwise_differences(scenario, ScenarioTrace(outcomes=tuple(outcomes)))
    assert lines and lines[0] == "step 1 (accumulate_mean) state.pending['w']: shape (2,) != (1, 2)"


def test_stepwise_oracle_is_exact_and_local_outside_fused_steps() -> None:
    """In a non-fused scenario a -0.0 where the reference has +0.0 is reported at that step, and
    the next step is judged from the actual state (not from the reference's own run)."""
    scenario = _hand_scenario()
    trace = run_reference(scenario)
    assert stepwise_differences(scenario, trace) == []
    tampered = _replace_state_pending(trace, 0, "w", [1.0, -0.0])
    lines = stepwise_differences(scenario, tampered)
    assert lines == [
        "step 0 (accumulate_sum) state.pending['w'][flat 1]: expected 0x0.0p+0, got -0x0.0p+0",
        # judged from the actual -0.0: -0.0 + -0.0 is -0.0, but the trace says +0.0
        "step 1 (accumulate_sum) state.pending['w'][flat 1]: expected -0x0.0p+0, got 0x0.0p+0",
    ]


def test_stepwise_oracle_checks_async_checkpoint_records() -> None:
    """A checkpoint whose record (resolved later) differs from the state at the call is reported."""
    scenario = _hand_scenario()
    trace = run_reference(scenario)
    outcomes = list(trace.outcomes)
    checkpoint = outcomes[2]
    assert checkpoint.record is not None
    drifted = dataclasses.replace(checkpoint.record, issued=3)
    outcomes[2] = dataclasses.replace(checkpoint, record=drifted)
    lines = stepwise_differences(scenario, ScenarioTrace(outcomes=tuple(outcomes)))
    assert lines[0] == "step 2 (checkpoint) record.issued: expected 2, got 3"


def test_record_from_snapshot_round_trips() -> None:
    """A snapshot turned back into a record loads and snapshots to the same bits."""
    record = _record_with_pending()
    snapshot = snapshot_record(record)
    rebuilt = record_from_snapshot(snapshot)
    assert tuple(rebuilt) == RECORD_KEYS
    target = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    target.load_state_dict(rebuilt, _params())
    assert snapshot_record(target.state_dict()).key() == snapshot.key()
