"""A test helper, not the audit's world runner: runs one adapter as an N-rank world started by
``python -m torch.distributed.run`` (gloo, CPU) and checks what every rank handed its optimizer.

Run as a script by :func:`run_world` (one process per rank, the torchrun environment set by
torchrun itself): each rank builds its :class:`LoopTask` on its own window of :func:`rank_windows`
(a stand-in for ``wacc.audit.windows.rank_windows``: token totals that differ across ranks, one
rank with a zero-token microbatch and very few tokens), calls ``adapter.run(task)`` and saves the
gradient ``task.record_gradients`` captured with ``torch.save``.  The parent reads them back with
``torch.load(weights_only=True)`` and :func:`expected` gives the float64 truth over every rank's
tokens together plus the two predictions a loop that weighs ranks (or microbatches) alike makes.
"""

from __future__ import annotations

import gc
import importlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from tests.wacc.audit.expected import prediction_bound
from wacc.audit.metrics import relative_l2
from wacc.audit.models import MODEL_KINDS
from wacc.audit.protocol import Adapter, LoopTask
from wacc.audit.truth import Truth, compute_truth, flatten
from wacc.audit.windows import Window, _sequences, _window, build_fp16_window

ROOT = Path(__file__).resolve().parents[3]

# Per rank K = 4 microbatches (the same K on every rank: one optimizer step each).  Rank 0 holds
# ``unequal`` (211 tokens); rank 1 has a zero-token microbatch and 17 tokens in all.
_RANK_TARGETS: tuple[tuple[int, ...], ...] = ((1, 7, 200, 3), (5, 0, 9, 3), (30, 2, 40, 11))


def rank_windows(world_size: int) -> tuple[Window, ...]:
    """Rank ``r``'s window for each rank of a ``world_size`` world (at most 3 here)."""
    return tuple(
        _window(f"rank{r}", targets, _sequences(targets, seed=100 + r))
        for r, targets in enumerate(_RANK_TARGETS[:world_size])
    )


def _adapter(spec: str) -> Adapter:
    module, _, attribute = spec.partition(":")
    adapter: Adapter = getattr(importlib.import_module(module), attribute)
    return adapter


# The dtype arguments that run the loop's float16 path (:func:`run_world_fp16`): the overflow
# window spiked on rank 0 only, or its clean twin on every rank.
FP16, FP16_CLEAN = "fp16", "fp16-clean"


def _rank_main(spec: str, out: Path, dtype_name: str) -> None:
    """One rank: run the adapter on this rank's window, save what it captured.  With ``FP16``:
    the loop's float16 path (float32 parameters) on the float16 overflow window, spiked on rank 0
    only (every other rank its clean twin; ``FP16_CLEAN``: the clean twin everywhere), and whether
    the parameters moved."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    adapter = _adapter(spec)
    workdir = out / f"rank{rank}"
    workdir.mkdir(parents=True, exist_ok=True)
    fp16 = dtype_name in (FP16, FP16_CLEAN)
    spiked = dtype_name == FP16 and rank == 0
    task = LoopTask(
        model_spec=MODEL_KINDS[adapter.model],
        dtype=torch.float32 if fp16 else getattr(torch, dtype_name),
        window=build_fp16_window(spike=spiked) if fp16 else rank_windows(world_size)[rank],
        workdir=workdir,
        world_size=world_size,
        rank=rank,
        backend="gloo",
        fp16=fp16,
    )
    result = adapter.run(task)
    fresh = dict(task.model_spec.build(task.dtype).named_parameters())
    moved = [
        not torch.equal(p.detach(), fresh[n].detach())
        for n, p in task.models[-1].named_parameters()
    ]
    # The loop's objects go before the process group (as wacc.audit.world does): one that DDP
    # still holds would be freed at interpreter exit, where gloo can abort the process.
    task.models.clear()
    gc.collect()
    if torch.distributed.is_initialized():  # the machinery's job at merge (protocol item 4)
        torch.distributed.destroy_process_group()
    torch.save(
        {
            "captured": task.captured,
            "counted": result.counted_tokens,
            "steps_seen": task.steps_seen,
            "fetched": sorted(set(task.fetch_log)),
            "changed": any(moved),
            "loss_scales": list(result.loss_scales) if result.loss_scales else None,
            "spike_overflowed": any(s.spike_overflowed for s in task.spikes),
        },
        out / f"rank{rank}.pt",
    )


@dataclass(frozen=True)
class RankResult:
    """What one rank handed its optimizer, and what it said it divided by."""

    gradient: NDArray[np.float64]
    counted: float | None
    steps_seen: int
    fetched: list[int]


@dataclass(frozen=True)
class Fp16RankResult:
    """One rank's float16 run: whether its parameters moved, its scaler's scale around the
    window, whether its own spike overflowed float16."""

    changed: bool
    loss_scales: tuple[float, float] | None
    spike_overflowed: bool


def run_world_fp16(
    spec: str, world_size: int, *, spike: bool = True, timeout: float = 300
) -> list[Fp16RankResult]:
    """Run adapter ``module:ATTR``'s float16 path as a ``world_size``-rank torchrun world on the
    float16 overflow window, spiked on rank 0 only (``spike=False``: nowhere); every rank's
    outcome."""
    results = []
    for saved in _run_ranks(spec, world_size, FP16 if spike else FP16_CLEAN, timeout):
        scales = saved["loss_scales"]
        results.append(
            Fp16RankResult(
                changed=saved["changed"],
                loss_scales=None if scales is None else (scales[0], scales[1]),
                spike_overflowed=saved["spike_overflowed"],
            )
        )
    return results


def run_world(
    spec: str, world_size: int, *, dtype: str = "float64", timeout: float = 300
) -> list[RankResult]:
    """Run adapter ``module:ATTR`` as a ``world_size``-rank torchrun world; every rank's result."""
    adapter = _adapter(spec)
    names = expected(adapter.model, world_size, dtype).truth_names
    results = []
    for rank, saved in enumerate(_run_ranks(spec, world_size, dtype, timeout)):
        if saved["captured"] is None:
            raise AssertionError(f"rank {rank} never called record_gradients")
        results.append(
            RankResult(
                gradient=flatten(saved["captured"], names),
                counted=saved["counted"],
                steps_seen=saved["steps_seen"],
                fetched=saved["fetched"],
            )
        )
    return results


def _run_ranks(spec: str, world_size: int, dtype: str, timeout: float) -> list[dict[str, Any]]:
    """The torchrun world of :func:`_rank_main`; what every rank saved, read back."""
    with tempfile.TemporaryDirectory(prefix="wacc-ranks-") as tmp:
        out = Path(tmp)
        _run_torchrun(spec, world_size, dtype, out, timeout)
        return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


def _run_torchrun(spec: str, world_size: int, dtype: str, out: Path, timeout: float) -> None:
    """Each rank of the world saves to ``out/rank<r>.pt`` (raises when the world fails)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world_size}",
        "--standalone",  # the agent binds its store's port itself
        __file__, spec, str(out), dtype,
    ]  # fmt: skip
    with subprocess.Popen(
        command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as world:
        try:
            _, stderr = world.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts each rank in a session of its own: only its SIGTERM handler
            # (which stops the workers it started) ends a world that hangs, ranks included.
            world.terminate()
            try:
                world.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                # torchrun starts each rank in a session of its own: only its SIGTERM handler
                # (which stops the workers it started) ends a world that hangs, ranks included.
                world.terminate()
                try:
                    world.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    world.kill()
                    world.communicate()
                raise AssertionError(f"world of {spec} still running after {timeout} s") from None
        if world.returncode != 0:
            raise AssertionError(f"world exited {world.returncode}:\n{stderr[-6000:]}")
        return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


@dataclass(frozen=True)
class Expected:
    """The float64 truth across ranks and what the equal-weighting loops compute."""

    truth_names: tuple[str, ...]
    truth: NDArray[np.float64]  # Σ_r Σ_k g_rk / Σ_r T_r
    equal_ranks: NDArray[np.float64]  # mean_r (Σ_k g_rk / T_r): DDP's mean of token means
    equal_microbatches: NDArray[np.float64]  # mean over every (r, k) of g_rk / n_rk
    rank_tokens: tuple[int, ...]
    rank_sums: tuple[NDArray[np.float64], ...]  # Σ_k g_rk per rank
    truths: tuple[Truth, ...]  # per rank: its window's g_rk and n_rk

    def rel(self, measured: NDArray[np.float64]) -> float:
        """Relative L2 error of ``measured`` against the truth."""
        return relative_l2(measured, self.truth)

    @property
    def predicted_equal_ranks(self) -> float:
        """The error predicted for a loop weighing ranks equally (token mean within a rank)."""
        return self.rel(self.equal_ranks)

    def divided_by(self, counts: Sequence[float]) -> NDArray[np.float64]:
        """DDP's mean over ranks of ``Σ_k g_rk / counts[r]``: a loop whose rank ``r`` divides its
        loss sum by ``counts[r]`` (the count it reports), its gradients then averaged."""
        return np.mean([s / c for s, c in zip(self.rank_sums, counts, strict=True)], axis=0)

    @property
    def predicted_equal_microbatches(self) -> float:
        """The error predicted for a loop weighing every microbatch's mean equally."""
        return self.rel(self.equal_microbatches)

    def equal_microbatches_bound(self, dtype: str) -> NDArray[np.float64]:
        """How far a run in ``dtype`` may be from :attr:`equal_microbatches`
        (:func:`tests.wacc.audit.expected.prediction_bound` of its terms ``(1 / (M n_rk), g_rk)``,
        ``M`` every rank's microbatches)."""
        count = sum(len(t.targets) for t in self.truths)
        return prediction_bound(
            [
                (1 / (count * n), g)
                for t in self.truths
                for g, n in zip(t.microbatch_sums, t.targets, strict=True)
                if n
            ],
            dtype,
        )

    def divided_by_bound(self, counts: Sequence[float], dtype: str) -> NDArray[np.float64]:
        """How far a run in ``dtype`` may be from :meth:`divided_by` (terms
        ``(1 / (R counts[r]), g_rk)``, ``R`` ranks)."""
        ranks = len(self.truths)
        return prediction_bound(
            [
                (1 / (ranks * c), g)
                for t, c in zip(self.truths, counts, strict=True)
                for g in t.microbatch_sums
            ],
            dtype,
        )


def expected(
    model: str, world_size: int, dtype: str = "float64", windows: Sequence[Window] | None = None
) -> Expected:
    """:class:`Expected` on ``model`` (converted to ``dtype``) for :func:`rank_windows` (or the
    given per-rank ``windows``: the audit's own, for a row of ``wacc audit --world-size``)."""
    truths: list[Truth] = [
        compute_truth(MODEL_KINDS[model], getattr(torch, dtype), window)
        for window in (rank_windows(world_size) if windows is None else windows)
    ]
    totals = tuple(sum(t.targets) for t in truths)
    summed = np.sum([np.sum(t.microbatch_sums, axis=0) for t in truths], axis=0)
    # A zero-target microbatch's mean-loss gradient is zero (no target reaches the logits).
    per_microbatch = [
        g / n if n else np.zeros_like(g)
        for t in truths
        for g, n in zip(t.microbatch_sums, t.targets, strict=True)
    ]
    return Expected(
        truth_names=truths[0].names,
        truth=summed / sum(totals),
        equal_ranks=np.mean([t.gradient for t in truths], axis=0),
        equal_microbatches=np.mean(per_microbatch, axis=0),
        rank_tokens=totals,
        rank_sums=tuple(np.sum(t.microbatch_sums, axis=0) for t in truths),
        truths=tuple(truths),
    )


if __name__ == "__main__":
    _rank_main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
