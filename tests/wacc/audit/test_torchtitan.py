"""torchtitan's ``Trainer.train_step`` driven on the CPU at world size 1 (its own step, loss and
``dist_sum_tensor`` over a one-rank gloo mesh) and across two ranks (its ``init_distributed``,
meshes and FSDP wrapping over gloo): runs where ``torchtitan.trainer`` imports (torchtitan 0.3.0
with triton installed: its MoE kernels import it), skips cleanly elsewhere."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.trainer", reason="torchtitan (and triton) not installed")

import torch.distributed as dist  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import run_audit  # noqa: E402
from wacc.audit.windows import build_window, rank_windows  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


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


@pytest.mark.slow
def test_train_step_across_two_ranks_weighs_every_token_alike(tmp_path: Path) -> None:
    """``wacc audit torchtitan --world-size 2`` (the CLI as a subprocess; each rank a real process
    on gloo) on the unequal rank windows (211 and 17 tokens, one rank with a zero-token
    microbatch): torchtitan's ``init_distributed``, ``build_mesh``, ``apply_fsdp_to_decoder``
    (divide factor 1) and ``train_step`` count the world's tokens on every rank
    (``dist_sum_tensor`` over the batch mesh: 228 on both), so the summed reduce-scatter is the
    gradient of the mean over both ranks' tokens: the row passes (the worst rank's float64 run
    within its bound), the ranks agree bit for bit, two runs hash the same, exit 0; and the whole
    window is read before the first backward, as at world size 1."""
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", "torchtitan", "--world-size", "2", "--windows",
         "unequal", "--out", str(tmp_path / "out"), "--quiet"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with (tmp_path / "out" / "audit.csv").open(newline="", encoding="utf-8") as handle:
        (row,) = csv.DictReader(handle)
    totals = [sum(w.targets) for w in rank_windows("unequal", 2)]
    assert row["world_size"] == "2" and row["rank_tokens"] == ";".join(map(str, totals))
    assert row["verdict"] == "pass", row
    assert [float(c) for c in row["rank_tokens_counted"].split(";")] == [sum(totals)] * 2
    assert float(row["f64_err_over_bound"]) <= 1
    assert row["ranks_agree"] == "True" and row["deterministic"] == "True"
    # train_step collects the whole window before its first forward (it counts the tokens first).
    assert row["reads_window_first"] == "yes", row["reads_window_first"]
