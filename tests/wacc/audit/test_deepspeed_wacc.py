"""``deepspeed+wacc`` and ``deepspeed-zero1+wacc`` through DeepSpeed's real engine on the CPU (the
`deepspeed` extra; skipped without it): ``TokenWeightedEngine`` passes every window where the
engine's own accumulation fails, at ZeRO 0 and ZeRO 1, keeps the pending gradient across a
mid-window checkpoint (the record in DeepSpeed's ``client_state``), and lets the engine's float16
GradScaler skip an overflowing window whole, backing off ZeRO 1's scaler, which DeepSpeed
does not."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.wacc.audit.fixed import (  # noqa: E402
    WINDOWS,
    assert_every_window_passes,
    assert_points_to,
    facts,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import AuditResult, _fp16_fact, _Runner, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOP = "deepspeed+wacc"
ZERO1 = "deepspeed-zero1+wacc"


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[LOOP]], [build_window(w) for w in WINDOWS])


@pytest.fixture(scope="module")
def zero1() -> AuditResult:
    return run_audit([ADAPTERS[ZERO1]], [build_window(w) for w in WINDOWS])


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


def test_zero1_passes_every_window_with_the_true_count(zero1: AuditResult) -> None:
    """ZeRO 1 with "gradient_allreduce_op": "sum": each rank's sums over the window's tokens
    into .grad, ZeRO 1's own reduce hands them to its partitioned optimizer: a pass on every
    window, dividing by the window's true count.  Not float64-exact: the float64 copy runs ZeRO
    1's "mode 2" (its float32 gradient accumulation dtype, .grad_accum), which rounds every
    microbatch's gradient to float32 before the accumulator takes it."""
    assert_every_window_passes(zero1, ZERO1, exact=False)


def test_zero1_mid_window_resume_restores_the_pending_gradient(zero1: AuditResult) -> None:
    """ZeRO 1's checkpoint (its partitioned optimizer state) carries the record in client_state:
    the resumed step is bit-identical to the uninterrupted run (the deepspeed-zero1 row never
    steps after its load)."""
    assert facts(zero1, ZERO1).resume == "restored (bit-identical)"


def test_zero1_failing_loop_points_to_its_fix() -> None:
    """The deepspeed-zero1 row names deepspeed-zero1+wacc (registered right after it), engine.py's
    division and ZeRO 1's average of the ranks."""
    assert_points_to("deepspeed-zero1", ZERO1)
    cause = ADAPTERS["deepspeed-zero1"].cause or ""
    assert "engine.py:3413" in cause and "stage_1_and_2.py:1485-1508" in cause


def test_zero1_float16_overflow_skips_the_window_and_backs_off(zero1: AuditResult) -> None:
    """ZeRO 1 under torch_autocast float16: the ZeRO optimizer's GradScaler skips the window
    whose one microbatch overflowed, and TokenWeightedEngine.step() backs the scale off, which
    DeepSpeed's own ZeRO 1 step never does (the deepspeed-zero1 row: "not backed off")."""
    assert facts(zero1, ZERO1).fp16 == "skips the whole window (scale 65536 -> 32768)"


def test_zero1_deepspeed_alone_skips_but_never_backs_off() -> None:
    """The deepspeed-zero1 row's float16 fact, DeepSpeed's ZeRO 1 torch_autocast step on its own:
    the overflowing window skipped, the scale not backed off (stage_1_and_2.py:3043-3050 return
    before :2978's update()), and the lines say so in the installed DeepSpeed."""
    with tempfile.TemporaryDirectory(prefix="wacc-audit-test-") as tmp:
        runner = _Runner(torch.float32, Path(tmp), lambda: None)
        fact = _fp16_fact(runner, ADAPTERS["deepspeed-zero1"])
    assert fact == "skips the whole window (scale 65536 -> 65536, not backed off)", fact
    zero = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    lines = Path(zero.__file__).read_text().splitlines()
    assert "is_invalid_grad_norm(scaled_global_grad_norm)" in lines[3042]
    assert "if self.overflow:" in lines[3049]
    assert "self.torch_autocast_gradscaler.update()" in lines[2977]
