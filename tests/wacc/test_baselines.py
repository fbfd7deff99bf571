"""The shipped baselines: the correct base passes the judge, every baseline is flagged."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from wacc.baselines import (
    fused_undeclared,
    pixparse_loop,
    scale_times_weight,
    spec_accumulator,
)
from wacc.judge.engine import CheckConfig, run_check, run_family
from wacc.judge.implementation import Factory, Implementation, load_implementation
from wacc.judge.verdict import ORACLE_SETS, ScenarioVerdict, judge
from wacc_ref import formats
from wacc_ref.scenario import Accumulate, Finish, Scenario

MAX_SHRUNK_ACCUMULATES = 3  # the limit for a shrunk scenario
EXAMPLES = 100  # the ci budget; each run stops at its first failure


def _load(factory: Factory) -> Implementation:
    return load_implementation(f"wacc.baselines:{factory.__name__}")


def _accumulates(verdict: ScenarioVerdict) -> list[Accumulate]:
    return [step for step in verdict.scenario.steps if isinstance(step, Accumulate)]


@pytest.mark.slow
def test_spec_accumulator_passes_every_family_in_every_work_dtype() -> None:
    """The plain SpecAccumulator passes all three oracles on every family, machine included."""
    report = run_check(_load(spec_accumulator), CheckConfig(examples=8))
    assert report.passed, [finding.verdict.describe() for finding in report.findings]
    assert set(report.summaries) == set(formats.WORK_DTYPES)
    assert all(summary.scenarios > 0 for summary in report.summaries.values())


def test_baselines_declare_the_reproducible_order() -> None:
    """Every baseline claims ``state.fused = False``, so the judge holds it to every bit."""
    for factory in (spec_accumulator, pixparse_loop, scale_times_weight, fused_undeclared):
        implementation = _load(factory)
        assert not implementation.fused
        # Records in the documented layout without a checksum (semantics §9 Reading "integrity").
        expected = ("records", "async_records") if factory is pixparse_loop else ("checksum",)
        assert implementation.missing == expected


def _one_token_each(scenario: Scenario) -> Scenario:
    return dataclasses.replace(
        scenario,
        steps=tuple(
            dataclasses.replace(step, weight=1.0)
            if isinstance(step, Accumulate) and step.weight > 0
            else step
            for step in scenario.steps
        ),
    )


def test_pixparse_loop_is_flagged_within_three_microbatches() -> None:
    """``loss /= accum_steps`` fails the bound within 3 microbatches, only for their weights."""
    implementation = _load(pixparse_loop)
    config = CheckConfig(examples=EXAMPLES, oracles=ORACLE_SETS["bound"])
    verdict = run_family(implementation, "float32", "windows", config)
    assert verdict is not None
    assert "bound" in verdict.failed_oracles, verdict.describe()
    assert 1 <= len(_accumulates(verdict)) <= MAX_SHRUNK_ACCUMULATES, verdict.describe()
    # The same microbatches at one token each: then the loop is exact in float32.
    assert not judge(implementation, _one_token_each(verdict.scenario)).failed


def _spec_window(counts: tuple[int, ...]) -> Scenario:
    # semantics §1's window: mean-loss microbatches, one gradient element each.
    return Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1024.0,
        fused=False,
        parameters=(("w", (1,)),),
        steps=(
            *(
                Accumulate(kind="mean", weight=float(count), grads=(("w", (float(k + 1),)),))
                for k, count in enumerate(counts)
            ),
            Finish("mean"),
        ),
    )


def test_pixparse_loop_fails_the_bound_on_unequal_counts_only() -> None:
    """Counts 1, 7, 200, 3 break the error bound; four microbatches of 7 tokens stay within it."""
    implementation = _load(pixparse_loop)
    unequal = judge(implementation, _spec_window((1, 7, 200, 3)), oracles=ORACLE_SETS["bound"])
    assert unequal.failed_oracles == ("bound",), unequal.describe()
    # The loop's mean (1 + 2 + 3 + 4) / 4 is exact in float32; the right one is 627 / 211.
    right = Fraction(1 * 1 + 7 * 2 + 200 * 3 + 3 * 4, 1 + 7 + 200 + 3)
    assert unequal.maximum("max_rel_error") == float(abs(Fraction(10, 4) - right) / right)
    equal = judge(implementation, _spec_window((7, 7, 7, 7)), oracles=ORACLE_SETS["bound"])
    assert not equal.failed, equal.describe()


def test_scale_times_weight_is_flagged_in_float16() -> None:
    """Dividing once by ``S * W`` in float16 is flagged by the emulation and the bound."""
    verdict = run_family(
        _load(scale_times_weight), "float16", "windows", CheckConfig(examples=EXAMPLES)
    )
    assert verdict is not None
    assert {"emulation", "bound"} <= set(verdict.failed_oracles), verdict.describe()
    assert len(_accumulates(verdict)) <= MAX_SHRUNK_ACCUMULATES


def test_fused_undeclared_is_flagged_in_float32() -> None:
    """A one-pass ``add_(g, alpha=w)`` claiming the reproducible order fails the emulation.

    float32: PyTorch's CPU kernel contracts it into an FMA. In float16/bfloat16 the judge's tiny
    tensors take the kernel's scalar tail, which rounds twice like the semantics, so it shows there
    only on longer tensors.
    """
    verdict = run_family(
        _load(fused_undeclared), "float32", "windows", CheckConfig(examples=EXAMPLES)
    )
    assert verdict is not None
    assert verdict.failed_oracles == ("emulation",), verdict.describe()
    assert 2 <= len(_accumulates(verdict)) <= MAX_SHRUNK_ACCUMULATES
