"""Tests of wacc_ref.oracles: the reference run, trace comparison, invariants, step-local oracle."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest

from tests.wacc_ref.scenario_support import (
    assert_array_bits,
    make_scenario,
    special_scenario,
)
from wacc_ref import formats
from wacc_ref.display import value_text
from wacc_ref.errors import (
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    WeightedAccumulationError,
    ZeroTotalWeightError,
)
from wacc_ref.faults import Fault
from wacc_ref.oracles import (
    found_inf_violations,
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
    ScalerOptions,
    Scenario,
    UpdateScaler,
    without_interruptions,
)
from wacc_ref.traces import (
    FinishOutcome,
    ScalerSnapshot,
    ScenarioTrace,
    StepOutcome,
)

# --------------------------------------------------------------------------------------------
# Running scenarios on the reference
# --------------------------------------------------------------------------------------------


def _hand_scenario() -> Scenario:
    """float32, S = 2, one parameter w of 2 elements; every outcome is derived by hand below."""
    return make_scenario(
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
        assert_array_bits(pending["w"], [4.0, 0.0], f"step {index} pending")
    checkpoint_record = trace.outcomes[2].record
    assert checkpoint_record is not None and checkpoint_record.issued == 2
    mean = trace.outcomes[6].result
    assert mean is not None and mean.normalized and mean.weight == 8.0 and mean.issued == 3
    assert_array_bits(dict(mean.grads)["w"], [0.25, 0.0], "finish_mean")
    sums = trace.outcomes[9].result
    assert sums is not None and not sums.normalized and sums.weight == 0.0
    assert dict(sums.grads) == {"w": None}
    assert trace.outcomes[6].state.param_names == ("w",)  # the tracked set stays bound
    assert trace_violations(trace) == []


def test_run_reference_mean_uses_the_converted_weight() -> None:
    """bfloat16 mean: weight 1001 counts as 1000 in W and in the product (semantics §6)."""
    scenario = make_scenario(
        (Accumulate.of("mean", 1001.0, {"w": [1.0, 0.5]}), Finish("mean")),
        work_dtype="bfloat16",
        grad_dtype="bfloat16",
        loss_scale=1.0,
    )
    trace = run_reference(scenario)
    assert trace.outcomes[0].state.total_weight == 1000.0
    assert_array_bits(dict(trace.outcomes[0].state.pending)["w"], [1000.0, 500.0], "pending")
    result = trace.outcomes[1].result
    assert result is not None
    assert_array_bits(dict(result.grads)["w"], [1.0, 0.5], "finish_mean")


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
        trace = run_reference(
            make_scenario(steps, fused=fused, loss_scale=1.0), fused_variant=variant
        )
        result = trace.outcomes[2].result
        assert result is not None
        assert_array_bits(dict(result.grads)["w"], [expected, 0.0], f"{fused=} {variant}")


def test_run_reference_exact_mode_gives_the_real_result_rounded_once() -> None:
    """exact mode: finish_mean equals (Σ g)/S/W of the unconverted gradients, rounded once."""
    g1, g2 = 1.0 + 2.0**-30, 3.0  # float64 gradients: the exact mode uses them unconverted
    scenario = make_scenario(
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
    assert_array_bits(dict(result.grads)["w"], expected, "exact finish_mean")
    assert trace_violations(trace) == []


def test_mid_window_restore_is_bit_identical_to_the_uninterrupted_run() -> None:
    """Checkpoint + restore in the middle of a window changes no finish result (semantics §9)."""
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
    interrupted = make_scenario(steps, work_dtype="float16", grad_dtype="float16", loss_scale=8.0)
    plain = without_interruptions(interrupted)
    assert [s.op for s in plain.steps] == ["accumulate_mean", "accumulate_mean", "finish_mean"]
    got = [o.result for o in run_reference(interrupted) if o.result is not None]
    want = [o.result for o in run_reference(plain) if o.result is not None]
    assert len(got) == len(want) == 1
    assert got[0].differences(want[0], what="finish_mean") == []


def test_run_reference_is_deterministic() -> None:
    """Two runs of the same scenario give identical traces (keys equal, no differences)."""
    first, second = run_reference(special_scenario()), run_reference(special_scenario())
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
    assert (
        len(lines) == 1
        and "step 6 (finish_mean)" in lines[0]
        and "-0.0 (-0x0.0000000000000p+0)" in lines[0]
    )
    nan_scenario = make_scenario(
        (Accumulate.of("sum", 1.0, {"w": [math.nan, 1.0]}), Finish("sums"))
    )
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


def test_trace_differences_pins_mismatch_lines_and_stops_at_limit() -> None:
    """A missing step, another op or another index are each one exact line (the comparison stops
    at a step mismatch); at most ``limit`` lines (20 by default) come back, and once a step brings
    them to ``limit`` the later outcomes are not read."""
    trace = run_reference(_hand_scenario())

    def edited(position: int, **changes: object) -> ScenarioTrace:
        outcomes = list(trace.outcomes)
        outcomes[position] = dataclasses.replace(outcomes[position], **changes)  # type: ignore[arg-type]
        return ScenarioTrace(outcomes=tuple(outcomes))

    shorter = ScenarioTrace(outcomes=trace.outcomes[:-1])
    assert trace_differences(trace, shorter) == ["trace length: expected 10 steps, got 9"]
    assert trace_differences(trace, edited(1, op="accumulate_mean")) == [
        "step 1 (accumulate_sum): got step 1 (accumulate_mean)"
    ]
    assert trace_differences(trace, edited(1, index=0)) == [
        "step 1 (accumulate_sum): got step 0 (accumulate_sum)"
    ]
    step = Accumulate.of("sum", 1.0, {"w": [1.0] * 15})
    scenario = make_scenario((step, step), parameters=(("w", (15,)),))
    expected = run_reference(scenario)
    # Both steps differ in all 15 elements: buf [1] * 15 then [2] * 15 against [3] * 15.
    tampered = _replace_state_pending(
        _replace_state_pending(expected, 0, "w", [3.0] * 15), 1, "w", [3.0] * 15
    )
    line = "step {} (accumulate_sum) state.pending['w'][flat {}]: expected {}, got {}"
    one, two, three = (value_text(v, "float32") for v in (1.0, 2.0, 3.0))
    every = [line.format(0, i, one, three) for i in range(15)]
    every += [line.format(1, i, two, three) for i in range(15)]
    assert trace_differences(expected, tampered) == every[:20]
    assert trace_differences(expected, tampered, limit=7) == every[:7]
    assert trace_differences(expected, tampered, limit=100) == every
    unreadable = dataclasses.replace(tampered.outcomes[1], state=None)  # type: ignore[arg-type]
    cut = ScenarioTrace(outcomes=(tampered.outcomes[0], unreadable))
    assert trace_differences(expected, cut, limit=15) == every[:15]


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


def _float16_overflow() -> Scenario:
    """float16, S = 1: two finite gradients of 40000 whose sum overflows (65504 is the top)."""
    return make_scenario(
        (
            Accumulate.of("sum", 1.0, {"w": [40000.0, 1.0]}),
            Accumulate.of("sum", 1.0, {"w": [40000.0, 1.0]}),
            Finish("sums"),
            Accumulate.of("sum", 1.0, {"w": [1.0, 2.0]}),
            Finish("mean"),
        ),
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=1.0,
    )


def test_the_reference_reports_found_inf_of_its_own_finished_values() -> None:
    """The reference's finish results carry found_inf (semantics §7): True for the sums whose
    addition overflowed float16 although no gradient was infinite, False for a clean mean, and
    its trace has no found_inf violation."""
    trace = run_reference(_float16_overflow())
    overflowed, clean = trace.outcomes[2].result, trace.outcomes[4].result
    assert overflowed is not None and overflowed.found_inf is True
    assert math.isinf(dict(overflowed.grads)["w"][0])  # type: ignore[index]
    assert clean is not None and clean.found_inf is False
    assert trace_violations(trace) == [] and found_inf_violations(trace) == []


def test_a_found_inf_that_misdescribes_its_gradients_is_a_violation() -> None:
    """found_inf False over an inf sum, or True over finite means, is reported at its step;
    a result that reports nothing (None) is not judged here."""
    outcomes = list(run_reference(_float16_overflow()).outcomes)
    for index, wrong in ((2, False), (4, True), (2, None)):
        changed = list(outcomes)
        result = changed[index].result
        assert result is not None
        changed[index] = dataclasses.replace(
            changed[index], result=dataclasses.replace(result, found_inf=wrong)
        )
        lines = found_inf_violations(ScenarioTrace(outcomes=tuple(changed)))
        assert lines == trace_violations(ScenarioTrace(outcomes=tuple(changed)))
        if wrong is None:
            assert lines == []
        else:
            op = "finish_sums" if index == 2 else "finish_mean"
            held = "hold" if index == 2 else "hold no"
            assert lines == [
                f"step {index} ({op}): found_inf is {wrong}, but the finished gradients "
                f"{held} NaN or ±inf"
            ]


def test_trace_differences_compare_found_inf_only_when_both_report_it() -> None:
    """Two results that differ only in found_inf differ (named found_inf); one that reports
    None is compared on everything else."""
    trace = run_reference(_float16_overflow())
    result = trace.outcomes[2].result
    assert result is not None
    flipped = dataclasses.replace(result, found_inf=False)
    assert flipped.key() != result.key()
    assert result.differences(flipped, what="r") == ["r.found_inf: expected True, got False"]
    assert result.differences(dataclasses.replace(result, found_inf=None), what="r") == []


def _corrupted_restore_raising(error: str | None) -> ScenarioTrace:
    """The hand scenario's trace with its corrupted restore (step 3) raising ``error``."""
    outcomes = list(run_reference(_hand_scenario()).outcomes)
    corrupted = outcomes[3]
    assert corrupted.op == "restore_corrupted" and corrupted.error == "RecordError"
    outcomes[3] = dataclasses.replace(corrupted, error=error)
    return ScenarioTrace(outcomes=tuple(outcomes))


# The semantics' error classes (§11) other than RecordError, and what the judge records for an
# exception outside them.
OTHER_REFUSALS = (
    *(
        cls.__name__
        for cls in (
            InvalidLossScaleError,
            InvalidWeightError,
            ParameterMismatchError,
            ZeroTotalWeightError,
            WeightedAccumulationError,
        )
    ),
    "unexpected ValueError",
)


def test_trace_violations_requires_record_error_for_a_corrupted_restore() -> None:
    """By default a corrupted restore must raise RecordError (semantics §9): any other class,
    another §11 error included, is a violation naming the step and the class."""
    assert trace_violations(_corrupted_restore_raising("RecordError")) == []
    for error in OTHER_REFUSALS:
        lines = trace_violations(_corrupted_restore_raising(error))
        assert lines == [f"step 3 (restore_corrupted): expected RecordError, got {error}"], error


def test_trace_violations_accepts_exactly_the_refusals_it_is_given() -> None:
    """With ``refusals`` (the judge's §11 family for opaque records), a corrupted restore raising
    any of them holds and one raising anything else, or nothing, is a violation."""
    family = ("RecordError", *OTHER_REFUSALS[:-1])
    for allowed in family:
        assert trace_violations(_corrupted_restore_raising(allowed), refusals=family) == [], allowed
    for refused in ("unexpected ValueError", None):
        lines = trace_violations(_corrupted_restore_raising(refused), refusals=family)
        assert len(lines) == 1 and lines[0].startswith("step 3 (restore_corrupted): expected "), (
            lines
        )
        assert lines[0].endswith(f", got {refused}") and all(name in lines[0] for name in family)


def _edited(trace: ScenarioTrace, position: int, **changes: object) -> ScenarioTrace:
    """``trace`` with the fields ``changes`` of outcome ``position`` replaced."""
    outcomes = list(trace.outcomes)
    outcomes[position] = dataclasses.replace(outcomes[position], **changes)  # type: ignore[arg-type]
    return ScenarioTrace(outcomes=tuple(outcomes))


def _two_checkpoints() -> Scenario:
    """float32, S = 2: buf [1, 2] and issued 1 at the first checkpoint, buf [5, 10] and issued 2
    at the second, then a restore (of the second) and a finish."""
    return make_scenario(
        (
            Accumulate.of("sum", 1.0, {"w": [1.0, 2.0]}),
            Checkpoint(),
            Accumulate.of("sum", 3.0, {"w": [4.0, 8.0]}),
            Checkpoint(),
            Restore(),
            Finish("sums"),
        )
    )


def test_trace_violations_names_each_checkpoint_break_and_keeps_earlier_lines() -> None:
    """A checkpoint record that differs from its state, and a later checkpoint that changed the
    state (so that its record, unchanged, differs from it too), are each a line naming the step
    and the field, in step order; no check drops the lines found before it (semantics §9)."""
    trace = run_reference(_two_checkpoints())
    assert trace_violations(trace) == []
    first_record, second_state = trace.outcomes[1].record, trace.outcomes[3].state
    assert first_record is not None and first_record.issued == 1 and second_state.issued == 2
    broken = _edited(trace, 1, record=dataclasses.replace(first_record, issued=7))
    broken = _edited(broken, 3, state=dataclasses.replace(second_state, issued=5, checksum=None))
    assert trace_violations(broken) == [
        "step 1 (checkpoint) record.issued: expected 1, got 7",
        "step 3 (checkpoint) changed state.issued: expected 2, got 5",
        "step 3 (checkpoint) record.issued: expected 5, got 2",
    ]


def test_trace_violations_compares_a_restore_with_the_latest_checkpoint_record() -> None:
    """A restore that did not raise must give exactly the latest checkpoint's record: a restored
    state with another ``issued`` (that of the first checkpoint) is one line naming the restore
    and the field.  A restore that raised is judged only against the state before it."""
    trace = run_reference(_two_checkpoints())
    restored = trace.outcomes[4].state
    assert restored.issued == 2
    drifted = dataclasses.replace(restored, issued=1, checksum=None)
    assert trace_violations(_edited(trace, 4, state=drifted)) == [
        "step 4 (restore) restored state.issued: expected 2, got 1"
    ]
    assert trace_violations(_edited(trace, 4, state=drifted, error="RecordError")) == [
        "step 4 (restore) raised but changed state.issued: expected 2, got 1"
    ]


def test_trace_violations_reports_a_checkpoint_without_a_record() -> None:
    """A checkpoint that did not raise but gave no record is one line naming the step; the
    restore after it then has no record to be compared with, and is not compared."""
    trace = run_reference(_hand_scenario())
    assert trace.outcomes[2].op == "checkpoint" and trace.outcomes[4].op == "restore"
    assert trace_violations(_edited(trace, 2, record=None)) == ["step 2 (checkpoint): no record"]


def test_trace_violations_lists_the_allowed_refusals_in_order() -> None:
    """With two refusals, a corrupted restore that raised neither reads 'expected one of A, B,
    got X': the refusals in the order given, separated by a comma and a space."""
    refusals = ("RecordError", "ZeroTotalWeightError")
    assert trace_violations(_corrupted_restore_raising(None), refusals=refusals) == [
        "step 3 (restore_corrupted): expected one of RecordError, ZeroTotalWeightError, got None"
    ]


def test_trace_differences_names_skipped_result_and_record_differences() -> None:
    """A different ``skipped`` flag, a missing finish result, and a checkpoint whose state and
    record both differ are reported by lines naming the step and the field; a step keeps all of
    its lines (the state's and the record's)."""
    trace = run_reference(_hand_scenario())
    assert trace_differences(trace, _edited(trace, 3, skipped=True)) == [
        "step 3 (restore_corrupted): skipped expected False, got True"
    ]
    assert trace_differences(trace, _edited(trace, 6, result=None)) == [
        "step 6 (finish_mean): result expected True, got None"
    ]
    checkpoint = trace.outcomes[2]
    assert checkpoint.record is not None and checkpoint.state.issued == 2
    both = _edited(
        trace,
        2,
        state=dataclasses.replace(checkpoint.state, issued=3, checksum=None),
        record=dataclasses.replace(checkpoint.record, issued=3),
    )
    assert trace_differences(trace, both) == [
        "step 2 (checkpoint) state.issued: expected 2, got 3",
        "step 2 (checkpoint) record.issued: expected 2, got 3",
    ]


def _refusals_scenario() -> Scenario:
    """Step 0 is due InvalidWeightError then ParameterMismatchError (a negative weight with an
    int64 gradient), step 1 nothing, step 2 InvalidWeightError only."""
    int64 = Fault("int64", "w")
    return make_scenario(
        (
            Accumulate("sum", -1.0, (("w", (1.0, 2.0)),), fault=int64),
            Accumulate.of("sum", 1.0, {"w": [1.0, 2.0]}),
            Accumulate.of("mean", -1.0, {"w": [1.0, 2.0]}),
        )
    )


def test_trace_differences_note_a_refusal_of_a_class_that_is_not_due() -> None:
    """Where the reference refuses with one §11 class and the other trace raised another §11
    class that the step is not due at all, the error line ends "(no X is due at this step)" (a
    check that misfired); no note where the class raised is due (if not first), where the
    reference raised nothing, or where what was raised is not a §11 class."""
    trace = run_reference(_refusals_scenario())
    assert [o.due for o in trace.outcomes] == [
        ("InvalidWeightError", "ParameterMismatchError"),
        (),
        ("InvalidWeightError",),
    ]

    def raising(position: int, error: str) -> list[str]:
        outcomes = list(trace.outcomes)
        outcomes[position] = dataclasses.replace(outcomes[position], error=error)
        return trace_differences(trace, ScenarioTrace(outcomes=tuple(outcomes)))

    assert raising(2, "ParameterMismatchError") == [
        "step 2 (accumulate_mean): error expected InvalidWeightError, got ParameterMismatchError"
        " (no ParameterMismatchError is due at this step)"
    ]
    assert raising(0, "ParameterMismatchError") == [  # due, after the weight's
        "step 0 (accumulate_sum): error expected InvalidWeightError, got ParameterMismatchError"
    ]
    assert raising(1, "ParameterMismatchError") == [  # nothing refused: not a refusal's note
        "step 1 (accumulate_sum): error expected None, got ParameterMismatchError"
    ]
    assert raising(2, "RuntimeError") == [  # not a §11 class
        "step 2 (accumulate_mean): error expected InvalidWeightError, got RuntimeError"
    ]


def test_a_refusal_the_reference_does_not_judge_has_no_due_and_no_note() -> None:
    """In exact mode a NaN gradient is refused with ExactModeError, a check refusals_due does
    not judge: the step's ``due`` is None (not known, not "nothing due"), and another §11 class
    raised there gets no "(no X is due ...)" note."""
    scenario = make_scenario((Accumulate.of("sum", 1.0, {"w": [math.nan, 1.0]}),))
    trace = run_reference(scenario, mode="exact")
    assert trace.outcomes[0].error == "ExactModeError"
    assert trace.outcomes[0].due is None
    other = dataclasses.replace(trace.outcomes[0], error="ParameterMismatchError")
    assert trace_differences(trace, ScenarioTrace(outcomes=(other,))) == [
        "step 0 (accumulate_sum): error expected ExactModeError, got ParameterMismatchError"
    ]


def test_trace_differences_name_a_missing_scaler_and_keep_the_lines_before_a_scaler_line() -> None:
    """A scaler snapshot where none is expected is a line naming the step, "scaler" and what
    came instead; where both have one, its differences come after the step's other lines (an
    error mismatch), which stay. Scenario: float32, S = 2, default scaler (backoff 0.5,
    hysteresis 1); an overflow reported at update_scaler backs the scale off to 2 * 0.5 = 1."""
    scenario = make_scenario(
        (Accumulate.of("sum", 1.0, {"w": [1.0, 2.0]}), Finish("sums"), UpdateScaler(True)),
        scaler=ScalerOptions(),
    )
    trace = run_reference(scenario)
    update = trace.outcomes[2]
    assert update.scaler is not None and update.scaler.scale == 1.0
    lines = trace_differences(trace, _edited(trace, 2, scaler=None))
    assert len(lines) == 1 and lines[0].startswith("step 2 (update_scaler): scaler expected ")
    assert lines[0].endswith("got None"), lines
    wrong = ScalerSnapshot(applied=update.scaler.applied, scale=0.5)
    lines = trace_differences(trace, _edited(trace, 2, error="InvalidWeightError", scaler=wrong))
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "step 2 (update_scaler): error expected None, got InvalidWeightError"
    )
    assert lines[1].startswith("step 2 (update_scaler) scaler.scale: "), lines
    assert (1.0).hex() in lines[1] and (0.5).hex() in lines[1], lines


def test_run_reference_labels_its_trace_and_validates_precision() -> None:
    """The trace names the reference, its mode and its fused variant ('wacc_ref/<mode>/<variant>');
    ``precision`` goes to the accumulator, which refuses one below 2 bits or not an int with a
    message naming the value."""
    scenario = _two_checkpoints()
    assert run_reference(scenario).implementation == "wacc_ref/emulated/fma"
    exact = run_reference(scenario, mode="exact", fused_variant="two_step", precision=2)
    assert exact.implementation == "wacc_ref/exact/two_step"
    with pytest.raises(ValueError, match=r"precision.*got 1$"):
        run_reference(scenario, mode="exact", precision=1)
    with pytest.raises(TypeError, match=r"precision.*got 'many'"):
        run_reference(scenario, precision="many")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The step-local oracle
# --------------------------------------------------------------------------------------------


def _fp16_fused_scenario() -> Scenario:
    """fp16 fused mean: buf = 62, then c = -62 with w_D = 1057.  Exactly, buf + c*w_D = 62 - 65534
    = -65472 = -2046 * 32, a float16 value; but round_16(c*w_D) = round_16(-65534) overflows
    (|x| >= 65520), so the two-step result is -inf while FMA and op-rounded give -65472."""
    return make_scenario(
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
    but each passes the stepwise oracle (semantics §6 allows both)."""
    scenario = _fp16_fused_scenario()
    op_rounded = run_reference(scenario, fused_variant="op_rounded")
    two_step = run_reference(scenario, fused_variant="two_step")
    assert_array_bits(dict(op_rounded.outcomes[1].state.pending)["w"], [-65472.0, 1.0], "op")
    assert_array_bits(dict(two_step.outcomes[1].state.pending)["w"], [-math.inf, 1.0], "two")
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
    # A state edited by hand carries no checksum (the reference would refuse a stale one).
    state = dataclasses.replace(old.state, pending=pending, checksum=None)
    outcomes[index] = dataclasses.replace(old, state=state)
    return ScenarioTrace(outcomes=tuple(outcomes))


def test_stepwise_oracle_refuses_a_fused_result_outside_the_allowed_set() -> None:
    """A fused mean element that is none of the three semantics §6 results is reported with the
    allowed values; the next step is judged from the actual (tampered) state."""
    scenario = _fp16_fused_scenario()
    tampered = _replace_state_pending(run_reference(scenario), 1, "w", [-65440.0, 1.0])
    lines = stepwise_differences(scenario, tampered)
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 1 (accumulate_mean) state.pending['w'][flat 0]: got ")
    assert "-0x1.ff8p+15" in lines[0] and "'-inf'" in lines[0], lines[0]  # in float16's width
    # finish_sums is judged from the tampered buffer, which the actual trace did not hand over.
    assert lines[1].startswith(
        "step 2 (finish_sums) result.grads['w'][flat 0]: expected -65440.0 (-0x1.ff4"
    )


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
        "step 0 (accumulate_sum) state.pending['w'][flat 1]: expected 0.0 (0x0.000000p+0), "
        "got -0.0 (-0x0.000000p+0)",
        # judged from the actual -0.0: -0.0 + -0.0 is -0.0, but the trace says +0.0
        "step 1 (accumulate_sum) state.pending['w'][flat 1]: expected -0.0 (-0x0.000000p+0), "
        "got 0.0 (0x0.000000p+0)",
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


def test_stepwise_oracle_judges_every_fused_buffer_after_a_missing_one() -> None:
    """A fused mean step whose trace lacks one touched buffer is reported as a name difference
    (not a crash), and the touched buffers after it are still judged element by element."""
    scenario = make_scenario(
        (
            Accumulate.of("mean", 1.0, {"a": [1.0, 2.0], "w": [62.0, 1.0]}),
            # w_D = 1057 (11 bits, exact in float16): a = [1 + 0.5 * 1057, 2] = [529.5, 2];
            # w as in _fp16_fused_scenario: allowed -65472 (FMA, op-rounded) or -inf (two-step).
            Accumulate.of("mean", 1057.0, {"a": [0.5, 0.0], "w": [-62.0, 0.0]}),
            Finish("sums"),
        ),
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=1.0,
        fused=True,
        parameters=(("a", (2,)), ("w", (2,))),
    )
    trace = run_reference(scenario)
    assert_array_bits(dict(trace.outcomes[1].state.pending)["a"], [529.5, 2.0], "a")
    outcomes = list(trace.outcomes)
    state = outcomes[1].state
    pending = (("w", np.array([-65440.0, 1.0])),)  # "a" dropped, w[0] outside the allowed set
    outcomes[1] = dataclasses.replace(
        outcomes[1], state=dataclasses.replace(state, pending=pending, checksum=None)
    )
    lines = stepwise_differences(scenario, ScenarioTrace(outcomes=tuple(outcomes)))
    allowed = sorted([value_text(-65472.0, "float16"), "-inf"])
    assert lines[:2] == [
        "step 1 (accumulate_mean) state.pending names: expected ['a', 'w'], got ['w']",
        f"step 1 (accumulate_mean) state.pending['w'][flat 0]: got "
        f"{value_text(-65440.0, 'float16')}, allowed {allowed} (buf "
        f"{value_text(62.0, 'float16')}, g {value_text(-62.0)}, w_D "
        f"{value_text(1057.0, 'float16')})",
    ], lines


def test_stepwise_oracle_reports_a_trace_that_does_not_follow_the_scenario() -> None:
    """A short trace, a step with another op or index, a checkpoint without a record and a state
    the reference cannot load are each reported by a line naming the step; the last three stop
    the comparison there."""
    scenario = _hand_scenario()
    trace = run_reference(scenario)
    assert len(trace) == 10 and stepwise_differences(scenario, trace) == []

    def edited(position: int, **changes: object) -> ScenarioTrace:
        outcomes = list(trace.outcomes)
        outcomes[position] = dataclasses.replace(outcomes[position], **changes)  # type: ignore[arg-type]
        return ScenarioTrace(outcomes=tuple(outcomes))

    short = ScenarioTrace(outcomes=trace.outcomes[:2])
    assert stepwise_differences(scenario, short) == ["trace length: expected 10 steps, got 2"]
    assert stepwise_differences(scenario, edited(1, op="accumulate_mean")) == [
        "step 1 (accumulate_sum): got step 1 (accumulate_mean)"
    ]
    assert stepwise_differences(scenario, edited(1, index=0)) == [
        "step 1 (accumulate_sum): got step 0 (accumulate_sum)"
    ]
    assert stepwise_differences(scenario, edited(2, record=None)) == [
        "step 2 (checkpoint): record present expected True",
        "step 2 (checkpoint): the actual trace has no record for this checkpoint",
    ]
    # After step 0 (weight 1): issued 1, W = 1.0; zero_weight = issued claims every batch had
    # weight 0, which the reference's record validation refuses (RecordError).
    state = trace.outcomes[0].state
    assert state.issued == 1 and state.zero_weight == 0 and state.total_weight == 1.0
    inconsistent = dataclasses.replace(state, zero_weight=1, checksum=None)
    assert stepwise_differences(scenario, edited(0, state=inconsistent)) == [
        "step 0 (accumulate_sum) state.zero_weight: expected 0, got 1",
        "step 1 (accumulate_sum): the state before it does not load into the reference: "
        "total_weight is 1.0 but every one of the 1 issued batches had weight 0 "
        "(zero_weight == issued)",
    ]


def test_stepwise_oracle_returns_at_most_limit_lines() -> None:
    """30 differing elements give 30 differences; the oracle returns the first ``limit`` of them
    (20 by default), in element order."""
    scenario = make_scenario(
        (Accumulate.of("sum", 1.0, {"w": [1.0] * 30}),), parameters=(("w", (30,)),)
    )
    tampered = _replace_state_pending(run_reference(scenario), 0, "w", [2.0] * 30)
    line = "step 0 (accumulate_sum) state.pending['w'][flat {}]: expected {}, got {}"
    expected = [
        line.format(i, value_text(1.0, "float32"), value_text(2.0, "float32")) for i in range(30)
    ]
    assert stepwise_differences(scenario, tampered) == expected[:20]
    assert stepwise_differences(scenario, tampered, limit=5) == expected[:5]
    assert stepwise_differences(scenario, tampered, limit=100) == expected


def test_stepwise_oracle_keeps_the_lines_of_earlier_fused_steps() -> None:
    """Differences found at one fused mean step are kept when later fused steps are judged."""
    scenario = _fp16_fused_scenario()
    tampered = _replace_state_pending(run_reference(scenario), 0, "w", [62.0, 3.0])
    lines = stepwise_differences(scenario, tampered)

    # Step 0: buf 0, g 1, w_D 1: every §6 result is 1.  Step 1 from the tampered buf 3 with g 0:
    # every result is 3, but the trace (untampered there) says 1.
    def h(value: float) -> str:
        return value_text(value, "float16")

    assert lines == [
        f"step 0 (accumulate_mean) state.pending['w'][flat 1]: got {h(3.0)}, "
        f"allowed {[h(1.0)]} (buf {h(0.0)}, g {value_text(1.0)}, w_D {h(1.0)})",
        f"step 1 (accumulate_mean) state.pending['w'][flat 1]: got {h(1.0)}, "
        f"allowed {[h(3.0)]} (buf {h(3.0)}, g {value_text(0.0)}, w_D {h(1057.0)})",
    ]


def test_stepwise_oracle_stops_reading_the_trace_once_limit_lines_are_found() -> None:
    """When a step brings the differences to exactly ``limit``, the oracle stops there: the
    later outcomes are not read, so even an unreadable one (no state) does not matter."""
    step = Accumulate.of("sum", 1.0, {"w": [1.0] * 20})
    scenario = make_scenario((step, step), parameters=(("w", (20,)),))
    tampered = _replace_state_pending(run_reference(scenario), 0, "w", [2.0] * 20)
    unreadable = dataclasses.replace(tampered.outcomes[1], state=None)  # type: ignore[arg-type]
    trace = ScenarioTrace(outcomes=(tampered.outcomes[0], unreadable))
    line = "step 0 (accumulate_sum) state.pending['w'][flat {}]: expected {}, got {}"
    assert stepwise_differences(scenario, trace) == [
        line.format(i, value_text(1.0, "float32"), value_text(2.0, "float32")) for i in range(20)
    ]
