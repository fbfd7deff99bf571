"""A rank's window as the global dataset a framework's own data-parallel sampler shards.

``Trainer`` (accelerate's ``BatchSamplerShard``) and Lightning (its ``DistributedSampler``) never
hand a rank the dataset they were given: they split it across ranks, rank ``r`` of ``N`` reading
the global indices ``r, r + N, r + 2N, ...`` (batch size 1, no shuffling, ``K * N`` items: no
padding and no dropped tail).  A user gives them one global dataset; the audit gives each rank
its own window.  :class:`RankShard` is the global dataset as rank ``r`` sees it: ``K * N`` long,
global index ``k * N + r`` is the window's microbatch ``k``, and any other index raises (the
framework handed this rank another rank's sample: the audit's windows would be wrong, so the run
must not go on).
"""

from __future__ import annotations

import torch

from wacc.audit.protocol import LoopTask, WindowDataset

__all__ = ["RankShard", "sharded_dataset"]


class RankShard(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The global dataset of which ``window`` is rank ``rank``'s shard (module docstring)."""

    def __init__(self, window: WindowDataset, rank: int, world_size: int) -> None:
        self._window = window
        self._rank = rank
        self._world_size = world_size

    def __len__(self) -> int:
        return len(self._window) * self._world_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position, owner = divmod(index, self._world_size)
        if owner != self._rank:
            raise IndexError(
                f"rank {self._rank} was handed global index {index}, rank {owner}'s sample"
            )
        return self._window[position]


def sharded_dataset(task: LoopTask) -> torch.utils.data.Dataset[dict[str, torch.Tensor]]:
    """``task.dataset`` at world size 1; else the :class:`RankShard` of this rank."""
    if task.world_size == 1:
        return task.dataset
    return RankShard(task.dataset, task.rank, task.world_size)
