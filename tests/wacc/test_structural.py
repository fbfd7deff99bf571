"""The structural family: malformed gradients are refused as semantics §5/§11 say, accepted
layouts work as the dense gradient, and the judge finds an accumulator that skips a check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.wacc.test_cli import REPO, wacc
from tests.wacc_ref.scenario_support import fault_scenario
from wacc.judge.engine import CORPUS_FAMILIES, FAMILIES, CheckConfig, family_names, run_family
from wacc.judge.implementation import load_implementation
from wacc.judge.verdict import judge
from wacc_ref.faults import FAULT_KINDS, REFUSED_FAULTS
from wacc_ref.scenario import (
    JSON_VERSION_STRUCTURAL,
    Accumulate,
    ScenarioError,
    from_json,
    scenarios_identical,
    to_json,
)

FACTORIES = ("reproducible", "fused", "zero_copy")


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_fault_has_the_semantics_outcome_and_wacc_torch_agrees(
    kind: str, factory: str
) -> None:
    """At weight 1 and 0, in sums and means, a refused fault's step expects
    ParameterMismatchError with nothing changed, an accepted one the dense step's result, and
    the window goes on; every wacc_torch factory agrees step by step."""
    implementation = load_implementation(f"wacc.implementation:wacc_torch_{factory}")
    for weight in (1.0, 0.0):
        for op in ("sum", "mean"):
            scenario = fault_scenario(kind, weight, op, fused=implementation.fused)
            verdict = judge(implementation, scenario)
            assert not verdict.failed, verdict.describe()
            expected = "ParameterMismatchError" if kind in REFUSED_FAULTS else None
            assert verdict.steps[1].expected_error == verdict.steps[1].actual_error == expected
            assert verdict.steps[3].expected_error is None  # the window continued to its mean


def test_the_zero_copy_adapter_checks_the_structure_before_w_d() -> None:
    """§5's check order in the zero-copy adapter: a mean whose weight does not survive float16
    (10**6 -> inf) with an int64 gradient is ParameterMismatchError, as in the buffered mode."""
    scenario = fault_scenario("int64", 1e6, "mean", work="float16")
    verdict = judge(load_implementation("wacc.implementation:wacc_torch_zero_copy"), scenario)
    assert verdict.steps[1].expected_error == "ParameterMismatchError"
    assert not verdict.failed, verdict.describe()


@pytest.mark.parametrize("factory", FACTORIES)
def test_wacc_torch_passes_the_structural_family(factory: str) -> None:
    """Generated structural scenarios (bfloat16, the ci budget's first 40) find nothing in
    any wacc_torch factory."""
    implementation = load_implementation(f"wacc.implementation:wacc_torch_{factory}")
    verdict = run_family(implementation, "bfloat16", "structural", CheckConfig(examples=40))
    assert verdict is None, verdict.describe()


def test_structural_is_a_family_and_in_the_frozen_corpus() -> None:
    """`wacc check` runs the structural family, and the report's frozen corpus holds its cells
    (so `wacc report` and the gate's corpus keys judge malformed gradients too: one verdict)."""
    from wacc.report.corpus import build_corpus

    assert "structural" in FAMILIES and "structural" in CORPUS_FAMILIES
    assert any(entry.family == "structural" for entry in build_corpus(size="quick"))


def test_a_fault_round_trips_through_json_version_3() -> None:
    """A scenario with a fault is written as version 3 and read back identical; the fault is
    part of the scenario's identity."""
    scenario = fault_scenario("broadcast", 0.0, "mean")
    text = to_json(scenario)
    assert json.loads(text)["version"] == JSON_VERSION_STRUCTURAL
    assert json.loads(text)["steps"][1]["fault"] == {"kind": "broadcast", "name": "w"}
    assert scenarios_identical(from_json(text), scenario)
    other = fault_scenario("reshaped", 0.0, "mean")
    assert not scenarios_identical(other, scenario)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d.update(version=2), r"steps\[1\]\['fault'\]: unknown field"),
        (lambda d: d["steps"][1]["fault"].update(kind="wrong_size"), "wrong_size"),
        (lambda d: d["steps"][1]["fault"].update(name="c"), r"steps\[1\]\.fault: .*needs"),
        (lambda d: d["steps"][1]["fault"].update(name="nope"), "not a tracked parameter"),
        (lambda d: d["steps"][1]["grads"].update(w=None), "needs the step's gradient values"),
        (lambda d: d["steps"][1]["fault"].update(extra=1), "extra"),
    ],
)
def test_from_json_refuses_a_fault_that_does_not_apply(edit: object, fragment: str) -> None:
    """A fault in a version-2 file, of an unknown kind, on a parameter it does not apply to
    (a broadcast of (1, 2, 1, 2) is fine, of a shape without a dimension above 1 not: here a
    transposed view of a rank-4 one), on an unknown name, or on a step without the name's
    values is a ScenarioError naming the field."""
    scenario = fault_scenario("transposed", 1.0, "sum")
    document = json.loads(to_json(scenario))
    edit(document)  # type: ignore[operator]
    with pytest.raises(ScenarioError, match=fragment):
        from_json(json.dumps(document))


def test_check_finds_a_planted_structural_bug_and_its_replay_reproduces_it(
    tmp_path: Path,
) -> None:
    """`wacc check --family structural` on an accumulator that adds a broadcastable gradient
    exits 1 and writes a finding that `wacc replay` reproduces (exit 1), and that wacc_torch
    replays clean (exit 0)."""
    impl = "tests.wacc.impls:broadcast_accepted"
    result = wacc(
        "check", impl, "--dtype", "float32", "--family", "structural", "--examples", "100",
        "--out", str(tmp_path), "--quiet",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "expected ParameterMismatchError, got None" in result.stdout
    (finding,) = tmp_path.glob("divergence-*.json")
    steps = from_json(finding.read_text(encoding="utf-8")).steps
    assert any(isinstance(s, Accumulate) and s.fault and s.fault.kind == "broadcast" for s in steps)
    replay = wacc("replay", str(finding), "--impl", impl)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    clean = wacc("replay", str(finding))
    assert clean.returncode == 0, clean.stdout + clean.stderr


def test_the_gate_runs_every_check_family_and_the_baseline_has_them() -> None:
    """`wacc gate` runs every family `wacc check` runs, structural included (one verdict for
    one implementation), and the committed baseline (reports/baseline.json) was made with them:
    its check keys are exactly the gate's."""
    from wacc.gate.measure import units

    baseline = json.loads((REPO / "reports" / "baseline.json").read_text(encoding="utf-8"))
    checked = {key for key in baseline["entries"] if key.endswith("/check")}
    gated = {unit.key for unit in units([])}
    assert {key.split("/")[1] for key in gated} == set(family_names())
    assert gated == checked
