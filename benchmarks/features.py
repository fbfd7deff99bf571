"""Which optional accumulator features the installed ``wacc_torch`` has (detected, not assumed).

The zero-copy mode and ``state_dict(checksum=False)`` are newer than this suite's first version;
their rows read ``n/a (not available)`` where they are missing instead of failing the run.
"""

from __future__ import annotations

import inspect

import torch

from wacc_torch import WeightedGradientsAccumulator


def has_zero_copy() -> bool:
    """``WeightedGradientsAccumulator(..., zero_copy=True)`` and ``acc.microbatch(...)`` exist."""
    parameters = inspect.signature(WeightedGradientsAccumulator.__init__).parameters
    return "zero_copy" in parameters and hasattr(WeightedGradientsAccumulator, "microbatch")


def has_checksum_option() -> bool:
    """``acc.state_dict(checksum=False)`` exists (skips the record's SHA-256)."""
    parameters = inspect.signature(WeightedGradientsAccumulator.state_dict).parameters
    return "checksum" in parameters


def pending_buffers(accumulator: WeightedGradientsAccumulator) -> dict[str, torch.Tensor]:
    """The accumulator's pending buffers, without copying them (an internal the memory and record
    benchmarks read: the window core's since the modes got modules of their own, the
    accumulator's own field before). Raises rather than guess: a wrong guess would measure
    nothing."""
    mode = getattr(accumulator, "_mode", None)
    if mode is not None:
        return dict(mode.window.pending)
    pending = getattr(accumulator, "_pending", None)
    if pending is None:
        raise AttributeError("cannot find the pending buffers of this wacc_torch version")
    return dict(pending)


def held_tensors(accumulator: WeightedGradientsAccumulator) -> list[torch.Tensor]:
    """The tensors the accumulator keeps between windows besides its pending buffers: the work
    tensor kept for the next call (CPU) and the buffered mode's arenas (internals the memory
    benchmark reads; none in a version without them)."""
    mode = getattr(accumulator, "_mode", None)
    held: list[torch.Tensor] = []
    work = getattr(mode, "kept_work", None)
    if work is not None:
        held += work._storage.values()
    held += [arena.storage for arena in getattr(mode, "arenas", {}).values()]
    return held
