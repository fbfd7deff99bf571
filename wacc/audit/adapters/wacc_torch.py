"""``wacc_torch.WeightedGradientsAccumulator``, buffered mode (semantics §5–§9), two ways:

* ``wacc_torch-mean``: ``(S * mean_loss).backward()`` then ``acc.accumulate_mean(model, n_k)``;
* ``wacc_torch-sum``: ``(S * loss_sum).backward()`` then ``acc.accumulate_sum(model, n_k)``;

then ``acc.finish_mean().apply_to(model)`` and ``optimizer.step()``.  Work dtype = the model's
dtype, ``loss_scale = S``.  Checkpoint: ``wacc_torch.save_record(acc.state_dict(), path)`` plus the
model's ``state_dict``; resume: ``acc.load_state_dict(wacc_torch.load_record(path), model)`` in a
fresh accumulator.  ``n_k`` is the microbatch's own count: nothing about the window is needed
before the first backward.  Float16 (``task.fp16``): the loop of README's "Dynamic loss scaling"
(semantics §13) — ``scaler = wacc_torch.WindowLossScaler(init_scale=2**12)`` (GradScaler's
defaults otherwise; at its default 2**16 the sum loop's backward of ``S * loss_sum`` overflows
float16 on the clean window too, from 2**14 on, measured: a running loop skips such windows until
its scale has backed off, so the audit starts where it would have settled),
``acc.set_loss_scale(scaler.scale)`` on the empty window, the forward under
``torch.autocast("cpu", dtype=torch.float16)``, the loss on ``logits.float()``,
``(scaler.scale * loss).backward()``, then ``result = acc.finish_mean()`` and only if
``scaler.update(result.found_inf)``: ``result.apply_to(model); optimizer.step()``.  Checked
against this repository's wacc_torch (record format 1).  The
zero-copy mode does not exist yet; when it does it is one more adapter here.

Across ranks (``task.world_size > 1``; ``torch.distributed.init_process_group(task.backend)``
first), each adapter takes one of wacc_torch's two cross-rank paths (semantics §7):

* ``wacc_torch-mean``: the helper — the same loop on the unwrapped model, then
  ``wacc_torch.all_reduce_mean(acc.finish_sums()).apply_to(model)``;
* ``wacc_torch-sum``: the DDP communication hook — ``ddp = DistributedDataParallel(model)``,
  ``hook = wacc_torch.ddp_hook.WeightedAllReduceHook(ddp, acc)``, every microbatch but the last
  under ``ddp.no_sync()`` with ``acc.accumulate_sum(model, n_k)``, then the last forward,
  ``hook.last_microbatch_sum(n_K)`` and its backward (DDP's bucketed all-reduce carries the
  window).

And ``wacc_torch-fsdp`` (FSDP2, at every world size): ``fully_shard`` on each ``nn.Linear`` and
on the root over a CPU device mesh of every rank, ``window = wacc_torch.fsdp.FSDPWeightedWindow(
model, loss_scale=S)``, per microbatch ``window.microbatch(last=...)``, the backward of ``S *
loss_sum``, ``window.add_weight(n_k)``, then ``window.finish_mean()``; the gradient the audit reads
is every shard gathered (``DTensor.full_tensor()``) into an unsharded twin right before
``optimizer.step()``.  At world size 1 a one-rank gloo group on a ``HashStore`` is brought up for
it (FSDP2 needs one) and ended after.  What decides its weighting across ranks:
``FSDPWeightedWindow.__init__`` (``set_gradient_divide_factor(1.0)`` and
``set_force_sum_reduction_for_comms(True)``: FSDP's reduce-scatter SUMS instead of averaging) and
``finish_mean`` in ``wacc_torch/fsdp.py`` (divides by ``S`` and the global weight of its metadata
exchange).

What decides the weighting across ranks: ``_all_reduce``/``_agree`` in
``wacc_torch/distributed.py`` (the global weight is ``math.fsum`` of every rank's ``W``, the
buffers a SUM all-reduce, then ``normalize_sums`` divides by ``S`` and that global weight) and,
for the hook, ``WeightedAllReduceHook._reduce_bucket`` in ``wacc_torch/ddp_hook.py`` (SUM, never
averaged, divided by the global weight of the metadata exchange): every token of every rank
weighs the same.
"""

from __future__ import annotations

import torch

from wacc.audit.models import causal_lm_loss_sum, logits_of
from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.windows import target_count

__all__ = ["FP16_INIT_SCALE", "FSDP", "MEAN", "SUM", "record_sharded_gradients"]

FP16_INIT_SCALE = 2.0**12  # the float16 run's first scale (module docstring)


def _run(task: LoopTask, *, mean: bool) -> LoopRun:
    import wacc_torch

    if task.world_size > 1:
        return _run_ranks(task, mean=mean)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        model = task.build_model()
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
        task.hook_optimizer(optimizer, model)
        acc = wacc_torch.WeightedGradientsAccumulator(dtype=task.dtype, loss_scale=task.loss_scale)
        return model, optimizer, acc

    model, optimizer, acc = fresh()
    assert isinstance(acc, wacc_torch.WeightedGradientsAccumulator)
    if task.fp16:
        return _run_fp16(task, model, optimizer, acc, mean=mean)
    data = task.dataset
    for index in range(len(data)):
        if task.checkpoint_after == index:
            path = task.workdir / "wacc_torch_record.pt"
            model_path = task.workdir / "wacc_torch_model.pt"
            wacc_torch.save_record(acc.state_dict(), path)
            torch.save(model.state_dict(), model_path)
            model, optimizer, acc = fresh()
            assert isinstance(acc, wacc_torch.WeightedGradientsAccumulator)
            model.load_state_dict(torch.load(model_path, weights_only=True))
            acc.load_state_dict(wacc_torch.load_record(path), model)
        batch = data[index]
        n = target_count(batch["labels"])
        logits = logits_of(model(input_ids=batch["input_ids"][None]))
        loss_sum = causal_lm_loss_sum(logits, batch["labels"][None])
        # A zero-target microbatch's mean is 0/0 = NaN: weight 0 means it is never read (§5).
        loss = loss_sum / n if mean else loss_sum
        (loss * task.loss_scale).backward()
        if mean:
            acc.accumulate_mean(model, n)
        else:
            acc.accumulate_sum(model, n)
    counted = acc.state.total_weight  # W, what finish_mean divides by
    acc.finish_mean().apply_to(model)
    optimizer.step()
    return LoopRun(counted_tokens=counted)


def _run_ranks(task: LoopTask, *, mean: bool) -> LoopRun:
    """Across ranks: the helper (``mean``) or the DDP hook (module docstring)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import wacc_torch
    from wacc_torch.ddp_hook import WeightedAllReduceHook

    dist.init_process_group(task.backend)
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    acc = wacc_torch.WeightedGradientsAccumulator(dtype=task.dtype, loss_scale=task.loss_scale)
    data = task.dataset
    batches = [data[i] for i in range(len(data))]
    if mean:
        for batch in batches:
            n = target_count(batch["labels"])
            logits = logits_of(model(input_ids=batch["input_ids"][None]))
            loss = causal_lm_loss_sum(logits, batch["labels"][None]) / n  # 0/0 read by no one
            (loss * task.loss_scale).backward()
            acc.accumulate_mean(model, n)
        result = wacc_torch.all_reduce_mean(acc.finish_sums())
        result.apply_to(model)
        optimizer.step()
        return LoopRun(counted_tokens=result.weight)
    ddp = DistributedDataParallel(model)
    hook = WeightedAllReduceHook(ddp, acc)
    for batch in batches[:-1]:
        with ddp.no_sync():
            logits = logits_of(ddp(input_ids=batch["input_ids"][None]))
            loss_sum = causal_lm_loss_sum(logits, batch["labels"][None])
            (loss_sum * task.loss_scale).backward()
        acc.accumulate_sum(model, target_count(batch["labels"]))
    last = batches[-1]
    logits = logits_of(ddp(input_ids=last["input_ids"][None]))
    loss_sum = causal_lm_loss_sum(logits, last["labels"][None])
    hook.last_microbatch_sum(target_count(last["labels"]))  # after the forward (ddp_hook.py)
    (loss_sum * task.loss_scale).backward()
    optimizer.step()
    assert hook.result is not None
    return LoopRun(counted_tokens=hook.result.weight)


def _run_fp16(
    task: LoopTask,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    acc: object,
    *,
    mean: bool,
) -> LoopRun:
    """The dynamic-loss-scaling loop of the module docstring (one window)."""
    import wacc_torch

    assert isinstance(acc, wacc_torch.WeightedGradientsAccumulator)
    scaler = wacc_torch.WindowLossScaler(init_scale=FP16_INIT_SCALE)
    before = scaler.scale
    acc.set_loss_scale(scaler.scale)  # the window is empty: the one place S changes
    data = task.dataset
    for index in range(len(data)):
        batch = data[index]
        n = target_count(batch["labels"])
        with torch.autocast("cpu", dtype=torch.float16):
            logits = logits_of(model(input_ids=batch["input_ids"][None]))
        loss_sum = causal_lm_loss_sum(logits.float(), batch["labels"][None])
        loss = loss_sum / n if mean else loss_sum
        (scaler.scale * loss).backward()
        if mean:
            acc.accumulate_mean(model, n)
        else:
            acc.accumulate_sum(model, n)
    counted = acc.state.total_weight
    result = acc.finish_mean()
    if scaler.update(result.found_inf):  # False: an overflow, skip the whole window
        result.apply_to(model)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return LoopRun(counted_tokens=counted, loss_scales=(before, scaler.scale))


def record_sharded_gradients(task: LoopTask, model: torch.nn.Module) -> None:
    """``task.record_gradients`` of an FSDP2-sharded ``model``: each rank holds a shard of every
    gradient; the audit reads the whole gradient, which ``full_tensor()`` all-gathers (the same
    calls on every rank), into an unsharded twin of the model."""
    whole = task.model_spec.build(task.weights_dtype or task.dtype).to(task.dtype)
    sharded = dict(model.named_parameters())
    for name, parameter in whole.named_parameters():
        grad = sharded[name].grad
        parameter.grad = None if grad is None else grad.full_tensor()  # type: ignore[attr-defined]
    task.record_gradients(whole)


def run_fsdp(task: LoopTask) -> LoopRun:
    """The FSDP2 loop (``wacc_torch-fsdp``): ``fully_shard`` on every linear layer and the root
    over a CPU mesh of every rank, :class:`wacc_torch.fsdp.FSDPWeightedWindow` around loss-sum
    microbatches.  At world size 1 (the audit's own process or its worker) a one-rank gloo group
    on an in-memory store is brought up for it and ended after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wacc_torch.fsdp import FSDPWeightedWindow

    own_group = task.world_size == 1 and not dist.is_initialized()
    if task.world_size > 1:
        dist.init_process_group(task.backend)
    elif own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = task.build_model()
        model.train()
        mesh = init_device_mesh("cpu", (task.world_size,))
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                fully_shard(module, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
        window = FSDPWeightedWindow(model, loss_scale=task.loss_scale)  # type: ignore[arg-type]
        data = task.dataset
        for index in range(len(data)):
            batch = data[index]
            window.microbatch(last=index == len(data) - 1)
            logits = logits_of(model(input_ids=batch["input_ids"][None]))
            loss_sum = causal_lm_loss_sum(logits, batch["labels"][None])
            (loss_sum * task.loss_scale).backward()
            window.add_weight(target_count(batch["labels"]))
        result = window.finish_mean()
        record_sharded_gradients(task, model)
        optimizer.step()
        return LoopRun(counted_tokens=result.weight)
    finally:
        if own_group:
            dist.destroy_process_group()


def run_mean(task: LoopTask) -> LoopRun:
    """``accumulate_mean`` loop of the module docstring."""
    return _run(task, mean=True)


def run_sum(task: LoopTask) -> LoopRun:
    """``accumulate_sum`` loop of the module docstring."""
    return _run(task, mean=False)


_COMMON = dict(requires=("wacc_torch",), model="plain", checked="this repository, record format 1",
               loss_scale=True, checkpoint=None, fp16=None, ranks=True)  # fmt: skip
MEAN = Adapter(
    name="wacc_torch-mean",
    title="wacc_torch accumulate_mean + finish_mean",
    code_path="WeightedGradientsAccumulator.accumulate_mean / finish_mean().apply_to",
    run=run_mean,
    **_COMMON,  # type: ignore[arg-type]
)
FSDP = Adapter(
    name="wacc_torch-fsdp",
    title="wacc_torch FSDPWeightedWindow on fully_shard",
    requires=("wacc_torch",),
    model="plain",
    code_path="fully_shard; FSDPWeightedWindow.microbatch / add_weight / finish_mean",
    checked="this repository, torch 2.13.0 (FSDP2)",
    loss_scale=True,
    checkpoint="no FSDP checkpoint path written for the audit",
    run=run_fsdp,
    ranks=True,
)
SUM = Adapter(
    name="wacc_torch-sum",
    title="wacc_torch accumulate_sum + finish_mean",
    code_path="WeightedGradientsAccumulator.accumulate_sum / finish_mean().apply_to",
    run=run_sum,
    **_COMMON,  # type: ignore[arg-type]
)
