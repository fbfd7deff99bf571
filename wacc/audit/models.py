"""The tiny causal LMs the audit trains: a hub-style model class built from a config (GPT-2 or
Llama of ``transformers``, a few thousand parameters) and a plain ``nn.Module``.

Every model is created in float32 from a fixed seed, then converted to the audited dtype; the truth
uses a float64 copy of *that* converted model (exact: every narrower float is a float64), so the
framework and the truth differentiate the same function at the same point.  Dropout is off: the
frameworks call ``model.train()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from wacc.audit.windows import IGNORE_INDEX, VOCAB_SIZE

__all__ = ["MODEL_KINDS", "ModelSpec", "TinyCausalLM", "causal_lm_loss_sum", "logits_of"]

MODEL_SEED = 1234
POSITIONS = 256


class TinyCausalLM(nn.Module):
    """A plain ``nn.Module`` causal LM: ``forward(input_ids, labels=None)`` returns a dict with
    ``logits`` and, given labels, ``loss`` = the mean token loss of this microbatch (shifted
    labels, ``-100`` ignored) — what a hand-written model usually returns.  Its forward takes no
    ``**kwargs``, so ``Trainer`` cannot hand it ``num_items_in_batch``."""

    def __init__(self, *, vocab_size: int = VOCAB_SIZE, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(POSITIONS, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        x = self.embed(input_ids) + self.position(positions)
        # A causal mixing step (running mean over earlier positions) so position t sees < t only.
        steps = torch.arange(1, input_ids.shape[-1] + 1, device=input_ids.device, dtype=x.dtype)
        x = torch.cumsum(x, dim=-2) / steps[:, None]
        logits = self.head(torch.tanh(self.hidden(x)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = functional.cross_entropy(
                logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                labels[..., 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return out


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output (a ``ModelOutput`` or a dict)."""
    logits: torch.Tensor = output["logits"]
    return logits


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ of the token cross-entropies over shifted labels != -100, in the logits' dtype."""
    return functional.cross_entropy(
        logits[..., :-1, :].reshape(-1, logits.shape[-1]),
        labels[..., 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB_SIZE, n_positions=POSITIONS, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=POSITIONS,
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@dataclass(frozen=True)
class ModelSpec:
    """A named model: ``build(dtype)`` gives a fresh copy, identical weights on every call."""

    name: str
    factory: Callable[[], nn.Module]  # builds the float32 model (called once, seeded)

    def build(self, dtype: torch.dtype) -> nn.Module:
        """A new model converted to ``dtype`` (float32 init from the fixed seed)."""
        return copy.deepcopy(_base(self.name)).to(dtype)


_BASES: dict[str, nn.Module] = {}


def _base(name: str) -> nn.Module:
    if name not in _BASES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            _BASES[name] = MODEL_KINDS[name].factory().float()
    return _BASES[name]


MODEL_KINDS: dict[str, ModelSpec] = {
    "gpt2": ModelSpec("gpt2", _gpt2),  # GPT2LMHeadModel, n_embd 16, 1 layer (needs transformers)
    "llama": ModelSpec("llama", _llama),  # LlamaForCausalLM, hidden 16, 1 layer (transformers)
    "plain": ModelSpec("plain", TinyCausalLM),
}
"""Models by name."""
