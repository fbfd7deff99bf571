"""litgpt's full fine-tuning loop, ``litgpt/finetune/full.py`` ``fit`` (litgpt 0.5.13, lines
272-294), on a real ``lightning.Fabric`` on the CPU (one device) at precision ``32-true`` and at
``bf16-mixed`` (litgpt's default ``precision`` on a CPU: ``get_default_supported_precision``).
``fit`` itself is not called: it builds a ``Tokenizer`` from a checkpoint directory and runs a
validation pass first; its accumulation lines run here as ``fit`` has them, with litgpt's own
``chunked_cross_entropy``, ``CycleIterator`` and ``TrainArgs.gradient_accumulation_iters``:

.. code-block:: python

    is_accumulating = state["iter_num"] % train.gradient_accumulation_iters(devices, num_nodes) != 0
    with fabric.no_backward_sync(model, enabled=is_accumulating):
        logits = model(input_ids)
        loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
        fabric.backward(loss / train.gradient_accumulation_iters(devices, num_nodes))
    if not is_accumulating:
        optimizer.step()

with ``TrainArgs(global_batch_size=K, micro_batch_size=1)`` (K accumulation iterations, one
optimizer step), ``fabric.setup(model, optimizer)`` and ``fabric.setup_dataloaders`` over the
window (batch size 1, in order; litgpt's SFT batches hold unshifted ``labels``); the model is the
audit's causal LM behind a wrapper whose ``forward(input_ids)`` returns the logits (a litgpt
``GPT`` returns logits); the optimizer ``torch.optim.SGD(lr=task.learning_rate)`` (litgpt's
AdamW; the audit reads the gradient in its step pre-hook).  ``chunked_cross_entropy`` returns the
microbatch's mean over its non-ignored targets (``non_masked_elems.maximum(1)``: 0 for a
microbatch without targets), and each is divided by the accumulation count: every microbatch
weighs the same.  ``bf16-mixed`` is Fabric's ``torch.autocast("cpu", torch.bfloat16)`` around the
forward (float64 is never autocast, so the float64 run is the weighting alone).  No checkpoint
inside a window (``fit`` saves at ``save_interval`` optimizer steps) and no float16 path of its
own (litgpt's ``16-mixed`` is Fabric's: GPU only).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["BF16_MIXED", "TRUE_32"]


class _Logits(nn.Module):
    """The audit's model as a litgpt ``GPT``: ``forward(input_ids)`` returns the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids)["logits"]


def _fit(task: LoopTask, precision: str) -> LoopRun:
    """``fit``'s accumulation over the window on a Fabric at ``precision`` (module docstring)."""
    lightning: Any = importlib.import_module("lightning")  # typed only where it is installed
    from litgpt.args import TrainArgs
    from litgpt.utils import CycleIterator, chunked_cross_entropy

    fabric = lightning.Fabric(accelerator="cpu", devices=1, precision=precision)
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    wrapped, optimizer = fabric.setup(_Logits(model), optimizer)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(task.dataset, batch_size=1, shuffle=False)
    )
    devices, num_nodes = 1, 1
    train = TrainArgs(global_batch_size=task.num_microbatches, micro_batch_size=1, epochs=1)
    state: dict[str, Any] = {"iter_num": 0, "step_count": 0}
    train_iterator = CycleIterator(loader)
    while state["step_count"] < 1:  # fit's loop (L272-294), up to its first optimizer step
        state["iter_num"] += 1
        batch = next(train_iterator)
        input_ids, targets = batch["input_ids"], batch["labels"]
        is_accumulating = (
            state["iter_num"] % train.gradient_accumulation_iters(devices, num_nodes) != 0
        )
        with fabric.no_backward_sync(wrapped, enabled=is_accumulating):
            logits = wrapped(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            fabric.backward(loss / train.gradient_accumulation_iters(devices, num_nodes))
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
    return LoopRun(counted_tokens=None)


def _adapter(name: str, precision: str, title: str) -> Adapter:
    return Adapter(
        name=name,
        title=title,
        requires=("litgpt", "lightning"),
        model="plain",
        code_path=f"litgpt/finetune/full.py fit L272-294 (chunked_cross_entropy(...) / "
        f"train.gradient_accumulation_iters(devices)) on lightning.Fabric(precision="
        f"{precision!r}), fit's lines restated with litgpt's own functions",
        checked="litgpt 0.5.13 with lightning 2.6.6 (CPU, run here)",
        loss_scale=False,
        checkpoint="fit saves at save_interval optimizer steps, never inside a window",
        run=lambda task: _fit(task, precision),
        fp16="no float16 path on the CPU: litgpt's 16-mixed is Fabric's GPU precision",
        cause="litgpt/finetune/full.py:272-294 (litgpt 0.5.13, fit) divides each microbatch's mean "
        "loss by gradient_accumulation_iters, so every microbatch weighs the same; no wacc "
        "integration yet: fit's loop is nanoGPT's under Fabric, and nanogpt+wacc shows it written "
        "with WeightedGradientsAccumulator.",
    )


TRUE_32 = _adapter("litgpt", "32-true", "litgpt finetune/full.py fit, precision 32-true")
BF16_MIXED = _adapter(
    "litgpt-bf16-mixed", "bf16-mixed", "litgpt finetune/full.py fit, bf16-mixed (CPU default)"
)
