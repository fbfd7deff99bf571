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

``deepspeed-zero1+wacc``: the same loop on the ``deepspeed-zero1`` row's ZeRO 1 engine, built with
``"gradient_allreduce_op": "sum"`` as well.  ZeRO 1's reduce in ``engine.step()``
(``reduce_gradients``, ``runtime/zero/stage_1_and_2.py:958``) is the only way its partitioned
optimizer gets a gradient, so it stays on; with ``"sum"`` its ``gradient_reduction_w_predivide``
(``stage_1_and_2.py:1485-1508``) all-reduces without ``div_(dp_world_size)``, and
``TokenWeightedEngine.step()`` writes each rank's sums divided by every rank's tokens into
``.grad``: the reduce's sum is the token mean.  The gradient is read right before the ZeRO
optimizer's ``step`` (after that reduce: ``safe_get_full_grad``, as the ``deepspeed-zero1`` row
reads it).  The float64 copy runs ZeRO 1's "mode 2": DeepSpeed takes float64 parameters for
float32 ones (``engine.py`` ``get_data_types``: ``model_dtype`` float32 unless fp16/bf16) and
accumulates in float32 (``use_grad_accum_attribute``, ``stage_1_and_2.py:397-404``), so each
microbatch's gradient reaches the accumulator through ``.grad_accum``, rounded to float32 once;
its err/bound is that rounding (about 0.1), not float64 noise.  Float16 (``task.fp16``): ZeRO 1's
``torch_autocast`` path, the ZeRO optimizer's own ``GradScaler``.  It skips an overflowing window
whole, its overflow check finding the inf (``stage_1_and_2.py:3043-3050``), but returns before
``_optimizer_step`` reaches the scaler's ``update()`` (``:2978``): on its own the scale never backs
off (the ``deepspeed-zero1`` row: 65536 -> 65536, "not backed off"); ``TokenWeightedEngine.step()``
backs it off as ``update()`` would (65536 -> 32768).
"""

from __future__ import annotations

from typing import Any

import torch

from wacc.audit.adapters.deepspeed import (
    DeepSpeedAdapter,
    _engine,
    _FullGradients,
    _scale,
    _world,
)
from wacc.audit.protocol import LoopRun, LoopTask
from wacc.audit.windows import target_count

__all__ = ["ADAPTER", "ZERO1"]


def run(task: LoopTask) -> LoopRun:
    """The loop of the module docstring."""
    return _run(task, stage=0)


def run_zero1(task: LoopTask) -> LoopRun:
    """The same loop at ZeRO 1, with ``"gradient_allreduce_op": "sum"`` (module docstring)."""
    return _run(task, stage=1)


def _record_before_step(task: LoopTask, engine: Any, model: torch.nn.Module) -> None:
    """ZeRO 1 steps the client ``SGD`` on its flat partition: the gradient is read right before
    the ZeRO optimizer's ``step`` (after ``engine.step()``'s reduce), every parameter's full
    gradient through ``safe_get_full_grad`` (an observation: the step itself is unchanged)."""
    zero = engine.optimizer
    step = zero.step

    def recorded(*args: Any, **kwargs: Any) -> Any:
        task.record_gradients(_FullGradients(model))
        return step(*args, **kwargs)

    zero.step = recorded


def _run(task: LoopTask, *, stage: int) -> LoopRun:
    from wacc_torch.integrations.deepspeed import TokenWeightedEngine

    data = task.dataset
    options: dict[str, Any] = {"managed_gradient_accumulation": False,
                               "gradient_accumulation_steps": 1}  # fmt: skip
    if stage == 1:  # ZeRO 1's reduce is the window's one SUM of the ranks' shares
        options["gradient_allreduce_op"] = "sum"
    with _world(task.dtype, task.world_size) as deepspeed:

        def fresh() -> tuple[Any, TokenWeightedEngine]:
            engine, model = _engine(task, deepspeed, stage, **options)
            if stage == 1:
                _record_before_step(task, engine, model)
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
ZERO1 = DeepSpeedAdapter(
    name="deepspeed-zero1+wacc",
    title="DeepSpeed engine, ZeRO 1, with TokenWeightedEngine",
    requires=("deepspeed",),
    model="plain",
    code_path="deepspeed.initialize(ZeRO 1, managed_gradient_accumulation=False, "
    "gradient_allreduce_op=sum); TokenWeightedEngine(engine): backward(loss, tokens) = "
    "engine.backward(loss, scale_wrt_gas=False) + accumulate_mean; step() = this rank's sums / "
    "global tokens into .grad + engine.step() (ZeRO 1's SUM reduce)",
    checked="deepspeed 0.19.8 (CPU, gloo, run here)",
    loss_scale=False,
    checkpoint=None,
    run=run_zero1,
    fp16=None,
    ranks=True,
)
