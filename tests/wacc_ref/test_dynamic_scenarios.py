"""Dynamic-scaling scenarios (semantics §13 in the judge): their steps, JSON, reference run and
generation."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, Phase, find, settings

from wacc_ref.oracles import run_reference, stepwise_differences, trace_differences
from wacc_ref.scaler import ReferenceLossScaler
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    ScalerOptions,
    Scenario,
    ScenarioError,
    SetLossScale,
    UpdateScaler,
    from_json,
    is_dynamic,
    scenarios_identical,
    to_json,
    without_interruptions,
)
from wacc_ref.strategies import dynamic_scenarios, scenarios

# find(): derandomized (found on every run), the first match is enough (no shrinking).
FIND = settings(
    database=None,
    derandomize=True,
    max_examples=1500,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def _loop(*steps: object, scaler: ScalerOptions | None = None, scale: float = 1024.0) -> Scenario:
    return Scenario(
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=scale,
        fused=False,
        parameters=(("w", (2,)),),
        steps=tuple(steps),
        scaler=ScalerOptions(growth_interval=2, hysteresis=2) if scaler is None else scaler,
    )


def _window(scale: float, values: tuple[float, float], *, found_inf: bool) -> list[object]:
    return [
        SetLossScale(scale),
        Accumulate.of("mean", 3.0, {"w": values}),
        Finish("mean"),
        UpdateScaler(found_inf),
    ]


def test_reference_decisions_and_scales_follow_the_scaler_hand_derived() -> None:
    """Interval 2, hysteresis 2 from 1024 (float16): clean, clean -> grow to 2048; overflow ->
    absorbed (2048 kept); overflow -> back off to 1024; each decision is update()'s return and
    the next scale is read right after it, bit for bit."""
    scenario = _loop(
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        *_window(2048.0, (65504.0, 65504.0), found_inf=True),
        *_window(2048.0, (65504.0, 65504.0), found_inf=True),
    )
    trace = run_reference(scenario)
    updates = [(o.scaler.applied, o.scaler.scale) for o in trace if o.op == "update_scaler"]
    assert updates == [(True, 1024.0), (True, 2048.0), (False, 2048.0), (False, 1024.0)]
    # the overflowing windows' own results say so: 3 * 65504 overflows float16
    finishes = [o.result for o in trace if o.op == "finish_mean"]
    assert [r.found_inf for r in finishes if r is not None] == [False, False, True, True]
    # every window ran at the scale set for it
    assert [o.state.loss_scale for o in trace if o.op == "set_loss_scale"] == [
        1024.0,
        1024.0,
        2048.0,
        2048.0,
    ]


def test_a_scale_set_mid_window_is_refused_and_changes_nothing() -> None:
    """set_loss_scale after an accumulate raises InvalidLossScaleError; the window keeps its
    scale and its buffer, and a refused invalid scale (NaN) does not change it either."""
    scenario = _loop(
        Accumulate.of("sum", 1.0, {"w": (1.0, 2.0)}),
        SetLossScale(2048.0),
        SetLossScale(math.nan),
        Finish("sums"),
        SetLossScale(0.0),
        SetLossScale(512.0),
    )
    trace = run_reference(scenario)
    assert [o.error for o in trace] == [
        None,
        "InvalidLossScaleError",
        "InvalidLossScaleError",
        None,
        "InvalidLossScaleError",
        None,
    ]
    assert trace.outcomes[2].state.key() == trace.outcomes[0].state.key()
    assert [o.state.loss_scale for o in trace] == [1024.0] * 5 + [512.0]


def test_restore_resumes_at_the_checkpoint_scale_with_the_scaler_of_that_moment() -> None:
    """A restore builds the accumulator at the scale in force at the checkpoint (not the
    scenario's initial one) and a scaler with the state of that moment: the decisions after it
    equal those of the run without the interruption, bit for bit."""
    scenario = _loop(
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        SetLossScale(2048.0),
        Accumulate.of("sum", 2.0, {"w": (1.0, -1.0)}),
        Checkpoint(),
        Restore(),
        Accumulate.of("mean", 5.0, {"w": (3.0, 0.5)}),
        Finish("mean"),
        UpdateScaler(False),
        UpdateScaler(True),
    )
    trace = run_reference(scenario)
    restore = trace.outcomes[11]
    assert restore.op == "restore" and restore.error is None
    assert restore.state.loss_scale == 2048.0
    assert restore.scaler is not None and restore.scaler.scale == 2048.0
    straight = run_reference(without_interruptions(scenario))
    kept = [o for o in trace if o.op not in ("checkpoint", "restore")]
    assert [o.key()[1:] for o in kept] == [o.key()[1:] for o in straight]


def test_the_stepwise_oracle_follows_scale_changes() -> None:
    """The step-local oracle loads each state at its own loss scale and runs the scaler: the
    reference's own trace has no difference, and a changed decision is named at its step."""
    scenario = _loop(
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        *_window(2048.0, (5.0, 6.0), found_inf=False),
        Checkpoint(),
        Restore(),
    )
    trace = run_reference(scenario)
    assert stepwise_differences(scenario, trace) == []
    wrong = _loop(
        *_window(1024.0, (1.0, 2.0), found_inf=False),
        *_window(1024.0, (1.0, 2.0), found_inf=True),
        *_window(2048.0, (5.0, 6.0), found_inf=False),
        Checkpoint(),
        Restore(),
    )
    lines = trace_differences(run_reference(wrong), trace)
    assert any("step 7 (update_scaler) scaler.applied" in line for line in lines), lines
    assert any("step 7 (update_scaler) scaler.scale" in line for line in lines), lines


def test_json_version_2_round_trips_and_version_1_is_unchanged() -> None:
    """A dynamic scenario is written as version 2 with its scaler and read back identical; a
    scenario without scaler or scale steps is written as version 1, without a scaler field."""
    dynamic = _loop(
        *_window(1024.0, (1.0, -0.0), found_inf=False),
        SetLossScale(math.inf),
        scaler=ScalerOptions(3.0, 0.3, 5, 3, min_scale=0.5, max_scale=4096.0),
    )
    text = to_json(dynamic)
    assert json.loads(text)["version"] == 2
    assert json.loads(text)["scaler"]["min_scale"] == "0x1.0000000000000p-1"
    assert scenarios_identical(from_json(text), dynamic)
    plain = Scenario("float32", "float32", 1.0, False, (("w", (1,)),), (Finish("sums"),))
    document = json.loads(to_json(plain))
    assert document["version"] == 1 and "scaler" not in document
    assert not is_dynamic(plain) and is_dynamic(dynamic)
    only_steps = Scenario("float32", "float32", 1.0, False, (("w", (1,)),), (SetLossScale(2.0),))
    assert json.loads(to_json(only_steps))["scaler"] is None
    assert scenarios_identical(from_json(to_json(only_steps)), only_steps)


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d["scaler"].update(growth_interval=0), "scaler.growth_interval"),
        (lambda d: d["scaler"].update(hysteresis=True), "scaler.hysteresis"),
        (lambda d: d["scaler"].update(growth_factor="0x1.0000000000000p-1"), "growth_factor must"),
        (lambda d: d["scaler"].update(backoff_factor="0.5"), "scaler.backoff_factor"),
        (lambda d: d["scaler"].update(max_scale="0x1.0000000000000p+9"), "max_scale"),
        (lambda d: d["scaler"].pop("min_scale"), "min_scale"),
        (lambda d: d["scaler"].update(extra=1), "extra"),
        (lambda d: d["steps"][0].update(loss_scale=2.0), "steps[0].loss_scale"),
        (lambda d: d["steps"][3].update(found_inf=0), "steps[3].found_inf"),
        (lambda d: d.update(scaler=None), "update_scaler in a scenario without a scaler"),
    ],
    ids=["interval-0", "hysteresis-true", "growth-below-1", "decimal-factor", "max-below-init",
         "missing-min", "unknown-field", "scale-not-hex", "found-inf-int", "no-scaler"],
)  # fmt: skip
def test_bad_dynamic_documents_name_the_field(edit: object, fragment: str) -> None:
    """from_json refuses a malformed scaler or dynamic step with a ScenarioError naming it."""
    document = json.loads(to_json(_loop(*_window(1024.0, (1.0, 2.0), found_inf=False))))
    edit(document)  # type: ignore[operator]
    with pytest.raises(ScenarioError, match=fragment.replace("[", r"\[").replace(".", r"\.")):
        from_json(json.dumps(document))


def test_scenario_validation_of_scaler_and_steps() -> None:
    """Options the reference scaler refuses, a bool as a scale and a non-bool found_inf are
    ScenarioErrors; update_scaler needs a scaler."""
    with pytest.raises(ScenarioError, match="scaler: backoff_factor"):
        _loop(scaler=ScalerOptions(backoff_factor=1.0))
    with pytest.raises(ScenarioError, match="scaler: init_scale 1024.0 is outside"):
        _loop(scaler=ScalerOptions(min_scale=2048.0))
    with pytest.raises(ScenarioError, match="loss_scale: must be a float"):
        SetLossScale(True)
    with pytest.raises(ScenarioError, match="found_inf must be a bool"):
        UpdateScaler(1)
    with pytest.raises(ScenarioError, match="steps\\[0\\]: update_scaler"):
        Scenario("float32", "float32", 1.0, False, (("w", (1,)),), (UpdateScaler(False),))


def _reaches(condition: object) -> Scenario:
    return find(dynamic_scenarios(), condition, settings=FIND)


def test_generation_reaches_skips_growth_and_backoff() -> None:
    """Generated loops skip an overflowing window, grow the scale and back it off, and each
    update's found_inf is the reference's own finished result's."""

    def story(scenario: Scenario) -> bool:
        trace = run_reference(scenario)
        updates = [o.scaler for o in trace if o.op == "update_scaler" and o.scaler is not None]
        scales = [u.scale for u in updates]
        return (
            any(u.applied is False for u in updates)
            and any(b > a for a, b in zip(scales, scales[1:], strict=False))
            and any(b < a for a, b in zip(scales, scales[1:], strict=False))
        )

    found = _reaches(story)
    assert story(found), to_json(found)


def test_generated_found_inf_is_the_references() -> None:
    """In a generated scenario without interruptions, every update_scaler carries the
    found_inf of the finish right before it, as the reference computes it."""

    strategy = dynamic_scenarios(max_interruptions=0)
    seen = 0

    def check(scenario: Scenario) -> bool:
        nonlocal seen
        trace = run_reference(scenario)
        for before, step in zip(trace.outcomes, scenario.steps[1:], strict=False):
            if isinstance(step, UpdateScaler):
                assert before.result is not None
                assert before.result.found_inf is step.found_inf, to_json(scenario)
                seen += 1
        return seen >= 100

    find(strategy, check, settings=FIND)
    assert seen >= 100


@pytest.mark.parametrize("case", ["mid-window", "invalid"])
def test_generation_reaches_refused_scales(case: str) -> None:
    """Generated loops set a scale in the middle of a window and ask for a scale no work
    dtype holds; both are refused (InvalidLossScaleError) by the reference."""

    def refused(scenario: Scenario) -> bool:
        for step, outcome in zip(scenario.steps, run_reference(scenario), strict=True):
            if isinstance(step, SetLossScale) and outcome.error == "InvalidLossScaleError":
                valid = math.isfinite(step.loss_scale) and step.loss_scale > 0
                if (case == "mid-window") == (valid and outcome.state.issued > 0):
                    return True
        return False

    found = _reaches(refused)
    assert refused(found), to_json(found)


def test_generation_reaches_an_overflow_a_growth_and_an_overflow_under_hysteresis() -> None:
    """With hysteresis >= 2, a generated loop overflows, grows, and overflows again (the story
    that shows whether hysteresis is restored at growth), its overflows coming from gradients
    accumulated in the windows themselves."""

    def story(scenario: Scenario) -> bool:
        if scenario.scaler is None or scenario.scaler.hysteresis < 2:
            return False
        trace = run_reference(scenario)
        updates = [o.scaler for o in trace if o.op == "update_scaler" and o.scaler is not None]
        found = [s.found_inf for s in scenario.steps if isinstance(s, UpdateScaler)]
        if len(found) != len(updates) or not any(isinstance(s, Accumulate) for s in scenario.steps):
            return False
        scales = [scenario.loss_scale] + [u.scale for u in updates]
        for i, inf in enumerate(found):
            grew = [j for j in range(i + 1, len(found)) if scales[j + 1] > scales[j]]
            if inf and grew and any(found[k] for k in range(grew[0] + 1, len(found))):
                return True
        return False

    found = _reaches(story)
    assert story(found), to_json(found)


def test_generation_reaches_a_restore_mid_window_at_a_changed_scale() -> None:
    """A generated restore lands in a window whose scale is not the initial one."""

    def restored(scenario: Scenario) -> bool:
        return any(
            o.op == "restore"
            and o.error is None
            and o.state.issued > 0
            and o.state.loss_scale != scenario.loss_scale
            for o in run_reference(scenario)
        )

    found = _reaches(restored)
    assert restored(found), to_json(found)


def test_scenarios_dynamic_is_dynamic_scenarios() -> None:
    """scenarios(dynamic=True) draws dynamic scenarios (the engine's family) in the dtypes
    asked for, every one valid with a scaler whose options the reference scaler accepts."""
    found = find(
        scenarios(work_dtypes=("bfloat16",), dynamic=True, fused=False),
        lambda s: len(s.steps) > 8,
        settings=FIND,
    )
    assert found.work_dtype == "bfloat16" and found.scaler is not None and not found.fused
    ReferenceLossScaler(found.loss_scale, **found.scaler.as_kwargs(), dtype="bfloat16")
