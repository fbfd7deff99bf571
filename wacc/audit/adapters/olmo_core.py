"""OLMo-core's transformer train module, ``olmo_core.train.train_module.TransformerTrainModule.
train_batch`` (ai2-olmo-core 3.0.0, ``train/train_module/transformer/train_module.py`` lines
391-468), driven on the CPU at world size 1: its own method runs unchanged on a train-module object
whose ``__init__`` (an OLMo-core ``Transformer`` from its config, parallelised, an optimizer
config) is replaced by the audit's objects.  What ``train_batch`` does, and so what is measured:

* ``batch_num_tokens_for_loss = (batch["labels"] != label_ignore_index).sum()``: the rank's token
  count over its whole batch (the window's K sequences as one ``[K, L]`` batch, right-padded to
  one length as OLMo-core's data loaders give them; the labels shifted as ``get_labels`` shifts
  them: position t predicts token t + 1);
* ``split_batch`` into micro-batches of ``rank_microbatch_size // seq_len`` instances
  (``rank_microbatch_size = L``: one sequence per micro-batch, K micro-batches);
* per micro-batch, inside its own ``_train_microbatch_context`` (DDP's ``no_sync`` but on the
  last; nothing on one process without DDP) and ``model_forward`` (autocast off: ``autocast_
  precision`` None), ``model(input_ids, labels=..., loss_reduction="sum",
  loss_div_factor=batch_num_tokens_for_loss)``, then ``loss.backward()``.

The model: the audit's causal LM behind a wrapper with an OLMo-core ``Transformer``'s loss
signature, which computes the loss as OLMo-core's ``LMHead`` does: its
``olmo_core.nn.functional.cross_entropy_loss`` (``reduction="sum"``, no z-loss) on the logits,
then ``LMHead._finalize_loss`` (called on a head stand-in with tensor and context parallelism off:
``loss / loss_div_factor``).  ``train_batch(dry_run=True)``: the same forward and backward, and it
returns before the metric bookkeeping (which needs a ``Trainer``); the optimizer step
(``optim_step``: clipping, then ``optim.step()``) is ``torch.optim.SGD(lr=task.learning_rate)``'s
``step()`` here, the audit reading the gradient in its pre-hook.  No checkpoint inside a batch and
no float16 path (its ``autocast_precision`` is bfloat16 on accelerators).

Across ranks (``task.world_size > 1``), OLMo-core's own data-parallel path, on the CPU with gloo:
``olmo_core.distributed.utils.init_distributed(backend="gloo")`` brings the group up from the
torchrun environment (what ``prepare_training_environment`` calls; gloo: no CUDA device set);
``build_world_mesh(dp=TransformerDataParallelConfig(name=DataParallelType.fsdp),
device_type="cpu")`` (the default data-parallel type of OLMo-core's configs) and
``get_dp_model_mesh``, as ``TransformerTrainModule.__init__`` (L171-177) does; then
``Transformer.apply_fsdp`` (``nn/transformer/model.py`` L1012-1077, the method
``parallelize_model`` calls for FSDP, ``train_module/transformer/common.py`` L120-136) run
unchanged on the wrapper above, which shows it no blocks, embeddings, norm or head of its own
(``apply_fsdp`` then ``fully_shard``s the root alone: the audit's model is one FSDP unit, its
parameters DTensors sharded over the ranks) and the config's ``reduce_dtype`` float32 (float64 in
the float64 run: a float32 reduction would round the audit's exact run).  Patched: the module-
global ``_WORLD_MESH`` is reset after each run (``build_world_mesh`` allows one per process; the
audit runs a loop three times per rank process).  ``train_batch`` then runs as at world size 1
with ``dp_config`` set, so its ``_train_microbatch_context`` (L614-631) takes the FSDP branch:
``set_is_last_backward`` only (no ``set_requires_gradient_sync``: FSDP reduce-scatters after every
micro-batch, so every rank must run as many micro-batches as the others, which OLMo-core's data
loader guarantees and the audit's rank windows have: 4 each).  The audit reads the gradient in the
optimizer's step pre-hook, each sharded gradient gathered whole (``DTensor.full_tensor()``, the
same collective on every rank) into an unsharded twin (the last ``task.build_model()``).

What decides the weighting across ranks: ``batch_num_tokens_for_loss`` (``train_batch`` L402-404)
is the rank's own count, never all-reduced (the metrics' ``_reduce_divide_factor``, L276, touches
only the logged loss), so each rank's gradient is its own token mean; FSDP2 then averages the
ranks (torch 2.13.0 ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``
``_get_gradient_divide_factors`` L840-846, no divide factor set: ``ReduceOp.AVG``, or a pre/post
division by the world size for a float64 reduction).  The gradient is mean_r Σ_k g_rk / T_r, the
mean over ranks of each rank's token mean: ``weighs_ranks_equally``, and at world size 2 the audit
must find a FAIL with its error the one predicted from the per-rank totals (211 and 17 tokens on
``unequal``: rel L2 2.32), to the float32 rounding of OLMo-core's own loss
(``cross_entropy_loss`` casts the logits to float32, in the float64 run too).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER", "drive"]

IGNORE = -100


class _Transformer(nn.Module):
    """The audit's model with an OLMo-core ``Transformer``'s training forward (module
    docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.divisors: list[float] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        ignore_index: int,
        loss_reduction: str,
        z_loss_multiplier: float | None,
        loss_div_factor: torch.Tensor | float | None,
        return_logits: bool | None = None,
    ) -> Any:
        from olmo_core.nn.functional import cross_entropy_loss
        from olmo_core.nn.lm_head import LMHead, LMOutputWithLoss

        logits = self.model(input_ids=input_ids)["logits"]
        ce_loss, _ = cross_entropy_loss(
            logits.view(-1, logits.shape[-1]), labels.contiguous().view(-1),
            ignore_index=ignore_index, reduction=loss_reduction,
            compute_z_loss=z_loss_multiplier is not None,
            z_loss_multiplier=z_loss_multiplier or 1e-4,
        )  # fmt: skip
        self.divisors.append(float(loss_div_factor) if loss_div_factor is not None else 0.0)
        head = SimpleNamespace(tp_enabled=False, cp_enabled=False)
        batch = input_ids.shape[0]

        def finalize(loss: torch.Tensor) -> torch.Tensor:
            return LMHead._finalize_loss(
                head, loss, batch, loss_reduction=loss_reduction, loss_div_factor=loss_div_factor
            )

        return LMOutputWithLoss(
            logits=None, loss=finalize(ce_loss), ce_loss=finalize(ce_loss.detach()), z_loss=None
        )

    def post_batch(self, dry_run: bool = False) -> None:
        pass

    def reset_auxiliary_metrics(self) -> None:
        pass


def _batch(task: LoopTask) -> dict[str, torch.Tensor]:
    """The window's K sequences as one ``[K, L]`` batch, labels shifted as ``get_labels`` shifts
    them (position t predicts token t + 1)."""
    data = task.dataset
    items = [data[i] for i in range(len(data))]
    input_ids = torch.stack([item["input_ids"] for item in items])
    unshifted = torch.stack([item["labels"] for item in items])
    labels = torch.full_like(unshifted, IGNORE)
    labels[:, :-1] = unshifted[:, 1:]
    return {"input_ids": input_ids, "labels": labels}


def _train_module(
    module_class: Any, model: nn.Module, seq_len: int, dp_config: Any = None, world_mesh: Any = None
) -> Any:
    """A ``module_class`` (``TransformerTrainModule`` or a subclass) holding ``model`` (its
    ``__init__`` replaced: module docstring); ``dp_config`` is what ``_train_microbatch_context``
    reads under FSDP, ``world_mesh`` what ``dp_process_group`` reads."""
    module: Any = module_class.__new__(module_class)
    state = dict(
        model=model, _model_mode=None, label_ignore_index=IGNORE, device=torch.device("cpu"),
        z_loss_multiplier=None, rank_microbatch_size=seq_len, autocast_precision=None,
        record_metric=lambda *args, **kwargs: None, _dp_config=dp_config, world_mesh=world_mesh,
        _tp_config=None, _cp_config=None,
    )  # fmt: skip
    for name, value in state.items():
        setattr(module, name, value)
    return module


Counted = Callable[[Any, _Transformer], "float | None"]


def _divisor(module: Any, wrapped: _Transformer) -> float | None:
    """What ``train_batch`` divided the loss by: its ``loss_div_factor``."""
    return wrapped.divisors[0] if wrapped.divisors else None


def run(task: LoopTask) -> LoopRun:
    """``drive`` with OLMo-core's own ``TransformerTrainModule``."""
    from olmo_core.train.train_module import TransformerTrainModule

    return drive(task, TransformerTrainModule, _divisor)


def drive(task: LoopTask, module_class: Any, counted: Counted) -> LoopRun:
    """One ``train_batch`` of a ``module_class`` over the window as one batch, then the optimizer
    step (module docstring); across ranks under OLMo-core's FSDP (:func:`_run_fsdp`).
    ``counted(module, wrapped)`` is the row's counted tokens."""
    if task.world_size > 1:
        return _run_fsdp(task, module_class, counted)
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    wrapped = _Transformer(model)
    batch = _batch(task)
    module = _train_module(module_class, wrapped, batch["input_ids"].shape[1])
    module.train_batch(batch, dry_run=True)
    optimizer.step()
    return LoopRun(counted_tokens=counted(module, wrapped))


def _run_fsdp(task: LoopTask, module_class: Any, counted: Counted) -> LoopRun:
    """The rank's ``train_batch`` with the model under OLMo-core's FSDP (module docstring)."""
    import olmo_core.distributed.parallel as parallel
    from olmo_core.distributed.parallel import (
        DataParallelType,
        build_world_mesh,
        get_dp_model_mesh,
    )
    from olmo_core.distributed.utils import init_distributed
    from olmo_core.nn.transformer import Transformer
    from olmo_core.train.train_module import TransformerDataParallelConfig

    init_distributed(backend=task.backend)
    try:
        dp_config = TransformerDataParallelConfig(name=DataParallelType.fsdp)
        world_mesh = build_world_mesh(dp=dp_config, device_type="cpu")
        model = task.build_model()
        wrapped = _Transformer(model)
        # What Transformer.apply_fsdp reads of a model without blocks, embeddings or head of
        # its own: the root alone is sharded (the audit's model is one FSDP unit).
        shown = dict(blocks=nn.ModuleDict(), embeddings=None, embedding_norm=None, lm_head=None,
                     tie_word_embeddings=False, dtype=task.dtype)  # fmt: skip
        for name, value in shown.items():
            setattr(wrapped, name, value)
        # The config's float32 reduction, but float64 in the float64 run (float32 would round
        # the audit's exact run, not what the audited dtype's run does).
        reduce_dtype = torch.float64 if task.dtype == torch.float64 else torch.float32
        apply_fsdp: Any = Transformer.apply_fsdp  # run on the wrapper, not a Transformer
        apply_fsdp(
            wrapped, dp_mesh=get_dp_model_mesh(world_mesh), reduce_dtype=reduce_dtype,
            wrapping_strategy=dp_config.wrapping_strategy,
        )  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
        sharded = dict(model.named_parameters())

        def record(*_: Any) -> None:
            # Each rank holds a shard of every gradient: full_tensor() all-gathers it (the same
            # call on every rank) into an unsharded twin the audit reads (the last model built:
            # its parameters are plain tensors, as the audit's readers of them expect).
            whole = task.build_model()
            for name, parameter in whole.named_parameters():
                grad = sharded[name].grad
                parameter.grad = None if grad is None else grad.full_tensor()  # type: ignore[attr-defined]
            task.record_gradients(whole)

        optimizer.register_step_pre_hook(record)
        batch = _batch(task)
        seq_len = batch["input_ids"].shape[1]
        module = _train_module(module_class, wrapped, seq_len, dp_config, world_mesh)
        module.train_batch(batch, dry_run=True)
        optimizer.step()
        tokens = counted(module, wrapped)
        # The process group's holders go first (teardown rule: gloo may abort at exit else);
        # the model and its shards, held by ``record`` alone then, go with this frame.
        del module, optimizer, record, wrapped, world_mesh
        gc.collect()
        return LoopRun(counted_tokens=tokens)
    finally:
        parallel._WORLD_MESH = None  # build_world_mesh allows one per process: a run has its own


ADAPTER = Adapter(
    name="olmo-core",
    title="OLMo-core TransformerTrainModule.train_batch (loss_div_factor)",
    requires=("olmo_core", "olmo_core.train.train_module"),
    model="plain",
    code_path="olmo_core/train/train_module/transformer/train_module.py "
    "TransformerTrainModule.train_batch (L391-468: batch_num_tokens_for_loss as "
    "loss_div_factor, split_batch, loss.backward() per micro-batch), the loss as LMHead's "
    "(cross_entropy_loss, reduction='sum'; _finalize_loss); across ranks init_distributed, "
    "build_world_mesh (FSDP) and Transformer.apply_fsdp (fully_shard)",
    checked="ai2-olmo-core 3.0.0 (CPU: one process, and 2 ranks under its FSDP on gloo; run here)",
    loss_scale=False,
    checkpoint="the Trainer checkpoints between steps, never inside a batch",
    run=run,
    fp16="no float16 path: its autocast_precision is bfloat16 on accelerators",
    ranks=True,
    weighs_ranks_equally=True,
    fixed_by="olmo-core+wacc",
    cause="across ranks olmo_core/train/train_module/transformer/train_module.py:402-404 "
    "(ai2-olmo-core 3.0.0) divides each rank's loss by its own batch_num_tokens_for_loss, never "
    "all-reduced, and its FSDP (Transformer.apply_fsdp: fully_shard, no divide factor) averages "
    "the ranks' gradients: every rank weighs 1/N whatever its token count (exact at world size 1).",
)
