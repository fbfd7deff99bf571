"""The judge on dynamic loss scaling (semantics §13): the dynamic_scaling family, its features,
and its divergences written and replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.wacc.test_cli import wacc
from wacc.judge.engine import CheckConfig, run_family
from wacc.judge.implementation import load_implementation
from wacc.judge.verdict import judge
from wacc_ref.scenario import ScalerOptions, Scenario, UpdateScaler

EXAMPLES = 40


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        ("wacc.implementation:wacc_torch_fused", "float16"),
        ("wacc.implementation:wacc_torch_zero_copy", "float16"),
        ("wacc.implementation:wacc_torch_reproducible", "bfloat16"),
        ("wacc.baselines:spec_accumulator", "float16"),
    ],
    ids=["fused-float16", "zero-copy-float16", "reproducible-bfloat16", "spec-float16"],
)
def test_correct_implementations_pass_the_family(spec: str, dtype: str) -> None:
    """wacc_torch in its three modes and the plain SpecAccumulator, each with wacc_torch's
    scaler, pass every oracle on generated dynamic-scaling loops (the default implementation
    on every dtype is the gate's ci check, tests/wacc/test_gate.py)."""
    implementation = load_implementation(spec)
    assert not {"set_loss_scale", "loss_scaler"} & set(implementation.missing)
    found = run_family(implementation, dtype, "dynamic_scaling", CheckConfig(examples=EXAMPLES))
    assert found is None, found.describe() if found else ""


def test_a_scaler_that_forgets_its_run_at_a_resume_is_flagged() -> None:
    """A scaler whose load_state_dict drops growth_tracker grows later than the reference after
    a restore: the family's checkpoints between and inside windows find it, at an update."""
    implementation = load_implementation("tests.wacc.impls:scaler_forgets_run")
    found = run_family(implementation, "float16", "dynamic_scaling", CheckConfig(examples=200))
    assert found is not None, "a scaler resumed without its run passed"
    assert "semantics" in found.failed_oracles
    assert any(step.op == "restore" for step in found.scenario.steps)
    assert any("update_scaler" in line for line in found.describe(limit=20)), found.describe()


def test_without_the_features_the_family_is_skipped_and_reported(tmp_path: Path) -> None:
    """An implementation without loss_scaler runs no dynamic scenario (run_family returns at
    once) and ``wacc check`` names the feature as not judged (an extension: exit 0, no flag)."""
    implementation = load_implementation("tests.wacc.impls:no_loss_scaler")
    assert run_family(implementation, "float16", "dynamic_scaling", CheckConfig()) is None
    common = ["--family", "dynamic_scaling", "--dtype", "float16", "--out", str(tmp_path)]
    result = wacc("check", "tests.wacc.impls:no_loss_scaler", *common)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("not judged:")]
    assert line.startswith("not judged: loss_scaler (the dynamic loss scaling extension"), line
    assert "no window loss scaler" in line and "unsupported" not in result.stdout
    assert "family not run: dynamic_scaling (it needs loss_scaler)" in result.stdout


def test_a_dynamic_divergence_is_written_as_version_2_and_replays(tmp_path: Path) -> None:
    """``wacc check`` writes the shrunk dynamic scenario as JSON version 2 with its scaler;
    ``wacc replay`` reproduces the divergence on the implementation (exit 1) and the default
    implementation agrees with the reference on it (exit 0)."""
    impl = "tests.wacc.impls:scaler_forgets_run"
    result = wacc(
        "check", impl, "--family", "dynamic_scaling", "--dtype", "float16", "--examples", "200",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (written,) = tmp_path.glob("divergence-*-float16-dynamic_scaling.json")
    document = json.loads(written.read_text(encoding="utf-8"))
    assert document["version"] == 2 and document["scaler"]["growth_interval"] >= 2
    replay = wacc("replay", str(written), "--impl", impl)
    assert replay.returncode == 1 and "DIVERGES" in replay.stdout, replay.stdout + replay.stderr
    # the table's argument column says what each scaling step asked for
    assert "found_inf=" in replay.stdout, replay.stdout
    assert "argument" in replay.stdout.splitlines()[1], replay.stdout
    agrees = wacc("replay", str(written))
    assert agrees.returncode == 0, agrees.stdout + agrees.stderr


def test_a_scaler_answering_with_tensors_is_judged_not_crashed() -> None:
    """A one-element tensor scale is read as its value (so the scale sequence agrees), but an
    update() returning a bool tensor is not a bool: each update step is a divergence naming what
    it returned, and the judge itself never raises."""
    implementation = load_implementation("tests.wacc.impls:tensor_scaler")
    scenario = Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("w", (1,)),),
        steps=(UpdateScaler(False), UpdateScaler(True)),
        scaler=ScalerOptions(growth_interval=1),
    )
    verdict = judge(implementation, scenario)
    assert verdict.failed_oracles == ("semantics",)
    lines = verdict.describe(limit=10)
    assert any("scaler.applied: expected True, got 'Tensor tensor(True)'" in x for x in lines)
    assert not any("scaler.scale" in line for line in lines), lines
