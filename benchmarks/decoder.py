"""Suite ``decoder``: a training step at realistic token counts, the plain loop vs the accumulator.

The model: a small GPT-2-like decoder in plain torch (token and position embeddings, pre-norm
causal self-attention blocks — ``nn.TransformerEncoderLayer(norm_first=True)`` with a causal mask
— a final LayerNorm and an untied linear head; dropout 0), d = 192, 3 layers, 4 heads,
feed-forward 768, vocabulary 4096, 1024 positions (3.1 M parameters). A window of four
microbatches of 512, 2048, 768 and 1024 tokens (batch x sequence: 1 x 512, 2 x 1024, 3 x 256,
1 x 1024), then an AdamW step. Modes:

- ``plain``: the prefetched loop: the window's token total is known up front,
  ``(loss_sum / total).backward()`` per microbatch, autograd accumulating into ``.grad``. The floor.
- ``wacc-buffered mean`` / ``sum``: ``loss_mean.backward()`` then ``accumulate_mean(model, n)``
  (or ``loss_sum.backward()`` then ``accumulate_sum(model, n)``) per microbatch,
  ``finish_mean().apply_to(model)``.
- ``wacc-zero-copy mean`` / ``sum``: ``with acc.microbatch(model, weight=n, kind=...)`` around each
  microbatch's forward and backward; ``finish_mean()`` leaves the mean in ``.grad``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.results import Row
from benchmarks.settings import Settings
from benchmarks.timing import Timed, interleaved_medians, ratio
from wacc_torch import WeightedGradientsAccumulator

SUITE = "decoder"
MODES = (
    "plain",
    "wacc-buffered mean",
    "wacc-buffered sum",
    "wacc-zero-copy mean",
    "wacc-zero-copy sum",
)
NOTES = (
    "Median seconds per training step (4 microbatches of 512, 2048, 768 and 1024 tokens, then "
    "AdamW) of a GPT-2-like decoder in plain torch: d=192, 3 pre-norm causal blocks, 4 heads, "
    "feed-forward 768, vocabulary 4096, 1024 positions, untied head (3.1 M parameters), float32. "
    "Ratio = mode / `plain`, the prefetched loop (the window's token total known up front, "
    "`loss_sum / total` backward, autograd accumulating into `.grad`). `mean` modes backward the "
    "microbatch's mean loss and weight it by its tokens; `sum` modes backward the loss sum; "
    "both finish with `finish_mean()`."
)


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's size and the window's microbatch shapes ``(batch, seq)``."""

    d_model: int
    heads: int
    feedforward: int
    layers: int
    vocab: int
    positions: int
    shapes: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(batch * seq for batch, seq in self.shapes)


FULL = DecoderConfig(192, 4, 768, 3, 4096, 1024, ((1, 512), (2, 1024), (3, 256), (1, 1024)))
QUICK = DecoderConfig(16, 2, 32, 1, 50, 16, ((1, 5), (2, 8), (1, 3)))


class Decoder(nn.Module):
    """Token ids ``(batch, seq)`` -> next-token logits ``(batch, seq, vocab)``."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab, config.d_model)
        self.wpe = nn.Embedding(config.positions, config.d_model)
        layer = nn.TransformerEncoderLayer(
            config.d_model,
            config.heads,
            dim_feedforward=config.feedforward,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        positions = torch.arange(seq, device=ids.device)
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        hidden = self.blocks(self.wte(ids) + self.wpe(positions), mask=mask, is_causal=True)
        return self.head(self.ln_f(hidden))


Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(config: DecoderConfig, device: torch.device) -> list[Batch]:
    """Random token ids and next-token targets, seeded."""
    generator = torch.Generator(device=device).manual_seed(0)
    return [
        (
            torch.randint(config.vocab, (batch, seq), generator=generator, device=device),
            torch.randint(config.vocab, (batch, seq), generator=generator, device=device),
        )
        for batch, seq in config.shapes
    ]


def _loss(model: nn.Module, batch: Batch, reduction: str) -> torch.Tensor:
    ids, targets = batch
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


class Trainer:
    """One mode's model, optimizer and accumulator; :meth:`step` runs one whole window."""

    def __init__(self, mode: str, model: nn.Module, batches: list[Batch]) -> None:
        self.mode = mode
        self.model = model
        self.batches = batches
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.kind = mode.rsplit(" ", 1)[-1]  # "plain": its own loop
        self.accumulator = None
        if mode != "plain":
            self.accumulator = WeightedGradientsAccumulator(
                dtype=torch.float32, loss_scale=1.0, zero_copy=mode.startswith("wacc-zero-copy")
            )

    def step(self) -> None:
        accumulator = self.accumulator
        reduction = "sum" if self.kind == "sum" else "mean"
        if accumulator is None:
            total = sum(batch[1].numel() for batch in self.batches)
            for batch in self.batches:
                (_loss(self.model, batch, "sum") / total).backward()
        elif accumulator.state.zero_copy:
            for batch in self.batches:
                tokens = batch[1].numel()
                with accumulator.microbatch(self.model, weight=tokens, kind=self.kind):  # type: ignore[arg-type]
                    _loss(self.model, batch, reduction).backward()
            accumulator.finish_mean()
        else:
            for batch in self.batches:
                _loss(self.model, batch, reduction).backward()
                if self.kind == "sum":
                    accumulator.accumulate_sum(self.model, batch[1].numel())
                else:
                    accumulator.accumulate_mean(self.model, batch[1].numel())
            accumulator.finish_mean().apply_to(self.model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run(settings: Settings) -> list[Row]:
    config = QUICK if settings.quick else FULL
    repeats = settings.repeats_or(5)
    rows: list[Row] = []
    for device in settings.devices:
        torch.manual_seed(0)
        template = Decoder(config).to(device)
        batches = make_batches(config, device)
        trainers = {mode: Trainer(mode, copy.deepcopy(template), batches) for mode in MODES}
        medians = interleaved_medians(
            {mode: Timed(trainer.step) for mode, trainer in trainers.items()},
            device=device,
            repeats=repeats,
        )
        case = f"training step, {'+'.join(map(str, config.tokens))} tokens"
        for mode, seconds in medians.items():
            rows.append(
                Row(
                    suite=SUITE,
                    case=case,
                    mode=mode,
                    dtype="float32",
                    device=str(device),
                    value=seconds * 1e3,
                    unit="ms",
                    ratio=None if mode == "plain" else ratio(seconds, medians["plain"]),
                    floor="" if mode == "plain" else "plain",
                )
            )
    return rows
