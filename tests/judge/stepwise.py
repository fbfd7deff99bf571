"""Step-local oracle for the opt-in fused mode (SPEC §6): each step judged from the state before it.

A fused mean step may give, per element, any of three results, so a fused run can legitimately
leave the reproducible trajectory. This oracle therefore judges every step of an implementation's
trace on its own: the reference is loaded with the implementation's state *before* the step, runs
the same step, and must agree exactly — except that each element of a fused mean step's buffers
only has to be a member of :func:`wacc_ref.arith.fused_mean_step_candidates`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wacc_ref import formats
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.arith import fused_mean_step_accepts, fused_mean_step_candidates
from wacc_ref.errors import WeightedAccumulationError
from wacc_ref.scenario import (
    Accumulate,
    Finish,
    RecordSnapshot,
    Scenario,
    ScenarioTrace,
    finish_outcome,
    snapshot_record,
)


def record_of(snapshot: RecordSnapshot) -> dict[str, Any]:
    """The record (shared schema) that ``snapshot`` was taken of."""
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


def _fused_buffer_differences(
    scenario: Scenario,
    step: Accumulate,
    before: RecordSnapshot,
    after: RecordSnapshot,
    *,
    what: str,
) -> list[str]:
    dtype = scenario.work_dtype
    w_d = formats.conv_to(step.weight, dtype)
    previous = dict(before.pending)
    observed = dict(after.pending)
    lines: list[str] = []
    for name, values in scenario.grad_arrays(step).items():
        if values is None:
            continue
        shape = scenario.params[name]
        start = previous.get(name, np.zeros(shape, dtype=np.float64))
        if name not in observed:
            lines.append(f"{what}: no buffer for {name!r} after a positive-weight step")
            continue
        for position, (buf, g, out) in enumerate(
            zip(start.reshape(-1), values.reshape(-1), observed[name].reshape(-1), strict=True)
        ):
            c = formats.conv_to(float(g), dtype)
            candidates = fused_mean_step_candidates(float(buf), c, w_d, dtype)
            if not fused_mean_step_accepts(float(out), candidates):
                accepted = ", ".join(sorted(float(v).hex() for v in candidates))
                lines.append(
                    f"{what}: {name}[flat {position}] = {float(out).hex()} from buf "
                    f"{float(buf).hex()}, c {c.hex()}, w_D {w_d.hex()}; accepted: {accepted}"
                )
    return lines


def stepwise_differences(scenario: Scenario, trace: ScenarioTrace) -> list[str]:
    """Every step of ``trace`` that the reference, started from the step's input state, rejects.

    Only accumulate and finish steps are judged (fused scenarios are generated without
    interruptions; records are compared exactly by the default-order oracle). Fused mean steps
    are judged per element against the SPEC §6 candidate set, everything else bit for bit.
    """
    lines: list[str] = []
    params = scenario.params
    names = list(params)
    before: RecordSnapshot | None = None
    for step, outcome in zip(scenario.steps, trace.outcomes, strict=True):
        what = f"step {outcome.index} ({outcome.op})"
        if not isinstance(step, Accumulate | Finish):
            raise ValueError(f"{what}: the step-local oracle judges accumulate and finish steps")
        reference = ReferenceAccumulator(
            dtype=scenario.work_dtype,
            loss_scale=scenario.loss_scale,
            fused=scenario.fused,
            fused_variant="two_step",
        )
        if before is not None:
            reference.load_state_dict(record_of(before), params)
        error: str | None = None
        result = None
        try:
            if isinstance(step, Accumulate):
                method = (
                    reference.accumulate_sum if step.kind == "sum" else reference.accumulate_mean
                )
                method(params, step.weight, grads=scenario.grad_arrays(step))
            else:
                finished = (
                    reference.finish_sums() if step.kind == "sums" else reference.finish_mean()
                )
                result = finish_outcome(finished, names)
        except WeightedAccumulationError as exc:
            error = type(exc).__name__
        expected = snapshot_record(reference.state_dict())
        if error != outcome.error:
            lines.append(f"{what}: error expected {error}, got {outcome.error}")
        fused_step = (
            scenario.fused
            and isinstance(step, Accumulate)
            and step.kind == "mean"
            and error is None
            and step.weight > 0
        )
        if fused_step:
            empty = record_of(expected)
            empty["pending"] = {}
            counters_only = snapshot_record(empty)
            observed = record_of(outcome.state)
            observed["pending"] = {}
            lines += counters_only.differences(snapshot_record(observed), what=f"{what} state")
            start = before if before is not None else counters_only
            lines += _fused_buffer_differences(scenario, step, start, outcome.state, what=what)
        else:
            lines += expected.differences(outcome.state, what=f"{what} state")
        if (result is None) != (outcome.result is None):
            lines.append(f"{what}: result expected {result is not None}")
        elif result is not None and outcome.result is not None:
            lines += result.differences(outcome.result, what=f"{what} result")
        before = outcome.state
    return lines
