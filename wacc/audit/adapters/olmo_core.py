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
``step()`` here, the audit reading the gradient in its pre-hook.  Across ranks (not run here) the
division is by the rank-local count and FSDP then averages the ranks' gradients.  No checkpoint
inside a batch and no float16 path (its ``autocast_precision`` is bfloat16 on accelerators).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER"]

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


def run(task: LoopTask) -> LoopRun:
    """One ``train_batch`` over the window as one batch, then the optimizer step (module
    docstring)."""
    from olmo_core.train.train_module import TransformerTrainModule

    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    wrapped = _Transformer(model)
    data = task.dataset
    items = [data[i] for i in range(len(data))]
    input_ids = torch.stack([item["input_ids"] for item in items])
    unshifted = torch.stack([item["labels"] for item in items])
    labels = torch.full_like(unshifted, IGNORE)
    labels[:, :-1] = unshifted[:, 1:]  # get_labels: position t predicts token t + 1
    module: Any = TransformerTrainModule.__new__(TransformerTrainModule)
    state = dict(
        model=wrapped, _model_mode=None, label_ignore_index=IGNORE, device=torch.device("cpu"),
        z_loss_multiplier=None, rank_microbatch_size=input_ids.shape[1], autocast_precision=None,
        record_metric=lambda *args, **kwargs: None,
    )  # fmt: skip
    for name, value in state.items():
        setattr(module, name, value)
    module.train_batch({"input_ids": input_ids, "labels": labels}, dry_run=True)
    optimizer.step()
    return LoopRun(counted_tokens=wrapped.divisors[0] if wrapped.divisors else None)


ADAPTER = Adapter(
    name="olmo-core",
    title="OLMo-core TransformerTrainModule.train_batch (loss_div_factor)",
    requires=("olmo_core", "olmo_core.train.train_module"),
    model="plain",
    code_path="olmo_core/train/train_module/transformer/train_module.py "
    "TransformerTrainModule.train_batch (L391-468: batch_num_tokens_for_loss as "
    "loss_div_factor, split_batch, loss.backward() per micro-batch), the loss as LMHead's "
    "(cross_entropy_loss, reduction='sum'; _finalize_loss)",
    checked="ai2-olmo-core 3.0.0 (CPU, one process, run here)",
    loss_scale=False,
    checkpoint="the Trainer checkpoints between steps, never inside a batch",
    run=run,
    fp16="no float16 path: its autocast_precision is bfloat16 on accelerators",
)
