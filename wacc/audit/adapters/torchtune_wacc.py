"""``torchtune+wacc``: the ``torchtune`` row's recipes (:mod:`wacc.audit.adapters.torchtune`:
``FullFinetuneRecipeSingleDevice.train`` at world size 1, ``FullFinetuneRecipeDistributed.train``
across ranks, driven the same way) with one config line changed::

    collate_fn: wacc_torch.integrations.torchtune.padded_collate_sft

:func:`wacc_torch.integrations.torchtune.padded_collate_sft` is torchtune's ``padded_collate_sft``
with each row's first label set to the ignore index, the position the recipes' shifted loss never
reads: the loss is unchanged, and the recipes' own ``current_num_tokens = (labels !=
ignore_index).sum()`` becomes the number of targets each batch's mean averages over.  The recipes
already weigh by tokens over the whole window (``loss * current_num_tokens``, then
``scale_grads(model, 1 / num_tokens)``), and across ranks over every rank's tokens
(``all_reduce(num_tokens)``, ``scale_grads(model, world_size / num_tokens)`` undoing FSDP2's
average): with the count right, the gradient the optimizer gets is the window's token mean, so
this row passes where the ``torchtune`` row counts one token too many per sequence.  No wacc
accumulator is needed (the recipe's accumulation is already the token-weighted sum); the count the
row shows is read as the ``torchtune`` row's (the factor handed to ``scale_grads``, a float32
tensor: a relative ``2**-24`` rounding in the float64 run too).  No checkpoint inside an epoch and
no float16 path, as the ``torchtune`` row.
"""

from __future__ import annotations

import dataclasses

from wacc.audit.adapters import torchtune
from wacc.audit.protocol import LoopRun, LoopTask

__all__ = ["ADAPTER", "COLLATE"]

# The config line's value: the integration's collate, by the dotted path the recipe resolves.
COLLATE = "wacc_torch.integrations.torchtune.padded_collate_sft"


def run(task: LoopTask) -> LoopRun:
    """The ``torchtune`` row's recipe drive with ``collate_fn`` = :data:`COLLATE`."""
    return torchtune.run(task, collate_fn=COLLATE)


ADAPTER = dataclasses.replace(
    torchtune.ADAPTER,
    name="torchtune+wacc",
    title="torchtune full_finetune recipes, collate_fn wacc_torch.integrations.torchtune."
    "padded_collate_sft",
    code_path=f"the torchtune row's recipes with collate_fn: {COLLATE} (each row's first label "
    "ignored: the recipes' current_num_tokens counts the shifted targets)",
    run=run,
    fixed_by=None,
    cause=None,
)
