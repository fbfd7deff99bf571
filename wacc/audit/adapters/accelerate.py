"""Hugging Face ``accelerate``, the two loops its gradient-accumulation guide documents
("Performing gradient accumulation with Accelerate"):

* ``accelerate``: ``Accelerator(gradient_accumulation_steps=K)``, ``accelerator.prepare(model,
  optimizer, dataloader)``, then per batch ``with accelerator.accumulate(model): loss =
  model(**batch).loss; accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()``.
  ``backward`` divides each microbatch's *mean* loss by K: every microbatch weighs the same.
* ``accelerate-variable``: the guide's fix for "training samples of variable size": prefetch the
  window's K batches, ``num_items_in_batch = sum(batch["labels"].ne(-100).sum() ...)`` gathered
  over processes, ``loss = loss_sum * K * num_processes / num_items_in_batch``,
  ``accelerator.backward(loss)`` per batch, one ``optimizer.step()``.  The guide counts unshifted
  labels while a causal LM's loss uses the shifted ones: the count it divides by is shown.

The model is the hub-style GPT-2 built from a config.  Batches come straight from
``task.dataset`` (batch size 1) rather than a prepared ``DataLoader``: the window is the whole
epoch, so the end-of-dataloader sync a prepared loader adds falls on the K-th batch anyway.
The gradient is read in a ``torch.optim`` step pre-hook on the wrapped optimizer: it runs only
when accelerate really steps.
Checkpoint: ``accelerator.save_state(dir)`` mid-window, then a fresh ``Accelerator`` + model +
optimizer, ``accelerator.load_state(dir)`` and the remaining batches.  Checked against
accelerate 1.15.0 on CPU, the version run here.  No fixed loss scale can be set: accelerate's
fp16 ``GradScaler`` is dynamic and needs an accelerator device.  Float16 (``task.fp16``): the same
loops with ``Accelerator(mixed_precision="fp16")`` and ``SGD(lr=task.learning_rate)``; the scaler
is ``accelerator.scaler`` (``accelerator.backward`` scales with it, the prepared optimizer's
``step`` skips on NaN/inf through it).  On CPU accelerate makes none, and no autocast either
(``native_amp`` stays off): the run reports it.

Across ranks (``task.world_size > 1``, a torchrun world): the same loops; ``Accelerator(cpu=True)``
reads the torchrun environment (``PartialState``: ``MULTI_CPU``, gloo) and ``prepare`` wraps the
model in DDP (``accelerator.py:2032``).  Each rank reads its own window (no prepared dataloader to
shard it).  What decides the weighting across ranks (accelerate 1.16.0, run here):

* ``accelerate``: ``accelerator.py:2757`` (``backward``: ``loss / gradient_accumulation_steps``)
  on each microbatch's *mean*, ``accelerator.py:1243-1257`` (``accumulate``: ``no_sync`` until
  the K-th batch sets ``sync_gradients``), then DDP's all-reduce divided by the world size: every
  microbatch of every rank weighs 1 / (N K).  Measured at N = 2 (ranks of 211 and 17 tokens, one
  with a zero-token microbatch): rel L2 2.66919137 against 2.66919130 predicted from the
  microbatch counts (agreement 4e-8: transformers' loss casts to float32); a FAIL.
* ``accelerate-variable``: the guide's ``accelerator.gather(num_items).sum()`` (``accelerator.py:
  2982``) makes the count global and ``loss * K * num_processes / num_items_in_batch`` undoes both
  divisions (``backward``'s by K, DDP's by N); the guide's skeleton runs every batch but the last
  under ``model.no_sync`` (done here).  It hands the optimizer Σ_r Σ_k g_rk / C, C the gathered
  count (measured: to rounding); the guide's skeleton counts ``labels.ne(-100)`` unshifted, 235
  for 228 targets here: rel L2 7/235 = 0.0298 (its text says to count ``labels[..., 1:]`` for a
  causal LM; the skeleton, audited, does not).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from wacc.audit.models import causal_lm_loss_sum, logits_of
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ACCUMULATE", "VARIABLE"]


def _fresh(task: LoopTask) -> tuple[Any, torch.nn.Module, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # Each run stands for a training script of its own (a restart after a checkpoint included),
    # but accelerate keeps one AcceleratorState per process and refuses another mixed precision
    # ("restart your runtime completely"): forget it, as a new process would start without it.
    # Its GradientState too: a Trainer run before leaves end_of_dataloader set, and accumulate()
    # would then sync (step) on every batch.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    options: dict[str, Any] = {"mixed_precision": "fp16"} if task.fp16 else {}
    accelerator = Accelerator(
        gradient_accumulation_steps=task.num_microbatches, cpu=True, **options
    )
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _checkpoint(task: LoopTask, accelerator: Any) -> tuple[Any, torch.nn.Module, Any]:
    directory = task.workdir / "accelerate_state"
    accelerator.save_state(str(directory))
    accelerator, model, optimizer = _fresh(task)
    accelerator.load_state(str(directory))
    return accelerator, model, optimizer


def _scale(accelerator: Any) -> float | None:
    """The fp16 scaler's scale now (None: accelerate made no scaler)."""
    scaler = accelerator.scaler
    return None if scaler is None else float(scaler.get_scale())


def _finished(
    task: LoopTask, accelerator: Any, counted: float | None, before: float | None
) -> LoopRun:
    after = _scale(accelerator)
    if not task.fp16:
        return LoopRun(counted_tokens=counted)
    if before is None or after is None:
        where = "off-GPU" if accelerator.device.type == "cpu" else f"on {accelerator.device.type}"
        return LoopRun(counted_tokens=counted, note=f"no GradScaler {where}")
    return LoopRun(counted_tokens=counted, loss_scales=(before, after))


def run_accumulate(task: LoopTask) -> LoopRun:
    """The documented ``accumulate()`` loop (module docstring)."""
    accelerator, model, optimizer = _fresh(task)
    before = _scale(accelerator)
    data = task.dataset
    for index in range(len(data)):
        if task.checkpoint_after == index:
            accelerator, model, optimizer = _checkpoint(task, accelerator)
        batch = {k: v[None] for k, v in data[index].items()}
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return _finished(task, accelerator, None, before)


def run_variable(task: LoopTask) -> LoopRun:
    """The documented variable-size fix (module docstring)."""
    accelerator, model, optimizer = _fresh(task)
    before = _scale(accelerator)
    data = task.dataset
    batches = [{k: v[None] for k, v in data[i].items()} for i in range(len(data))]
    k = task.num_microbatches
    num_items = sum(batch["labels"].ne(-100).sum() for batch in batches)
    num_items_in_batch = accelerator.gather(num_items).sum().item()
    for index, batch in enumerate(batches):
        if task.checkpoint_after == index:
            accelerator, model, optimizer = _checkpoint(task, accelerator)
        # The guide's skeleton: DDP's all-reduce only on the window's last batch.
        last = index == len(batches) - 1
        wrapped: Any = model  # DistributedDataParallel across ranks: it has no_sync
        sync = wrapped.no_sync if not last and accelerator.num_processes > 1 else nullcontext
        with sync():
            logits = logits_of(model(input_ids=batch["input_ids"]))
            loss = causal_lm_loss_sum(logits, batch["labels"])
            loss = (loss * k * accelerator.num_processes) / num_items_in_batch
            accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return _finished(task, accelerator, float(num_items_in_batch), before)


_COMMON = dict(requires=("accelerate", "transformers"), model="gpt2", loss_scale=False,
               checked="accelerate 1.15.0 with transformers 5.24.0", checkpoint=None,
               fp16=None, ranks=True)  # fmt: skip
ACCUMULATE = Adapter(
    name="accelerate",
    title="accelerate accumulate() (documented loop)",
    code_path="Accelerator(gradient_accumulation_steps=K).accumulate(model); accelerator.backward",
    run=run_accumulate,
    fixed_by="accelerate+wacc",
    cause="Accelerator.backward divides each microbatch's mean loss by gradient_accumulation_steps "
    "(accelerate 1.16.0: accelerator.py:2757): every microbatch weighs the same, whatever its "
    "tokens.",
    **_COMMON,  # type: ignore[arg-type]
)
VARIABLE = Adapter(
    name="accelerate-variable",
    title="accelerate variable-size fix (num_items_in_batch)",
    code_path="guide 'variable size': loss_sum*K*num_processes/num_items_in_batch; backward",
    run=run_variable,
    fixed_by="accelerate-variable+wacc",
    cause="The guide's skeleton counts num_items_in_batch as batch['labels'].ne(-100), over the "
    "unshifted labels (accelerate's docs/source/usage_guides/gradient_accumulation.md:280, at "
    "16cb6eb), while "
    "a causal LM's loss shifts them: one token too many per sequence.",
    **_COMMON,  # type: ignore[arg-type]
)
