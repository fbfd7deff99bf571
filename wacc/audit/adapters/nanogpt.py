"""The nanoGPT training loop, as karpathy/nanoGPT's ``train.py`` writes it (commit ``3adf61e``,
2025-11-12; lines 292-314), on the plain causal LM (a hand-written model whose forward returns its
own *mean* token loss, as nanoGPT's ``GPT.forward(idx, targets)`` does):

.. code-block:: python

    for micro_step in range(gradient_accumulation_steps):
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
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

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
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    before = float(scaler.get_scale())
    gradient_accumulation_steps = task.num_microbatches
    grad_clip = 0.0
    data = task.dataset

    def get_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = data[index]
        return batch["input_ids"][None], batch["labels"][None]

    X, Y = get_batch(0)  # noqa: N806 (the script's names)
    for micro_step in range(gradient_accumulation_steps):
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
)
