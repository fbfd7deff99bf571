"""``nanogpt+wacc``: nanoGPT's training loop (:mod:`wacc.audit.adapters.nanogpt`) written with
``wacc_torch.WeightedGradientsAccumulator``, as a user would change ``train.py``:

.. code-block:: python

    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=scaler.scale)
    ...
    acc.set_loss_scale(scaler.scale)  # the window is empty: the one place S changes
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)  # the microbatch's MEAN token loss
        tokens = (Y != -1).sum()  # what that mean divided by (nanoGPT's ignore_index=-1)
        X, Y = get_batch('train')
        (scaler.scale * loss).backward()  # no `loss / gradient_accumulation_steps`
        acc.accumulate_mean(model, tokens)  # weighted by its tokens; takes .grad
    result = acc.finish_mean()  # / S once, then / the window's tokens
    if scaler.update(result.found_inf):  # an overflow anywhere in the window: skip it whole
        result.apply_to(model)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

Three lines change: the division by ``gradient_accumulation_steps`` goes, ``accumulate_mean``
follows each backward, and ``finish_mean().apply_to`` comes before the step. ``scaler`` is
``wacc_torch.WindowLossScaler()`` (``torch.amp.GradScaler``'s defaults, decided per window) in the
float16 path (``dtype='float16'``: autocast float16), and the fixed scale ``S``
(``task.loss_scale``) otherwise, where ``train.py``'s ``GradScaler`` is disabled.  The count is
the audit's :func:`~wacc.audit.windows.target_count` (its labels are unshifted, ``-100``
ignored: the count the model's mean divides by).

Checkpoint (what ``train.py``'s ``ckpt.pt`` gains): the model, the optimizer, the micro-step and
the accumulator's record (``wacc_torch.save_record(acc.state_dict(), ...)``), in float16 also the
scaler's ``state_dict``, written between micro-steps; resume builds everything afresh, loads
them (``acc.load_state_dict(wacc_torch.load_record(...), model)``) and continues at that
micro-step: the pending gradient is restored bit for bit.  The loop body is shared with
``pixparse+wacc`` (:func:`run_loop`): the two loops differ in the prefetch only.

Across ranks (``task.world_size > 1``, a torchrun world): ``train.py``'s DDP path
(``init_process_group(backend)``, ``model = DDP(model)``, K microbatches per rank) with two
changes: ``model.require_backward_grad_sync = False`` on *every* micro step (the script syncs
the last one: DDP's reducer would average the ranks' gradients, a mean of per-rank means), and

.. code-block:: python

    result = wacc_torch.all_reduce_mean(acc.finish_sums())  # was: acc.finish_mean()

one reduction of every rank's sums and token counts (semantics §7: a metadata exchange, one SUM
all-reduce, ``/ S`` once, then ``/`` the global weight): every rank applies the same mean, its
``weight`` the tokens of every rank, and ``scaler.update(result.found_inf)`` decides the same on
every rank (an overflow on one rank skips the window on all).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed import init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 (the script's name)

from wacc.audit.adapters import nanogpt
from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.windows import target_count

__all__ = ["ADAPTER", "run_loop"]

Batch = tuple[torch.Tensor, torch.Tensor]


def run_loop(task: LoopTask, *, prefetch: bool, name: str) -> LoopRun:
    """One window of a ``mean loss -> accumulate_mean -> finish_mean`` loop (module docstring);
    with ``prefetch``, microbatch ``k + 1`` is read before microbatch ``k``'s backward (nanoGPT's
    order).  ``name`` prefixes the checkpoint's file."""
    import wacc_torch
    from wacc_torch import WeightedGradientsAccumulator as Accumulator

    data = task.dataset
    scaler = wacc_torch.WindowLossScaler() if task.fp16 else None
    scale = scaler.scale if scaler is not None else task.loss_scale
    ddp = task.world_size > 1
    if ddp:  # the loop's DDP setup (nanoGPT's `init_process_group(backend=backend)`)
        init_process_group(backend=task.backend)
    wrapped: torch.nn.Module | None = None  # DDP(model) across ranks

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, Accumulator]:
        model = task.build_model()
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
        task.hook_optimizer(optimizer, model)
        acc = Accumulator(dtype=task.dtype, loss_scale=scale)  # D = the parameters' dtype
        nonlocal wrapped
        wrapped = DDP(model, device_ids=None) if ddp else None
        return model, optimizer, acc

    def get_batch(index: int) -> Batch:
        batch = data[index]
        return batch["input_ids"][None], batch["labels"][None]

    model, optimizer, acc = fresh()
    before = scale
    X, Y = get_batch(0)  # noqa: N806 (nanoGPT's names)
    for micro_step in range(task.num_microbatches):
        if task.checkpoint_after == micro_step:
            path = task.workdir / f"{name}_ckpt.pt"
            record = task.workdir / f"{name}_accumulator.pt"
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "micro_step": micro_step,
                 "scaler": None if scaler is None else scaler.state_dict()},
                path,
            )  # fmt: skip
            wacc_torch.save_record(acc.state_dict(), record)
            del model, optimizer, acc
            model, optimizer, acc = fresh()
            checkpoint = torch.load(path, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            if scaler is not None:
                scaler = wacc_torch.WindowLossScaler()
                scaler.load_state_dict(checkpoint["scaler"])
            acc.load_state_dict(wacc_torch.load_record(record), model)
            X, Y = get_batch(checkpoint["micro_step"])  # noqa: N806 (the data position)
        # Every microbatch without DDP's all-reduce (the window's sums and weights are reduced
        # once, by all_reduce_mean below): nanoGPT's switch on every micro step, pixparse's
        # `with model.no_sync()` around every microbatch, its last one too.
        unsynced: AbstractContextManager[object] = nullcontext()
        if isinstance(wrapped, DDP):
            if prefetch:
                wrapped.require_backward_grad_sync = False
            else:
                unsynced = wrapped.no_sync()
        with unsynced:
            with torch.autocast("cpu", dtype=torch.float16, enabled=task.fp16):
                # the microbatch's mean token loss
                loss = (wrapped or model)(input_ids=X, labels=Y)["loss"]
            tokens = target_count(Y)  # what that mean divides by (0: a 0/0 mean, never read)
            if prefetch and micro_step + 1 < task.num_microbatches:
                X, Y = get_batch(micro_step + 1)  # noqa: N806
            (scale * loss).backward()
        acc.accumulate_mean(model, tokens)
        if not prefetch and micro_step + 1 < task.num_microbatches:
            X, Y = get_batch(micro_step + 1)  # noqa: N806
    # Across ranks: every rank's sums and weights reduced once (semantics §7): the same mean,
    # the same weight and the same found_inf on every rank.
    result = wacc_torch.all_reduce_mean(acc.finish_sums()) if ddp else acc.finish_mean()
    counted = result.weight
    if scaler is None or scaler.update(result.found_inf):  # False: skip the whole window
        result.apply_to(model)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        return LoopRun(counted_tokens=counted)
    return LoopRun(counted_tokens=counted, loss_scales=(before, scaler.scale))


def run(task: LoopTask) -> LoopRun:
    """nanoGPT's loop with the accumulator (module docstring)."""
    return run_loop(task, prefetch=True, name="nanogpt")


ADAPTER = Adapter(
    name="nanogpt+wacc",
    title="nanoGPT train.py with WeightedGradientsAccumulator",
    requires=("torch",),
    model="plain",
    code_path=f"{nanogpt.SOURCE} with (S * loss).backward(); acc.accumulate_mean(model, tokens); "
    "acc.finish_mean().apply_to(model) before the step (across ranks: "
    "require_backward_grad_sync = False on every micro step, all_reduce_mean(acc.finish_sums()))",
    checked="nanoGPT 3adf61e (written here), this repository's wacc_torch (record format 1)",
    loss_scale=True,
    checkpoint=None,
    run=run,
    fp16=None,
    ranks=True,
)
