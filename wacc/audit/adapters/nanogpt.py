"""The nanoGPT training loop, as karpathy/nanoGPT's ``train.py`` writes it (commit ``3adf61e``,
2025-11-12; lines 292-314), on the plain causal LM (a hand-written model whose forward returns its
own *mean* token loss, as nanoGPT's ``GPT.forward(idx, targets)`` does):

.. code-block:: python

    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # the script's stand-in for no_sync(): only the last micro step all-reduces
            assert isinstance(model, DDP)
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch('train')  # prefetch the next microbatch before backward
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

No dependency: the loop is written here as the script has it, with the audit's window in place of
``get_batch`` (same prefetch order: microbatch ``k + 1`` is read before microbatch ``k``'s
backward) and ``grad_clip = 0.0`` (the script's switch that turns clipping off; its default 1.0
would clip the gradient the audit reads).  ``scaler`` is ``train.py:196``'s
``GradScaler(enabled=(dtype == 'float16'))`` written with the non-deprecated
``torch.amp.GradScaler(device_type, ...)``; in a float32 run it is disabled (``scale`` returns the
loss, ``step`` calls ``optimizer.step()``).  The optimizer is ``torch.optim.SGD(lr=task.
learning_rate)`` where the script builds AdamW (``configure_optimizers``): the audit reads the
gradient in a step pre-hook, before either would use it.  ``compile`` is off (CPU).

Each microbatch's mean is divided by ``gradient_accumulation_steps``: every microbatch weighs the
same whatever its token count, and a microbatch without targets has a ``0/0`` mean.  No fixed loss
scale: the script's only scaler is the dynamic ``GradScaler``.  Checkpoint: ``train.py`` writes
``ckpt.pt`` (model, optimizer, ``iter_num``, not the ``GradScaler``) only at the top of an
iteration (``iter_num % eval_interval == 0``, lines 263-286), never between micro-steps, and
``init_from='resume'`` restarts that iteration on fresh random batches (``get_batch``): there is no
mid-window state to save or to resume.  Float16 (``task.fp16``): the script's
``dtype='float16'`` path — ``ctx = torch.amp.autocast(device_type, dtype=torch.float16)`` and the
scaler enabled (initial scale 2**16), run here with ``device_type='cpu'``; ``train.py`` itself
takes ``ctx = nullcontext()`` on a CPU device (line 112), so this is its accelerator branch run on
the CPU's float16 autocast.

Across ranks (``task.world_size > 1``): the script's DDP path, as ``torchrun`` runs it — ``ddp =
int(os.environ.get('RANK', -1)) != -1``, ``init_process_group(backend=backend)`` (its DDP setup
block), ``gradient_accumulation_steps //= ddp_world_size`` (the global setting here is K times the
world size: every rank runs its own K microbatches), ``model = DDP(model,
device_ids=[ddp_local_rank])`` (``device_ids=None`` on a CPU, which DDP requires there) and, per
micro step, ``model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)``
(in the lines :data:`SOURCE` names: the script's stand-in for ``no_sync()``). What decides the
weighting across ranks: ``loss = loss / gradient_accumulation_steps`` on each microbatch's *mean*
loss and DDP's reducer averaging the ranks (``Reducer::mark_variable_ready_dense`` divides by the
world size): every microbatch of every rank weighs the same, whatever its tokens (a zero-target
microbatch still counts in K: torch's cross-entropy gives its ``0/0`` mean a zero gradient). No
prediction from per-rank totals applies (it weighs microbatches, not ranks, equally).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.distributed import init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 (the script's name)

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER", "SOURCE"]

SOURCE = "karpathy/nanoGPT train.py@3adf61e L292-314"  # the lines the loop follows


def run(task: LoopTask) -> LoopRun:
    """One iteration of ``train.py``'s training loop over the window (module docstring)."""
    device_type = "cpu"
    dtype = "float16" if task.fp16 else "float32"  # train.py's `dtype` setting
    ptdtype = {
        "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16
    }[dtype]  # fmt: skip
    ctx: AbstractContextManager[object] = (
        torch.amp.autocast(device_type=device_type, dtype=ptdtype) if task.fp16 else nullcontext()
    )
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
    ddp = int(os.environ.get("RANK", -1)) != -1 and task.world_size > 1
    gradient_accumulation_steps = task.num_microbatches * task.world_size  # the global setting
    if ddp:
        init_process_group(backend=task.backend)
        ddp_world_size = int(os.environ["WORLD_SIZE"])
        assert gradient_accumulation_steps % ddp_world_size == 0
        gradient_accumulation_steps //= ddp_world_size
    raw_model = task.build_model()
    raw_model.train()
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, raw_model)
    model: torch.nn.Module = raw_model
    if ddp:
        model = DDP(raw_model, device_ids=None)
    before = float(scaler.get_scale())
    grad_clip = 0.0
    data = task.dataset

    def get_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = data[index]
        return batch["input_ids"][None], batch["labels"][None]

    X, Y = get_batch(0)  # noqa: N806 (the script's names)
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            # the script's stand-in for no_sync(): only the last micro step all-reduces
            assert isinstance(model, DDP)
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            out = model(input_ids=X, labels=Y)
            logits, loss = out["logits"], out["loss"]  # noqa: F841 (as the script has it)
            loss = loss / gradient_accumulation_steps
        if micro_step + 1 < gradient_accumulation_steps:  # the window has no batch after it
            X, Y = get_batch(micro_step + 1)  # noqa: N806
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if task.fp16:
        return LoopRun(counted_tokens=None, loss_scales=(before, float(scaler.get_scale())))
    return LoopRun(counted_tokens=None)


ADAPTER = Adapter(
    name="nanogpt",
    title="nanoGPT train.py loss / gradient_accumulation_steps",
    requires=("torch",),
    model="plain",
    code_path=f"{SOURCE}: loss / gradient_accumulation_steps; scaler.scale(loss).backward()",
    checked="nanoGPT 3adf61e (written here), torch 2.13.0 (run here)",
    loss_scale=False,
    checkpoint="train.py saves ckpt.pt only at the top of an iteration (eval_interval); "
    "init_from='resume' restarts the iteration on new random batches",
    run=run,
    fp16=None,
    fixed_by="nanogpt+wacc",
    cause="karpathy/nanoGPT train.py@3adf61e L292-314 divides each microbatch's mean loss by "
    "gradient_accumulation_steps (`loss = loss / gradient_accumulation_steps`): every microbatch "
    "weighs 1/K whatever its token count.",
    ranks=True,
)
