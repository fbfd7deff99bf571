"""The ``+wacc`` rows of ``transformers.Trainer``: each Trainer loop of
:mod:`wacc.audit.adapters.trainer` (and :mod:`wacc.audit.adapters.peft_lora`) run with
:class:`wacc_torch.integrations.transformers.WaccTrainer` in place of ``Trainer`` — the same
``TrainingArguments``, dataset, optimizer, callbacks and checkpoint protocol, nothing else
changed. ``WaccTrainer`` weights each microbatch's own mean loss by its target count (labels !=
-100 after the model's shift) in a ``wacc_torch`` accumulator and writes the window's token mean
into ``.grad`` before the Trainer's step; the plain ``nn.Module`` is told ``shift_labels=True``
(its loss shifts, and nothing in a plain module says so). Resume: as the Trainer rows, the
Trainer checkpoints only at optimizer steps (``checkpoint-1``, with ``wacc_window.pt``: the empty
window and the scaler), and the interrupted window is recomputed. Float16: on CPU accelerate has
no ``GradScaler`` and no float16 autocast, so ``WaccTrainer`` runs the forward under float16
autocast with a ``WindowLossScaler`` that skips an overflowing window whole; the scaler's scale
is reported around the window. It starts at ``2**12`` (GradScaler's other defaults), as the
``wacc_torch`` rows (:data:`wacc.audit.adapters.wacc_torch.FP16_INIT_SCALE`): at GradScaler's
``2**16`` the float16 backward overflows on the clean window too (measured), so a running loop
skips windows until its scale has backed off there; the audit starts where it would have settled.

Across ranks (``task.world_size > 1``, a torchrun world): the Trainer rows' own across-ranks path
(:func:`wacc.audit.adapters.trainer.run_with`: ``ddp_backend``, the sharded global dataset), the
Trainer wrapping the model in DDP. ``WaccTrainer.training_step`` runs every microbatch (the
window's last too) under DDP's ``no_sync()`` and its window's last microbatch reduces every rank's
scaled sums and token count once (``wacc_torch.all_reduce_mean``), then divides by the global
count: what decides the weighting across ranks is ``wacc_torch/integrations/_token_window.py``
(``TokenWindow.finish``), not ``num_items_in_batch``, ``average_tokens_across_devices`` or DDP's
mean.
"""

from __future__ import annotations

import functools
from typing import Any

from wacc.audit.adapters import peft_lora, trainer
from wacc.audit.adapters.wacc_torch import FP16_INIT_SCALE
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["BERT", "HUB", "HUB_RANK_TOKENS", "LLAMA_RANK_TOKENS", "LORA_GPT2", "PLAIN", "T5", "fix"]


def _run(task: LoopTask, *, average: bool | None = None, **options: Any) -> LoopRun:
    import wacc_torch
    from wacc_torch.integrations.transformers import WaccTrainer

    if task.fp16:
        options["loss_scaler"] = wacc_torch.WindowLossScaler(init_scale=FP16_INIT_SCALE)
    return trainer.run_with(task, functools.partial(WaccTrainer, **options), average=average)


def run(task: LoopTask) -> LoopRun:
    """The Trainer loop with ``WaccTrainer`` (module docstring)."""
    return _run(task)


def run_rank_tokens(task: LoopTask) -> LoopRun:
    """The ``average_tokens_across_devices=False`` Trainer loop with ``WaccTrainer`` (the flag
    changes nothing: ``WaccTrainer`` never hands the model a count)."""
    return _run(task, average=False)


def run_plain(task: LoopTask) -> LoopRun:
    """The Trainer loop with ``WaccTrainer(shift_labels=True)`` (the plain causal module)."""
    return _run(task, shift_labels=True)


_PATH = "WaccTrainer.training_step: own mean loss -> accumulate_mean(tokens) -> finish_mean"


def fix(adapter: Adapter, **changes: Any) -> Adapter:
    """``adapter``'s ``+wacc`` row: the same loop with ``WaccTrainer``."""
    fields: dict[str, Any] = dict(
        name=f"{adapter.name}+wacc", title=f"{adapter.title} + WaccTrainer",
        requires=adapter.requires, model=adapter.model, code_path=_PATH,
        checked=adapter.checked, loss_scale=False, checkpoint=None, run=run, fp16=None,
        ranks=True,
    )  # fmt: skip
    fields.update(changes)
    return Adapter(**fields)


HUB = fix(trainer.HUB)
HUB_RANK_TOKENS = fix(trainer.HUB_RANK_TOKENS, run=run_rank_tokens)
LLAMA_RANK_TOKENS = fix(trainer.LLAMA_RANK_TOKENS, run=run_rank_tokens)
BERT = fix(trainer.BERT)
T5 = fix(trainer.T5)
PLAIN = fix(trainer.PLAIN, run=run_plain, code_path=_PATH + " (shift_labels=True)")
LORA_GPT2 = fix(peft_lora.LORA_GPT2)
