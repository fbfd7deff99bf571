"""Structure-aware shrinking of a failing :class:`~wacc_ref.scenario.Scenario`.

Hypothesis finds a failing scenario; shrinking it through the strategy costs a full draw of a
whole scenario per candidate (most of the time of a check), so the engine shrinks the scenario
itself instead, greedily, each candidate a valid scenario that must still fail with one of the
oracles the original failed:

1. drop steps (whole windows first, then single steps), keeping every restore after a checkpoint;
2. drop parameters, then single gradient entries (a dropped entry is a None contribution);
3. simplify weights (1, then small integers) and the loss scale (1), where still valid;
4. simplify gradient values (0, 1, -1, then the value with fewer significant bits).

Passes repeat until none makes progress or the time budget is spent.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator

from wacc_ref import formats
from wacc_ref.scenario import Accumulate, Finish, Scenario, ScenarioError, Step

__all__ = ["shrink_scenario"]


def _valid(**fields: object) -> Scenario | None:
    try:
        return Scenario(**fields)  # type: ignore[arg-type]
    except ScenarioError:
        return None


def _with(scenario: Scenario, **changes: object) -> Scenario | None:
    fields = {f.name: getattr(scenario, f.name) for f in dataclasses.fields(scenario)}
    fields.update(changes)
    return _valid(**fields)


def _replace_step(scenario: Scenario, index: int, step: Step) -> Scenario | None:
    steps = scenario.steps[:index] + (step,) + scenario.steps[index + 1 :]
    return _with(scenario, steps=steps)


def _window_spans(steps: tuple[Step, ...]) -> list[tuple[int, int]]:
    """(start, end) of each run of accumulate steps closed by a finish (or the end)."""
    spans: list[tuple[int, int]] = []
    start = 0
    for index, step in enumerate(steps):
        if isinstance(step, Finish):
            spans.append((start, index + 1))
            start = index + 1
    if start < len(steps):
        spans.append((start, len(steps)))
    return spans


def _step_removals(scenario: Scenario) -> Iterator[Scenario]:
    steps = scenario.steps
    for start, end in _window_spans(steps):
        candidate = _with(scenario, steps=steps[:start] + steps[end:])
        if candidate is not None:
            yield candidate
    for index in range(len(steps) - 1, -1, -1):
        candidate = _with(scenario, steps=steps[:index] + steps[index + 1 :])
        if candidate is not None:
            yield candidate


def _gradient_removals(scenario: Scenario) -> Iterator[Scenario]:
    names = [name for name, _ in scenario.parameters]
    if len(names) > 1:
        for name in names:
            steps = tuple(
                dataclasses.replace(s, grads=tuple(g for g in s.grads if g[0] != name))
                if isinstance(s, Accumulate)
                else s
                for s in scenario.steps
            )
            parameters = tuple(p for p in scenario.parameters if p[0] != name)
            candidate = _with(scenario, parameters=parameters, steps=steps)
            if candidate is not None:
                yield candidate
    for index, step in enumerate(scenario.steps):
        if isinstance(step, Accumulate):
            for entry in range(len(step.grads)):
                grads = step.grads[:entry] + step.grads[entry + 1 :]
                candidate = _replace_step(scenario, index, dataclasses.replace(step, grads=grads))
                if candidate is not None:
                    yield candidate


def _simpler_floats(value: float) -> list[float]:
    """Simpler values to try in place of ``value``: 0, ±1, then fewer significant bits."""
    if value == 0.0:
        return []
    if not math.isfinite(value):
        return [0.0, 1.0]
    mantissa, exponent = math.frexp(value)
    rounded = []
    for bits in (1, 2, 4, 8):
        try:
            rounded.append(math.ldexp(round(mantissa * 2**bits) / 2**bits, exponent))
        except OverflowError:  # rounded up past float64's largest value: not a simpler float
            continue
    options = [0.0, math.copysign(1.0, value), *rounded]
    return [v for v in dict.fromkeys(options) if v != value]


def _value_simplifications(scenario: Scenario) -> Iterator[Scenario]:
    if scenario.loss_scale != 1.0:
        candidate = _with(scenario, loss_scale=1.0)
        if candidate is not None:
            yield candidate
    for index, step in enumerate(scenario.steps):
        if not isinstance(step, Accumulate):
            continue
        for weight in (1.0, 2.0, 3.0, 7.0):
            if weight < step.weight and math.isfinite(step.weight):
                candidate = _replace_step(scenario, index, dataclasses.replace(step, weight=weight))
                if candidate is not None:
                    yield candidate
        for entry, (name, values) in enumerate(step.grads):
            if values is None:
                continue
            for position, value in enumerate(values):
                for simpler in _simpler_floats(value):
                    if not formats.is_representable(simpler, scenario.grad_dtype):
                        continue
                    new_values = values[:position] + (simpler,) + values[position + 1 :]
                    grads = step.grads[:entry] + ((name, new_values),) + step.grads[entry + 1 :]
                    simpler_step = dataclasses.replace(step, grads=grads)
                    candidate = _replace_step(scenario, index, simpler_step)
                    if candidate is not None:
                        yield candidate


_PASSES: tuple[Callable[[Scenario], Iterator[Scenario]], ...] = (
    _step_removals,
    _gradient_removals,
    _value_simplifications,
)


def shrink_scenario(
    scenario: Scenario,
    still_fails: Callable[[Scenario], bool],
    *,
    seconds: float,
) -> Scenario:
    """The smallest scenario the passes reach from ``scenario`` that ``still_fails``."""
    deadline = time.perf_counter() + seconds
    current = scenario
    progress = True
    while progress and time.perf_counter() < deadline:
        progress = False
        for shrink_pass in _PASSES:
            for candidate in shrink_pass(current):
                if time.perf_counter() >= deadline:
                    return current
                if still_fails(candidate):
                    current = candidate
                    progress = True
                    break  # restart this pass on the smaller scenario
            if progress:
                break
    return current
