"""``pixparse+wacc``: the pixparse loop (:mod:`wacc.audit.adapters.timm`, ``loss /= accum_steps``
and ``NativeScaler(..., need_update=last)``) written with ``wacc_torch``, as a user would change
``task_cruller_finetune_*.py``'s ``train_step``:

.. code-block:: python

    with autocast():
        loss = model(...)  # the microbatch's MEAN token loss
    (scaler.scale * loss).backward()  # no `loss /= accum_steps`, no NativeScaler call
    acc.accumulate_mean(model, tokens)  # weighted by the tokens that mean divided by
    if need_update:  # the window's last microbatch
        result = acc.finish_mean()  # / S once, then / the window's tokens
        if scaler.update(result.found_inf):  # an overflow: skip the window whole
            result.apply_to(model)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

``scaler`` is ``wacc_torch.WindowLossScaler()`` in the ``amp`` (float16) path, in place of
``NativeScaler`` (``GradScaler``'s defaults; both decide once per window), and the fixed scale
``S`` (``task.loss_scale``) otherwise.  Checkpoint: the model, the optimizer, the accumulator's
record and the scaler's state (what ``NativeScaler.state_dict()`` held), between microbatches;
resume continues at that microbatch with the pending gradient restored bit for bit.  The loop is
:func:`wacc.audit.adapters.nanogpt_wacc.run_loop` without nanoGPT's prefetch.

Across ranks (``task.world_size > 1``): the task's ``DistributedDataParallel`` model, every
microbatch under ``model.no_sync()`` (the last one too: pixparse syncs it, and DDP would average
the ranks' gradients), and ``result = wacc_torch.all_reduce_mean(acc.finish_sums())`` in place
of ``acc.finish_mean()``: the sums and the token counts of every rank reduced once (semantics
§7), the same mean and the same ``found_inf`` on every rank.
"""

from __future__ import annotations

from wacc.audit.adapters.nanogpt_wacc import run_loop
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER"]


def run(task: LoopTask) -> LoopRun:
    """The pixparse loop with the accumulator (module docstring)."""
    return run_loop(task, prefetch=False, name="pixparse")


ADAPTER = Adapter(
    name="pixparse+wacc",
    title="pixparse loop with WeightedGradientsAccumulator",
    requires=("torch",),
    model="plain",
    code_path="(S * loss).backward(); acc.accumulate_mean(model, tokens); on need_update: "
    "acc.finish_mean() (across ranks: all_reduce_mean(acc.finish_sums()), every microbatch "
    "under no_sync).apply_to(model), WindowLossScaler.update, optimizer.step",
    checked="torch 2.13.0, this repository's wacc_torch (record format 1)",
    loss_scale=True,
    checkpoint=None,
    run=run,
    fp16=None,
    ranks=True,
)
