"""``lightning+wacc`` and ``lightning-manual+wacc`` through the real ``Trainer.fit`` (the
`lightning` extra; skipped without it): ``TokenWeightedAccumulation`` on automatic optimization
and the manual recipe pass every window where Lightning's own accumulation fails, keep the
pending gradient across a mid-window checkpoint (the record inside Lightning's checkpoint), and
skip an overflowing float16 window whole."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.wacc.audit.fixed import (  # noqa: E402
    WINDOWS,
    assert_every_window_passes,
    assert_points_to,
    facts,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOPS = {"lightning": "lightning+wacc", "lightning-manual": "lightning-manual+wacc"}


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[n] for n in LOOPS.values()], [build_window(w) for w in WINDOWS])


@pytest.mark.parametrize("loop", LOOPS.values())
def test_every_window_passes_with_the_true_count(result: AuditResult, loop: str) -> None:
    """Lightning's division by accumulate_grad_batches undone in the backward and each mean
    weighted by its tokens: a pass on every window, dividing by the window's true count."""
    assert_every_window_passes(result, loop)


@pytest.mark.parametrize("loop", LOOPS.values())
def test_mid_window_resume_restores_the_pending_gradient(result: AuditResult, loop: str) -> None:
    """`trainer.save_checkpoint` after 2 of 4 batches and `fit(ckpt_path=...)` in fresh objects
    (a resumable loader): the accumulator's record in Lightning's checkpoint makes the step
    bit-identical to the uninterrupted run."""
    assert facts(result, loop).resume == "restored (bit-identical)"


@pytest.mark.parametrize("loop", LOOPS.values())
def test_float16_overflow_skips_the_whole_window(result: AuditResult, loop: str) -> None:
    """Under Lightning's 16-mixed plugin (float16 autocast + its GradScaler), the mean written
    before the scaler unscales: one overflowing microbatch skips the whole window and halves
    the scale, the clean twin is applied."""
    assert facts(result, loop).fp16 == "skips the whole window (scale 65536 -> 32768)"


@pytest.mark.parametrize(("loop", "fix"), LOOPS.items())
def test_the_failing_loop_points_to_its_fix(loop: str, fix: str) -> None:
    """Each Lightning row names its +wacc row (registered right after it) and its cause."""
    assert_points_to(loop, fix)
