"""The audit's windows: microbatches of causal-LM token ids with ``-100`` labels where nothing is
learned.

A microbatch with ``n`` target tokens is one sequence of ``n + 1`` tokens whose labels are its
input ids (the Hugging Face convention): a causal LM shifts labels by one, so position 0 is never a
target and ``n`` tokens are.  A zero-target microbatch has every label ``-100`` (a prompt-only
sample).  Every microbatch of a window is right-padded to the window's longest sequence with pad
token 0 and label ``-100`` (fixed shapes; for a causal model right padding changes no earlier
position's logits).  Everything is seeded: the same name gives the same tensors.

The float16 overflow window (:func:`build_fp16_window`, used only by the audit's ``fp16 overflow``
column) is ``unequal``'s target counts drawn from token ids ``1 .. SPIKE_TOKEN - 1``, with
``SPIKE_TOKEN`` at position 0 of microbatch ``SPIKE_MICROBATCH`` only (or nowhere: its clean twin).
In a float16 run the audit's models make that token's activations overflow
(:func:`wacc.audit.models.add_spike`).

Across ranks (:func:`rank_windows`): per rank one window of K = 4 microbatches (every rank the
same K, as a data-parallel loop steps all ranks together).  ``unequal``: rank 0 holds ``unequal``'s
counts (1, 7, 200, 3), 211 tokens; rank 1 (12, 0, 3, 2), 17 tokens, a zero-target microbatch among
them and very few tokens in its whole window; at world size 4, rank 2 (30, 64, 6, 20), 120 tokens,
and rank 3 (1, 1, 2, 1), 5 tokens.  ``equal``: every rank (64, 64, 64, 64), the control on which a
mean of per-rank means is the mean.  Each rank's tokens are drawn from a seed of its own; its
microbatches are padded to its own longest sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "IGNORE_INDEX",
    "VOCAB_SIZE",
    "SPIKE_MICROBATCH",
    "SPIKE_TOKEN",
    "WINDOW_NAMES",
    "Window",
    "build_fp16_window",
    "build_window",
    "RANK_WINDOW_NAMES",
    "rank_windows",
    "target_count",
    "world_window",
]

IGNORE_INDEX = -100
VOCAB_SIZE = 32
ZERO_TARGET_LENGTH = 9  # the prompt-only microbatch's length (its tokens still run forward)
LONG_TAIL_SEED = 20261201
LONG_TAIL_MICROBATCHES = 6
LONG_TAIL_MAX_TARGETS = 200  # keeps every sequence within the tiny models' 256 positions
SPIKE_TOKEN = VOCAB_SIZE - 1  # the float16 overflow window's spike (never drawn there otherwise)
SPIKE_MICROBATCH = 1  # the one microbatch of that window that holds it
FP16_WINDOW_SEED = 17

_TARGETS: dict[str, tuple[int, ...]] = {
    "unequal": (1, 7, 200, 3),
    "equal": (64, 64, 64, 64),
    "zero": (12, 0, 30, 6),
}


def _long_tail_targets() -> tuple[int, ...]:
    rng = np.random.default_rng(LONG_TAIL_SEED)
    # Pareto tail: most microbatches short, one or two long (what packing-free SFT data looks like).
    draws = np.ceil(rng.pareto(1.2, size=LONG_TAIL_MICROBATCHES) * 8)
    return tuple(int(min(max(d, 1), LONG_TAIL_MAX_TARGETS)) for d in draws)


WINDOW_NAMES: tuple[str, ...] = ("unequal", "equal", "zero", "longtail")
"""Every window the audit knows, in report order."""


@dataclass(frozen=True)
class Window:
    """One optimizer step's microbatches: each a dict of ``input_ids`` and ``labels``, shape [L]."""

    name: str
    targets: tuple[int, ...]  # true target tokens per microbatch (after the causal shift)
    microbatches: tuple[dict[str, torch.Tensor], ...]

    @property
    def total_targets(self) -> int:
        """The true count the window's mean divides by."""
        return sum(self.targets)

    def describe(self) -> str:
        """``unequal (1, 7, 200, 3)``."""
        return f"{self.name} ({', '.join(str(n) for n in self.targets)})"


def target_count(labels: torch.Tensor) -> int:
    """Target tokens of a causal-LM microbatch as its loss counts them: shifted labels != -100."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _sequences(
    targets: Sequence[int], seed: int, *, high: int = VOCAB_SIZE
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in targets:
        length = n + 1 if n > 0 else ZERO_TARGET_LENGTH
        ids = torch.randint(1, high, (length,), generator=generator)
        labels = ids.clone() if n > 0 else torch.full((length,), IGNORE_INDEX)
        out.append((ids, labels))
    return out


def build_window(name: str) -> Window:
    """The window called ``name`` (one of :data:`WINDOW_NAMES`); ``KeyError`` for another name."""
    if name == "longtail":
        targets = _long_tail_targets()
    else:
        targets = _TARGETS[name]
    return _window(name, targets, _sequences(targets, seed=WINDOW_NAMES.index(name)))


def build_fp16_window(*, spike: bool = True) -> Window:
    """The float16 overflow window (module docstring): ``fp16-spike``, or ``fp16-clean`` without
    the spike (the same tensors otherwise)."""
    targets = _TARGETS["unequal"]
    sequences = _sequences(targets, seed=FP16_WINDOW_SEED, high=SPIKE_TOKEN)
    if spike:
        ids, labels = sequences[SPIKE_MICROBATCH]
        ids, labels = ids.clone(), labels.clone()
        ids[0] = labels[0] = SPIKE_TOKEN  # position 0's label is never a target (causal shift)
        sequences[SPIKE_MICROBATCH] = (ids, labels)
    return _window("fp16-spike" if spike else "fp16-clean", targets, sequences)


RANK_WINDOW_NAMES: tuple[str, ...] = ("unequal", "equal")
"""The windows the audit runs across ranks (module docstring)."""

_RANK_TARGETS: dict[str, tuple[tuple[int, ...], ...]] = {
    "unequal": ((1, 7, 200, 3), (12, 0, 3, 2), (30, 64, 6, 20), (1, 1, 2, 1)),
    "equal": ((64, 64, 64, 64),) * 4,
}
RANK_SEED = 1000  # rank r of window w draws from RANK_SEED + 10 * index(w) + r


def rank_windows(name: str, world_size: int) -> tuple[Window, ...]:
    """Rank ``r``'s window of ``name`` for each of ``world_size`` ranks (module docstring);
    ``KeyError`` for another name, ``ValueError`` for a world size other than 1, 2 or 4.  At world
    size 1 the one window is :func:`build_window`'s."""
    if world_size == 1:
        return (build_window(name),)
    if world_size not in (2, 4):
        raise ValueError(f"world size {world_size}: the audit's rank windows are for 1, 2 or 4")
    plan = _RANK_TARGETS[name][:world_size]
    index = RANK_WINDOW_NAMES.index(name)
    return tuple(
        _window(f"{name}/rank{r}", targets, _sequences(targets, seed=RANK_SEED + 10 * index + r))
        for r, targets in enumerate(plan)
    )


def world_window(name: str, windows: Sequence[Window]) -> Window:
    """Every rank's microbatches as one window called ``name``, rank 0's first (the truth's
    window: its mean is over every rank's tokens together)."""
    return Window(
        name=name,
        targets=tuple(n for w in windows for n in w.targets),
        microbatches=tuple(mb for w in windows for mb in w.microbatches),
    )


def _window(
    name: str, targets: Sequence[int], sequences: list[tuple[torch.Tensor, torch.Tensor]]
) -> Window:
    width = max(ids.numel() for ids, _ in sequences)
    microbatches = []
    for ids, labels in sequences:
        pad = width - ids.numel()
        microbatches.append(
            {
                "input_ids": torch.cat([ids, torch.zeros(pad, dtype=ids.dtype)]),
                "labels": torch.cat([labels, torch.full((pad,), IGNORE_INDEX)]),
            }
        )
    window = Window(name=name, targets=tuple(targets), microbatches=tuple(microbatches))
    counted = tuple(target_count(mb["labels"]) for mb in window.microbatches)
    assert counted == window.targets, (counted, window.targets)  # construction invariant
    return window
