"""torchtune's full-finetune recipe, ``recipes/full_finetune_single_device.py`` (torchtune 0.6.1,
``FullFinetuneRecipeSingleDevice.train``, lines 656-713), driven on the CPU: the recipe's own
``train`` and ``_loss_step`` methods run unchanged on a recipe object whose ``setup`` (checkpoint
files, tokenizer, dataset and logger from a YAML config) is replaced by the audit's objects:

* ``_model``: the audit's causal LM behind a wrapper whose ``forward(tokens)`` returns its logits
  (a torchtune ``TransformerDecoder`` returns logits; its parameters are the model's);
* ``_loss_fn``: ``torch.nn.CrossEntropyLoss()`` (mean over the non-ignored labels, as the
  configs' ``CEWithChunkedOutputLoss`` computes it unchunked; the recipe reads its
  ``ignore_index``);
* ``_dataloader``: ``torch.utils.data.DataLoader`` over the window (batch size 1, a
  ``DistributedSampler(num_replicas=1, shuffle=False)``: the recipe calls ``set_epoch``) with
  torchtune's ``padded_collate_sft`` (``tokens`` / ``labels``, the labels unshifted: the recipe
  shifts them in ``_loss_step``);
* ``_optimizer``: ``torch.optim.SGD(lr=task.learning_rate)`` (the configs' AdamW; the audit reads
  the gradient in a step pre-hook), ``gradient_accumulation_steps`` = K, one epoch of K batches
  (one optimizer step), ``clip_grad_norm`` None, no compile, no optimizer-in-backward, no
  activation checkpointing, ``DummyProfiler``; ``save_checkpoint`` (called once after the epoch)
  does nothing.

What the recipe computes (lines 692-706): per batch ``current_num_tokens = (labels !=
ignore_index).sum()`` over the *unshifted* labels, ``loss = _loss_step(batch) *
current_num_tokens`` (``_loss_step`` is the mean over the *shifted* labels), ``loss.backward()``;
after K batches ``training.scale_grads(model, 1 / num_tokens)``, then ``optimizer.step()``.  The
count includes each sequence's first label, which no shifted target has: a text-completion batch
(labels = tokens) counts one token more per sequence than its loss averages over, so each
microbatch's mean is weighted by ``n_k + 1`` and the sum divided by ``Σ (n_k + 1)`` (an
instruction batch masks its prompt's first label and counts right).  The adapter records the
factor the recipe hands ``scale_grads`` (a wrapper around torchtune's own function, called
through) as the count it divided by.  That factor is ``1 / num_tokens`` of an int64 tensor: a
float32 tensor, so even the float64 run multiplies by ``1/N`` rounded to float32 (relative
``2**-24`` at most: far below any weighting error, within a float32 bound).

Dtype: the recipe has no mixed precision: its ``dtype: bf16`` puts the parameters, and so the
gradients it accumulates, in bfloat16, with no loss scaler; the adapter builds the model in the
audit's dtype (``wacc audit torchtune --dtype bfloat16`` is that run).  No checkpoint inside an
epoch (``save_checkpoint`` runs at the end of one) and no float16 path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER"]


class _Logits(nn.Module):
    """The audit's model as a torchtune decoder: ``forward(tokens)`` returns the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens)["logits"]


class _Silent:
    """The recipe's metric logger: its per-step numbers are not the audit's."""

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        pass


def _recipe_module() -> ModuleType:
    """``recipes/full_finetune_single_device.py`` as torchtune installs it (the ``recipes``
    folder beside the package is not importable as a package: it raises on purpose)."""
    import torchtune

    root = Path(torchtune.__file__).resolve().parent.parent
    path = root / "recipes" / "full_finetune_single_device.py"
    name = "_wacc_torchtune_full_finetune_single_device"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"torchtune's recipe is not at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(task: LoopTask) -> LoopRun:
    """The recipe's ``train()`` over the window, one optimizer step (module docstring)."""
    from torchtune import training
    from torchtune.data import padded_collate_sft

    recipe_class: Any = _recipe_module().FullFinetuneRecipeSingleDevice
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    loss_fn = nn.CrossEntropyLoss()
    dataset = task.dataset

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        rows = [{"tokens": b["input_ids"].tolist(), "labels": b["labels"].tolist()} for b in batch]
        return padded_collate_sft(rows, padding_idx=0, ignore_idx=loss_fn.ignore_index)

    sampler: torch.utils.data.DistributedSampler[dict[str, torch.Tensor]]
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=sampler, collate_fn=collate)
    recipe = recipe_class.__new__(recipe_class)  # setup() reads files: its objects set here
    k = task.num_microbatches
    state = dict(
        _model=_Logits(model), _loss_fn=loss_fn, _optimizer=optimizer, _dataloader=loader,
        _gradient_accumulation_steps=k, _steps_per_epoch=1, max_steps_per_epoch=None,
        epochs_run=0, total_epochs=1, global_step=0, _compile=False, _optimizer_in_bwd=False,
        _clip_grad_norm=None, _lr_scheduler=None, _log_every_n_steps=1,
        _log_peak_memory_stats=False, _device=torch.device("cpu"), profiler_profile_memory=False,
        _profiler=training.DummyProfiler(),
        activations_handling_ctx=training.get_act_offloading_ctx_manager(model, False),
        ignore_labels_cache=torch.full((1, 1), loss_fn.ignore_index),
        _metric_logger=_Silent(),
    )  # fmt: skip
    for name, value in state.items():
        setattr(recipe, name, value)
    recipe.save_checkpoint = lambda epoch: None
    factors: list[float] = []
    original = training.scale_grads

    def scale_grads(module: nn.Module, scaler: torch.Tensor) -> None:
        factors.append(float(scaler))
        original(module, scaler)

    training.scale_grads = scale_grads  # observes the factor; torchtune's own function scales
    try:
        recipe.train()
    finally:
        training.scale_grads = original
    # The factor is a float32 tensor (1 / an int64 count): the count is its rounded reciprocal.
    return LoopRun(counted_tokens=round(1 / factors[0]) if factors else None)


ADAPTER = Adapter(
    name="torchtune",
    title="torchtune full_finetune_single_device recipe",
    requires=("torchtune", "torchao"),
    model="plain",
    code_path="recipes/full_finetune_single_device.py FullFinetuneRecipeSingleDevice.train "
    "(L656-713: loss * current_num_tokens, training.scale_grads(model, 1 / num_tokens))",
    checked="torchtune 0.6.1 with torchao 0.15.0 (CPU, run here)",
    loss_scale=False,
    checkpoint="the recipe checkpoints at the end of an epoch (save_checkpoint), never inside "
    "a gradient-accumulation window",
    run=run,
    fp16="no float16 path: its dtype setting puts the parameters in bf16 (no autocast, no scaler)",
    cause="recipes/full_finetune_single_device.py:692-706 (torchtune 0.6.1) counts "
    "current_num_tokens over the unshifted labels while _loss_step averages over the shifted ones, "
    "so a text-completion sequence weighs one token too many (215 counted for 211); no wacc "
    "integration yet: the recipe weighs by tokens already and needs only its count shifted "
    "(labels[..., 1:]).",
)
