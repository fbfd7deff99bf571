"""The tiny models the audit trains: hub-style model classes built from configs (``transformers``'
GPT-2, Llama, Qwen2, GPT-NeoX and OPT causal LMs, a BERT masked LM and a T5 seq2seq model, a few
thousand parameters each), two of them with PEFT LoRA adapters (``lora-gpt2``, ``lora-llama``) and
a plain ``nn.Module`` causal LM.

Each model belongs to a *family* (:class:`Family`) that says what a microbatch of the window is for
it, how its logits are computed and which labels its loss counts, so that every family gets its
own float64 truth (:mod:`wacc.audit.truth`) on the same target counts:

* ``causal``: the window's microbatch as is (``input_ids``, ``labels`` = the ids, ``-100`` where
  nothing is learned); the loss shifts the labels by one (position ``t`` predicts ``t + 1``).
* ``masked`` (BERT-style): ``labels`` keep the token at positions ``1 .. n`` (the causal
  microbatch's ``n`` targets; position 0, the ``[CLS]`` slot, and padding are ``-100``),
  ``input_ids`` hold ``MASK_TOKEN`` at every such position, ``attention_mask`` hides the padding;
  the loss is unshifted (the data collator's ``labels`` convention).
* ``seq2seq`` (T5-style): the encoder reads ``input_ids`` (with ``attention_mask``), the decoder
  is trained on ``labels`` = the same positions ``1 .. n`` as targets, unshifted; the decoder input
  is ``labels`` shifted right with the decoder start token (pad, ``0``) in front and ``-100`` read
  as pad, which is what ``T5ForConditionalGeneration`` builds from ``labels`` itself.

Every family keeps the window's per-microbatch target counts exactly (the truth checks it).

A LoRA model (``peft.get_peft_model``) is its base model's exact weights (a copy of the
``gpt2`` / ``llama`` model) with rank-``LORA_RANK`` adapters on PEFT's default target modules for
that architecture, every base weight frozen: only the adapters train, and the truth is the gradient
of exactly those (:mod:`wacc.audit.truth` differentiates the trainable parameters).  The adapters
are built with ``init_lora_weights=False``: PEFT's default zeroes ``B``, so ``A``'s gradient
(``B^T``-weighted) would be exactly zero at the audited point and half of the adapters' gradient
would compare zero with zero; with both factors at ``nn.Linear``'s default init every adapter
parameter has a nonzero gradient.  ``lora_dropout=0`` (dropout is off everywhere).

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
float16 there, and GPT-2's tied head would carry a scaled row into every position's logits.  The
positions are read from the model's ``input_ids``: for the seq2seq family (whose head is the
decoder's) that is the decoder position aligned with the encoder's spike token (decoder and
encoder have the same length in the audit's windows).
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from wacc.audit.windows import IGNORE_INDEX, SPIKE_TOKEN, VOCAB_SIZE

__all__ = [
    "FAMILIES",
    "MASK_TOKEN",
    "MODEL_KINDS",
    "SPIKE_FACTOR",
    "Family",
    "ModelSpec",
    "SpikeProbe",
    "TinyCausalLM",
    "add_spike",
    "causal_lm_loss_sum",
    "logits_of",
    "lora_options",
]

MODEL_SEED = 1234
POSITIONS = 256
SPIKE_FACTOR = 2.0**20
MASK_TOKEN = VOCAB_SIZE  # the masked LM's [MASK]: one id past the window's vocabulary
PAD_TOKEN = 0  # the windows' right padding (wacc.audit.windows) and T5's decoder start token


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


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ of the token cross-entropies over *unshifted* labels != -100 (masked LM, seq2seq)."""
    return functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def shift_right(labels: torch.Tensor) -> torch.Tensor:
    """The seq2seq decoder input for ``labels`` ([..., L]): ``PAD_TOKEN`` (the decoder start
    token) then ``labels[..., :-1]``, with ``-100`` read as ``PAD_TOKEN``."""
    start = torch.full_like(labels[..., :1], PAD_TOKEN)
    shifted = torch.cat([start, labels[..., :-1]], dim=-1)
    return shifted.masked_fill(shifted == IGNORE_INDEX, PAD_TOKEN)


def _attention_mask(ids: torch.Tensor) -> torch.Tensor:
    return (ids != PAD_TOKEN).long()


def _causal_prepare(microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in microbatch.items()}


def _targets_from_one(microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal microbatch's labels with position 0 ignored: its ``n`` targets, unshifted."""
    labels = microbatch["labels"].clone()
    labels[..., 0] = IGNORE_INDEX
    return labels


def _masked_prepare(microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = microbatch["input_ids"]
    labels = _targets_from_one(microbatch)
    masked = ids.masked_fill(labels != IGNORE_INDEX, MASK_TOKEN)
    return {"input_ids": masked, "attention_mask": _attention_mask(ids), "labels": labels}


def _seq2seq_prepare(microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    ids = microbatch["input_ids"].clone()
    return {
        "input_ids": ids,
        "attention_mask": _attention_mask(ids),
        "labels": _targets_from_one(microbatch),
    }


def _causal_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return logits_of(model(input_ids=batch["input_ids"]))


def _masked_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return logits_of(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))


def _seq2seq_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return logits_of(
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            decoder_input_ids=shift_right(batch["labels"]),
        )
    )


@dataclass(frozen=True)
class Family:
    """What a microbatch is for a model family and how its loss is computed (module docstring)."""

    name: str
    prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # window mb -> inputs
    logits: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]  # batched inputs -> logits
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> Σ loss
    shifted: bool  # the loss shifts the labels by one (a target count is over labels[..., 1:])

    def count(self, labels: torch.Tensor) -> int:
        """Target tokens of a prepared microbatch as this family's loss counts them."""
        counted = labels[..., 1:] if self.shifted else labels
        return int((counted != IGNORE_INDEX).sum())


FAMILIES: dict[str, Family] = {
    "causal": Family("causal", _causal_prepare, _causal_logits, causal_lm_loss_sum, True),
    "masked": Family("masked", _masked_prepare, _masked_logits, token_loss_sum, False),
    "seq2seq": Family("seq2seq", _seq2seq_prepare, _seq2seq_logits, token_loss_sum, False),
}
"""Model families by name (module docstring)."""


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


def _qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=POSITIONS,
        use_cache=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def _gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=POSITIONS, hidden_dropout=0.0,
        attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return GPTNeoXForCausalLM(config)


def _opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=VOCAB_SIZE, hidden_size=16, word_embed_proj_dim=16, ffn_dim=32,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=POSITIONS,
        dropout=0.0, attention_dropout=0.0, layerdrop=0.0, use_cache=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return OPTForCausalLM(config)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=MASK_TOKEN + 1, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, type_vocab_size=1, pad_token_id=PAD_TOKEN,
    )  # fmt: skip
    return BertForMaskedLM(config)


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB_SIZE, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.0, use_cache=False, pad_token_id=PAD_TOKEN, eos_token_id=1,
    )  # fmt: skip
    config.decoder_start_token_id = PAD_TOKEN  # T5 starts the decoder with the pad token
    return T5ForConditionalGeneration(config)


LORA_RANK = 4


def lora_options(base: str) -> dict[str, Any]:
    """The ``LoraConfig`` keywords of ``base``'s LoRA model (module docstring); the reproducers
    (:mod:`wacc.audit.repro`) write them out."""
    return dict(
        task_type="CAUSAL_LM", r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
        init_lora_weights=False, fan_in_fan_out=base == "gpt2",  # GPT-2's Conv1D layers
    )  # fmt: skip


def _lora(base: str) -> Callable[[], nn.Module]:
    """A factory for ``base``'s model with LoRA adapters (module docstring; needs ``peft``).
    Built right after ``torch.manual_seed(MODEL_SEED)`` (:func:`_base`): the adapters' init draws
    from torch's RNG."""

    def build() -> nn.Module:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(**lora_options(base))
        with warnings.catch_warnings():  # PEFT's own deprecation notices, not the caller's
            warnings.simplefilter("ignore")
            model: nn.Module = get_peft_model(copy.deepcopy(_base(base)), config)
        return model

    return build


@dataclass(frozen=True)
class ModelSpec:
    """A named model: ``build(dtype)`` gives a fresh copy, identical weights on every call."""

    name: str
    factory: Callable[[], nn.Module]  # builds the float32 model (called once, seeded)
    family: str = "causal"  # a name of FAMILIES: the microbatch format and loss of its truth
    lora: str | None = None  # a LoRA model: its base model's name (LoraConfig: lora_options)

    def build(self, dtype: torch.dtype) -> nn.Module:
        """A new model converted to ``dtype`` (float32 init from the fixed seed)."""
        return copy.deepcopy(_base(self.name)).to(dtype)

    @property
    def loss_family(self) -> Family:
        """Its :class:`Family`."""
        return FAMILIES[self.family]

    def prepare(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The window's (causal) microbatch in this model's family format, new tensors."""
        return self.loss_family.prepare(microbatch)


_BASES: dict[str, nn.Module] = {}
# The factories draw their init from torch's global generator, which every thread shares: two
# threads building at once (``wacc audit --world-size 2 --jobs 2`` computes truths in threads)
# interleaved their draws and cached a model no process builds, so the truth was another model's.
_BUILDING = threading.RLock()  # reentrant: a LoRA factory builds its base inside


def _base(name: str) -> nn.Module:
    with _BUILDING:
        if name not in _BASES:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(MODEL_SEED)
                _BASES[name] = MODEL_KINDS[name].factory().float()
        return _BASES[name]


MODEL_KINDS: dict[str, ModelSpec] = {
    "gpt2": ModelSpec("gpt2", _gpt2),  # GPT2LMHeadModel, n_embd 16, 1 layer (needs transformers)
    "llama": ModelSpec("llama", _llama),  # LlamaForCausalLM, hidden 16, 1 layer (transformers)
    "qwen2": ModelSpec("qwen2", _qwen2),  # Qwen2ForCausalLM, hidden 16, GQA 2:1 (transformers)
    "gpt_neox": ModelSpec("gpt_neox", _gpt_neox),  # GPTNeoXForCausalLM, hidden 16 (transformers)
    "opt": ModelSpec("opt", _opt),  # OPTForCausalLM, hidden 16, 1 layer (transformers)
    "bert": ModelSpec("bert", _bert, "masked"),  # BertForMaskedLM, hidden 16 (transformers)
    "t5": ModelSpec("t5", _t5, "seq2seq"),  # T5ForConditionalGeneration, d_model 16 (transformers)
    "lora-gpt2": ModelSpec("lora-gpt2", _lora("gpt2"), lora="gpt2"),  # LoRA on c_attn (peft)
    "lora-llama": ModelSpec("lora-llama", _lora("llama"), lora="llama"),  # on q/v_proj (peft)
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
