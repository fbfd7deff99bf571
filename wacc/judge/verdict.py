"""The three oracles of the semantics (§12) applied to one scenario run, and their metrics.

* Oracle 1, ``emulation``: the implementation's values equal the reference's step-by-step rounded
  values bit for bit (pending buffers after every step where the record follows the schema, and
  every finished gradient; ±0 and NaN positions compared, NaN payloads not). For an
  implementation that declares ``state.fused``, each element of a mean step may be any result of
  the §6 set (:func:`wacc_ref.oracles.stepwise_differences`).
* Oracle 2, ``bound``: against the exact real result, every value stays within
  :func:`wacc_ref.bounds.window_error_bound` (pending sums against ``Σ c_k`` after every
  accumulate step, finished gradients against ``Σ c_k / S / W`` or ``Σ c_k``).
* Oracle 3, ``semantics``: counters after every step, the same error class at the same step,
  the state unchanged after a raise, a checkpoint that changes nothing, a restore that reproduces
  its checkpoint, a corrupted restore refused (``RecordError`` for a record of the §9 schema, any
  §11 error for an opaque one), and resume bit-identical: the finished results of the scenario
  equal those of the same scenario without its checkpoints and restores. Where oracle 1 is not
  applied (``--oracle bound``), oracle 3 also holds the None rule of §7: a value where the
  reference has None (all ``+0.0`` is a note), or None where it has values, is a divergence.

:func:`judge` runs a scenario on the reference and on an implementation and returns a
:class:`ScenarioVerdict` with one :class:`StepVerdict` per step: the ops, both error classes,
max ulps in D against the emulation, max relative error and max error/bound against the exact
result, and which oracles failed there.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np
import torch

from wacc.choices import ORACLE_SET_NAMES
from wacc.judge.implementation import SEMANTICS_ERRORS, Implementation
from wacc.judge.runner import in_module_order, run_implementation
from wacc_ref import formats
from wacc_ref.bits import array_differences, array_key
from wacc_ref.bounds import BoundArgumentError, error_ratio, window_error_bound
from wacc_ref.corruption import CHECKSUM_KINDS
from wacc_ref.display import shown_format, value_text
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
    Scenario,
    without_interruptions,
)
from wacc_ref.traces import FinishOutcome, RecordSnapshot, ScenarioTrace, StepOutcome

__all__ = [
    "ORACLES",
    "ORACLE_SETS",
    "ScenarioVerdict",
    "StepVerdict",
    "judge",
]

ORACLES: tuple[str, ...] = ("emulation", "bound", "semantics")
# --oracle choice -> the oracles applied
ORACLE_SETS: dict[str, tuple[str, ...]] = {
    "strict": ORACLES,
    "bound": ("bound", "semantics"),
}
if tuple(ORACLE_SETS) != tuple(ORACLE_SET_NAMES):  # the command line's names (wacc.choices)
    raise ImportError(f"wacc.choices.ORACLE_SET_NAMES {tuple(ORACLE_SET_NAMES)} is out of step")


@dataclass(frozen=True)
class StepVerdict:
    """One step of one scenario, judged (metrics are 0.0 where nothing was compared)."""

    index: int
    op: str
    weight: float | None
    expected_error: str | None
    actual_error: str | None
    max_ulps: float
    max_rel_error: float
    max_ratio: float
    failed: tuple[str, ...]
    lines: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # (oracle, its first failure line here) for each oracle that failed at this step: what
    # diverged, by oracle (wacc.judge.signature groups divergences by it)
    firsts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ScenarioVerdict:
    """A scenario judged: its steps, the oracles applied and the scenario-level findings."""

    scenario: Scenario
    implementation: str
    oracles: tuple[str, ...]
    steps: tuple[StepVerdict, ...]
    scenario_lines: tuple[str, ...] = field(default=())  # resume findings (oracle 3)
    messages: dict[int, str] = field(default_factory=dict)
    tracebacks: dict[int, str] = field(default_factory=dict)  # step -> the exception's traceback
    # The scenario without its checkpoints and restores, judged on its own, when the resume is
    # not bit-identical and that run breaks the semantics itself: the restore hid a divergence
    # the uninterrupted window shows, which is then the finding (its signature is this one's).
    uninterrupted: ScenarioVerdict | None = None

    @property
    def failed(self) -> bool:
        """Whether any applied oracle failed anywhere."""
        return bool(self.scenario_lines) or any(step.failed for step in self.steps)

    @property
    def failed_oracles(self) -> tuple[str, ...]:
        """The oracles that failed somewhere, in :data:`ORACLES` order."""
        hit = {name for step in self.steps for name in step.failed}
        if self.scenario_lines:
            hit.add("semantics")
        return tuple(name for name in ORACLES if name in hit)

    def maximum(self, metric: str) -> float:
        """The largest ``max_ulps`` / ``max_rel_error`` / ``max_ratio`` over the steps."""
        return max((getattr(step, metric) for step in self.steps), default=0.0)

    def describe(self, *, limit: int = 12) -> list[str]:
        """The failure lines (first ``limit``), each naming its step."""
        lines = list(self.scenario_lines)
        for step in self.steps:
            lines += [f"[{', '.join(step.failed)}] {line}" for line in step.lines]
        return lines[:limit]


# --------------------------------------------------------------------------- metrics


def _exact(value: float) -> Fraction | None:
    return Fraction(value) if math.isfinite(value) else None


def _ulps(expected: np.ndarray, actual: np.ndarray, dtype: str) -> float:
    """Max distance in units of D's spacing at the expected value (inf on a NaN/inf mismatch)."""
    worst = 0.0
    for e, a in zip(expected.reshape(-1).tolist(), actual.reshape(-1).tolist(), strict=True):
        if math.isnan(e) or math.isnan(a) or math.isinf(e) or math.isinf(a):
            if not (math.isnan(e) and math.isnan(a)) and e != a:
                return math.inf
            continue
        worst = max(worst, abs(a - e) / formats.ulp(e, dtype))
    return worst


def _rel_error(
    actual: np.ndarray, exact: Sequence[Fraction], min_normal: float, bound: Sequence[float]
) -> float:
    """Max |a - x| / |x| over the elements where a relative error means something: the exact
    value x is in D's normal range (``|x| >= min_normal``) and larger than its own error bound.
    Below the normal range D's spacing is fixed, and where the bound is at least |x| (a
    cancellation, or underflow in an intermediate) the bound's absolute part decides: there one
    spacing off a tiny x reads as 100 % or more next to a pass, so the bound oracle judges
    those elements, and an exact zero alike."""
    worst = 0.0
    for a, x, b in zip(actual.reshape(-1).tolist(), exact, bound, strict=True):
        if abs(x) < min_normal or b >= abs(x):
            continue
        value = _exact(a)
        if value is None:
            return math.inf
        try:
            relative = float(abs(value - x) / abs(x))
        except OverflowError:  # beyond float64's range: a relative error of +inf
            return math.inf
        worst = max(worst, relative)
    return worst


def _worst_element(
    array: np.ndarray, exact: Sequence[Fraction], bound: np.ndarray, spacing: float = 0.0
) -> str:
    """The bound oracle's line: the element whose error is the largest part of its bound, with
    its value, the exact value and the bound; a bound below ``spacing`` (D's smallest spacing:
    0 or a few float64 subnormals, so the exact value must come out, as the semantics make it
    representable) is said so rather than as a ratio of inf or of 10**300."""
    worst: tuple[Fraction | float, int] | None = None
    values = array.reshape(-1).tolist()
    limits = bound.reshape(-1).tolist()
    for position, (value, truth, limit) in enumerate(zip(values, exact, limits, strict=True)):
        if not math.isfinite(limit):
            continue  # no bound applies there
        got = _exact(value)
        error = math.inf if got is None else abs(got - truth)
        if error == 0:
            continue
        ratio = math.inf if limit == 0 or error == math.inf else error / Fraction(limit)
        if worst is None or ratio > worst[0]:
            worst = (ratio, position)
    if worst is None:  # error_ratio saw what this does not: say the ratio alone
        return "error/bound > 1"
    ratio, position = worst
    truth = exact[position]
    shown = f"[flat {position}] = {values[position]!r}, exact {_as_float(truth)!r}"
    if limits[position] == 0:
        return f"error/bound = inf: {shown}, bound 0 (the exact value must come out)"
    if limits[position] < spacing:
        return (
            f"error > bound: {shown}, bound {limits[position]:.3g}, below one spacing of D (the "
            "exact value must come out)"
        )
    return f"error/bound = {_as_float(ratio):.3g} > 1: {shown}, bound {limits[position]:.3g}"


def _as_float(value: Fraction | float) -> float:
    """``value`` rounded to a float; beyond float64's range, the infinity of its sign."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


# ------------------------------------------------------------------ the window model


@dataclass(frozen=True)
class _Term:
    kind: str
    weight: float
    grads: dict[str, np.ndarray | None]
    loss_scale: float  # the window's (semantics §13: one scale for every batch of a window)


def _windows(scenario: Scenario, expected: ScenarioTrace) -> list[list[_Term] | None]:
    """Per step, the reference's open window after it (accumulate) or the window it finished
    (finish); None for other steps. Restores reopen the window of their checkpoint."""
    window: list[_Term] = []
    latest: list[_Term] = []
    out: list[list[_Term] | None] = []
    for step, outcome in zip(scenario.steps, expected.outcomes, strict=True):
        current: list[_Term] | None = None
        if isinstance(step, Accumulate):
            if outcome.error is None:
                term = _Term(
                    step.kind, step.weight, scenario.grad_arrays(step), outcome.state.loss_scale
                )
                window = [*window, term]
            current = window
        elif isinstance(step, Finish):
            if outcome.error is None:
                current, window = window, []
        elif isinstance(step, Checkpoint):
            latest = window
        elif isinstance(step, Restore) and outcome.error is None:
            window = latest
        out.append(current)
    return out


def _exact_and_bound(
    scenario: Scenario, terms: list[_Term], name: str, *, normalized: bool
) -> tuple[list[Fraction], np.ndarray] | None:
    """The exact value and the bound of parameter ``name`` over ``terms``; None if untouched."""
    dtype = scenario.work_dtype
    loss_scale = terms[0].loss_scale if terms else scenario.loss_scale
    grads = [term.grads.get(name) for term in terms]
    weights = [term.weight for term in terms]
    try:
        bound = window_error_bound(
            kind=[term.kind for term in terms],
            grads=grads,
            weights=weights,
            dtype=dtype,
            loss_scale=loss_scale,
            normalized=normalized,
        )
    except BoundArgumentError:
        return None  # no gradient array in a positive-weight batch: the result is None
    size = math.prod(scenario.params[name])
    total = [Fraction(0)] * size
    weight_sum = Fraction(0)
    for term, grad in zip(terms, grads, strict=True):
        if term.weight == 0:
            continue
        multiplier = 1.0 if term.kind == "sum" else formats.conv_to(term.weight, dtype)
        weight_sum += Fraction(term.weight if term.kind == "sum" else multiplier)
        if grad is None:
            continue
        for position, value in enumerate(grad.reshape(-1).tolist()):
            exact = _exact(value)
            if exact is not None:  # a NaN/inf gradient: the bound is +inf there, never read
                total[position] += exact * Fraction(multiplier)
    if normalized:
        total = [x / Fraction(loss_scale) / weight_sum for x in total]
    return total, bound


# --------------------------------------------------------------------------- oracles


def _counters_only(trace: ScenarioTrace) -> ScenarioTrace:
    """``trace`` with buffers, parameter lists and gradient values dropped (oracle 3's view)."""

    def bare(snapshot: RecordSnapshot | None) -> RecordSnapshot | None:
        return None if snapshot is None else _bare(snapshot)

    def _bare(snapshot: RecordSnapshot) -> RecordSnapshot:
        return replace(
            snapshot,
            format_version=None,
            param_names=(),
            param_shapes=(),
            pending=(),
            checksum=None,
        )

    def bare_result(result: FinishOutcome | None) -> FinishOutcome | None:
        # found_inf goes with the values it describes: the full trace's violations judge it.
        return None if result is None else replace(result, grads=(), found_inf=None)

    return ScenarioTrace(
        outcomes=tuple(
            replace(
                outcome,
                state=_bare(outcome.state),
                record=bare(outcome.record),
                result=bare_result(outcome.result),
            )
            for outcome in trace.outcomes
        ),
        implementation=trace.implementation,
    )


def _presence_differences(
    expected: StepOutcome, actual: StepOutcome, *, what: str
) -> tuple[list[str], list[str], list[tuple[str, np.ndarray, np.ndarray]]]:
    """Which finished gradients are None (semantics §7, §12): (divergence lines, notes, and the
    (name, expected, actual) pairs where both have values).

    All ``+0.0`` (bit for bit: ``-0.0`` is not) where the reference has None is a note; any
    other value where None is expected, or None where values are expected, is a divergence.
    """
    lines: list[str] = []
    notes: list[str] = []
    both: list[tuple[str, np.ndarray, np.ndarray]] = []
    if expected.result is None or actual.result is None:
        return lines, notes, both
    act_grads = dict(actual.result.grads)
    for name, exp_grad in expected.result.grads:
        act_grad = act_grads.get(name)
        if exp_grad is None and act_grad is None:
            continue
        if exp_grad is None and act_grad is not None:
            zeros = np.zeros_like(act_grad)
            if array_key(act_grad) == array_key(zeros):
                notes.append(f"{what}: grads[{name!r}] is all +0.0 where the reference has None")
            else:
                lines.append(f"{what}: grads[{name!r}] expected None, got values")
            continue
        if act_grad is None:
            lines.append(f"{what}: grads[{name!r}] is None, expected values")
            continue
        assert exp_grad is not None
        both.append((name, exp_grad, act_grad))
    return lines, notes, both


def _step_title(index: int, step: object) -> str:
    """How failure lines name a step: its index and op, and an accumulate's weight."""
    op = getattr(step, "op")  # noqa: B009  # every step type has it
    if isinstance(step, Accumulate):
        return f"step {index} ({op}, weight {step.weight!r})"  # float64: repr is exact
    return f"step {index} ({op})"


_FLAT = re.compile(r"\[flat (\d+)\]: ")


def _with_inputs(lines: list[str], step: object, name: str, fmt: str) -> list[str]:
    """An accumulate's pending-buffer lines, each with the input gradient entry at its flat
    position (what was added there), so a reader sees the operands of the diverging step."""
    if not isinstance(step, Accumulate):
        return lines
    values = dict(step.grads).get(name)
    shown = []
    for line in lines:
        match = _FLAT.search(line)
        if values is not None and match is not None and int(match[1]) < len(values):
            position = int(match[1])
            line += f"; input grads[{name!r}][flat {position}] = "
            line += value_text(float(values[position]), fmt)
        shown.append(line)
    return shown


def _value_differences(
    expected: StepOutcome, actual: StepOutcome, *, schema: bool, what: str, step: object = None
) -> tuple[list[str], list[str]]:
    """Oracle 1 for one step of the reproducible order: (divergence lines, notes)."""
    lines: list[str] = []
    # Values are shown in D (the reference's own records say which)
    fmt = shown_format(expected.state.dtype)
    if schema:
        exp_pending, act_pending = dict(expected.state.pending), dict(actual.state.pending)
        if exp_pending.keys() != act_pending.keys():
            lines.append(
                f"{what}: pending buffers {sorted(act_pending)}, expected {sorted(exp_pending)}"
            )
        for name in sorted(exp_pending.keys() & act_pending.keys()):
            lines += _with_inputs(
                array_differences(
                    f"{what} pending[{name!r}]", exp_pending[name], act_pending[name], fmt=fmt
                ),
                step, name, fmt,
            )  # fmt: skip
    presence, notes, both = _presence_differences(expected, actual, what=what)
    lines += presence
    for name, exp_grad, act_grad in both:
        lines += array_differences(f"{what} grads[{name!r}]", exp_grad, act_grad, fmt=fmt)
    return lines, notes


_STEP_PREFIX = re.compile(r"^step (\d+) ")


def _by_step(lines: Sequence[str], count: int) -> list[list[str]]:
    """Lines that start with ``step N `` grouped by N (others go to step 0)."""
    grouped: list[list[str]] = [[] for _ in range(max(count, 1))]
    for line in lines:
        match = _STEP_PREFIX.match(line)
        index = int(match.group(1)) if match else 0
        grouped[min(index, len(grouped) - 1)].append(line)
    return grouped


def _agnostic_expectations(
    scenario: Scenario, expected: ScenarioTrace, actual: ScenarioTrace
) -> ScenarioTrace:
    """For opaque records, a format-agnostic corruption must be refused with any §11 error,
    or be detected before the implementation sees it (the damaged file does not load)."""
    outcomes = []
    for step, exp, act in zip(scenario.steps, expected.outcomes, actual.outcomes, strict=True):
        if isinstance(step, RestoreCorrupted):
            refused = act.error in SEMANTICS_ERRORS
            exp = replace(
                exp,
                skipped=act.skipped,
                error=None if act.skipped else (act.error if refused else "RecordError"),
            )
        outcomes.append(exp)
    return ScenarioTrace(outcomes=tuple(outcomes), implementation=expected.implementation)


def _checksum_optional(
    scenario: Scenario, expected: ScenarioTrace, actual: ScenarioTrace
) -> ScenarioTrace:
    """The record's ``checksum`` is optional (semantics §9): where the implementation's record
    has none, a corruption kind that needs one does not apply (the run skips it), whatever the
    reference's record holds."""
    outcomes = []
    for step, exp, act in zip(scenario.steps, expected.outcomes, actual.outcomes, strict=True):
        if isinstance(step, RestoreCorrupted) and step.kind in CHECKSUM_KINDS and act.skipped:
            exp = replace(exp, skipped=True, error=None)
        outcomes.append(exp)
    return ScenarioTrace(outcomes=tuple(outcomes), implementation=expected.implementation)


def _restores_follow_checkpoints(scenario: Scenario) -> bool:
    """Whether every restore loads a checkpoint taken right before it (resume is then exact)."""
    since_checkpoint = True
    for step in scenario.steps:
        if isinstance(step, Checkpoint):
            since_checkpoint = True
        elif isinstance(step, Restore):
            if not since_checkpoint:
                return False
        elif not isinstance(step, RestoreCorrupted):
            since_checkpoint = False
    return True


def _finish_keys(trace: ScenarioTrace) -> list[tuple[object, ...]]:
    return [
        (outcome.error, None if outcome.result is None else outcome.result.key())
        for outcome in trace.outcomes
        if outcome.op.startswith("finish")
    ]


def judge(
    implementation: Implementation,
    scenario: Scenario,
    *,
    device: torch.device | str = "cpu",
    oracles: Sequence[str] = ORACLES,
) -> ScenarioVerdict:
    """Run ``scenario`` on the reference and on ``implementation`` and apply ``oracles``."""
    scenario = in_module_order(scenario)
    applied = tuple(name for name in ORACLES if name in oracles)
    expected = run_reference(scenario, mode="emulated")
    actual, run = run_implementation(implementation, scenario, device=device)
    schema = run.schema
    count = len(scenario.steps)

    expected_view = _counters_only(expected)
    if not schema:
        expected_view = _agnostic_expectations(scenario, expected_view, actual)
    else:
        expected_view = _checksum_optional(scenario, expected_view, actual)
    actual_view = _counters_only(actual)
    # A corrupted restore: RecordError for a schema record, any §11 error for an opaque one.
    if schema:
        violations = trace_violations(actual, refusals=("RecordError",))
    else:
        # The view has no gradient values: found_inf is judged on the full trace.
        violations = trace_violations(actual_view, refusals=SEMANTICS_ERRORS)
        violations += found_inf_violations(actual)
    semantics = _by_step(
        trace_differences(expected_view, actual_view, limit=10**6) + violations, count
    )
    fused_lines: list[list[str]] | None = None
    if implementation.fused and schema and "emulation" in applied:
        fused_lines = _by_step(stepwise_differences(scenario, actual, limit=10**6), count)

    scenario_lines: list[str] = []
    uninterrupted: ScenarioVerdict | None = None
    if (
        "semantics" in applied
        and any(isinstance(step, Restore) for step in scenario.steps)
        and _restores_follow_checkpoints(scenario)
    ):
        straight, _ = run_implementation(
            implementation, without_interruptions(scenario), device=device
        )
        if _finish_keys(straight) != _finish_keys(_strip_interruptions(scenario, actual)):
            line = (
                "resume is not bit-identical: the finished results differ from the same "
                "scenario run without its checkpoints and restores"
            )
            alone = judge(
                implementation, without_interruptions(scenario), device=device, oracles=oracles
            )
            if alone.failed:
                uninterrupted = alone
                line += f", which fails on its own: {alone.describe(limit=1)[0]}"
            scenario_lines.append(line)

    windows = _windows(scenario, expected)
    verdicts: list[StepVerdict] = []
    for index, (step, exp, act) in enumerate(
        zip(scenario.steps, expected.outcomes, actual.outcomes, strict=True)
    ):
        what = _step_title(index, step)
        failed: list[str] = []
        lines: list[str] = []
        notes: list[str] = []
        firsts: dict[str, str] = {}
        if "semantics" in applied and semantics[index]:
            failed.append("semantics")
            lines += semantics[index]
            firsts["semantics"] = semantics[index][0]
        if "emulation" in applied:
            if fused_lines is not None:
                emulation = fused_lines[index]
            else:
                emulation, notes = _value_differences(exp, act, schema=schema, what=what, step=step)
            if emulation:
                failed.insert(0, "emulation")
                lines = emulation + lines
                firsts["emulation"] = emulation[0]
        elif "semantics" in applied:
            # Without oracle 1 (and oracle 2 bounds values only), §7's None rule is oracle 3's.
            presence, notes, _ = _presence_differences(exp, act, what=what)
            if presence:
                if "semantics" not in failed:
                    failed.append("semantics")
                lines += presence
                firsts.setdefault("semantics", presence[0])
        ulps = rel = ratio = 0.0
        terms = windows[index]
        observed: list[tuple[str, np.ndarray, np.ndarray | None, bool]] = []
        if terms is not None and isinstance(step, Accumulate) and schema:
            exp_pending = dict(exp.state.pending)
            observed = [
                (name, array, exp_pending.get(name), False) for name, array in act.state.pending
            ]
        elif terms is not None and act.result is not None:
            exp_grads = dict(exp.result.grads) if exp.result is not None else {}
            observed = [
                (name, array, exp_grads.get(name), act.result.normalized)
                for name, array in act.result.grads
                if array is not None
            ]
        for name, array, reference, normalized in observed:
            if reference is not None and reference.shape == array.shape:
                ulps = max(ulps, _ulps(reference, array, scenario.work_dtype))
            if name not in scenario.params or array.shape != scenario.params[name]:
                continue
            exact_bound = _exact_and_bound(scenario, terms or [], name, normalized=normalized)
            if exact_bound is None:
                continue
            exact, bound = exact_bound
            finite = np.isfinite(bound).reshape(-1)
            rel = max(
                rel,
                _rel_error(
                    array.reshape(-1)[finite],
                    [x for x, f in zip(exact, finite, strict=True) if f],
                    formats.get_format(scenario.work_dtype).min_normal,
                    bound.reshape(-1)[finite].tolist(),
                ),
            )
            step_ratio = error_ratio(
                array, np.array(exact, dtype=object).reshape(array.shape), bound
            )
            ratio = max(ratio, step_ratio)
            if step_ratio > 1.0 and "bound" in applied:
                spacing = formats.get_format(scenario.work_dtype).min_subnormal
                lines.append(f"{what}: {name!r} {_worst_element(array, exact, bound, spacing)}")
                firsts.setdefault("bound", lines[-1])
                if "bound" not in failed:
                    failed.append("bound")
        verdicts.append(
            StepVerdict(
                index=index,
                op=step.op,
                weight=step.weight if isinstance(step, Accumulate) else None,
                expected_error=exp.error,
                actual_error=act.error,
                max_ulps=ulps,
                max_rel_error=rel,
                max_ratio=ratio,
                failed=tuple(name for name in ORACLES if name in failed),
                lines=tuple(lines),
                notes=tuple(notes),
                firsts=tuple(firsts.items()),
            )
        )
    return ScenarioVerdict(
        scenario=scenario,
        implementation=implementation.spec,
        oracles=applied,
        steps=tuple(verdicts),
        scenario_lines=tuple(scenario_lines),
        messages=dict(run.messages),
        tracebacks=dict(run.tracebacks),
        uninterrupted=uninterrupted,
    )


def _strip_interruptions(scenario: Scenario, trace: ScenarioTrace) -> ScenarioTrace:
    """The outcomes of ``trace`` for the steps :func:`without_interruptions` keeps."""
    kept = tuple(
        outcome
        for step, outcome in zip(scenario.steps, trace.outcomes, strict=True)
        if isinstance(step, Accumulate | Finish)
    )
    return ScenarioTrace(outcomes=kept, implementation=trace.implementation)
