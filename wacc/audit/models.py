"""The tiny causal LMs the audit trains: a hub-style model class built from a config (GPT-2 or
Llama of ``transformers``, a few thousand parameters) and a plain ``nn.Module``.

Every model is created in float32 from a fixed seed, then converted to the audited dtype; the truth
uses a float64 copy of *that* converted model (exact: every narrower float is a float64), so the
framework and the truth differentiate the same function at the same point.  Dropout is off: the
frameworks call ``model.train()``.

The float16 overflow spike (:func:`add_spike`, the audit's ``fp16 overflow`` column only): every
model gets the same site, its output head's input, whose rows at the positions holding
``SPIKE_TOKEN`` are multiplied by ``SPIKE_FACTOR = 2**20`` — a token-specific activation outlier.
The head runs in float16 under autocast, so that token's logits overflow float16 (> 65504) while
every other position is untouched, and the same spiked model in float32 stays finite.  The site is
the head's input, not the token's embedding row: GPT-2 and Llama normalise every position
(LayerNorm / RMSNorm, in float32) before any float16 matmul, so no embedding row can overflow
float16 there, and GPT-2's tied head would carry a scaled row into every position's logits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from wacc.audit.windows import IGNORE_INDEX, SPIKE_TOKEN, VOCAB_SIZE

__all__ = [
    "MODEL_KINDS",
    "SPIKE_FACTOR",
    "ModelSpec",
    "SpikeProbe",
    "TinyCausalLM",
    "add_spike",
    "causal_lm_loss_sum",
    "logits_of",
]

MODEL_SEED = 1234
POSITIONS = 256
SPIKE_FACTOR = 2.0**20


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


@dataclass
class SpikeProbe:
    """What the spike site of one model saw (module docstring): head outputs in float16, and
    whether the spiked / the other positions' logits were non-finite."""

    float16_logits: bool = False
    spike_overflowed: bool = False
    other_overflowed: bool = False
    mask: torch.Tensor | None = field(default=None, repr=False)  # SPIKE_TOKEN's positions now


def _head(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else getattr(model, "head", None)
    if not isinstance(head, nn.Module):
        raise TypeError(f"{type(model).__name__} has no output head to spike")
    return head


def add_spike(model: nn.Module) -> SpikeProbe:
    """Give ``model`` the float16 overflow spike (module docstring); returns its probe.  The
    parameters are unchanged: hooks on the model (reads ``input_ids``) and on its head."""
    probe = SpikeProbe()

    def read_ids(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        probe.mask = None if ids is None else ids == SPIKE_TOKEN

    def spike(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        mask = probe.mask
        if mask is None or not bool(mask.any()):
            return None
        x = args[0]
        return (torch.where(mask[..., None], x * SPIKE_FACTOR, x), *args[1:])

    def observe(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        probe.float16_logits |= output.dtype == torch.float16
        finite = torch.isfinite(output.detach()).all(dim=-1)
        mask = probe.mask if probe.mask is not None else torch.zeros_like(finite)
        probe.spike_overflowed |= bool((~finite & mask).any())
        probe.other_overflowed |= bool((~finite & ~mask).any())

    model.register_forward_pre_hook(read_ids, with_kwargs=True)
    head = _head(model)
    head.register_forward_pre_hook(spike)
    head.register_forward_hook(observe)
    return probe
