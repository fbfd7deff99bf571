"""Tests of wacc_ref.scenario: the scenario data model, its validation and its JSON."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest

from tests.wacc_ref.scenario_support import (
    TWO_PARAMS,
    make_scenario,
    special_scenario,
)
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Restore,
    RestoreCorrupted,
    ScenarioError,
    from_json,
    scenarios_identical,
    to_json,
)

# --------------------------------------------------------------------------------------------
# Construction and validation
# --------------------------------------------------------------------------------------------


def test_gradient_not_representable_in_grad_dtype_is_refused_naming_it() -> None:
    """A gradient value that is not a value of the gradient dtype raises ScenarioError naming it."""
    value = 1.0 + 2.0**-30  # needs 31 significand bits: not a float32
    with pytest.raises(ScenarioError, match=re.escape(value.hex())):
        make_scenario((Accumulate.of("sum", 1.0, {"w": [1.0, value]}),))


def test_float8_gradient_values_are_validated_against_float8() -> None:
    """A float8_e4m3fn scenario accepts 448 and NaN but refuses 464 and inf (no inf in e4m3fn)."""
    ok = make_scenario(
        (Accumulate.of("sum", 1.0, {"w": [448.0, math.nan]}),), grad_dtype="float8_e4m3fn"
    )
    assert ok.grad_dtype == "float8_e4m3fn"
    for bad in (464.0, math.inf):
        with pytest.raises(ScenarioError, match=re.escape(bad.hex())):
            make_scenario(
                (Accumulate.of("sum", 1.0, {"w": [bad, 0.0]}),), grad_dtype="float8_e4m3fn"
            )


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"work_dtype": "float8_e5m2"}, "float8_e5m2"),
        ({"grad_dtype": "int8"}, "int8"),
        pytest.param(
            {"work_dtype": "float16", "loss_scale": 2.0**16},
            re.escape((2.0**16).hex()),
            id="float16-loss-scale-2**16",  # the regex's backslashes would be escaped in the id
        ),
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
        make_scenario((), **overrides)


def test_bad_steps_are_refused() -> None:
    """Unknown parameters, wrong element counts, non-float values and early restores are refused."""
    with pytest.raises(ScenarioError, match="'nope'"):
        make_scenario((Accumulate.of("sum", 1.0, {"nope": [1.0, 2.0]}),))
    with pytest.raises(ScenarioError, match="2 elements"):
        make_scenario((Accumulate.of("sum", 1.0, {"w": [1.0]}),))
    with pytest.raises(ScenarioError, match="int"):
        Accumulate.of("sum", 1.0, {"w": [1, 2.0]})
    with pytest.raises(ScenarioError, match="bool"):
        Accumulate(kind="sum", weight=True)
    with pytest.raises(ScenarioError, match="'product'"):
        Accumulate(kind="product", weight=1.0)  # type: ignore[arg-type]
    with pytest.raises(ScenarioError, match="before any checkpoint"):
        make_scenario((Restore(),))
    with pytest.raises(ScenarioError, match="before any checkpoint"):
        make_scenario((RestoreCorrupted("dtype_wrong"), Checkpoint()))
    with pytest.raises(ScenarioError, match="'no_such_kind'"):
        RestoreCorrupted("no_such_kind")


def test_invalid_weights_are_scenario_data() -> None:
    """Negative, NaN and infinite weights are valid scenario steps (they model error paths)."""
    steps = tuple(Accumulate.of("sum", w, {}) for w in (-1.0, math.nan, math.inf))
    assert len(make_scenario(steps).steps) == 3


def test_grad_arrays_have_the_parameter_shapes() -> None:
    """grad_arrays reshapes flat row-major values to each parameter's shape; None stays None."""
    scenario = make_scenario(
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


def test_json_round_trip_keeps_signed_zero_inf_nan_and_subnormals() -> None:
    """to_json/from_json round-trips a scenario with ±0, ±inf, NaN and subnormals bit for bit."""
    scenario = special_scenario()
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
    plus = make_scenario((Accumulate.of("sum", 1.0, {"w": [0.0, math.nan]}),))
    minus = make_scenario((Accumulate.of("sum", 1.0, {"w": [-0.0, math.nan]}),))
    nan_again = make_scenario((Accumulate.of("sum", 1.0, {"w": [0.0, -math.nan]}),))
    assert not scenarios_identical(plus, minus)
    assert scenarios_identical(plus, nan_again)


def test_json_is_plain_json_without_float_literals() -> None:
    """Every float in the JSON text is a hex string (no JSON number can lose bits)."""
    document = json.loads(to_json(special_scenario()))
    assert isinstance(document["loss_scale"], str)
    for step in document["steps"]:
        if "weight" in step:
            assert isinstance(step["weight"], str)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d.update(version=4), "version"),
        (lambda d: d.update(version=2), "scaler: missing"),
        (lambda d: d["steps"].append({"op": "update_scaler", "found_inf": False}), "update_scaler"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.pop("fused"), "fused"),
        (lambda d: d["steps"][0].update(weight=1001.0), "weight"),
        (lambda d: d["steps"][0].update(weight="0x1.zzp+0"), "0x1.zzp"),
        (lambda d: d["steps"][0].update(op="accumulate_max"), "accumulate_max"),
        pytest.param(
            lambda d: d["steps"][0]["grads"].update(b=["0x1.0000001p+0"]),
            re.escape(float.fromhex("0x1.0000001p+0").hex()),
            id="gradient-not-in-its-dtype",
        ),
        (lambda d: d["parameters"][0].update(shape=3), "shape"),
    ],
)
def test_from_json_refuses_malformed_documents(edit: Any, fragment: str) -> None:
    """from_json raises ScenarioError naming the bad field or value of a malformed document."""
    document = json.loads(to_json(special_scenario()))
    edit(document)
    with pytest.raises(ScenarioError, match=fragment):
        from_json(json.dumps(document))


def test_from_json_refuses_non_json() -> None:
    """Text that is not JSON raises ScenarioError."""
    with pytest.raises(ScenarioError, match="not JSON"):
        from_json("{")
