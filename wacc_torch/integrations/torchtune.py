"""torchtune's recipes with the token count their loss averages over: a collate function.

torchtune's full-finetune recipes (``recipes/full_finetune_single_device.py`` and
``full_finetune_distributed.py``, torchtune 0.6.1) already weigh by tokens across the whole
window (and, across ranks, over every rank: they all-reduce the count): each batch's mean loss
is multiplied by ``current_num_tokens = (batch["labels"] != ignore_index).sum()`` and the
window's gradient divided by the sum of those counts.  But that count is taken over the
*unshifted* labels, while the loss (``_loss_step``) averages over the *shifted* ones (``labels[...,
1:]``, with an ignored position appended): every sequence whose first label is a target counts one
token more than its loss averages over (a text-completion data set, whose labels are its tokens:
215 counted for 211 targets in the audit's window).

:func:`padded_collate_sft` is torchtune's ``torchtune.data.padded_collate_sft`` with each row's
first label set to the ignore index: the one position the shifted loss never reads (no logit
predicts it), so the loss is unchanged and the recipe's own count becomes the number of targets
the loss averages over.  Used through the recipe config, one line::

    collate_fn: wacc_torch.integrations.torchtune.padded_collate_sft

(the recipe resolves the dotted path and calls it with ``padding_idx`` and ``ignore_idx``, as it
calls torchtune's).  A packed data set (``packed: True``) does not go through ``collate_fn``.
torchtune is imported when the function is first called; without it the call raises
:class:`~wacc_torch.integrations._framework.MissingFrameworkError` naming ``wacc[torchtune]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from wacc_torch.integrations._framework import require

__all__ = ["padded_collate_sft"]

_BY = "wacc_torch.integrations.torchtune"


def padded_collate_sft(
    batch: Sequence[Mapping[str, Any]], padding_idx: int = 0, ignore_idx: int = -100
) -> dict[str, torch.Tensor]:
    """``torchtune.data.padded_collate_sft(batch, padding_idx, ignore_idx)`` (``tokens`` and
    ``labels`` padded to the batch's longest row) with ``labels[:, 0] = ignore_idx``: the first
    label, which the recipes' shifted loss never reads, is not counted as a target (module
    docstring).  ``ignore_idx`` defaults to torchtune's ``CROSS_ENTROPY_IGNORE_IDX`` (-100)."""
    data: Any = require("torchtune.data", extra="torchtune", integration=_BY)
    collated: dict[str, torch.Tensor] = data.padded_collate_sft(
        list(batch), padding_idx=padding_idx, ignore_idx=ignore_idx
    )
    labels = collated["labels"]
    if labels.shape[-1]:  # an empty row has no first label
        labels[:, 0] = ignore_idx
    return collated
