"""The audit across data-parallel ranks (``wacc audit --world-size N``, N = 2 or 4).

Per loop × window: rank ``r`` runs on :func:`wacc.audit.windows.rank_windows`' window ``r`` (token
totals that differ across ranks, a zero-target microbatch, a rank with very few tokens), each loop
in a world of N real processes per window (:func:`wacc.audit.world.run_world`) that runs it three
times, as at world size 1: twice in the audited dtype ``D`` (errors; whether the two hash the same)
and once on the float64 copy (the verdict). The truth is the float64 gradient of the mean token
loss over every rank's tokens together (:func:`wacc.audit.windows.world_window`), its bound the one
for summing every rank's microbatch sums (:func:`wacc.audit.metrics.bound_for`). Every rank's
captured gradient is compared with the truth; the row shows rank 0's errors, the verdict takes the
worst rank, and ``ranks agree`` says whether every rank handed its optimizer the same gradient in
``D`` (bit for bit; when not, the largest rel L2 between a rank and rank 0: a disagreement FAILs
the row).

For a loop that weighs ranks equally (``Adapter.weighs_ranks_equally``: the mean over ranks of
each rank's token mean, what DDP's average makes of a per-rank mean) the error is predicted from
the per-rank token totals and per-rank exact gradients alone
(:func:`wacc.audit.truth.equal_rank_mean`): ``predicted_rel_l2`` beside the measured float64
error.  The per-loop facts of world size 1 (mid-window resume, fixed loss scale, float16
overflow) are not measured across ranks; ``reads window first`` is rank 0's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from wacc.audit.metrics import (
    bound_for,
    bound_ratio,
    gradient_hash,
    max_relative_element,
    normwise_ratio,
    relative_l2,
)
from wacc.audit.models import MODEL_KINDS
from wacc.audit.protocol import Adapter
from wacc.audit.results import DTYPES, AuditResult, Cell, LoopFacts, describe_error
from wacc.audit.truth import Truth, compute_truth, equal_rank_mean, flatten
from wacc.audit.windows import Window, rank_windows, world_window
from wacc.audit.world import RankOutcome, run_world

__all__ = ["NOT_ACROSS_RANKS", "run_ranks"]

NOT_ACROSS_RANKS = "measured at world size 1 only"  # the facts not measured across ranks


def run_ranks(
    adapters: Sequence[Adapter],
    names: Sequence[str],
    *,
    dtype: str,
    world_size: int,
    progress: Callable[[int], Callable[[], None]] | None = None,
    jobs: int = 1,
) -> AuditResult:
    """Audit ``adapters`` on the rank windows called ``names`` in worlds of ``world_size``
    processes (module docstring), ``jobs`` loops at a time (each rank with the machine's cores
    shared out: torch threads = cores // (jobs * world_size))."""
    per_rank = {name: rank_windows(name, world_size) for name in names}
    joined = [world_window(name, per_rank[name]) for name in names]
    runnable = [a for a in adapters if _unavailable(a, world_size) is None]
    tick = progress(3 * len(names) * len(runnable)) if progress else (lambda: None)
    threads = max(1, (os.cpu_count() or 1) // (jobs * world_size))
    facts = [LoopFacts(adapter=a, version=a.version(), model=a.model) for a in adapters]
    cells: list[list[Cell]] = [[] for _ in adapters]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {}
        for index, adapter in enumerate(adapters):
            missing = _unavailable(adapter, world_size)
            if missing is not None:
                facts[index].status = missing
                cells[index] = [_cell(adapter, w, per_rank[w.name], status=missing)
                                for w in joined]  # fmt: skip
                continue
            futures[index] = pool.submit(
                _audit_loop, adapter, joined, per_rank, facts[index], dtype=dtype,
                threads=threads, tick=tick,
            )  # fmt: skip
        for index, future in futures.items():
            cells[index] = future.result()
    return AuditResult(
        dtype=dtype, windows=joined, facts=facts, cells=[c for row in cells for c in row],
        world_size=world_size, rank_windows=per_rank,
    )  # fmt: skip


def _unavailable(adapter: Adapter, world_size: int) -> str | None:
    return adapter.unavailable() or adapter.ranks_unavailable(world_size)


def _cell(adapter: Adapter, joined: Window, ranks: Sequence[Window], *, status: str) -> Cell:
    return Cell(
        adapter.name, joined.name, status=status, true_count=joined.total_targets,
        world_size=len(ranks), rank_tokens=tuple(w.total_targets for w in ranks),
    )  # fmt: skip


def _audit_loop(
    adapter: Adapter,
    joined: Sequence[Window],
    per_rank: dict[str, tuple[Window, ...]],
    fact: LoopFacts,
    *,
    dtype: str,
    threads: int,
    tick: Callable[[], None],
) -> list[Cell]:
    """Every window of one loop (a thread of :func:`run_ranks`)."""
    fact.resume = fact.loss_scale = fact.fp16 = NOT_ACROSS_RANKS
    out = []
    for index, window in enumerate(joined):
        ranks = per_rank[window.name]
        cell = _cell(adapter, window, ranks, status="ok")
        out.append(cell)
        try:
            _audit_window(adapter, window, ranks, cell, fact, dtype=dtype, threads=threads,
                          tick=tick, first=index == 0)  # fmt: skip
        except _RankFailed as exc:
            cell.status = str(exc)
            if index == 0:
                fact.notes.append(f"{window.name}: {cell.status}")
        except Exception as exc:  # a loop that raises is a finding, not a crash
            cell.status = describe_error(exc)
            if index == 0:
                fact.notes.append(f"{window.name}: {cell.status}")
    return out


class _RankFailed(Exception):
    """A rank's error, already worded as a row's status."""


def _gradients(outcomes: Sequence[RankOutcome], truth: Truth) -> list[np.ndarray]:
    errors = [o.error for o in outcomes if o.error]
    if errors:  # a rank's own error rather than a peer killed waiting for it, where there is one
        own = [e for e in errors if "still running" not in e]
        raise _RankFailed((own or errors)[0])
    out = []
    for outcome in outcomes:
        assert outcome.captured is not None
        out.append(flatten(outcome.captured, truth.names))
    return out


def _audit_window(
    adapter: Adapter,
    window: Window,
    ranks: Sequence[Window],
    cell: Cell,
    fact: LoopFacts,
    *,
    dtype: str,
    threads: int,
    tick: Callable[[], None],
    first: bool,
) -> None:
    torch_dtype = DTYPES[dtype]
    truth = compute_truth(MODEL_KINDS[adapter.model], torch_dtype, window)
    bound = bound_for(truth, dtype)
    if first:
        fact.truth_casts, fact.loss_casts = truth.casts, truth.loss_casts

    runs = run_world(adapter, ranks, dtypes=(torch_dtype, torch_dtype, torch.float64),
                     weights_dtype=torch_dtype, threads=threads)  # fmt: skip
    for _ in runs:
        tick()
    outcomes = runs[0]
    observed = _gradients(outcomes, truth)
    again = _gradients(runs[1], truth)
    semantic = _gradients(runs[2], truth)
    cell.rank_counted = tuple(o.counted for o in outcomes)
    cell.counted = None if outcomes[0].counted is None else float(outcomes[0].counted)
    cell.digest = gradient_hash(observed[0])
    hashes = [gradient_hash(g) for g in observed]
    cell.deterministic = hashes == [gradient_hash(g) for g in again]
    cell.ranks_agree = len(set(hashes)) == 1
    cell.rank_spread = max(relative_l2(g, observed[0]) for g in observed)
    cell.finite = all(bool(np.all(np.isfinite(g))) for g in observed)
    cell.rel_l2 = relative_l2(observed[0], truth.gradient)
    cell.max_rel = max_relative_element(observed[0], truth.gradient)
    cell.ratio = normwise_ratio(observed[0], truth, bound)
    cell.element_ratio = bound_ratio(observed[0], truth, bound)
    worst = max(range(len(semantic)), key=lambda r: normwise_ratio(semantic[r], truth, bound))
    cell.semantic_rel_l2 = relative_l2(semantic[worst], truth.gradient)
    cell.semantic_ratio = normwise_ratio(semantic[worst], truth, bound)
    cell.semantic_element_ratio = bound_ratio(semantic[worst], truth, bound)
    if adapter.weighs_ranks_equally:
        predicted = equal_rank_mean(truth, [w.targets for w in ranks])
        cell.predicted_rel_l2 = relative_l2(predicted, truth.gradient)
    for outcome in outcomes:
        if outcome.note:
            fact.notes.append(f"rank {outcome.rank}: {outcome.note}")
    if not cell.ranks_agree:
        fact.notes.append(
            f"{window.name}: ranks disagree (largest rel L2 from rank 0: {cell.rank_spread:.3g})"
        )
    if first:
        k = len(ranks[0].microbatches)
        fetched = outcomes[0].fetched_at_first_backward
        fact.needs_total = "yes" if fetched == k and k > 1 else f"no ({fetched} of {k} read)"
