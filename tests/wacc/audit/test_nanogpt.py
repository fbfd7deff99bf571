"""The nanoGPT training loop (``train.py``'s ``loss / gradient_accumulation_steps`` with its
``GradScaler``), written as the script has it: no extra needed."""

from __future__ import annotations

import pytest
import torch

from tests.wacc.audit.expected import assert_mean_weighted_error
from wacc.audit.adapters import ADAPTERS
from wacc.audit.models import MODEL_KINDS
from wacc.audit.runner import AuditResult, Cell, run_audit
from wacc.audit.truth import compute_truth
from wacc.audit.windows import build_window

WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS["nanogpt"]], [build_window(w) for w in WINDOWS])


def _cell(result: AuditResult, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.window == window]
    assert cell.status == "ok", cell.status
    return cell


@pytest.mark.parametrize("window", WINDOWS)
def test_loss_over_accumulation_steps_weighs_microbatches_equally(
    result: AuditResult, window: str
) -> None:
    """The loop hands the optimizer Σ_k mean_k / K: the float64 run's error is that
    prediction's to float64 rounding: FAIL on the unequal and zero-target windows, exact to
    rounding on the 4x64 control (float32 run within its bound)."""
    cell = _cell(result, window)
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(window))
    assert_mean_weighted_error(cell.semantic_rel_l2, truth, 1 / len(truth.targets), "float64")
    assert cell.counted is None and cell.finite and cell.deterministic
    if window == "equal":
        assert cell.verdict == "pass" and cell.ratio <= 1.0
    else:
        assert cell.verdict == "FAIL" and cell.semantic_rel_l2 > 0.5


def test_loop_facts(result: AuditResult) -> None:
    """The script prefetches batch k+1 before batch k's backward (2 of 4 read at the first
    backward); it has no mid-window checkpoint and no fixed loss scale; its float16 path
    (autocast + GradScaler) skips the window whose one microbatch overflows and halves the
    scale."""
    (fact,) = result.facts
    assert fact.needs_total == "no (2 of 4 read)"
    assert fact.resume.startswith("n/a: train.py saves ckpt.pt only at the top of an iteration")
    assert fact.loss_scale == "not settable"
    assert fact.fp16 == "skips the whole window (scale 65536 -> 32768)"


def test_code_path_names_the_script_lines() -> None:
    """The adapter names the file, commit and lines of nanoGPT it follows."""
    assert "train.py@3adf61e L292-314" in ADAPTERS["nanogpt"].code_path
