"""Runs every requested loop on every requested window and collects the findings.

Per loop × window: the loop runs twice in the audited dtype ``D`` (errors, and whether the two
gradients hash the same) and once on the float64 copy of the model.  The float64 run isolates what
the loop *means* from rounding: its error against the truth is the loop's weighting/count error
(float64 noise is ~2**-29 of a float32 bound), and the verdict is ``pass`` iff that error is
within the bound in ``D`` for the window's sums (:func:`wacc.audit.metrics.bound_for`), read
normwise (``‖e‖₂ ≤ ‖B‖₂``): a model whose own loss casts to float32 (reported) leaves float32
noise in that run, which cancelling elements would blow up elementwise.  Per loop,
on the first window (``unequal`` by default): whether it read the whole window before the first
backward (measured: microbatches fetched when the first gradient arrived); a mid-window checkpoint
after ``K // 2`` microbatches with the loop's own checkpoint call, resumed in fresh objects
(error of the resumed gradient, and whether it is bit-identical to the uninterrupted run); and, if
a fixed loss scale can be set, a run with ``S = 2**10`` (bit-identical to ``S = 1`` = divided out
exactly once, as a power-of-two scale of every value is exact).  Per loop that has a float16 path
(``Adapter.fp16`` is None), ``fp16 overflow``: the loop's own float16 mixed-precision path run on
the float16 overflow window (:func:`wacc.audit.windows.build_fp16_window`: one microbatch holds the
spike token, whose float16 logits overflow; :func:`wacc.audit.models.add_spike`) and on its clean
twin, with SGD at ``lr > 0``.  The outcome is read from the parameters after the run against a
fresh copy, and from the loop's loss scaler: "skips the whole window" (unchanged; the scale
before -> after), "applies non-finite gradients" (a NaN/inf parameter), "drops the microbatch" (a
finite step in the direction of the window without it), or what else was seen; a path that never
computed in float16 says so, as does a clean twin that is not applied.

A loop that is not installed, cannot be imported, or raises is a row saying so, never a crash.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numpy.typing import NDArray

from wacc.audit.metrics import (
    bound_for,
    bound_ratio,
    gradient_hash,
    max_relative_element,
    meaningful_relative_element,
    normwise_ratio,
    relative_l2,
)
from wacc.audit.models import MODEL_KINDS
from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.results import DTYPES, TEST_LOSS_SCALE, AuditResult, Cell, LoopFacts, describe_error
from wacc.audit.truth import Truth, compute_truth, flatten
from wacc.audit.windows import SPIKE_MICROBATCH, Window, build_fp16_window

__all__ = ["AuditResult", "Cell", "LoopFacts", "describe_error", "run_audit", "TEST_LOSS_SCALE"]


# The result types live in wacc.audit.results (the runner across ranks builds them too); the
# runner re-exports them, its callers' one import.
class _Runner:
    def __init__(self, dtype: torch.dtype, workdir: Path, tick: Callable[[], None]) -> None:
        self.dtype = dtype
        self.workdir = workdir
        self.tick = tick
        self.truths: dict[tuple[str, str], Truth] = {}
        self.bounds: dict[tuple[str, str], NDArray[np.float64]] = {}
        self._count = 0

    def truth(self, model: str, window: Window) -> tuple[Truth, NDArray[np.float64]]:
        key = (model, window.name)
        if key not in self.truths:
            truth = compute_truth(MODEL_KINDS[model], self.dtype, window)
            self.truths[key] = truth
            self.bounds[key] = bound_for(truth, str(self.dtype).removeprefix("torch."))
        return self.truths[key], self.bounds[key]

    def once(
        self,
        adapter: Adapter,
        window: Window,
        *,
        dtype: torch.dtype,
        loss_scale: float = 1.0,
        checkpoint_after: int | None = None,
    ) -> tuple[LoopTask, LoopRun, NDArray[np.float64]]:
        self._count += 1
        workdir = self.workdir / f"run{self._count}"
        workdir.mkdir()
        task = LoopTask(
            model_spec=MODEL_KINDS[adapter.model], dtype=dtype, window=window, workdir=workdir,
            loss_scale=loss_scale, checkpoint_after=checkpoint_after, weights_dtype=self.dtype,
        )  # fmt: skip
        run = self._call(adapter, task)
        self.tick()
        if task.captured is None:
            raise RuntimeError("the loop never stepped its optimizer in this window")
        # The truth's parameter order (same model class: a missing name is a KeyError row).
        return task, run, flatten(task.captured, self.truth(adapter.model, window)[0].names)

    def _call(self, adapter: Adapter, task: LoopTask) -> LoopRun:
        # Every loop starts from the same global RNG state, and the caller's comes back (Trainer
        # and accelerate reseed torch, numpy and random).
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return adapter.run(task)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)

    def fp16(self, adapter: Adapter, window: Window, *, tick: bool = True) -> Fp16Run:
        """One run of the loop's float16 path on ``window`` (module docstring)."""
        self._count += 1
        workdir = self.workdir / f"run{self._count}"
        workdir.mkdir()
        spec = MODEL_KINDS[adapter.model]
        task = LoopTask(model_spec=spec, dtype=torch.float32, window=window, workdir=workdir,
                        weights_dtype=self.dtype, fp16=True)  # fmt: skip
        run = self._call(adapter, task)
        if tick:
            self.tick()
        if not task.models:
            raise RuntimeError("the loop never built its model")
        before = dict(spec.build(self.dtype).to(torch.float32).named_parameters())
        after = dict(task.models[-1].named_parameters())
        delta = torch.cat([(after[n].detach() - before[n].detach()).double().reshape(-1)
                           for n in before])  # fmt: skip
        finite = all(bool(torch.isfinite(p.detach()).all()) for p in after.values())
        changed = any(not torch.equal(after[n].detach(), p.detach()) for n, p in before.items())
        return Fp16Run(
            changed=changed, finite=finite, delta=delta, loss_scales=run.loss_scales,
            note=run.note, float16=any(s.float16_logits for s in task.spikes),
            spike_overflowed=any(s.spike_overflowed for s in task.spikes),
            other_overflowed=any(s.other_overflowed for s in task.spikes),
        )  # fmt: skip


@dataclass(frozen=True)
class Fp16Run:
    """What one float16 run did: the parameters after it against a fresh copy, its scaler, and
    what the spike probe saw."""

    changed: bool  # some parameter differs from the fresh copy
    finite: bool  # every parameter is finite
    delta: torch.Tensor  # after - before, flattened (float64)
    loss_scales: tuple[float, float] | None  # the loop's scale before, after (None: no scaler)
    note: str  # the loop's word on it (why no scaler)
    float16: bool  # some logits were computed in float16
    spike_overflowed: bool  # the spike's logits were non-finite
    other_overflowed: bool  # some other position's logits were non-finite

    def outcome(self) -> str:
        """What happened to the parameters (and the scale)."""
        if not self.finite:
            return "applies non-finite gradients"
        if self.changed:
            return "applies the window"
        text = "skips the whole window"
        if self.loss_scales is not None:
            before, after = self.loss_scales
            backed = "" if after < before else ", not backed off"
            text += f" (scale {before:g} -> {after:g}{backed})"
        return text


def _without_spiked_microbatch(window: Window) -> Window:
    keep = [k for k in range(len(window.microbatches)) if k != SPIKE_MICROBATCH]
    return Window(
        name=f"{window.name} without microbatch {SPIKE_MICROBATCH}",
        targets=tuple(window.targets[k] for k in keep),
        microbatches=tuple(window.microbatches[k] for k in keep),
    )


def _fp16_fact(runner: _Runner, adapter: Adapter) -> str:
    """The ``fp16 overflow`` fact (module docstring)."""
    if adapter.fp16 is not None:
        return adapter.fp16
    try:
        clean = runner.fp16(adapter, build_fp16_window(spike=False))
        spiked_window = build_fp16_window(spike=True)
        spiked = runner.fp16(adapter, spiked_window)
        if not spiked.float16:
            text = f"no float16 compute, nothing overflows: {spiked.outcome()}"
        elif not spiked.spike_overflowed:
            text = f"the spike did not overflow: {spiked.outcome()}"
        elif spiked.finite and spiked.changed:
            dropped = runner.fp16(adapter, _without_spiked_microbatch(spiked_window), tick=False)
            a, b = spiked.delta, dropped.delta
            cosine = float(a @ b / (a.norm() * b.norm())) if b.norm() > 0 else 0.0
            if cosine > 0.999:
                ratio = float(a.norm() / b.norm())
                scale = (
                    ""
                    if abs(ratio - 1) < 1e-3
                    else f" (step x{ratio:.3g} of the window without it)"
                )
                text = f"drops the microbatch{scale}"
            else:
                text = "applies a finite step that is not the window without the microbatch"
        else:
            text = spiked.outcome()
        if spiked.loss_scales is None:
            text += f" ({spiked.note or 'no loss scaler'})"
        if not (clean.finite and clean.changed) or clean.other_overflowed:
            text += f"; without the spike too: {clean.outcome()}"
        return text
    except Exception as exc:
        return describe_error(exc)


def run_audit(
    adapters: Sequence[Adapter],
    windows: Sequence[Window],
    *,
    dtype: str = "float32",
    progress: Callable[[int], Callable[[], None]] | None = None,
    isolate: bool = False,
    jobs: int = 1,
    world_size: int = 1,
) -> AuditResult:
    """Audit ``adapters`` on ``windows`` in ``dtype`` (see the module docstring); with
    ``isolate``, each loop in a process of its own (:mod:`wacc.audit.isolation`: a built-in
    loop or a ``module:function`` spec, which the worker imports again), ``jobs`` of them at a
    time (each with the machine's cores shared out: torch threads = cores // jobs).  With
    ``world_size`` N > 1 each loop runs in worlds of N processes instead (:mod:`wacc.audit.ranks`
    on :func:`wacc.audit.windows.rank_windows` of each window's name)."""
    if jobs < 1 or (jobs > 1 and not isolate and world_size == 1):
        raise ValueError(f"jobs must be 1, or >= 1 with isolate=True; got {jobs}")
    if world_size > 1:
        from wacc.audit.ranks import run_ranks

        return run_ranks(adapters, [w.name for w in windows], dtype=dtype,
                         world_size=world_size, progress=progress, jobs=jobs)  # fmt: skip
    torch_dtype = DTYPES[dtype]
    runnable = [a for a in adapters if a.unavailable() is None]
    total = sum(
        3 * len(windows) + (a.checkpoint is None) + a.loss_scale + 2 * (a.fp16 is None)
        for a in runnable
    )
    tick = progress(total) if progress else (lambda: None)
    facts: list[LoopFacts] = []
    cells: list[Cell] = []
    if isolate:
        return _isolated(adapters, windows, dtype=dtype, tick=tick, jobs=jobs)
    with tempfile.TemporaryDirectory(prefix="wacc-audit-") as tmp:
        runner = _Runner(torch_dtype, Path(tmp), tick)
        for adapter in adapters:
            fact = LoopFacts(adapter=adapter, version=adapter.version(), model=adapter.model)
            facts.append(fact)
            missing = adapter.unavailable()
            if missing is not None:
                fact.status = missing
                cells.extend(Cell(adapter.name, w.name, status=missing) for w in windows)
                continue
            for index, window in enumerate(windows):
                cell = Cell(adapter.name, window.name, true_count=window.total_targets)
                cells.append(cell)
                try:
                    _audit_cell(runner, adapter, window, cell, fact, first=index == 0)
                except Exception as exc:  # a loop that raises is a finding, not a crash
                    cell.status = describe_error(exc)
                    if index == 0:
                        fact.notes.append(f"{window.name}: {cell.status}")
            fact.fp16 = _fp16_fact(runner, adapter)
    return AuditResult(dtype=dtype, windows=list(windows), facts=facts, cells=cells)


def _isolated(
    adapters: Sequence[Adapter],
    windows: Sequence[Window],
    *,
    dtype: str,
    tick: Callable[[], None],
    jobs: int,
) -> AuditResult:
    """:func:`run_audit` with each loop in a worker process, ``jobs`` at a time, the results in
    the order of ``adapters``."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from wacc.audit.isolation import Isolated, run_isolated

    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None
    facts = [LoopFacts(adapter=a, version=a.version(), model=a.model) for a in adapters]
    outcomes: list[Isolated | None] = [None] * len(adapters)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {}
        for index, adapter in enumerate(adapters):
            missing = adapter.unavailable()
            if missing is not None:
                absent = [Cell(adapter.name, w.name, status=missing) for w in windows]
                outcomes[index] = Isolated(facts={"status": missing}, cells=absent)
                continue
            futures[index] = pool.submit(
                run_isolated, adapter, windows, dtype=dtype, tick=tick, threads=threads
            )
        for index, future in futures.items():
            outcomes[index] = future.result()
    cells: list[Cell] = []
    for fact, outcome in zip(facts, outcomes, strict=True):
        assert outcome is not None
        if outcome.error is not None:  # the worker died: a row per window saying how
            fact.status = outcome.error
            cells.extend(Cell(fact.adapter.name, w.name, status=outcome.error) for w in windows)
            continue
        for name, value in outcome.facts.items():
            setattr(fact, name, value)
        cells.extend(outcome.cells)
    return AuditResult(dtype=dtype, windows=list(windows), facts=facts, cells=cells)


def _audit_cell(
    runner: _Runner, adapter: Adapter, window: Window, cell: Cell, fact: LoopFacts, *, first: bool
) -> None:
    truth, bound = runner.truth(adapter.model, window)
    if first:
        fact.truth_casts = truth.casts
        fact.loss_casts = truth.loss_casts
    task, run, observed = runner.once(adapter, window, dtype=runner.dtype)
    _, _, again = runner.once(adapter, window, dtype=runner.dtype)
    cell.digest = gradient_hash(observed)
    cell.deterministic = cell.digest == gradient_hash(again)
    cell.counted = None if run.counted_tokens is None else float(run.counted_tokens)
    cell.finite = bool(np.all(np.isfinite(observed)))
    cell.rel_l2 = relative_l2(observed, truth.gradient)
    cell.max_rel = max_relative_element(observed, truth.gradient)
    dtype = str(runner.dtype).removeprefix("torch.")
    cell.max_rel_normal, cell.normal_elements, cell.max_rel_share = meaningful_relative_element(
        observed, truth.gradient, bound, dtype
    )
    cell.ratio = normwise_ratio(observed, truth, bound)
    cell.element_ratio = bound_ratio(observed, truth, bound)
    _, _, semantic = runner.once(adapter, window, dtype=torch.float64)
    cell.semantic_rel_l2 = relative_l2(semantic, truth.gradient)
    cell.semantic_ratio = normwise_ratio(semantic, truth, bound)
    cell.semantic_element_ratio = bound_ratio(semantic, truth, bound)
    if run.note:
        fact.notes.append(run.note)
    if not first:
        return
    k = task.num_microbatches
    fetched = task.fetched_at_first_backward
    fact.needs_total = "yes" if fetched == k and k > 1 else f"no ({fetched} of {k} read)"
    if adapter.checkpoint is not None:
        fact.resume = f"n/a: {adapter.checkpoint}"
    else:
        fact.resume_after = k // 2
        try:
            _, resumed_run, resumed = runner.once(
                adapter, window, dtype=runner.dtype, checkpoint_after=fact.resume_after
            )
            fact.resume_rel_l2 = relative_l2(resumed, truth.gradient)
            same = gradient_hash(resumed) == cell.digest
            if resumed_run.resume == "replay":
                how = "no mid-window checkpoint; resume replays the window"
                fact.resume = f"{how} ({'bit-identical' if same else 'differs'})"
            else:
                fact.resume = "restored (bit-identical)" if same else "pending gradient lost"
        except Exception as exc:
            fact.resume = describe_error(exc)
    if not adapter.loss_scale:
        fact.loss_scale = "not settable"
        return
    try:
        _, _, scaled = runner.once(adapter, window, dtype=runner.dtype, loss_scale=TEST_LOSS_SCALE)
        if gradient_hash(scaled) == cell.digest:
            fact.loss_scale = "divided out once (bit-identical)"
        else:
            factor = float(np.linalg.norm(scaled) / np.linalg.norm(observed))
            fact.loss_scale = f"result x{factor:.6g} (S = {TEST_LOSS_SCALE:g})"
    except Exception as exc:
        fact.loss_scale = describe_error(exc)
