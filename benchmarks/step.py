"""Suite ``step``: one whole training step, the plain loop vs the accumulator, side by side.

The model: a ``batch_first`` ``nn.TransformerEncoder`` (2 layers, d=256, 4 heads, feed-forward
1024, dropout 0 so that every mode computes the same thing), a linear head and a per-token
cross-entropy. A window of 4 microbatches of unequal token counts (61, 200, 17, 134), then an
AdamW step. Modes:

- ``plain``: the window's token total is known up front: ``(S * loss_sum / total).backward()`` per
  microbatch, autograd accumulating into ``.grad``; with S != 1 the gradients are divided by S once
  before the step. The floor.
- ``wacc-buffered``: ``(S * loss_mean).backward()``, ``accumulate_mean(model, tokens)`` per
  microbatch, ``finish_mean().apply_to(model)``.
- ``wacc-zero-copy``: ``with acc.microbatch(model, weight=tokens, kind="mean")`` around each
  microbatch's forward and backward, ``finish_mean()`` leaves the mean in ``.grad``.
- ``wacc-buffered sum`` / ``wacc-zero-copy sum``: the same with the microbatch's loss *sum*
  (``accumulate_sum``, ``kind="sum"``): no product ``round_D(g * w_D)`` per microbatch, so the
  gap between a mode and its ``sum`` row is what the reproducible mean's own pass costs, and the
  ``sum`` row's ratio is the accumulator's overhead beside it (no target: diagnostics).

Variants: float32, and float16 autocast with the fixed loss scale S = 1024 in every mode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.features import has_zero_copy
from benchmarks.results import Row
from benchmarks.settings import Settings
from benchmarks.timing import Timed, interleaved_medians, ratio
from wacc_torch import WeightedGradientsAccumulator

SUITE = "step"
TARGETS = {"wacc-buffered": 1.03, "wacc-zero-copy": 1.01}
MODES = ("plain", "wacc-buffered", "wacc-zero-copy")
SUM_MODES = ("wacc-buffered sum", "wacc-zero-copy sum")  # diagnostics, this suite only
DISPOSABLE = "wacc-buffered disposable"  # accumulate_mean(..., disposable=True): the memory suite
NOTES = (
    "Median seconds per training step (4 microbatches of 61, 200, 17, 134 tokens and an AdamW "
    "step) of a 2-layer d=256 transformer encoder with a linear head; ratio = mode / `plain` "
    "(the window's token total known up front, autograd accumulating into `.grad`). The "
    "`fp16-autocast` variant runs under `torch.autocast(device, dtype=torch.float16)` with the "
    "loss scale S = 1024 in every mode (`plain` divides `.grad` by S once before the step). On "
    "a CPU without native float16 matrix units that variant's time is dominated by the float16 "
    "matmuls, which dilutes every ratio towards 1. The `sum` modes backward the microbatch's "
    'loss sum (`accumulate_sum`, `kind="sum"`): no per-microbatch product, so a mean mode\'s '
    "excess over its `sum` row is the reproducible mean's own pass."
)


@dataclass(frozen=True)
class StepConfig:
    """The model's size and the window's microbatch shapes ``(batch, seq)``."""

    d_model: int
    nhead: int
    feedforward: int
    layers: int
    vocab: int
    shapes: tuple[tuple[int, int], ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(batch * seq for batch, seq in self.shapes)


# 61, 200, 17, 134 tokens
FULL = StepConfig(256, 4, 1024, 2, 1000, ((1, 61), (8, 25), (1, 17), (2, 67)))
QUICK = StepConfig(32, 2, 64, 1, 50, ((1, 5), (2, 4), (1, 1), (1, 7)))


class TokenModel(nn.Module):
    """Transformer encoder and a linear head: per-token logits of a ``(batch, seq, d)`` input."""

    def __init__(self, config: StepConfig) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            config.d_model,
            config.nhead,
            dim_feedforward=config.feedforward,
            dropout=0.0,
            batch_first=True,
        )
        # nested tensors only serve inference; off, so the constructor does not warn
        self.encoder = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.head = nn.Linear(config.d_model, config.vocab)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(inputs))


Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(config: StepConfig, device: torch.device) -> list[Batch]:
    """The window's microbatches: random inputs and target tokens, seeded on the device."""
    generator = torch.Generator(device=device).manual_seed(0)
    batches = []
    for batch, seq in config.shapes:
        inputs = torch.randn(batch, seq, config.d_model, generator=generator, device=device)
        targets = torch.randint(config.vocab, (batch, seq), generator=generator, device=device)
        batches.append((inputs, targets))
    return batches


def make_model(config: StepConfig, device: torch.device) -> TokenModel:
    torch.manual_seed(0)
    return TokenModel(config).to(device)


def _loss(model: nn.Module, batch: Batch, reduction: str) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)


def _nothing() -> None:
    return None


@dataclass
class Trainer:
    """One mode's model, optimizer and accumulator; :meth:`step` runs one whole window."""

    mode: str
    model: nn.Module
    batches: list[Batch]
    loss_scale: float
    autocast: bool
    after: Callable[[], None] = _nothing  # a sampling point (the memory suite's)

    def __post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.accumulator: WeightedGradientsAccumulator | None = None
        self.kind = "sum" if self.mode.endswith(" sum") else "mean"
        self.disposable = self.mode == DISPOSABLE
        if self.mode.startswith("wacc-buffered"):
            self.accumulator = WeightedGradientsAccumulator(
                dtype=torch.float32, loss_scale=self.loss_scale
            )
        elif self.mode.startswith("wacc-zero-copy"):
            self.accumulator = WeightedGradientsAccumulator(
                dtype=torch.float32,
                loss_scale=self.loss_scale,
                zero_copy=True,  # type: ignore[call-arg,unused-ignore]
            )

    def _autocast(self) -> AbstractContextManager[object]:
        if not self.autocast:
            return nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=torch.float16)

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scale == 1.0 else self.loss_scale * loss

    def _microbatches(self) -> Iterator[tuple[Batch, int]]:
        for batch in self.batches:
            yield batch, batch[1].numel()

    def step(self) -> None:
        if self.mode == "plain":
            total = sum(tokens for _, tokens in self._microbatches())
            for batch, _ in self._microbatches():
                with self._autocast():
                    loss_sum = _loss(self.model, batch, "sum")
                (self._scaled(loss_sum) / total).backward()
                self.after()
            if self.loss_scale != 1.0:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                torch._foreach_div_(grads, self.loss_scale)
        elif self.mode.startswith("wacc-buffered"):
            assert self.accumulator is not None
            for batch, tokens in self._microbatches():
                with self._autocast():
                    loss = _loss(self.model, batch, self.kind)
                self._scaled(loss).backward()
                self.after()
                if self.kind == "sum":
                    self.accumulator.accumulate_sum(self.model, tokens)
                else:
                    self.accumulator.accumulate_mean(self.model, tokens, disposable=self.disposable)
                self.after()
            self.accumulator.finish_mean().apply_to(self.model)
        else:
            accumulator: object = self.accumulator
            for batch, tokens in self._microbatches():
                with accumulator.microbatch(  # type: ignore[attr-defined]
                    self.model, weight=tokens, kind=self.kind
                ):
                    with self._autocast():
                        loss = _loss(self.model, batch, self.kind)
                    self._scaled(loss).backward()
                self.after()
            self.accumulator.finish_mean()  # type: ignore[union-attr]
        self.after()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def available_modes() -> tuple[str, ...]:
    """The modes the installed ``wacc_torch`` supports."""
    return MODES if has_zero_copy() else MODES[:2]


def _suite_modes() -> tuple[str, ...]:
    """This suite's modes: :func:`available_modes` and their ``sum`` rows."""
    modes = available_modes()
    return modes + tuple(m for m in SUM_MODES if m.rsplit(" ", 1)[0] in modes)


def run(settings: Settings) -> list[Row]:
    config = QUICK if settings.quick else FULL
    repeats = settings.repeats_or(20)
    rows: list[Row] = []
    for device in settings.devices:
        for variant, loss_scale, autocast in (
            ("float32", 1.0, False),
            ("fp16-autocast", 1024.0, True),
        ):
            template = make_model(config, device)
            batches = make_batches(config, device)
            modes = _suite_modes()
            trainers = {
                mode: Trainer(mode, copy.deepcopy(template), batches, loss_scale, autocast)
                for mode in modes
            }
            medians = interleaved_medians(
                {mode: Timed(trainer.step) for mode, trainer in trainers.items()},
                device=device,
                repeats=repeats,
            )
            for mode in MODES + SUM_MODES:
                seconds = medians.get(mode)
                rows.append(
                    Row(
                        suite=SUITE,
                        case="training step",
                        mode=mode,
                        dtype=variant,
                        device=str(device),
                        value=None if seconds is None else seconds * 1e3,
                        unit="ms",
                        ratio=None if seconds is None else ratio(seconds, medians["plain"]),
                        floor="" if mode == "plain" else "plain",
                        target=TARGETS.get(mode),
                    )
                )
    return rows
