"""``wacc_torch.integrations.torchtune.padded_collate_sft`` under torchtune's own recipe code: the
recipe's count over its labels is the number of targets the recipe's shifted loss averages over,
the loss and its gradient are torchtune's collate's bit for bit, and the recipe's config line
resolves to it (the whole recipe runs in tests/wacc/audit/test_torchtune.py; needs torchtune with
a torchao <= 0.15)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchtune", reason="torchtune (with a torchao <= 0.15) is not installed")

from omegaconf import DictConfig  # noqa: E402
from torchtune.data import padded_collate_sft as torchtunes  # noqa: E402

from wacc.audit.adapters.torchtune import _recipe_module  # noqa: E402
from wacc_torch.integrations.torchtune import padded_collate_sft  # noqa: E402

IGNORE = -100
# Two text-completion rows (labels = tokens: the first label is a target of nothing) and an
# instruction row whose prompt is masked (its first label already ignored).
ROWS = [
    {"tokens": [5, 9, 2, 7, 3], "labels": [5, 9, 2, 7, 3]},
    {"tokens": [4, 8], "labels": [4, 8]},
    {"tokens": [6, 1, 3, 9], "labels": [IGNORE, IGNORE, 3, 9]},
]


class _Model(nn.Module):
    """A small decoder stand-in: ``forward(tokens)`` returns logits, as the recipe calls it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.embed(tokens))
        return logits


class _ReadLabels(nn.CrossEntropyLoss):
    """The recipe's loss (mean over the non-ignored labels), noting the labels it is handed."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.read = labels.clone()
        loss: torch.Tensor = super().forward(logits, labels)
        return loss


def _recipe_step(batch: dict[str, torch.Tensor]) -> tuple[int, int, torch.Tensor, list[Any]]:
    """The single-device recipe's own count (``(labels != ignore_index).sum()``, train's line)
    and ``_loss_step`` with a backward: (count, targets the loss read, loss, gradients)."""
    recipe_class: Any = _recipe_module().FullFinetuneRecipeSingleDevice
    recipe = recipe_class.__new__(recipe_class)
    recipe._model, recipe._loss_fn = _Model(), _ReadLabels()
    recipe.ignore_labels_cache = torch.full((len(ROWS), 1), IGNORE)
    recipe.activations_handling_ctx = torch.enable_grad()  # no activation offloading
    counted = int((batch["labels"] != recipe._loss_fn.ignore_index).sum())
    loss = recipe._loss_step(dict(batch))  # it pops the labels
    loss.backward()
    targets = int((recipe._loss_fn.read != IGNORE).sum())
    return counted, targets, loss, [p.grad for p in recipe._model.parameters()]


def test_the_recipes_count_is_the_targets_its_loss_reads() -> None:
    """Over the integration's batch the recipe counts exactly the targets its shifted loss
    averages over (the rows' shifted targets: 4, 1 and 2), where over
    torchtune's own it counts one more per text-completion row; the loss and every gradient are
    torchtune's collate's bit for bit (only a position the loss never reads changed)."""
    counted, targets, loss, grads = _recipe_step(padded_collate_sft(ROWS, 0, IGNORE))
    theirs_counted, theirs_targets, theirs_loss, theirs_grads = _recipe_step(
        torchtunes(ROWS, padding_idx=0, ignore_idx=IGNORE)
    )
    assert counted == targets == theirs_targets == 4 + 1 + 2
    assert theirs_counted == targets + 2  # the two rows whose first label is a target
    assert torch.equal(loss, theirs_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, theirs_grads, strict=True))


def test_the_padding_and_ignore_index_are_the_recipes() -> None:
    """Called as the recipe's data loader calls it (``padding_idx``, ``ignore_idx`` by keyword):
    ``tokens`` padded with ``padding_idx``, ``labels`` with ``ignore_idx``, each row's first label
    ``ignore_idx`` too; the rest is torchtune's output unchanged."""
    got = padded_collate_sft(ROWS, padding_idx=1, ignore_idx=-1)
    want = torchtunes(ROWS, padding_idx=1, ignore_idx=-1)
    assert torch.equal(got["tokens"], want["tokens"])
    assert got["labels"][:, 0].tolist() == [-1, -1, -1]
    assert torch.equal(got["labels"][:, 1:], want["labels"][:, 1:])
    assert got["labels"][1].tolist() == [-1, 8, -1, -1, -1]


def rows(tokenizer: Any) -> list[dict[str, list[int]]]:
    """A data set component for the recipe's config (it passes its tokenizer): :data:`ROWS`."""
    return ROWS


# torchdata's StatefulDataLoader (the recipe's loader) calls torch.set_vital, which torch 2.13
# deprecates.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_the_recipe_config_line_selects_it() -> None:
    """``collate_fn: wacc_torch.integrations.torchtune.padded_collate_sft`` in the single-device
    recipe's own ``_setup_data`` (the config's data set, its ``padding_idx`` from the tokenizer
    and ``ignore_idx`` from the loss): the batch its loader yields has every first label
    ignored."""
    recipe_class: Any = _recipe_module().FullFinetuneRecipeSingleDevice
    recipe = recipe_class.__new__(recipe_class)
    recipe._tokenizer = type("Tokenizer", (), {"pad_id": 0})()
    recipe._loss_fn = nn.CrossEntropyLoss()  # ignore_index -100, ROWS' mask
    loader = recipe._setup_data(
        cfg_dataset=DictConfig({"_component_": f"{__name__}.rows"}),
        shuffle=False,
        batch_size=3,
        collate_fn="wacc_torch.integrations.torchtune.padded_collate_sft",
    )
    (batch,) = list(loader)
    assert batch["labels"][:, 0].tolist() == [IGNORE, IGNORE, IGNORE]
    assert int((batch["labels"] != IGNORE).sum()) == 4 + 1 + 2
