"""Lightning's two accumulation paths audited through the real ``Trainer.fit`` (the `lightning`
extra; skipped without it, where the audit shows a "not installed" row)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests.wacc.audit.expected import assert_mean_weighted_error  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.runner import AuditResult, Cell, run_audit  # noqa: E402
from wacc.audit.truth import compute_truth  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOPS = ("lightning", "lightning-manual")
WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def audit() -> tuple[AuditResult, list[str]]:
    """The audit, run from an empty working directory (returned: what it left there)."""
    with tempfile.TemporaryDirectory(prefix="wacc-lightning-cwd-") as cwd:
        before = Path.cwd()
        os.chdir(cwd)
        try:
            result = run_audit([ADAPTERS[n] for n in LOOPS], [build_window(w) for w in WINDOWS])
        finally:
            os.chdir(before)
        return result, sorted(os.listdir(cwd))


def _cell(result: AuditResult, loop: str, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.adapter == loop and c.window == window]
    assert cell.status == "ok", cell.status
    return cell


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_each_microbatch_weighs_the_same(
    audit: tuple[AuditResult, list[str]], loop: str, window: str
) -> None:
    """Automatic (`accumulate_grad_batches=K`) and the manual recipe (`loss / N`) hand the
    optimizer Σ_k mean_k / K: the float64 run's error is that prediction's to float64 rounding,
    a FAIL on the unequal and the zero-target windows, and exact to rounding on the 4x64 control
    (the float32 run within the float32 rounding of the prediction too)."""
    result, _ = audit
    cell = _cell(result, loop, window)
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(window))
    factor = 1 / len(truth.targets)
    assert_mean_weighted_error(cell.semantic_rel_l2, truth, factor, "float64")
    assert cell.counted is None and cell.finite and cell.deterministic
    if window == "equal":
        assert cell.verdict == "pass" and cell.ratio <= 1.0
        assert_mean_weighted_error(cell.rel_l2, truth, factor, "float32")
    else:
        assert cell.verdict == "FAIL" and cell.semantic_rel_l2 > 0.5


@pytest.mark.parametrize("loop", LOOPS)
def test_mid_window_resume_rereads_the_epoch_without_the_pending_gradient(
    audit: tuple[AuditResult, list[str]], loop: str
) -> None:
    """`trainer.save_checkpoint` after 2 of 4 microbatches, then `fit(ckpt_path=...)` in fresh
    objects: the accumulated gradient is gone and the plain DataLoader starts over while the
    batch counter goes on, so the step comes after microbatches 0 and 1 again:
    (g_0/n_0 + g_1/n_1) / 4 (measured error = that prediction's to float32 rounding, float32
    run)."""
    result, _ = audit
    (fact,) = [f for f in result.facts if f.adapter.name == loop]
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window("unequal"))
    assert fact.resume == "pending gradient lost"
    assert_mean_weighted_error(fact.resume_rel_l2, truth, 1 / 4, "float32", microbatches=(0, 1))
    assert fact.loss_scale == "not settable"


def test_fp16_on_cpu_is_bf16_without_a_scaler(audit: tuple[AuditResult, list[str]]) -> None:
    """`Trainer(precision="16-mixed")` on CPU: Lightning switches to bf16-mixed (no float16
    logits, no GradScaler), so the spike never overflows and the window is applied."""
    result, _ = audit
    expected = (
        "no float16 compute, nothing overflows: applies the window "
        "(no GradScaler: Lightning runs 16-mixed as bf16-mixed on CPU)"
    )
    assert [f.fp16 for f in result.facts] == [expected, expected]


def test_nothing_is_left_in_the_working_directory(audit: tuple[AuditResult, list[str]]) -> None:
    """No lightning_logs, checkpoints or other files outside the task's workdir."""
    _, left = audit
    assert left == []
