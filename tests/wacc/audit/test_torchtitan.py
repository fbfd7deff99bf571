"""torchtitan's ``Trainer.train_step`` driven on the CPU at world size 1 (its own step, loss and
``dist_sum_tensor`` over a one-rank gloo mesh): runs where ``torchtitan.trainer`` imports
(torchtitan 0.3.0 with triton installed: its MoE kernels import it), skips cleanly elsewhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.trainer", reason="torchtitan (and triton) not installed")

import torch.distributed as dist  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402


def test_train_step_divides_by_the_global_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the unequal and zero-target windows the step sums the labels' valid tokens, hands the
    count to ``dist_sum_tensor`` over the batch mesh (observed: one call per step with the
    window's count) and divides the summed loss by it: counted = true, verdict pass (the float64
    run within the float32 bound: its loss casts the logits to float32), two runs identical, and
    no process group left behind."""
    seen: list[int] = []
    real = dist_utils.dist_sum_tensor

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(int(x))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(dist_utils, "dist_sum_tensor", spy)
    windows = [build_window(w) for w in ("unequal", "zero")]
    result = run_audit([ADAPTERS["torchtitan"]], windows)
    for cell, window in zip(result.cells, windows, strict=True):
        assert cell.status == "ok", cell.status
        assert cell.counted == window.total_targets
        assert cell.verdict == "pass" and cell.deterministic
    assert set(seen) == {w.total_targets for w in windows}
    assert not dist.is_initialized()
    (fact,) = result.facts
    assert fact.version == "0.3.0" and fact.needs_total == "yes"
