"""A Hypothesis ``RuleBasedStateMachine`` that drives an implementation and the reference.

Rules: accumulate a sum or a mean (unequal token counts, explicit zero weights, rarely an invalid
weight), finish sums or mean, checkpoint (sync or async), restore the latest checkpoint into a
fresh instance, restore a corrupted copy. After every rule the invariant judges the scenario built
so far with all applied oracles (:func:`wacc.judge.verdict.judge`), so a divergence is reported at
the first step that shows it, and Hypothesis shrinks the rule sequence; the shrunk sequence is a
:class:`~wacc_ref.scenario.Scenario` that ``wacc replay`` runs again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from wacc.judge.implementation import Implementation
from wacc.judge.targets import observe_metrics
from wacc.judge.verdict import ScenarioVerdict, judge
from wacc_ref import formats
from wacc_ref.corruption import CORRUPTION_KINDS
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    GradValues,
    Restore,
    RestoreCorrupted,
    Scenario,
    Step,
)
from wacc_ref.strategies import (
    PARAMETER_NAMES,
    gradient_values,
    loss_scales,
    overflow_prone_scales,
    unequal_microbatches,
)

__all__ = ["MAX_MACHINE_STEPS", "run_machine"]

MAX_MACHINE_STEPS = 12  # rules per run; every invariant re-judges the prefix, so keep it short
_INVALID_WEIGHTS = (-1.0, math.nan, math.inf)


def _weights() -> st.SearchStrategy[float]:
    counts = unequal_microbatches(min_size=1, max_size=1).map(lambda counts: float(counts[0]))
    rare = st.one_of(st.sampled_from((0.0, -0.0)), st.sampled_from(_INVALID_WEIGHTS))
    return st.one_of(counts, counts, counts, rare)


def run_machine(
    implementation: Implementation,
    dtype: str,
    *,
    device: torch.device,
    oracles: Sequence[str],
    settings: Settings,
    seed: int | None,
    on_verdict: Callable[[ScenarioVerdict], None],
) -> None:
    """Run the machine as a test; ``on_verdict`` sees every judged prefix (it raises to fail)."""
    records = implementation.supports("records")

    class AccumulatorMachine(RuleBasedStateMachine):
        """Accumulate, finish, checkpoint and restore in any order, judged after every step."""

        def __init__(self) -> None:
            super().__init__()
            self.steps: list[Step] = []
            self.checkpointed = False
            self.grad_dtype = "float32"
            self.loss_scale = 1.0
            self.parameters: tuple[tuple[str, tuple[int, ...]], ...] = ()
            self.last: ScenarioVerdict | None = None

        @initialize(
            grad_dtype=st.sampled_from(tuple(formats.FORMATS)),
            overflow_prone=st.booleans(),
            data=st.data(),
            count=st.integers(1, 2),
        )
        def setup(
            self, grad_dtype: str, overflow_prone: bool, data: st.DataObject, count: int
        ) -> None:
            self.grad_dtype = grad_dtype
            scales = overflow_prone_scales(dtype) if overflow_prone else loss_scales(dtype)
            self.loss_scale = data.draw(scales, label="loss_scale")
            names = PARAMETER_NAMES[:count]
            sizes = data.draw(st.lists(st.integers(1, 3), min_size=count, max_size=count))
            self.parameters = tuple(
                (name, (size,)) for name, size in zip(names, sizes, strict=True)
            )

        def _scenario(self) -> Scenario:
            return Scenario(
                work_dtype=dtype,
                grad_dtype=self.grad_dtype,
                loss_scale=self.loss_scale,
                fused=implementation.fused,
                parameters=self.parameters,
                steps=tuple(self.steps),
            )

        def _accumulate(self, kind: str, weight: float, data: st.DataObject) -> None:
            values = gradient_values(self.grad_dtype, work_dtype=dtype)
            grads: list[tuple[str, GradValues]] = []
            for position, (name, (size,)) in enumerate(self.parameters):
                # The first parameter always has values, so every accumulate carries data.
                if position == 0 or data.draw(st.booleans(), label=f"{name} present"):
                    drawn = data.draw(st.lists(values, min_size=size, max_size=size))
                    grads.append((name, tuple(drawn)))
            self.steps.append(Accumulate(kind=kind, weight=weight, grads=tuple(grads)))  # type: ignore[arg-type]

        # Two rules, so that accumulating is drawn as often as everything else together.
        @rule(weight=_weights(), data=st.data())
        def accumulate_sum(self, weight: float, data: st.DataObject) -> None:
            self._accumulate("sum", weight, data)

        @rule(weight=_weights(), data=st.data())
        def accumulate_mean(self, weight: float, data: st.DataObject) -> None:
            self._accumulate("mean", weight, data)

        @rule(kind=st.sampled_from(("sums", "mean")))
        def finish(self, kind: str) -> None:
            self.steps.append(Finish(kind))  # type: ignore[arg-type]

        @precondition(lambda self: records)
        @rule(asynchronous=st.booleans())
        def checkpoint(self, asynchronous: bool) -> None:
            self.steps.append(Checkpoint(asynchronous=asynchronous))
            self.checkpointed = True

        @precondition(lambda self: records and self.checkpointed)
        @rule(corruption=st.one_of(st.none(), st.sampled_from(CORRUPTION_KINDS)))
        def restore(self, corruption: str | None) -> None:
            self.steps.append(Restore() if corruption is None else RestoreCorrupted(corruption))

        @invariant()
        def matches_the_reference(self) -> None:
            if self.steps:
                verdict = judge(implementation, self._scenario(), device=device, oracles=oracles)
                self.last = verdict
                on_verdict(verdict)

        def teardown(self) -> None:
            # Every run ends by finishing its open window (a run may never draw the finish
            # rule); hypothesis.target may be called once per test case: with the last verdict.
            # Not after a failure: teardown runs then too, and judging the failed run once more
            # counted a second failing scenario that no finding explains.
            failed = self.last is not None and self.last.failed
            if self.steps and not isinstance(self.steps[-1], Finish) and not failed:
                self.steps.append(Finish("mean"))
                self.matches_the_reference()
            if self.last is not None:
                observe_metrics(self.last)

    # A state machine cannot take hypothesis.seed: with a seed it runs derandomized instead,
    # which is just as reproducible.
    machine_settings = Settings(
        settings,
        stateful_step_count=MAX_MACHINE_STEPS,
        derandomize=settings.derandomize or seed is not None,
    )
    run_state_machine_as_test(AccumulatorMachine, settings=machine_settings)
