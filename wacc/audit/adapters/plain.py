"""Plain PyTorch, the correct hand-written loop: ``(S * loss_sum / known_total).backward()`` per
microbatch, the window's true target count read before the first backward, ``p.grad /= S`` once,
then ``optimizer.step()``.

Code path: ``torch.Tensor.backward`` accumulating into ``.grad``, ``torch.optim.SGD.step``;
checkpoint = ``torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})``
and ``torch.load(weights_only=True)`` (what such loops save: ``.grad`` is in neither state dict).
Float16 (``task.fp16``): torch's AMP recipe around the same loop — ``torch.autocast("cpu",
dtype=torch.float16)`` over the forward and the loss, ``scaler = torch.amp.GradScaler("cpu")``
(its defaults: initial scale 2**16), ``scaler.scale(loss_sum / known_total).backward()`` per
microbatch, then ``scaler.step(optimizer)`` (unscales; skips ``optimizer.step()`` when a gradient
is NaN/inf) and ``scaler.update()``.
Across ranks (``task.world_size > 1``): the same loop as a data-parallel tutorial wraps it —
``torch.distributed.init_process_group(task.backend)``, ``ddp = DistributedDataParallel(model)``,
every microbatch but the last under ``ddp.no_sync()``, the last one's backward all-reducing. What
decides the weighting across ranks: ``(loss_sum * scale / total).backward()`` with ``total`` the
rank's *own* known total (the sum over ``task.dataset``, this rank's window), and DDP's reducer
averaging the ranks' ``.grad`` (without a communication hook,
``Reducer::mark_variable_ready_dense`` in ``torch/csrc/distributed/c10d/reducer.cpp`` divides each
gradient by ``div_factor_``, the world size, before the bucket's SUM all-reduce): the mean over
ranks of each rank's token mean. ``weighs_ranks_equally``: its error is predicted from the per-rank
totals.
Checked against torch 2.13.0 (the version run here).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from wacc.audit.models import causal_lm_loss_sum, logits_of
from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.windows import target_count

__all__ = ["ADAPTER"]


def _fresh(task: LoopTask) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    return model, optimizer


def run(task: LoopTask) -> LoopRun:
    """Run the loop of the module docstring on ``task``."""
    if task.fp16:
        return _run_fp16(task)
    if task.world_size > 1:
        return _run_ddp(task)
    model, optimizer = _fresh(task)
    data = task.dataset
    batches = [data[i] for i in range(len(data))]  # the known total needs the whole window first
    total = sum(target_count(b["labels"]) for b in batches)
    scale = task.loss_scale
    for index, batch in enumerate(batches):
        if task.checkpoint_after == index:
            path = task.workdir / "plain_checkpoint.pt"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
            model, optimizer = _fresh(task)
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        logits = logits_of(model(input_ids=batch["input_ids"][None]))
        loss_sum = causal_lm_loss_sum(logits, batch["labels"][None])
        (loss_sum * scale / total).backward()
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.div_(scale)
    optimizer.step()
    return LoopRun(counted_tokens=float(total))


def _run_ddp(task: LoopTask) -> LoopRun:
    """The loop across ranks: DDP + ``no_sync()`` (module docstring)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(task.backend)
    model, optimizer = _fresh(task)
    ddp = DistributedDataParallel(model)
    data = task.dataset
    batches = [data[i] for i in range(len(data))]
    total = sum(target_count(b["labels"]) for b in batches)  # this rank's window only
    scale = task.loss_scale
    for index, batch in enumerate(batches):
        last = index == len(batches) - 1
        with nullcontext() if last else ddp.no_sync():  # the last backward all-reduces (mean)
            logits = logits_of(ddp(input_ids=batch["input_ids"][None]))
            loss_sum = causal_lm_loss_sum(logits, batch["labels"][None])
            (loss_sum * scale / total).backward()
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.div_(scale)
    optimizer.step()
    return LoopRun(counted_tokens=float(total))


def _run_fp16(task: LoopTask) -> LoopRun:
    """The float16 AMP loop of the module docstring."""
    model, optimizer = _fresh(task)
    scaler = torch.amp.GradScaler("cpu")
    before = scaler.get_scale()
    data = task.dataset
    batches = [data[i] for i in range(len(data))]
    total = sum(target_count(b["labels"]) for b in batches)
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = logits_of(model(input_ids=batch["input_ids"][None]))
            loss_sum = causal_lm_loss_sum(logits, batch["labels"][None])
        scaler.scale(loss_sum / total).backward()
    scaler.step(optimizer)
    scaler.update()
    return LoopRun(counted_tokens=float(total), loss_scales=(before, scaler.get_scale()))


ADAPTER = Adapter(
    name="plain",
    title="plain PyTorch loss_sum / known_total",
    requires=("torch",),
    model="plain",
    code_path="(S*loss_sum/known_total).backward(); p.grad /= S; torch.optim.SGD.step",
    checked="torch 2.13.0 (run here)",
    loss_scale=True,
    checkpoint=None,
    run=run,
    fp16=None,
    ranks=True,
    weighs_ranks_equally=True,
    cause="across ranks the tutorial loop backwards `loss_sum / known_total` with known_total its "
    "own rank's tokens, every microbatch but the last under DistributedDataParallel.no_sync(), and "
    "DDP's reducer divides the all-reduced sum by the world size (torch 2.13.0: "
    "torch/csrc/distributed/c10d/reducer.cpp, Reducer::mark_variable_ready_dense, div_factor_): "
    "every rank weighs 1/N whatever its token count (exact at world size 1).",
    # The reference loop's fix is wacc_torch itself: the same DDP loop with its communication
    # hook (WeightedAllReduceHook), which carries every rank's sums and token counts at once.
    fixed_by="wacc_torch-sum",
)
