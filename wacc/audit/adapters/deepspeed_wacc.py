"""``deepspeed+wacc``: DeepSpeed's engine (:mod:`wacc.audit.adapters.deepspeed`: CPU, gloo,
ZeRO 0, ``gradient_clipping`` 0) with
:class:`wacc_torch.integrations.deepspeed.TokenWeightedEngine`, the loop a user writes with it:

.. code-block:: python

    engine, *_ = deepspeed.initialize(model=model, optimizer=SGD(...), config={
        ..., "zero_optimization": {"stage": 0},
        "managed_gradient_accumulation": False,  # the window is the caller's
        "gradient_accumulation_steps": 1})
    weighted = TokenWeightedEngine(engine)
    for batch in window:
        loss = engine(**batch)["loss"]  # the microbatch's mean token loss
        weighted.backward(loss, tokens=n)  # scale_wrt_gas=False; accumulate_mean
    weighted.step()  # the token-weighted mean into .grad, then engine.step()

``n`` is the audit's :func:`~wacc.audit.windows.target_count` of the microbatch's labels.
Checkpoint: ``weighted.save_checkpoint(dir)`` after ``c`` microbatches (DeepSpeed's
``engine.save_checkpoint`` with the accumulator's record in ``client_state``), then a fresh
model, optimizer, engine and wrapper, ``weighted.load_checkpoint(dir)`` and the remaining
microbatches: the window's position is the caller's (no ``micro_steps`` to lose), the pending
gradient the record's.  Float16 (``task.fp16``): the ``deepspeed`` row's ``torch_autocast`` fp16
engine, whose ``GradScaler`` scales each backward and, in ``engine.step()``, unscales the
window's mean and steps or skips it whole.

Across ranks (``task.world_size > 1``): the ``deepspeed`` row's torchrun world
(``init_distributed`` reading the environment torchrun set).  ``TokenWeightedEngine`` sets
``engine.enable_backward_allreduce = False``, which keeps DeepSpeed's own reduce (an average of
the ranks, ``buffered_allreduce_fallback``) out of ``backward`` (``_backward_epilogue``) and of
the unmanaged boundary in ``step()`` (``engine.py`` ``step``: ``elif
self.enable_backward_allreduce``), and its ``step()`` reduces the window once:
:func:`wacc_torch.all_reduce_mean` of every rank's ``finish_sums()`` (semantics §7).  Every
rank's ``.grad`` holds the same mean over every rank's tokens, so the ``torch_autocast``
``GradScaler`` finds the same overflow on every rank.
"""

from __future__ import annotations

from typing import Any

from wacc.audit.adapters.deepspeed import DeepSpeedAdapter, _engine, _scale, _world
from wacc.audit.protocol import LoopRun, LoopTask
from wacc.audit.windows import target_count

__all__ = ["ADAPTER"]


def run(task: LoopTask) -> LoopRun:
    """The loop of the module docstring."""
    from wacc_torch.integrations.deepspeed import TokenWeightedEngine

    data = task.dataset
    with _world(task.dtype, task.world_size) as deepspeed:

        def fresh() -> tuple[Any, TokenWeightedEngine]:
            engine, _ = _engine(
                task, deepspeed, managed_gradient_accumulation=False, gradient_accumulation_steps=1
            )
            return engine, TokenWeightedEngine(engine)

        engine, weighted = fresh()
        before = _scale(engine)
        for index in range(len(data)):
            if task.checkpoint_after == index:
                directory = str(task.workdir / "deepspeed_checkpoint")
                weighted.save_checkpoint(directory)
                del engine, weighted
                engine, weighted = fresh()
                weighted.load_checkpoint(directory)
            batch = {k: v[None] for k, v in data[index].items()}
            loss = engine(**batch)["loss"]
            weighted.backward(loss, tokens=target_count(batch["labels"]))
        result = weighted.step()
        after = _scale(engine)
    if not task.fp16:
        return LoopRun(counted_tokens=result.weight)
    if before is None or after is None:
        return LoopRun(counted_tokens=result.weight, note="no torch_autocast GradScaler")
    return LoopRun(counted_tokens=result.weight, loss_scales=(before, after))


ADAPTER = DeepSpeedAdapter(
    name="deepspeed+wacc",
    title="DeepSpeed engine, ZeRO 0, with TokenWeightedEngine",
    requires=("deepspeed",),
    model="plain",
    code_path="deepspeed.initialize(ZeRO 0, managed_gradient_accumulation=False); "
    "TokenWeightedEngine(engine): backward(loss, tokens) = engine.backward(loss, "
    "scale_wrt_gas=False) + accumulate_mean; step() = finish_mean().apply_to + engine.step()",
    checked="deepspeed 0.19.8 (CPU, gloo, run here)",
    loss_scale=False,
    checkpoint=None,
    run=run,
    fp16=None,
    ranks=True,
)
