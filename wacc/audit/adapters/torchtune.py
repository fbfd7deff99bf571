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
  the config's ``collate_fn``, resolved as the recipe's ``_setup_data`` resolves it: torchtune's
  ``padded_collate_sft`` (``tokens`` / ``labels``, the labels unshifted: the recipe shifts them
  in ``_loss_step``) unless ``run`` is given another (the ``torchtune+wacc`` row's);
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

Across ranks (``task.world_size > 1``): ``recipes/full_finetune_distributed.py``
(``FullFinetuneRecipeDistributed``, torchtune 0.6.1), every rank a torchrun-style process (gloo
on the CPU).  Driven as the recipe's own code: ``__init__(cfg)`` (a ``DictConfig`` with
``device: cpu``, the audit's dtype, ``gradient_accumulation_steps`` = K, one epoch; it calls
``init_process_group(training.get_distributed_backend("cpu"))``: gloo, from the torchrun
environment), ``_setup_model`` (the model instantiated from ``cfg.model`` under the meta device,
``init_device_mesh("cpu", (N, 1))``, FSDP2 through ``training.shard_model`` with
``custom_sharded_layers`` = every leaf module of the audit's model, which has no ``layers.<i>``
for the default condition, then ``training.load_from_full_model_state_dict`` of the full state
dict of ``task.build_model()``: the checkpoint's weights), ``_setup_optimizer`` (``cfg.optimizer``
= ``torch.optim.SGD``), ``_setup_data`` (its ``StatefulDistributedSampler(num_replicas=N,
rank=r, shuffle=False)`` and ``StatefulDataLoader`` with the config's ``collate_fn``, batch size 1,
over a data set in which item ``i * N + r`` is rank ``r``'s microbatch ``i``: each rank holds and
reads its own window only), ``_setup_profiler(None)``, then ``train()`` and ``cleanup()`` (which
destroys the group, after the FSDP model and optimizer are dropped and ``gc.collect()`` has run).
Stand-ins: the config's ``model``/``dataset`` components are this module's ``_config_model`` /
``_config_dataset``, the tokenizer an object with ``pad_id = 0``, the loss
``nn.CrossEntropyLoss()``, the metric logger silent, the checkpoint client's end-of-epoch save a
no-op; torchtune's CUDA-only memory calls are no-ops while the recipe runs
(``training.get_memory_stats``, which ``_setup_model`` calls on rank 0 and which raises for a CPU
device, ``log_memory_stats``, and ``cleanup_before_training``, whose ``torch.cpu.empty_cache``
does not exist: ``gc.collect()`` only).  The audit reads the gradient in an optimizer step
pre-hook: every shard gathered (``DTensor.full_tensor()``, the same collective on every rank)
into the unsharded ``task.build_model()`` model; a hook on the logits notes how much data was
read at the first backward.

What decides the weighting across ranks (``train``, lines 776-829): ``current_num_tokens =
(labels != ignore_index).sum()`` per batch, ``num_tokens += current_num_tokens``, ``current_loss
= loss_fn(logits, shifted labels) * current_num_tokens``, ``backward()`` (FSDP2's reduce-scatter
averages the ranks: a divide factor of N), and at the K-th batch
``torch.distributed.all_reduce(num_tokens)`` (a SUM over every rank) and
``training.scale_grads(model, world_size / num_tokens)`` ("multiply by world_size to undo FSDP2
gradient normalization").  Every token of every rank weighs the same: no rank-equal error, and
the ranks agree.  But the count is the single-device recipe's, over the unshifted labels: each
labelled sequence weighs ``n + 1`` and the sum is divided by ``Σ_r Σ_k (n_rk + 1)`` (the audit's
``unequal`` rank windows: 235 counted for 228 targets), so the audit must find a FAIL at N = 2
with exactly that first-label error (and the ``equal`` windows, every sequence 64 targets, pass).
The count the row shows is ``world_size`` over the factor (``2 / num_tokens``: float32, as at
world size 1).
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER", "COLLATE", "run"]

# The recipes' ``collate_fn`` when the config names none (``cfg.get("collate_fn", ...)``).
COLLATE = "torchtune.data.padded_collate_sft"


class _Logits(nn.Module):
    """The audit's model as a torchtune decoder: ``forward(tokens)`` returns the logits;
    ``on_backward`` (when given) sees the logits' gradient arrive."""

    def __init__(
        self, model: nn.Module, on_backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        super().__init__()
        self.model = model
        self.on_backward = on_backward

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens)["logits"]
        if self.on_backward is not None and logits.requires_grad:
            logits.register_hook(self.on_backward)  # observes only: returns None
        return logits


class _Silent:
    """The recipe's metric logger: its per-step numbers are not the audit's."""

    def log_dict(self, payload: dict[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _recipe_module(recipe: str = "full_finetune_single_device") -> ModuleType:
    """``recipes/<recipe>.py`` as torchtune installs it (the ``recipes`` folder beside the
    package is not importable as a package: it raises on purpose)."""
    import torchtune

    root = Path(torchtune.__file__).resolve().parent.parent
    path = root / "recipes" / f"{recipe}.py"
    name = f"_wacc_torchtune_{recipe}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"torchtune's recipe is not at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(task: LoopTask, collate_fn: str = COLLATE) -> LoopRun:
    """The recipe's ``train()`` over the window, one optimizer step (module docstring); across
    ranks the distributed recipe's (:func:`_run_distributed`).  ``collate_fn``: the config's
    ``collate_fn`` (a dotted path, resolved and called as the recipes' ``_setup_data`` does)."""
    if task.world_size > 1:
        return _run_distributed(task, collate_fn)
    from torchtune import training
    from torchtune.config._utils import _get_component_from_path

    padded_collate = _get_component_from_path(collate_fn)

    recipe_class: Any = _recipe_module().FullFinetuneRecipeSingleDevice
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    loss_fn = nn.CrossEntropyLoss()
    dataset = task.dataset

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        rows = [{"tokens": b["input_ids"].tolist(), "labels": b["labels"].tolist()} for b in batch]
        collated: dict[str, torch.Tensor]
        collated = padded_collate(rows, padding_idx=0, ignore_idx=loss_fn.ignore_index)
        return collated

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
    with _observed_scale_grads() as factors:
        recipe.train()
    # The factor is a float32 tensor (1 / an int64 count): the count is its rounded reciprocal.
    return LoopRun(counted_tokens=round(1 / factors[0]) if factors else None)


@contextmanager
def _observed_scale_grads() -> Iterator[list[float]]:
    """``training.scale_grads`` (which the recipes call through the module) wrapped so that the
    factor it is handed is noted; torchtune's own function scales."""
    from torchtune import training

    factors: list[float] = []
    original = training.scale_grads

    def scale_grads(module: nn.Module, scaler: torch.Tensor) -> None:
        factors.append(float(scaler))
        original(module, scaler)

    training.scale_grads = scale_grads
    try:
        yield factors
    finally:
        training.scale_grads = original


class _NoCheckpoint:
    """The recipe's checkpoint client: its end-of-epoch save writes nothing here."""

    def save_checkpoint(self, **kwargs: Any) -> None:
        pass


class _Tokenizer:
    """The recipe's tokenizer as ``_setup_data`` reads it: only its padding id."""

    pad_id = 0


class _GlobalView(torch.utils.data.Dataset[dict[str, list[int]]]):
    """The data set ``_setup_data`` shards: every rank's window interleaved (item ``i * N + r`` is
    rank ``r``'s microbatch ``i``), of which this rank holds (and reads) only its own: the
    recipe's ``StatefulDistributedSampler(num_replicas=N, rank=r, shuffle=False)`` picks exactly
    those, in order, as ``tokens``/``labels`` lists (what torchtune's SFT data sets yield)."""

    def __init__(self, window: torch.utils.data.Dataset[dict[str, torch.Tensor]], length: int,
                 rank: int, world_size: int) -> None:  # fmt: skip
        self._window, self._length = window, length
        self._rank, self._world_size = rank, world_size

    def __len__(self) -> int:
        return self._length * self._world_size

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        if index % self._world_size != self._rank:
            raise IndexError(f"item {index} is rank {index % self._world_size}'s, not this rank's")
        item = self._window[index // self._world_size]
        return {"tokens": item["input_ids"].tolist(), "labels": item["labels"].tolist()}


# What the distributed recipe's config components hand it (set by _run_distributed only).
_PENDING: dict[str, Any] = {}


def _config_model() -> nn.Module:
    """``cfg.model``'s component: the audit's model, built in the recipe's default dtype (its
    ``_setup_model`` sets it) and moved to the meta device, as the recipe's configs build theirs:
    its weights come from the full state dict the recipe loads into the shards."""
    spec = _PENDING["spec"]
    model: nn.Module = spec.build(torch.get_default_dtype())
    return _Logits(model.to("meta"), on_backward=_PENDING["on_backward"])


def _config_dataset(tokenizer: _Tokenizer) -> _GlobalView:
    """``cfg.dataset``'s component (the recipe passes its tokenizer): :class:`_GlobalView`."""
    view: _GlobalView = _PENDING["dataset"]
    return view


# The recipe's ``dtype`` settings (it refuses fp16 itself: "full fp16 training is not supported").
_DTYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


def _run_distributed(task: LoopTask, collate_fn: str) -> LoopRun:
    """``FullFinetuneRecipeDistributed`` across ranks (module docstring, "Across ranks")."""
    from omegaconf import DictConfig

    here = __name__
    cfg = DictConfig({
        "device": "cpu", "dtype": _DTYPES[task.dtype], "output_dir": str(task.workdir),
        "resume_from_checkpoint": False, "gradient_accumulation_steps": task.num_microbatches,
        "seed": 0, "epochs": 1, "max_steps_per_epoch": None,
        "model": {"_component_": f"{here}._config_model"},
        "optimizer": {"_component_": "torch.optim.SGD", "lr": task.learning_rate},
        "dataset": {"_component_": f"{here}._config_dataset"}, "collate_fn": collate_fn,
    })  # fmt: skip
    whole = task.build_model()  # the weights (the checkpoint's), and the gradient's reader

    def first_backward(grad: torch.Tensor) -> None:
        if task.fetched_at_first_backward is None:
            task.fetched_at_first_backward = len(set(task.fetch_log))

    recipe_class: Any = _recipe_module("full_finetune_distributed").FullFinetuneRecipeDistributed
    recipe = recipe_class(cfg)  # init_process_group(get_distributed_backend("cpu")): gloo
    _PENDING.update(spec=task.model_spec, on_backward=first_backward, dataset=_GlobalView(
        task.dataset, task.num_microbatches, task.rank, task.world_size))  # fmt: skip
    try:
        with _without_device_memory(), _observed_scale_grads() as factors:
            _setup_and_train(recipe, cfg, task, whole)
    finally:
        _PENDING.clear()
        # The FSDP model and its optimizer go before the process group (recipe.cleanup ends it).
        recipe._model = recipe._optimizer = None
        gc.collect()
    recipe.cleanup()
    # The factor is world_size / the all-reduced count, a float32 tensor: the count's rounding.
    return LoopRun(counted_tokens=round(task.world_size / factors[0]) if factors else None)


def _setup_and_train(recipe: Any, cfg: Any, task: LoopTask, whole: nn.Module) -> None:
    """``setup()``'s steps that build the model, optimizer and data loader (the recipe's own
    ``_setup_model``, ``_setup_optimizer``, ``_setup_data``, ``_setup_profiler``; the loss,
    tokenizer, logger and checkpoint client the module docstring's), then ``train()``."""
    recipe._compile = False
    recipe._checkpoint_client = _NoCheckpoint()
    recipe._metric_logger = _Silent()
    recipe._tokenizer = _Tokenizer()
    recipe._model = recipe._setup_model(
        cfg_model=cfg.model, enable_activation_checkpointing=False,
        enable_activation_offloading=False, fsdp_cpu_offload=False,
        reshard_after_forward=True, model_state_dict=_Logits(whole).state_dict(),
        custom_sharded_layers=_sharded_layers(whole),
    )  # fmt: skip
    recipe._optimizer = recipe._setup_optimizer(cfg_optimizer=cfg.optimizer)
    recipe._optimizer.register_step_pre_hook(lambda *_: _record_whole(task, recipe, whole))
    recipe._loss_fn = nn.CrossEntropyLoss()
    recipe._dataloader = recipe._setup_data(
        cfg_dataset=cfg.dataset, shuffle=False, batch_size=1,
        collate_fn=cfg.get("collate_fn", COLLATE),  # as the recipe's setup() reads it
    )  # fmt: skip
    recipe._steps_per_epoch = len(recipe._dataloader) // task.num_microbatches
    recipe._lr_scheduler = None
    recipe._profiler = recipe._setup_profiler(None)
    recipe.ignore_labels_cache = torch.full((1, 1), recipe._loss_fn.ignore_index)
    recipe.train()


@contextmanager
def _without_device_memory() -> Iterator[None]:
    """torchtune's device-memory calls, which assume CUDA, as no-ops on the CPU:
    ``_setup_model`` reports memory on rank 0 (``training.get_memory_stats`` raises for a CPU
    device) and ``train`` starts with ``training.cleanup_before_training`` (``torch.cpu`` has no
    ``empty_cache``): there ``gc.collect()`` only, its first step."""
    from torchtune import training

    names = ("get_memory_stats", "log_memory_stats", "cleanup_before_training")
    saved = {name: getattr(training, name) for name in names}
    training.get_memory_stats = lambda device, reset_stats=True: {}
    training.log_memory_stats = lambda stats, message="": None
    training.cleanup_before_training = gc.collect
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(training, name, value)


def _sharded_layers(model: nn.Module) -> list[str]:
    """The recipe's ``custom_sharded_layers`` (module names, as its configs list
    ``tok_embeddings`` and ``output``): every leaf module of the audit's model (which has no
    ``layers.<i>``, the recipe's default shard condition), each its own FSDP unit."""
    return [f"model.{name}" for name, module in model.named_modules() if name and
            not any(True for _ in module.children())]  # fmt: skip


def _record_whole(task: LoopTask, recipe: Any, whole: nn.Module) -> None:
    """Right before ``optimizer.step()``: every rank's shards of every gradient gathered
    (``DTensor.full_tensor()``, the same collective on every rank) into the unsharded model
    ``whole`` (the one whose state dict the recipe loaded), which the audit records."""
    sharded = {name.removeprefix("model."): p for name, p in recipe._model.named_parameters()}
    for name, parameter in whole.named_parameters():
        grad = sharded[name].grad
        parameter.grad = None if grad is None else grad.full_tensor()
    task.record_gradients(whole)


ADAPTER = Adapter(
    name="torchtune",
    title="torchtune full_finetune recipe (single device; distributed across ranks)",
    requires=("torchtune", "torchao"),
    model="plain",
    code_path="recipes/full_finetune_single_device.py FullFinetuneRecipeSingleDevice.train "
    "(L656-713: loss * current_num_tokens, training.scale_grads(model, 1 / num_tokens)); across "
    "ranks recipes/full_finetune_distributed.py FullFinetuneRecipeDistributed.train (L776-829: "
    "all_reduce(num_tokens), training.scale_grads(model, world_size / num_tokens), FSDP2 via "
    "training.shard_model)",
    checked="torchtune 0.6.1 with torchao 0.15.0 (CPU, run here)",
    loss_scale=False,
    checkpoint="the recipe checkpoints at the end of an epoch (save_checkpoint), never inside "
    "a gradient-accumulation window",
    run=run,
    ranks=True,
    fp16="no float16 path: its dtype setting puts the parameters in bf16 (no autocast, no scaler)",
    cause="recipes/full_finetune_single_device.py:692-706 (torchtune 0.6.1) counts "
    "current_num_tokens over the unshifted labels while _loss_step averages over the shifted ones, "
    "so a text-completion sequence weighs one token too many (215 counted for 211; "
    "recipes/full_finetune_distributed.py:778-781 counts the same way and all-reduces it, so "
    "every rank's tokens weigh alike but 235 are counted for 228 at world size 2); the recipe "
    "weighs by tokens already: a collate_fn that ignores each row's first label fixes its count.",
    fixed_by="torchtune+wacc",
)
