"""Side-by-side timing: modes interleaved round-robin, a warm-up first, the median of N samples.

Interleaving spreads the noise of other processes sharing the machine over every mode alike, so
that a ratio of two medians from the same run means something even on a busy machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Timed:
    """One mode to time: ``call`` is timed, ``setup`` (if any) runs untimed before each sample."""

    call: Callable[[], object]
    setup: Callable[[], object] = _nothing


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU does not)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: Sequence[float]) -> float:
    """The median of the samples (robust against the outliers a shared machine produces)."""
    if not values:
        raise ValueError("median of no samples")
    return float(statistics.median(values))


def ratio(value: float, floor: float) -> float:
    """``value / floor``, the figure every target is stated in."""
    if not floor > 0:
        raise ValueError(f"floor must be > 0 to form a ratio, got {floor!r}")
    return value / floor


def interleaved_samples(
    modes: Mapping[str, Timed],
    *,
    device: torch.device | str,
    repeats: int,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Seconds of each sample of each mode; round ``r`` runs every mode once, in a rotated order.

    The rotation keeps a mode from always running right after the same neighbour (caches, the
    allocator's state). Warm-up rounds (compilation of kernels, lazy allocation) are not kept.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}")
    names = list(modes)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            mode = modes[name]
            mode.setup()
            synchronize(device)
            start = time.perf_counter()
            result = mode.call()
            synchronize(device)
            elapsed = time.perf_counter() - start
            # Released after the clock stops: freeing what a call returns (a finished window's
            # 160 MB of buffers, a record's copies) is not the call's cost, and the plain loop
            # pays the same when its .grad is set to None.
            del result
            if round_index >= warmup:
                samples[name].append(elapsed)
    return samples


def interleaved_medians(
    modes: Mapping[str, Timed],
    *,
    device: torch.device | str,
    repeats: int,
    warmup: int = 1,
) -> dict[str, float]:
    """The median seconds per call of each mode (see :func:`interleaved_samples`)."""
    samples = interleaved_samples(modes, device=device, repeats=repeats, warmup=warmup)
    return {name: median(values) for name, values in samples.items()}
