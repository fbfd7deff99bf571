"""DeepSpeed's engine (ZeRO 0, CPU, gloo, one process) audited through ``deepspeed.initialize``,
``engine.backward`` and ``engine.step`` (the `deepspeed` extra; skipped without it, where the
audit shows a "not installed" row)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.wacc.audit.expected import (  # noqa: E402
    assert_close_to_prediction,
    assert_mean_weighted_error,
    mean_weighted,
    mean_weighted_terms,
    prediction_bound,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.adapters import deepspeed as adapter  # noqa: E402
from wacc.audit.metrics import relative_l2  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import LoopTask  # noqa: E402
from wacc.audit.runner import AuditResult, Cell, _Runner, run_audit  # noqa: E402
from wacc.audit.truth import compute_truth, flatten  # noqa: E402
from wacc.audit.windows import build_fp16_window, build_window  # noqa: E402

WINDOWS = ("unequal", "equal", "zero")
# The engine's all-reduce casts every gradient to communication_data_type (float32 unless
# fp16/bf16: engine.py allreduce_bucket) and back, so the float64 copy's gradient is rounded to
# float32 once: it matches a float64 prediction to float32 rounding (prediction_bound's float32).
REDUCE_DTYPE = "float32"


class Audited(NamedTuple):
    """The audit's result and what it did around it."""

    result: AuditResult
    left: list[str]  # files left in the working directory
    printed: str  # its stdout and stderr
    changed_env: list[str]  # environment variables it changed
    hook_kept: bool  # sys.excepthook is the one from before
    autocast: tuple[Any, Any]  # DeepSpeed's torch_autocast globals: (before, after) the audit


@pytest.fixture(scope="module")
def audit() -> Audited:
    """The audit, run from an empty working directory with its output captured."""
    out = io.StringIO()
    env, hook = dict(os.environ), sys.excepthook
    autocast = importlib.import_module("deepspeed.runtime.torch_autocast")

    def flags() -> tuple[bool, Any]:
        return autocast.TORCH_AUTOCAST_INITIALIZED, autocast.TORCH_AUTOCAST_DTYPE

    before_flags = flags()
    with tempfile.TemporaryDirectory(prefix="wacc-deepspeed-cwd-") as cwd:
        before = Path.cwd()
        os.chdir(cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result = run_audit([ADAPTERS["deepspeed"]], [build_window(w) for w in WINDOWS])
        finally:
            os.chdir(before)
        left = sorted(os.listdir(cwd))
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    kept = sys.excepthook is hook
    return Audited(result, left, out.getvalue(), changed, kept, (before_flags, flags()))


def _cell(result: AuditResult, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.window == window]
    assert cell.status == "ok", cell.status
    return cell


@pytest.mark.slow
@pytest.mark.parametrize("window", WINDOWS)
def test_each_microbatch_weighs_the_same(audit: Audited, window: str) -> None:
    """`engine.backward` divides each microbatch's mean by gradient_accumulation_steps and the
    step comes on the K-th: the optimizer gets Σ_k mean_k / K.  The float64 run's error is that
    prediction's (to the one float32 rounding of the all-reduce), a FAIL on the unequal and the
    zero-target windows and a pass on the 4x64 control; the float32 run is the same to float32
    rounding (the float64 accelerator changes nothing but the dtype check)."""
    result = audit.result
    cell = _cell(result, window)
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(window))
    factor = 1 / len(truth.targets)
    assert_mean_weighted_error(cell.semantic_rel_l2, truth, factor, REDUCE_DTYPE)
    assert_mean_weighted_error(cell.rel_l2, truth, factor, "float32")
    assert cell.counted is None and cell.finite and cell.deterministic
    if window == "equal":
        assert cell.verdict == "pass" and cell.ratio <= 1.0 and cell.semantic_ratio < 1.0
    else:
        assert cell.verdict == "FAIL" and cell.semantic_rel_l2 > 0.5


@pytest.mark.slow
def test_float64_copy_is_rounded_to_float32_once() -> None:
    """The float64 copy's gradient is the float64 prediction rounded to float32 (the all-reduce's
    communication_data_type), not the prediction itself: within float32 rounding of it, and
    bit-equal to it cast to float32 and back element by element."""
    window = build_window("unequal")
    truth = compute_truth(MODEL_KINDS["plain"], torch.float64, window)
    with tempfile.TemporaryDirectory() as workdir:
        task = LoopTask(model_spec=MODEL_KINDS["plain"], dtype=torch.float64, window=window,
                        workdir=Path(workdir), weights_dtype=torch.float32)  # fmt: skip
        adapter.run(task)
    assert task.captured is not None
    observed = flatten(task.captured, truth.names)
    factor = 1 / len(truth.targets)
    predicted = mean_weighted(truth, factor)
    assert relative_l2(observed, predicted) > 0
    bound = prediction_bound(mean_weighted_terms(truth, factor), REDUCE_DTYPE)
    assert_close_to_prediction(observed, predicted, bound)
    assert (observed == observed.astype("float32").astype("float64")).all()


@pytest.mark.slow
def test_mid_window_checkpoint_loses_the_gradient_and_the_micro_step_count(
    audit: Audited,
) -> None:
    """`engine.save_checkpoint` after 2 of 4 microbatches and `engine.load_checkpoint` in a fresh
    engine: the checkpoint holds no `.grad` and no `micro_steps`, so the resumed engine's boundary
    is 4 microbatches after the load and the 2 that remain never reach it (the row says so)."""
    result = audit.result
    (fact,) = result.facts
    assert fact.resume.startswith(
        "error: RuntimeError: never steps after load_checkpoint: micro_steps restarts at 0 "
        "(not checkpointed), boundary 4 microbatches on, 2 remain"
    )
    assert fact.loss_scale == "not settable"


@pytest.mark.slow
def test_resumed_engine_steps_c_microbatches_late() -> None:
    """Resumed after 2 of 4 microbatches, the engine steps only once it has seen 4 more: a loop
    that goes on into the next epoch (microbatches 2, 3, then 0, 1 again) hands the optimizer
    (Σ_{k≥2} mean_k + Σ_{k<2} mean_k) / 4 — the pending gradient of 0 and 1 is gone, their next
    epoch's fills its place; the checkpoint file has the module, no gradient, no micro_steps."""
    window = build_window("unequal")
    truth = compute_truth(MODEL_KINDS["plain"], torch.float64, window)
    with tempfile.TemporaryDirectory() as workdir:
        task = LoopTask(model_spec=MODEL_KINDS["plain"], dtype=torch.float64, window=window,
                        workdir=Path(workdir), weights_dtype=torch.float32)  # fmt: skip
        data, directory = task.dataset, str(task.workdir / "ckpt")
        with adapter._world(task.dtype) as deepspeed:
            engine, _ = adapter._engine(task, deepspeed)
            for index in (0, 1):
                engine.backward(engine(**{k: v[None] for k, v in data[index].items()})["loss"])
                engine.step()
            engine.save_checkpoint(directory, tag="mid")
            engine, model = adapter._engine(task, deepspeed)
            engine.load_checkpoint(directory, tag="mid")
            assert engine.micro_steps == 0 and engine.global_steps == 0
            assert all(p.grad is None for p in model.parameters())
            for index in (2, 3, 0, 1):
                assert task.steps_seen == 0
                engine.backward(engine(**{k: v[None] for k, v in data[index].items()})["loss"])
                engine.step()
            assert task.steps_seen == 1
        (saved,) = Path(directory, "mid").glob("*model_states.pt")
        state = torch.load(saved, map_location="cpu", weights_only=False)
    assert "module" in state and "micro_steps" not in state
    assert not any("grad" in key for key in state)
    assert task.captured is not None
    observed = flatten(task.captured, truth.names)
    bound = prediction_bound(mean_weighted_terms(truth, 1 / 4), REDUCE_DTYPE)
    assert_close_to_prediction(observed, mean_weighted(truth, 1 / 4), bound)


@pytest.mark.slow
def test_fp16_is_torch_autocast_with_the_engines_grad_scaler(
    audit: Audited,
) -> None:
    """`torch_autocast` (float16) at ZeRO 0: the engine's own GradScaler skips the overflowing
    window and halves its scale; the clean twin is applied at the same scale (the skip is the
    spike's)."""
    result = audit.result
    with tempfile.TemporaryDirectory(prefix="wacc-audit-test-") as tmp:
        runner = _Runner(torch.float32, Path(tmp), lambda: None)
        clean = runner.fp16(ADAPTERS["deepspeed"], build_fp16_window(spike=False))
    assert clean.float16 and clean.finite and clean.changed and not clean.other_overflowed
    assert clean.loss_scales is not None and clean.loss_scales[0] == clean.loss_scales[1]
    before = clean.loss_scales[0]
    (fact,) = result.facts
    assert fact.fp16 == f"skips the whole window (scale {before:g} -> {before / 2:g})"


def test_fp16_config_is_refused_without_cpu_float16() -> None:
    """DeepSpeed's `fp16` section (where `loss_scale` — fixed S, or 0 for dynamic — lives) is
    refused by `deepspeed.initialize` on a CPU without oneDNN float16, with its own message."""
    deepspeed_accelerator = pytest.importorskip("deepspeed.accelerator.cpu_accelerator")
    if deepspeed_accelerator.CPU_Accelerator().is_fp16_supported():
        pytest.skip("this CPU has oneDNN float16: DeepSpeed takes its fp16 section here")
    model = MODEL_KINDS["plain"].build(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for loss_scale in (0, 2**10):
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                  "fp16": {"enabled": True, "loss_scale": loss_scale}}  # fmt: skip
        with adapter._world(torch.float32) as deepspeed:
            with pytest.raises(ValueError, match=r"^Type fp16 is not supported on your device\.$"):
                deepspeed.initialize(model=model, optimizer=optimizer, config=config)


@pytest.mark.slow
def test_global_state_is_put_back(audit: Audited) -> None:
    """After the audit: no process group, the environment variables, sys.excepthook and
    DeepSpeed's torch_autocast globals (set for good by the float16 engine, read by every later
    ZeRO optimizer) as they were, nothing left in the working directory, nothing printed
    (DeepSpeed logs to stdout)."""
    assert not torch.distributed.is_initialized()
    assert audit.changed_env == [] and audit.hook_kept
    before, after = audit.autocast
    assert after == before
    assert audit.left == []
    assert audit.printed == ""
