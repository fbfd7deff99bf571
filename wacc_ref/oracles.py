"""The reference run of a scenario and the oracles that judge any implementation's trace.

:func:`trace_differences` compares two traces exactly: same number of steps, same op, same error
class (or both None), same ``skipped``, and every number identical as a float64 bit pattern —
``+0.0`` differs from ``-0.0`` — except that every NaN equals every NaN (sign and payload are not
compared, positions are); counters and flags with ``==``; pending buffers keyed by name, so the
order in which an implementation allocated them does not matter.  An empty list means the traces
are identical.  :func:`trace_violations` checks the semantics' invariants within a single trace (a
raising step changes nothing, a corrupted restore raises ``RecordError`` or another refusal the
caller allows, a restore reproduces the checkpoint, a checkpoint changes nothing).

:func:`stepwise_differences` is the step-local form of the same comparison: before each step the
reference loads the state the *actual* trace recorded after the previous step, runs the step, and
compares.  It localizes a divergence to one step, and it is the oracle for fused scenarios: with
``fused=True`` a mean step may legitimately give any of three results per element (§6), and
PyTorch's CPU float16 ``add_(c, alpha=w)`` mixes two of them within one tensor (vectorized chunks
round in float32, the scalar tail rounds the product to float16 first), so no single
``fused_variant`` of :func:`run_reference` matches it; the stepwise oracle accepts, per element,
exactly the semantics' set.  For float32/float64 on CPU the fused result is the FMA
(``fused_variant="fma"``) and a whole-trace comparison works as well.

"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from wacc_ref import errors, formats
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.arith import fused_mean_step_accepts, fused_mean_step_candidates
from wacc_ref.corruption import applicable_corruptions, corrupt_record
from wacc_ref.display import value_text
from wacc_ref.errors import WeightedAccumulationError
from wacc_ref.scaler import ReferenceLossScaler
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    Scenario,
    SetLossScale,
    UpdateScaler,
)
from wacc_ref.traces import (
    FinishOutcome,
    RecordSnapshot,
    ScalerSnapshot,
    ScenarioTrace,
    StepOutcome,
    finish_outcome,
    record_from_snapshot,
    snapshot_record,
)

__all__ = [
    "found_inf_violations",
    "run_reference",
    "stepwise_differences",
    "trace_differences",
    "trace_violations",
]


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


def trace_violations(
    trace: ScenarioTrace, *, refusals: Collection[str] = ("RecordError",)
) -> list[str]:
    """The invariants of the semantics a single trace breaks (empty: none).

    * a step that raised left the state exactly as it was (semantics §11);
    * a checkpoint does not change the state, and its record equals the state (semantics §9);
    * a restore that did not raise gives exactly the state of the checkpoint it loaded;
    * a corrupted restore that was not skipped raised one of ``refusals``: ``RecordError`` for
      records of the §9 schema (the default); the judge passes every §11 class for an
      implementation's opaque records (semantics §12);
    * a finished result that reports ``found_inf`` says whether its own gradients hold a NaN or
      an infinity (semantics §7, §8);
    * a finished gradient is a tensor of the work dtype (§7, §8 hand over the D buffers).
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
        lines += _found_inf_violation(outcome, what=what)
        lines += _dtype_violations(outcome, what=what)
        if outcome.op == "restore_corrupted" and not outcome.skipped:
            if outcome.error not in refusals:
                names = tuple(refusals)
                expected = names[0] if len(names) == 1 else f"one of {', '.join(names)}"
                lines.append(f"{what}: expected {expected}, got {outcome.error}")
        previous = outcome.state
    return lines


def _dtype_violations(outcome: StepOutcome, *, what: str) -> list[str]:
    result = outcome.result
    if result is None:
        return []
    return [
        f"{what}: grads[{name!r}] is a {got} tensor; the finished gradients are the {work} "
        "buffers (semantics §7, §8)"
        for name, got, work in result.foreign_dtypes
    ]


def _found_inf_violation(outcome: StepOutcome, *, what: str) -> list[str]:
    result = outcome.result
    if result is None or result.found_inf is None:
        return []
    held = result.holds_non_finite()
    if result.found_inf == held:
        return []
    return [
        f"{what}: found_inf is {result.found_inf}, but the finished gradients "
        f"{'hold' if held else 'hold no'} NaN or ±inf"
    ]


def found_inf_violations(trace: ScenarioTrace) -> list[str]:
    """The finished results whose ``found_inf`` misdescribes their own gradients (semantics
    §7, §8); part of :func:`trace_violations`, and on its own for a trace whose other checks
    run on a view without the gradient values."""
    lines: list[str] = []
    for outcome in trace.outcomes:
        lines += _found_inf_violation(outcome, what=f"step {outcome.index} ({outcome.op})")
    return lines


def _reference_factory(
    scenario: Scenario, *, mode: str, fused_variant: str, precision: int
) -> Callable[[float], ReferenceAccumulator]:
    def fresh(loss_scale: float) -> ReferenceAccumulator:
        return ReferenceAccumulator(
            dtype=scenario.work_dtype,
            loss_scale=loss_scale,
            fused=scenario.fused,
            fused_variant=fused_variant,
            mode=mode,
            precision=precision,
        )

    return fresh


@dataclass
class _ReferenceRun:
    """The reference's side of a run between steps: the accumulator, the loss scale in force
    (the last one set without an error), the latest checkpoint (its record, that scale, and a
    copy of the scaler), and the scenario's scaler (None without one)."""

    accumulator: ReferenceAccumulator
    fresh: Callable[[float], ReferenceAccumulator]
    scale: float
    scaler: ReferenceLossScaler | None
    latest: Mapping[str, Any] | None = None
    latest_scale: float = 1.0
    latest_scaler: ReferenceLossScaler | None = None


def _reference_scaler(scenario: Scenario) -> ReferenceLossScaler | None:
    if scenario.scaler is None:
        return None
    return ReferenceLossScaler(
        scenario.loss_scale,
        **scenario.scaler.as_kwargs(),
        dtype=scenario.work_dtype,
    )


def _run_step(scenario: Scenario, index: int, run: _ReferenceRun) -> StepOutcome:
    """Run step ``index`` on ``run`` (which it advances: a restore makes a fresh accumulator)
    and return its outcome."""
    step = scenario.steps[index]
    params = scenario.params
    error: str | None = None
    skipped = False
    result: FinishOutcome | None = None
    record: RecordSnapshot | None = None
    scaler: ScalerSnapshot | None = None
    due: tuple[str, ...] | None = None
    try:
        if isinstance(step, Accumulate):
            accumulator = run.accumulator
            method = (
                accumulator.accumulate_sum if step.kind == "sum" else accumulator.accumulate_mean
            )
            grads = scenario.reference_grads(step)
            due = accumulator.refusals_due(
                params, step.weight, grads=grads, mean=step.kind == "mean"
            )
            method(params, step.weight, grads=grads)
        elif isinstance(step, Finish):
            finished = (
                run.accumulator.finish_sums()
                if step.kind == "sums"
                else run.accumulator.finish_mean()
            )
            result = finish_outcome(finished, list(params))
        elif isinstance(step, Checkpoint):
            run.latest = run.accumulator.state_dict()
            run.latest_scale = run.scale
            run.latest_scaler = copy.copy(run.scaler)
            record = snapshot_record(run.latest)
        elif isinstance(step, Restore):
            assert run.latest is not None  # Scenario validation: a checkpoint came first
            accumulator = run.fresh(run.latest_scale)
            accumulator.load_state_dict(run.latest, params)
            run.accumulator, run.scale = accumulator, run.latest_scale
            if run.latest_scaler is not None:
                run.scaler = copy.copy(run.latest_scaler)
                scaler = ScalerSnapshot(applied=None, scale=run.scaler.scale)
        elif isinstance(step, SetLossScale):
            run.accumulator.set_loss_scale(step.loss_scale)
            run.scale = step.loss_scale
        elif isinstance(step, UpdateScaler):
            assert run.scaler is not None  # Scenario validation: only with a scaler
            applied = run.scaler.update(step.found_inf)
            scaler = ScalerSnapshot(applied=applied, scale=run.scaler.scale)
        else:
            assert run.latest is not None
            if step.kind in applicable_corruptions(run.latest):
                run.accumulator.load_state_dict(corrupt_record(run.latest, step.kind), params)
            else:
                skipped = True
    except WeightedAccumulationError as exc:
        error = type(exc).__name__
    if due is not None and due[:1] != ((error,) if error is not None else ()):
        due = None  # raised by a check refusals_due does not judge (exact mode, environment)
    return StepOutcome(
        index=index,
        op=step.op,
        error=error,
        skipped=skipped,
        state=snapshot_record(run.accumulator.state_dict()),
        result=result,
        record=record,
        scaler=scaler,
        due=due,
    )


def run_reference(
    scenario: Scenario,
    *,
    mode: str = "emulated",
    fused_variant: str = "fma",
    precision: int = 256,
) -> ScenarioTrace:
    """Run ``scenario`` step by step on the reference accumulator and return its trace.

    Only the semantics' errors (``wacc_ref.errors.WeightedAccumulationError`` and subclasses) are
    caught and recorded; anything else propagates.  ``mode`` (``"emulated"`` or ``"exact"``),
    ``fused_variant`` (``"fma"``, ``"op_rounded"`` or ``"two_step"``, used only when the scenario
    is fused) and ``precision`` go to :class:`~wacc_ref.accumulator.ReferenceAccumulator`, which
    validates them.  In ``"exact"`` mode the snapshots show each exact value rounded once to
    float64.  A scenario with a scaler runs :class:`~wacc_ref.scaler.ReferenceLossScaler`.
    """
    fresh = _reference_factory(
        scenario, mode=mode, fused_variant=fused_variant, precision=precision
    )
    run = _ReferenceRun(
        accumulator=fresh(scenario.loss_scale),
        fresh=fresh,
        scale=scenario.loss_scale,
        scaler=_reference_scaler(scenario),
    )
    outcomes = [_run_step(scenario, index, run) for index in range(len(scenario.steps))]
    return ScenarioTrace(
        outcomes=tuple(outcomes), implementation=f"wacc_ref/{mode}/{fused_variant}"
    )


_SEMANTIC_CLASSES = frozenset(errors.__all__)  # the §11 classes, as a trace names them


def _not_due(expected: StepOutcome, raised: str | None) -> bool:
    """Whether ``raised``, a §11 class, came where the reference's step refuses with another
    class and none of ``raised``'s is due at all (its ``due`` known): a check that misfired,
    not a refusal that came early."""
    return (
        expected.error is not None
        and expected.due is not None
        and raised in _SEMANTIC_CLASSES
        and raised not in expected.due
    )


def _outcome_differences(expected: StepOutcome, actual: StepOutcome, *, what: str) -> list[str]:
    lines: list[str] = []
    if expected.error != actual.error:
        line = f"{what}: error expected {expected.error}, got {actual.error}"
        then = f"{expected.error}, then "
        if expected.error is not None and (actual.error or "").startswith(then):
            # The step refused as demanded; the state read after it is what failed.
            line = (
                f"{what}: raised {expected.error} as expected, then the state read after it "
                f"failed: {(actual.error or '').removeprefix(then)}"
            )
        if _not_due(expected, actual.error):
            line += f" (no {actual.error} is due at this step)"
        lines.append(line)
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
    if (expected.scaler is None) != (actual.scaler is None):
        lines.append(f"{what}: scaler expected {expected.scaler}, got {actual.scaler}")
    elif expected.scaler is not None and actual.scaler is not None:
        lines += expected.scaler.differences(actual.scaler, what=f"{what} scaler")
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
    """A fused mean step: counters and structure exact, each touched element in the §6 set."""
    work = scenario.work_dtype
    w_d = formats.conv_to(step.weight, work)
    # What the step contributes (a "missing" fault's name left out: wacc_ref.faults).
    touched = {
        name: array.reshape(-1).tolist()
        for name, array in scenario.grad_arrays(step).items()
        if array is not None
    }
    actual_pending = dict(actual.state.pending)

    def judged_here(name: str, array: np.ndarray) -> bool:
        # A buffer of another shape is left to the exact comparison, which reports it.
        return (
            name in touched and name in actual_pending and actual_pending[name].shape == array.shape
        )

    # Exact comparison of everything else: substitute the actual values of touched buffers.
    masked = dataclasses.replace(
        expected.state,
        checksum=actual.state.checksum,  # of the actual values, which may legitimately differ
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
                shown = sorted(value_text(float(c), work) for c in candidates)
                lines.append(
                    f"{what} state.pending[{name!r}][flat {position}]: got "
                    f"{value_text(value, work)}, allowed {shown} (buf {value_text(buf, work)}, "
                    f"g {value_text(gradient)}, w_D {value_text(w_d, work)})"
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
    oracle for fused scenarios: in a fused mean step each touched element may be ANY result
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
    # The scaler's inputs are the scenario's found_inf values: the reference's own scaler runs
    # on, and so does its latest checkpoint (its record is replaced by the actual one).
    run = _ReferenceRun(
        accumulator=fresh(scenario.loss_scale),
        fresh=fresh,
        scale=scenario.loss_scale,
        scaler=_reference_scaler(scenario),
    )
    for index, outcome in enumerate(actual.outcomes[: len(scenario.steps)]):
        step = scenario.steps[index]
        what = f"step {index} ({step.op})"
        if outcome.op != step.op or outcome.index != index:
            lines.append(f"{what}: got step {outcome.index} ({outcome.op})")
            break
        if before is not None:
            try:
                run.accumulator = fresh(before.loss_scale)
                run.accumulator.load_state_dict(record_from_snapshot(before), params)
            except WeightedAccumulationError as exc:
                lines.append(f"{what}: the state before it does not load into the reference: {exc}")
                break
            run.scale = before.loss_scale
        expected = _run_step(scenario, index, run)
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
            run.latest = record_from_snapshot(outcome.record)
            run.latest_scale = outcome.record.loss_scale
        before = outcome.state
        if len(lines) >= limit:
            break
    return lines[:limit]
