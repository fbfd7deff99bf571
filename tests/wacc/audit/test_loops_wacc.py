"""``nanogpt+wacc`` and ``pixparse+wacc``: the nanoGPT and pixparse loops written with
``WeightedGradientsAccumulator`` (no framework), through the audit's runner: they pass every
window where the loops they fix fail, resume mid-window bit for bit, and skip an overflowing
float16 window whole."""

from __future__ import annotations

import pytest

from tests.wacc.audit.fixed import WINDOWS, assert_every_window_passes, assert_points_to, facts
from wacc.audit.adapters import ADAPTERS
from wacc.audit.runner import AuditResult, run_audit
from wacc.audit.windows import build_window

LOOPS = {"nanogpt": "nanogpt+wacc", "pixparse": "pixparse+wacc"}


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[n] for n in LOOPS.values()], [build_window(w) for w in WINDOWS])


@pytest.mark.parametrize("loop", LOOPS.values())
def test_every_window_passes_with_the_true_count(result: AuditResult, loop: str) -> None:
    """Each microbatch's mean weighted by its tokens: a pass on every window (the unequal, the
    zero-target and the long-tail ones included), dividing by the window's true count."""
    assert_every_window_passes(result, loop)


@pytest.mark.parametrize("loop", LOOPS.values())
def test_mid_window_resume_restores_the_pending_gradient(result: AuditResult, loop: str) -> None:
    """The accumulator's record saved with the checkpoint after 2 of 4 microbatches, loaded in
    fresh objects: the step is bit-identical to the uninterrupted run; a fixed loss scale is
    divided out exactly once."""
    fact = facts(result, loop)
    assert fact.resume == "restored (bit-identical)"
    assert fact.loss_scale == "divided out once (bit-identical)"


@pytest.mark.parametrize("loop", LOOPS.values())
def test_float16_overflow_skips_the_whole_window(result: AuditResult, loop: str) -> None:
    """The float16 path with WindowLossScaler: the window whose one microbatch overflows is
    skipped whole and the scale halves, while its clean twin is applied (else the fact would
    say so)."""
    assert facts(result, loop).fp16 == "skips the whole window (scale 65536 -> 32768)"


@pytest.mark.parametrize(("loop", "fix"), LOOPS.items())
def test_the_failing_loop_points_to_its_fix(loop: str, fix: str) -> None:
    """nanogpt and pixparse name their +wacc row (registered right after them) and the line of
    their loop that weighs microbatches equally."""
    assert_points_to(loop, fix)
    assert "accum" in (ADAPTERS[loop].cause or "")
