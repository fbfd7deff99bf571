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
reached at world size 1: no FSDP there.  No checkpoint inside a step (``checkpointer.save`` runs
between steps) and no float16 path (torchtitan's mixed precision is FSDP's ``MixedPrecisionPolicy``
or autocast on the accelerator).

Across ranks (``task.world_size > 1``), torchtitan's own data-parallel path, on the CPU with gloo:

* the group and the meshes: ``Trainer.init_distributed`` (``trainer.py``: torchtitan's
  ``dist_utils.init_distributed(config.comm, ...)``, which turns autograd's multithreading off,
  sets its ``TORCH_NCCL_*``/``TORCH_FR_*`` variables and calls ``init_process_group`` from the
  torchrun environment, then ``ParallelDims.from_config(config.parallelism, world_size)``: the
  default ``data_parallel_shard_degree = -1``, i.e. pure FSDP over every rank), then
  ``ParallelDims.build_mesh`` (a real ``DeviceMesh`` whose ``batch`` and ``fsdp`` axes hold both
  ranks) and ``dist_utils.set_spmd_backend``, as ``Trainer.__init__`` runs them;
  ``config.dump_folder`` is the rank's workdir (its comm-trace folder goes there);
* patched: torchtitan's module-level ``device_type`` (``tools/utils.py``: ``"cuda"`` when no
  accelerator is found) is ``"cpu"`` in ``distributed/utils.py`` and
  ``distributed/parallel_dims.py`` while the group and the meshes are built, so that
  ``init_distributed`` picks gloo (the CPU's default backend) and ``build_mesh`` a CPU mesh; put
  back after (the world is gloo on the CPU whatever ``task.backend``: the audit's model is on
  the CPU);
* the FSDP wrapping: torchtitan's ``apply_fsdp_to_decoder`` (``distributed/fsdp.py``, the one
  every decoder's ``parallelize`` calls) over the ``fsdp`` mesh, on the audit's model seen as a
  ``Decoder``: ``tok_embeddings`` = its token embedding, ``layers`` = ``{"0": hidden layer}``,
  ``lm_head`` = its head, no ``norm`` and no weight tying (so the head and the position
  embedding are sharded with the root), ``param_dtype = reduce_dtype =`` the run's dtype
  (torchtitan's ``mixed_precision_param`` default is bfloat16; the audit measures one dtype),
  default reshard policy; it ends with ``disable_fsdp_gradient_division`` (every FSDP module's
  ``set_gradient_divide_factor(1.0)``);
* patched: every FSDP module also gets ``set_force_sum_reduction_for_comms(True)`` (the
  first call of torchtitan's own ``enable_fsdp_symm_mem``): with a divide factor and a float32
  gradient FSDP reduce-scatters with NCCL's ``ReduceOp.PREMUL_SUM(1/1.0)``, which gloo lacks
  ("Cannot use ReduceOp.PREMUL_SUM with Gloo", measured); a SUM that divides by nothing is the
  same arithmetic (a product by 1.0 is exact).  The float64 run takes FSDP's SUM path anyway;
* then the same ``train_step`` as above, with the real ``parallel_dims`` (``dp_enabled`` true:
  two ranks); the audit reads, in SGD's step pre-hook, every sharded gradient gathered whole
  (``DTensor.full_tensor()``, the same calls on every rank) into an unsharded twin of the model;
  ``fully_shard`` replaces the parameters that ``task.build_model``'s read-first hook is on, so a
  hook on the logits notes how much of the window was read at the first backward.

What decides the weighting across ranks: ``train_step`` (``trainer.py`` L884-904:
``local_valid_tokens`` summed over the window's labels, then ``global_valid_tokens =
dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)``), the loss's ``/
global_valid_tokens`` (``components/loss.py`` L327-332, ``BaseLoss.__call__``), and
``disable_fsdp_gradient_division`` (``distributed/fsdp.py`` L27-41, called at the end of
``apply_fsdp_to_decoder``): FSDP's reduce-scatter sums the ranks' gradients of their loss sums
over the global count.  Every token of every rank weighs the same: the audit must find a pass on
every rank, every rank counting the world's total, the ranks agreeing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from wacc.audit.adapters.wacc_torch import record_sharded_gradients
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER"]


class _Logits(nn.Module):
    """The audit's model as a torchtitan model part: ``forward(input)`` returns the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=inputs)["logits"]


class _Decoder(_Logits):
    """The audit's model as the ``Decoder`` that torchtitan's ``apply_fsdp_to_decoder`` shards:
    its token embedding, one block (the hidden layer) and its output head, no final norm and no
    tied weights.  Properties, not registered submodules: the parameters keep the audit model's
    names (``model.embed.weight``, ...)."""

    enable_weight_tying = False
    norm = None

    @property
    def tok_embeddings(self) -> nn.Module:
        return cast(nn.Module, self.model.embed)

    @property
    def layers(self) -> dict[str, nn.Module]:
        return {"0": cast(nn.Module, self.model.hidden)}

    @property
    def lm_head(self) -> nn.Module:
        return cast(nn.Module, self.model.head)


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


def _train_step(
    task: LoopTask, trainer: Any, part: nn.Module, optimizer: torch.optim.Optimizer, **state: Any
) -> LoopRun:
    """``trainer.train_step`` over the window, with ``part`` as its one model part and the
    Trainer attributes of the module docstring (plus ``state``: ``config``, ``parallel_dims``)."""
    from torchtitan.components.loss import CrossEntropyLoss

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

    state.update(
        model_config=None, model_parts=[part], loss_fn=observed_loss,
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


def run(task: LoopTask) -> LoopRun:
    """One ``Trainer.train_step`` over the window (module docstring); across ranks
    :func:`_run_ranks`."""
    if task.world_size > 1:
        return _run_ranks(task)
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.trainer import Trainer

    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    trainer: Any = Trainer.__new__(Trainer)
    with _one_rank_group():
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("batch",))
        parallel_dims = SimpleNamespace(
            dp_enabled=True, pp_enabled=False, cp_enabled=False, dp_cp_enabled=False,
            ep_enabled=False, get_mesh=lambda name: mesh, get_optional_mesh=lambda name: None,
        )  # fmt: skip
        return _train_step(
            task, trainer, _Logits(model), optimizer, config=_config(), parallel_dims=parallel_dims
        )


@contextlib.contextmanager
def _cpu_device_type() -> Iterator[None]:
    """torchtitan's ``device_type`` (``"cuda"`` on a machine without an accelerator:
    ``tools/utils.py`` ``get_device_info``) as ``"cpu"`` where ``init_distributed`` picks its
    backend and ``ParallelDims.build_mesh`` its mesh, for the run; put back after."""
    from torchtitan.distributed import parallel_dims, utils

    saved = utils.device_type, parallel_dims.device_type
    utils.device_type = parallel_dims.device_type = "cpu"
    try:
        yield
    finally:
        utils.device_type, parallel_dims.device_type = saved


def _run_ranks(task: LoopTask) -> LoopRun:
    """Across ranks (module docstring): ``Trainer.init_distributed`` brings the group and the
    parallel dims up, ``apply_fsdp_to_decoder`` shards the model over the ``fsdp`` mesh, then
    ``train_step``; the audit reads every gradient gathered whole."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.trainer import Trainer

    config = copy.deepcopy(_config())
    config.dump_folder = str(task.workdir)
    trainer: Any = Trainer.__new__(Trainer)
    trainer.config = config
    with _cpu_device_type():
        parallel_dims = trainer.init_distributed()
        parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    model = task.build_model()
    model.train()
    part = _Decoder(model)
    apply_fsdp_to_decoder(
        part,
        parallel_dims.get_mesh("fsdp"),
        param_dtype=task.dtype,
        reduce_dtype=task.dtype,
        pp_enabled=False,
    )
    # Gloo has no PREMUL_SUM, the reduce-scatter op FSDP picks for a float32 gradient with a
    # divide factor (here torchtitan's 1.0); a SUM multiplied by nothing is the same arithmetic
    # (x * 1.0 is exact).  torchtitan's own enable_fsdp_symm_mem makes this call.
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.SGD(part.parameters(), lr=task.learning_rate)

    def note(grad: torch.Tensor) -> None:
        # fully_shard replaced the parameters that task.build_model's hook is on: the logits'
        # gradient is the first of each backward, noted the same way.
        if task.fetched_at_first_backward is None:
            task.fetched_at_first_backward = len(set(task.fetch_log))

    def on_logits(module: nn.Module, args: Any, logits: torch.Tensor) -> None:
        logits.register_hook(note)  # returns None: the output is unchanged

    part.register_forward_hook(on_logits)

    optimizer.register_step_pre_hook(lambda *_: record_sharded_gradients(task, model))
    return _train_step(task, trainer, part, optimizer, parallel_dims=parallel_dims)


ADAPTER = Adapter(
    name="torchtitan",
    title="torchtitan Trainer.train_step (its own step on the CPU)",
    requires=("torchtitan", "torchtitan.trainer"),
    model="plain",
    code_path="torchtitan/trainer.py Trainer.train_step (L871-948: local_valid_tokens, "
    "dist_utils.dist_sum_tensor over the batch mesh, loss_fn(pred, labels, "
    "global_valid_tokens)), on a Trainer object set up with the audit's model and window; "
    "across ranks after Trainer.init_distributed, ParallelDims.build_mesh and "
    "distributed/fsdp.py apply_fsdp_to_decoder (disable_fsdp_gradient_division: divide factor 1)",
    checked="torchtitan 0.3.0 (CPU, gloo, one and two ranks, run here)",
    loss_scale=False,
    checkpoint="the Trainer checkpoints between steps (checkpointer.save), never inside one",
    run=run,
    fp16="no float16 path on the CPU: its mixed precision is FSDP's MixedPrecisionPolicy",
    ranks=True,
)
