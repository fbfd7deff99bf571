"""``deepspeed+wacc`` through DeepSpeed's real engine on the CPU (the `deepspeed` extra; skipped
without it): ``TokenWeightedEngine`` passes every window where the engine's own accumulation
fails, keeps the pending gradient across a mid-window checkpoint (the record in DeepSpeed's
``client_state``), and lets the engine's float16 GradScaler skip an overflowing window whole."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from tests.wacc.audit.fixed import (  # noqa: E402
    WINDOWS,
    assert_every_window_passes,
    assert_points_to,
    facts,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOP = "deepspeed+wacc"


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[LOOP]], [build_window(w) for w in WINDOWS])


def test_every_window_passes_with_the_true_count(result: AuditResult) -> None:
    """engine.backward(loss, scale_wrt_gas=False) and each mean weighted by its tokens: a pass on
    every window, dividing by the window's true count (the engine's all-reduce, which would
    round the float64 run's mean through float32, is off: float64 noise only)."""
    assert_every_window_passes(result, LOOP)


def test_mid_window_resume_restores_the_pending_gradient(result: AuditResult) -> None:
    """`save_checkpoint` after 2 of 4 microbatches, a fresh engine and `load_checkpoint`: the
    record in client_state makes the step bit-identical to the uninterrupted run (the deepspeed
    row never steps after its load: micro_steps is not checkpointed)."""
    assert facts(result, LOOP).resume == "restored (bit-identical)"


def test_float16_overflow_skips_the_whole_window(result: AuditResult) -> None:
    """torch_autocast fp16: the engine's GradScaler unscales the window's mean and skips the
    window whose one microbatch overflowed, halving the scale; the clean twin is applied."""
    assert facts(result, LOOP).fp16 == "skips the whole window (scale 65536 -> 32768)"


def test_the_failing_loop_points_to_its_fix() -> None:
    """The deepspeed row names deepspeed+wacc (registered right after it) and engine.py's line."""
    assert_points_to("deepspeed", LOOP)
    assert "engine.py:3413" in (ADAPTERS["deepspeed"].cause or "")
