"""The "Fix your framework" pages of the loops written without a framework (nanoGPT, pixparse)
run as written: they train, weigh each microbatch by its tokens, skip nothing on clean float
windows and resume a window from its record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fix_your_framework import blocks, run_page


@pytest.mark.parametrize("page", ["nanogpt.md", "pixparse.md"])
def test_each_page_has_one_block(page: str) -> None:
    """Each page shows its loop as one Python block, built on WeightedGradientsAccumulator."""
    (block,) = blocks(page)
    assert "WeightedGradientsAccumulator(" in block and "accumulate_mean(" in block


def test_nanogpt_loop_runs_and_resumes_mid_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The changed train.py loop trains 3 iterations (every window applied: the bfloat16
    autocast never overflows) and its mid-window checkpoint resumes 2 pending micro-steps whose
    weight is the tokens they held."""
    monkeypatch.chdir(tmp_path)
    namespace = run_page("nanogpt.md", tmp_path)
    state = namespace["resumed"].state
    assert state.issued == 2 and state.total_weight > 0
    assert namespace["scaler"].scale == 2.0**16  # restored, never backed off
    assert "2 micro-steps pending; continue at 2" in capsys.readouterr().out


def test_pixparse_train_step_applies_each_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The changed train_step under float16 autocast, as the page says: the first window
    overflows at 2**16 and is skipped whole (the scale halves), the second is applied; the model
    stays finite."""
    monkeypatch.chdir(tmp_path)
    namespace = run_page("pixparse.md", tmp_path)
    assert namespace["applied"] == [False, True]
    assert namespace["scaler"].scale == 2.0**15
    assert all(torch.isfinite(p).all() for p in namespace["model"].parameters())
