"""The zero-copy mode under a real DistributedDataParallel on 2 gloo ranks.

Outside ``no_sync()`` a block is refused before anything changes (DDP would all-reduce a ``.grad``
its backward did not fill); inside it, every rank's zero-copy window, reduced with
``all_reduce_mean``, gives the same bits as the buffered mode fed by a plain model's backward.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from wacc_torch import WeightedGradientsAccumulator, ZeroCopyError, all_reduce_mean

from .spawn import init_rank, load_results, run_job, save_result

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
LOSS_SCALE = 2.0**3
# Token counts of each rank's microbatches: unequal within and across ranks.
TOKENS = {0: (1, 7, 3), 1: (20, 2)}


def _model() -> nn.Linear:
    torch.manual_seed(3)
    return nn.Linear(4, 3)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return LOSS_SCALE * ((model(x) - y) ** 2).mean()


def _rank(rank: int, world_size: int, init_file: str, work_dir: str) -> None:
    init_rank(rank, world_size, init_file)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [
        (torch.randn(n, 4, generator=generator), torch.randn(n, 3, generator=generator))
        for n in TOKENS[rank]
    ]
    ddp = DistributedDataParallel(_model())
    zero_copy = WeightedGradientsAccumulator(
        dtype=torch.float32, loss_scale=LOSS_SCALE, zero_copy=True
    )
    x, y = batches[0]
    try:
        with zero_copy.microbatch(ddp, weight=len(y), kind="mean"):
            _loss(ddp, x, y).backward()  # pragma: no cover - must not run
        refused = ""
    except ZeroCopyError as exc:
        refused = str(exc)
    untouched = zero_copy.state.issued == 0 and all(p.grad is None for p in ddp.parameters())

    for x, y in batches:
        with ddp.no_sync(), zero_copy.microbatch(ddp, weight=len(y), kind="mean"):
            _loss(ddp, x, y).backward()
    zero_copy_mean = all_reduce_mean(zero_copy.finish_sums())

    plain = _model()
    buffered = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    for x, y in batches:
        _loss(plain, x, y).backward()
        buffered.accumulate_mean(plain, len(y))
    buffered_mean = all_reduce_mean(buffered.finish_sums())
    save_result(
        work_dir,
        rank,
        {
            "refused": refused,
            "untouched": untouched,
            "weight": zero_copy_mean.weight,
            "zero_copy": {n: g.detach().clone() for n, g in zero_copy_mean.grads.items()},
            "buffered": {n: g.detach().clone() for n, g in buffered_mean.grads.items()},
        },
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


def test_zero_copy_under_ddp_needs_no_sync_and_then_matches_the_buffered_mode() -> None:
    """Outside no_sync() a block is refused with nothing changed; inside it, both ranks' reduced
    zero-copy means equal the buffered mode's bit for bit (and each other)."""
    with tempfile.TemporaryDirectory(prefix="wacc-zero-copy-ddp-") as scratch:
        work_dir = Path(scratch)
        run_job(_rank, (str(work_dir),), world_size=WORLD_SIZE, work_dir=work_dir)
        results: list[dict[str, Any]] = load_results(work_dir, WORLD_SIZE)
    for rank, result in enumerate(results):
        assert "no_sync" in result["refused"], rank
        assert result["untouched"], rank
        assert result["weight"] == float(sum(sum(t) for t in TOKENS.values()))
        assert len(result["buffered"]) == len(result["zero_copy"]) == 2
        for name, grad in result["buffered"].items():
            # The DDP wrapper's names carry its "module." prefix.
            zero_copy = result["zero_copy"][f"module.{name}"]
            assert torch.equal(_bits(zero_copy), _bits(grad)), (rank, name)
            assert torch.equal(_bits(grad), _bits(results[0]["buffered"][name])), (rank, name)
