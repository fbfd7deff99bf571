"""litgpt's full fine-tuning loop, ``litgpt/finetune/full.py`` ``fit`` (litgpt 0.5.13, lines
272-294), on a real ``lightning.Fabric`` on the CPU (one device; across ranks below) at precision
``32-true`` and at ``bf16-mixed`` (litgpt's default ``precision`` on a CPU:
``get_default_supported_precision``).
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
optimizer step), ``fabric.setup(model)``, ``fabric.setup_optimizers`` and
``fabric.setup_dataloaders`` over the window (batch size 1, in order; litgpt's SFT batches hold
unshifted ``labels``); the model is the audit's causal LM behind a wrapper whose
``forward(input_ids)`` returns the logits (a litgpt ``GPT`` returns logits); the optimizer
``torch.optim.SGD(lr=task.learning_rate)`` (litgpt's AdamW; the audit reads the gradient in its step
pre-hook).  ``chunked_cross_entropy`` returns the microbatch's mean over its non-ignored targets
(``non_masked_elems.maximum(1)``: 0 for a microbatch without targets), and each is divided by the
accumulation count: every microbatch weighs the same.  ``bf16-mixed`` is Fabric's
``torch.autocast("cpu", torch.bfloat16)`` around the forward (float64 is never autocast), and
``MixedPrecision.convert_output`` (``lightning/fabric/plugins/precision/amp.py:71-72``) converts the
model's output to the default dtype: the float64 run's logits are rounded to float32 once, its
weighting is the ``32-true`` row's (to float32 rounding).  No checkpoint inside a window (``fit``
saves at ``save_interval`` optimizer steps) and no float16 path of its own (litgpt's ``16-mixed`` is
Fabric's: GPU only). As in ``setup`` (``full.py:123``), the loop runs inside ``fabric.launch(main,
...)``.

Across ranks (``task.world_size > 1``, a torchrun world): litgpt's ``setup`` (``full.py:107-118``)
builds ``L.Fabric(devices=devices, num_nodes=num_nodes, strategy=FSDPStrategy(...))`` on more than
one device (``devices * num_nodes > 1``), which Fabric refuses on a CPU
(``lightning/fabric/connector.py:433-439``: "FSDP is only available on GPU").  Driven here instead:
``L.Fabric(accelerator="cpu", devices=N, strategy=DDPStrategy(process_group_backend=task.backend),
precision=...)``, Fabric's own DDP strategy; Fabric finds the torchrun environment
(``TorchElasticEnvironment``) and ``fabric.launch`` brings the gloo group up in the launched
processes (no spawn).  ``fit``'s lines are unchanged: ``TrainArgs(global_batch_size=K * N,
micro_batch_size=1)``, so ``gradient_accumulation_iters(devices=N)`` is K on every rank;
``fabric.no_backward_sync`` is ``DDPStrategy.no_backward_sync``
(``fabric/strategies/ddp.py:248-260``: ``module.no_sync()`` on the first K - 1 microbatches) and the
K-th ``fabric.backward`` all-reduces.  Nothing is patched; the one departure is the data:
``fabric.setup_dataloaders(..., use_distributed_sampler=False)``, Fabric's switch for data a user
shards itself, because each rank reads its own window (litgpt's ``get_dataloaders`` lets Fabric put
a ``DistributedSampler`` over one shared dataset). What decides the weighting across ranks:
``full.py:285`` (``loss / train.gradient_accumulation_iters(devices, num_nodes)``) on
``chunked_cross_entropy``'s mean (``litgpt/utils.py:346-351``) and DDP's reducer averaging the ranks
(it divides by the world size): every microbatch of every rank weighs 1 / (N K), whatever its
tokens.  The audit must find a FAIL equal to the equal-microbatch prediction (not the equal-rank
one: ``weighs_ranks_equally`` is False).  Measured at N = 2 (ranks of 211 and 17 tokens, one with a
zero-token microbatch): rel L2 4.726084520055488 on the test driver's windows (``ranks_driver.py``),
4.635859359928037 on the audit's ``unequal`` rank windows, each the equal-microbatch prediction to
float64 rounding (``32-true``; ``bf16-mixed`` to float32 rounding), the ranks bit-identical
(``tests/wacc/audit/test_litgpt.py``).  The fix is ``litgpt+wacc``
(:mod:`wacc.audit.adapters.litgpt_wacc`).  On a GPU, litgpt's ``FSDPStrategy`` weighs the same (FSDP
averages the ranks' gradients too) and at ``bf16-mixed`` would also reduce them in bfloat16
(``FSDPPrecision.mixed_precision_config``: ``reduce_dtype=torch.bfloat16``), which is not run here.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["BF16_MIXED", "TRUE_32", "fit", "setup"]


class _Logits(nn.Module):
    """The audit's model as a litgpt ``GPT``: ``forward(input_ids)`` returns the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids)["logits"]


def _strategy(task: LoopTask, lightning: Any) -> Any:
    """``setup``'s strategy (module docstring): ``"auto"`` on one device; across ranks Fabric's
    ``DDPStrategy`` over the torchrun world (litgpt's ``FSDPStrategy``, which Fabric refuses on
    a CPU)."""
    if task.world_size == 1:
        return "auto"
    return lightning.fabric.strategies.DDPStrategy(process_group_backend=task.backend)


# ``main``'s part under ``fabric.launch``: (fabric, task, train, devices, num_nodes) -> the
# count the loop divided by (None: it never divides by one).
Main = Callable[[Any, LoopTask, Any, int, int], "float | None"]


def fit(task: LoopTask, precision: str, main: Main) -> LoopRun:
    """``setup``: a Fabric at ``precision`` on ``task.world_size`` CPU devices, ``TrainArgs``,
    then ``fabric.launch(main, ...)`` (module docstring)."""
    lightning: Any = importlib.import_module("lightning")  # typed only where it is installed
    from litgpt.args import TrainArgs

    devices, num_nodes = task.world_size, 1
    fabric = lightning.Fabric(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=_strategy(task, lightning),
        precision=precision,
    )
    # fit's global batch is every rank's: K microbatches of one sequence per rank and step.
    train = TrainArgs(
        global_batch_size=task.num_microbatches * devices * num_nodes, micro_batch_size=1, epochs=1
    )
    try:
        counted = fabric.launch(main, task, train, devices, num_nodes)
    finally:
        # Fabric's strategy holds the DDP module and the process group: gone before the audit
        # destroys the group (a DDP reducer freed at exit can abort gloo).
        del fabric
        gc.collect()
    return LoopRun(counted_tokens=counted)


def setup(fabric: Any, task: LoopTask) -> tuple[Any, Any, Any]:
    """``main``'s setup: the model behind ``fabric.setup``, SGD (read in its step pre-hook)
    behind ``fabric.setup_optimizers``, the window behind ``fabric.setup_dataloaders``; returns
    them."""
    model = task.build_model()
    model.train()
    wrapped = fabric.setup(_Logits(model))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    optimizer = fabric.setup_optimizers(optimizer)
    # Each rank reads its own window, in order: no DistributedSampler over one shared dataset.
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(task.dataset, batch_size=1, shuffle=False),
        use_distributed_sampler=False,
    )
    return wrapped, optimizer, loader


def _main(fabric: Any, task: LoopTask, train: Any, devices: int, num_nodes: int) -> None:
    """``main``'s setup and ``fit``'s loop (L272-294) up to its first optimizer step."""
    from litgpt.utils import CycleIterator, chunked_cross_entropy

    model, optimizer, loader = setup(fabric, task)
    state: dict[str, Any] = {"iter_num": 0, "step_count": 0}
    train_iterator = CycleIterator(loader)
    while state["step_count"] < 1:  # fit's loop (L272-294), up to its first optimizer step
        state["iter_num"] += 1
        batch = next(train_iterator)
        input_ids, targets = batch["input_ids"], batch["labels"]
        is_accumulating = (
            state["iter_num"] % train.gradient_accumulation_iters(devices, num_nodes) != 0
        )
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            fabric.backward(loss / train.gradient_accumulation_iters(devices, num_nodes))
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1


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
        run=lambda task: fit(task, precision, _main),
        fp16="no float16 path on the CPU: litgpt's 16-mixed is Fabric's GPU precision",
        ranks=True,
        fixed_by=f"{name}+wacc",
        cause="litgpt/finetune/full.py:285 (litgpt 0.5.13, fit) divides each microbatch's mean "
        "loss by gradient_accumulation_iters, so every microbatch weighs the same (and across "
        "ranks Fabric's DDP averages the ranks).",
    )


TRUE_32 = _adapter("litgpt", "32-true", "litgpt finetune/full.py fit, precision 32-true")
BF16_MIXED = _adapter(
    "litgpt-bf16-mixed", "bf16-mixed", "litgpt finetune/full.py fit, bf16-mixed (CPU default)"
)
