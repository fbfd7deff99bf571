"""torchtitan's training step, ``torchtitan.trainer.Trainer.train_step`` (torchtitan 0.3.0,
``trainer.py`` lines 871-948), driven on the CPU at world size 1.  The ``Trainer`` itself is not
built: its ``__init__`` takes the device module from the accelerator (``torch.cuda``), builds the
model from a registered model spec and the data loader from a Hugging Face dataset.  Its own
methods run unchanged on a ``Trainer`` object whose attributes are set here:

* ``train_step``, ``forward_backward_step``, ``post_dataloading_process`` and
  ``_forward_backward_body`` (as ``fwd_bwd_fn``): torchtitan's code, unchanged;
* ``loss_fn``: torchtitan's ``CrossEntropyLoss`` (``components/loss.py``: ``cross_entropy_loss``,
  ``F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")``, then
  ``/ global_valid_tokens``); an observer notes the count it is handed;
* the global token count: ``local_valid_tokens`` summed over the window's microbatches, then
  ``dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)`` over a one-rank gloo
  ``DeviceMesh`` named ``batch`` (``parallel_dims.dp_enabled`` set true, so that the
  data-parallel branch runs; a process group of one rank is created when none exists and
  destroyed after the step);
* ``clip_grad_norm_``: torchtitan's ``dist_utils.clip_grad_norm_`` with ``max_norm = inf`` (it
  computes the norm and multiplies every gradient by 1.0: the gradient is unchanged; its default
  1.0 would clip what the audit reads);
* ``model_parts``: the audit's causal LM behind a wrapper whose ``forward(input)`` returns its
  logits; the data iterator yields ``({"input": ids[:-1]}, labels[1:])`` per microbatch (batch
  size 1), the shift torchtitan's text datasets apply (``HuggingFaceTextDataset``);
* ``optimizers``: ``zero_grad`` / ``step`` of a ``torch.optim.SGD(lr=task.learning_rate)`` (the
  audit reads the gradient in its step pre-hook); ``lr_schedulers`` and ``metrics_processor``
  stand-ins that do nothing (``should_log`` is false: the logging branch is not run);
  ``train_context`` a null context (torchtitan's is an SPMD type-checking context);
  ``config.parallelism.spmd_backend = "partial_dtensor"`` (no input annotation).

The gradient divide factor (torchtitan sets FSDP's to 1, so that its reduce-scatter sums) is not
reached: no FSDP at world size 1.  No checkpoint inside a step (``checkpointer.save`` runs
between steps) and no float16 path (torchtitan's mixed precision is FSDP's ``MixedPrecisionPolicy``
or autocast on the accelerator).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER"]


class _Logits(nn.Module):
    """The audit's model as a torchtitan model part: ``forward(input)`` returns the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs)["logits"]


class _Optimizers:
    """``OptimizersContainer``'s two calls that ``train_step`` makes."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.optimizer.step()


@contextlib.contextmanager
def _one_rank_group() -> Iterator[None]:
    """A gloo process group of one rank for the step (none is left behind)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@functools.cache
def _config() -> Any:
    """``Trainer.Config()`` with the two settings of the module docstring (built once: it logs a
    line about checkpoint loading each time)."""
    from torchtitan.trainer import Trainer

    config = Trainer.Config()
    config.training.max_norm = float("inf")
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def run(task: LoopTask) -> LoopRun:
    """One ``Trainer.train_step`` over the window (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.trainer import Trainer

    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    counts: list[int] = []

    def observed_loss(pred: torch.Tensor, labels: torch.Tensor, tokens: torch.Tensor) -> Any:
        counts.append(int(tokens))
        return loss_fn(pred, labels, tokens)

    def batches() -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        data = task.dataset
        for index in range(len(data)):
            item = data[index]
            yield {"input": item["input_ids"][None, :-1]}, item["labels"][None, 1:]

    config = _config()
    trainer: Any = Trainer.__new__(Trainer)
    with _one_rank_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("batch",))
        parallel_dims = SimpleNamespace(
            dp_enabled=True, pp_enabled=False, cp_enabled=False, dp_cp_enabled=False,
            ep_enabled=False, get_mesh=lambda name: mesh, get_optional_mesh=lambda name: None,
        )  # fmt: skip
        state = dict(
            config=config, model_config=None, parallel_dims=parallel_dims,
            model_parts=[_Logits(model)], loss_fn=observed_loss,
            optimizers=_Optimizers(optimizer),
            lr_schedulers=SimpleNamespace(get_metrics=lambda: {}, step=lambda: None),
            metrics_processor=SimpleNamespace(should_log=lambda step: False),
            checkpointer=SimpleNamespace(maybe_wait_for_staging=lambda: None),
            gradient_accumulation_steps=task.num_microbatches,
            num_pipeline_parallel_microbatches=1, device=torch.device("cpu"), step=1,
            ntokens_seen=0, train_context=contextlib.nullcontext,
        )  # fmt: skip
        for name, value in state.items():
            setattr(trainer, name, value)
        trainer.fwd_bwd_fn = trainer._forward_backward_body
        trainer.train_step(batches())
    return LoopRun(counted_tokens=counts[0] if counts else None)


ADAPTER = Adapter(
    name="torchtitan",
    title="torchtitan Trainer.train_step (its own step on the CPU)",
    requires=("torchtitan", "torchtitan.trainer"),
    model="plain",
    code_path="torchtitan/trainer.py Trainer.train_step (L871-948: local_valid_tokens, "
    "dist_utils.dist_sum_tensor over the batch mesh, loss_fn(pred, labels, "
    "global_valid_tokens)), on a Trainer object set up with the audit's model and window",
    checked="torchtitan 0.3.0 (CPU, gloo, one rank, run here)",
    loss_scale=False,
    checkpoint="the Trainer checkpoints between steps (checkpointer.save), never inside one",
    run=run,
    fp16="no float16 path on the CPU: its mixed precision is FSDP's MixedPrecisionPolicy",
)
