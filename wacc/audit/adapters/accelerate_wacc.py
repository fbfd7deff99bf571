"""The ``+wacc`` rows of ``accelerate``: the two loops of :mod:`wacc.audit.adapters.accelerate`
with :class:`wacc_torch.integrations.accelerate.WaccAccumulation` in place of
``accelerator.backward``:

* ``accelerate+wacc``: the documented ``accumulate()`` loop; per batch ``with
  accelerator.accumulate(model): with wacc.autocast(): loss = model(**batch).loss;
  wacc.backward(loss, count_tokens(batch["labels"], shift=True)); optimizer.step();
  optimizer.zero_grad()`` — the window ends where accelerate syncs.
* ``accelerate-variable+wacc``: the guide's variable-size loop (the window's batches prefetched,
  one ``optimizer.step()`` after them) with each batch's mean loss and its own count:
  ``wacc.backward(loss, tokens, last=index == K - 1)``; no window-wide count is needed.

``accelerator.register_for_checkpointing(wacc)``: the mid-window ``accelerator.save_state(dir)``
saves the pending window with accelerate's own state, a fresh ``Accelerator`` + model + optimizer
+ ``WaccAccumulation`` registered the same way runs ``accelerator.load_state(dir)`` and the
remaining batches. Float16 (``mixed_precision="fp16"``): on CPU accelerate makes no
``GradScaler`` and no autocast, so ``wacc.autocast()`` is float16 autocast and a
``WindowLossScaler`` (started at ``2**12``, as the ``wacc_torch`` rows) skips an overflowing
window whole.

Across ranks (``task.world_size > 1``, a torchrun world): the loops of
:mod:`wacc.audit.adapters.accelerate` across ranks (``prepare`` wraps the model in DDP), nothing
else changed; ``WaccAccumulation`` gives the DDP model a communication hook that sends nothing
(``wacc_torch.ddp_hook.local_gradients_hook``: the backward on which accelerate syncs no longer
averages), and its window's last microbatch reduces every rank's scaled sums and token count once
(``wacc_torch.all_reduce_mean``), then divides by the global count: what decides the weighting
across ranks is ``wacc_torch/integrations/_token_window.py`` (``TokenWindow.finish``), not
accelerate's ``backward`` or DDP's mean.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from wacc.audit.adapters import accelerate
from wacc.audit.adapters.wacc_torch import FP16_INIT_SCALE
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ACCUMULATE", "VARIABLE"]


def _fresh(task: LoopTask) -> tuple[Any, torch.nn.Module, Any, Any]:
    import wacc_torch
    from wacc_torch.integrations.accelerate import WaccAccumulation

    accelerator, model, optimizer = accelerate._fresh(task)
    scaler = wacc_torch.WindowLossScaler(init_scale=FP16_INIT_SCALE) if task.fp16 else None
    wacc = WaccAccumulation(accelerator, model, loss_scaler=scaler)
    accelerator.register_for_checkpointing(wacc)
    return accelerator, model, optimizer, wacc


def _checkpoint(task: LoopTask, accelerator: Any) -> tuple[Any, torch.nn.Module, Any, Any]:
    directory = task.workdir / "accelerate_state"
    accelerator.save_state(str(directory))
    accelerator, model, optimizer, wacc = _fresh(task)
    accelerator.load_state(str(directory))
    return accelerator, model, optimizer, wacc


def _finished(task: LoopTask, wacc: Any, before: float | None) -> LoopRun:
    if not task.fp16:
        return LoopRun(counted_tokens=wacc.window_tokens)
    if before is None or wacc.loss_scaler is None:
        return LoopRun(counted_tokens=wacc.window_tokens, note="no loss scaler")
    return LoopRun(counted_tokens=wacc.window_tokens, loss_scales=(before, wacc.loss_scaler.scale))


def _batch(task: LoopTask, index: int) -> dict[str, torch.Tensor]:
    return {k: v[None] for k, v in task.dataset[index].items()}


def run_accumulate(task: LoopTask) -> LoopRun:
    """The ``accumulate()`` loop with ``WaccAccumulation`` (module docstring)."""
    from wacc_torch.integrations.accelerate import count_tokens

    accelerator, model, optimizer, wacc = _fresh(task)
    before = None if wacc.loss_scaler is None else wacc.loss_scaler.scale
    for index in range(task.num_microbatches):
        if task.checkpoint_after == index:
            accelerator, model, optimizer, wacc = _checkpoint(task, accelerator)
        batch = _batch(task, index)
        with accelerator.accumulate(model):
            with wacc.autocast():
                loss = model(**batch).loss
            wacc.backward(loss, count_tokens(batch["labels"], shift=True))
            optimizer.step()
            optimizer.zero_grad()
    return _finished(task, wacc, before)


def run_variable(task: LoopTask) -> LoopRun:
    """The guide's variable-size loop with ``WaccAccumulation`` (module docstring)."""
    from wacc_torch.integrations.accelerate import count_tokens

    accelerator, model, optimizer, wacc = _fresh(task)
    before = None if wacc.loss_scaler is None else wacc.loss_scaler.scale
    k = task.num_microbatches
    batches = [_batch(task, i) for i in range(k)]
    for index, batch in enumerate(batches):
        if task.checkpoint_after == index:
            accelerator, model, optimizer, wacc = _checkpoint(task, accelerator)
        # The guide's skeleton: every batch but the window's last under no_sync across ranks.
        last = index == k - 1
        sync = accelerator.no_sync if not last else lambda _: nullcontext()
        with sync(model), wacc.autocast():
            loss = model(**batch).loss
        wacc.backward(loss, count_tokens(batch["labels"], shift=True), last=last)
    optimizer.step()
    optimizer.zero_grad()
    return _finished(task, wacc, before)


def _fix(adapter: Adapter, run: Any, code_path: str) -> Adapter:
    return Adapter(
        name=f"{adapter.name}+wacc", title=f"{adapter.title} + WaccAccumulation",
        requires=adapter.requires, model=adapter.model, code_path=code_path,
        checked=adapter.checked, loss_scale=False, checkpoint=None, run=run, fp16=None,
        ranks=True,
    )  # fmt: skip


ACCUMULATE = _fix(
    accelerate.ACCUMULATE,
    run_accumulate,
    "accumulate(model): wacc.backward(mean, tokens) -> finish_mean at sync_gradients",
)
VARIABLE = _fix(
    accelerate.VARIABLE,
    run_variable,
    "guide 'variable size': wacc.backward(mean, tokens, last=...); one optimizer.step()",
)
