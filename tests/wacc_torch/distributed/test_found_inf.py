"""``found_inf`` across ranks (issue 17): the distributed helpers, the DDP hook and FSDP2 answer
for the reduced window, the same on every rank, so that every rank skips an overflowing window
together. Real gloo jobs of 2 and 4 spawned ranks.

Cases per job, each on every path:

* ``clean``: finite everywhere: False on every rank;
* ``one_rank``: an inf in one element of the LAST rank's gradient only: True on every rank (for
  FSDP the element lies in rank 0's shard, so the rank that saw it does not hold it);
* ``sum_only``: float16 gradients of 40000 on every rank, finite locally, whose reduced sum
  overflows float16: True on every rank, while each rank's local ``finish_sums`` says False.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from wacc_torch import WeightedGradientsAccumulator, all_reduce_mean, all_reduce_sums
from wacc_torch.ddp_hook import WeightedAllReduceHook
from wacc_torch.fsdp import FSDPWeightedWindow

from .spawn import init_rank, load_results, run_job, save_result

pytestmark = pytest.mark.slow

CASES = ("clean", "one_rank", "sum_only")
WIDTH = 4  # elements of the one parameter; rank 0's FSDP shard holds element 0


def _gradient(case: str, rank: int, world_size: int) -> torch.Tensor:
    """This rank's gradient of the window (float16 values, exact in float32 too)."""
    if case == "sum_only":
        return torch.full((WIDTH,), 40000.0)
    g = torch.arange(1.0, WIDTH + 1.0) * (rank + 1)
    if case == "one_rank" and rank == world_size - 1:
        g[0] = math.inf
    return g


class _Probe(nn.Module):
    """One parameter; forward(g) = sum(weight * g), whose gradient is exactly g."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(WIDTH, dtype=dtype))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()


def _module(dtype: torch.dtype) -> nn.Module:
    return _Probe(dtype)


def _helpers(case: str, rank: int, world_size: int) -> dict[str, bool]:
    out = {}
    for name, reduce in (
        ("all_reduce_sums", all_reduce_sums),
        ("all_reduce_mean", all_reduce_mean),
    ):
        acc = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
        module = _module(torch.float16)
        acc.accumulate_sum(module, 1.0, grads={"weight": _gradient(case, rank, world_size)})
        local = acc.finish_sums()
        out[f"{name}/local"] = local.found_inf
        out[name] = reduce(local).found_inf
    return out


def _ddp_hook(case: str, rank: int, world_size: int) -> bool:
    """The window's last backward goes through the hook: its gradient is ``_gradient``."""
    module = _module(torch.float16)
    model = DistributedDataParallel(module)
    acc = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    hook = WeightedAllReduceHook(model, acc)
    g = _gradient(case, rank, world_size).to(torch.float16)
    with model.no_sync():
        model(torch.zeros_like(g)).backward()
        acc.accumulate_sum(model.module, 1.0)
    model.module.weight.grad = None
    loss = model(g)  # forward first: DDP may rebuild its buckets
    hook.last_microbatch_sum(1.0)
    loss.backward()
    assert hook.result is not None
    return hook.result.found_inf


def _fsdp(case: str, rank: int, world_size: int) -> bool:
    """One microbatch per rank whose float32 gradient is ``_gradient`` (the parameter's four
    elements are sharded by rows: a (WIDTH, 1) weight puts element 0 in rank 0's shard)."""
    torch.manual_seed(0)
    model = nn.Linear(1, WIDTH, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)), reshard_after_forward=False)
    window = FSDPWeightedWindow(model, loss_scale=1.0)  # type: ignore[arg-type]
    g = _gradient(case, rank, world_size)
    if case == "sum_only":
        g = torch.full((WIDTH,), 3.0e38)  # float32 parameters: the reduced sum overflows float32
    window.microbatch(last=True)
    (model(torch.ones(1, 1)).reshape(-1) * g).sum().backward()
    window.add_weight(1.0)
    return window.finish_mean().found_inf


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    init_rank(rank, world_size, init_file)
    try:
        out: dict[str, Any] = {}
        for case in CASES:
            out[case] = {
                **_helpers(case, rank, world_size),
                "ddp_hook": _ddp_hook(case, rank, world_size),
                "fsdp": _fsdp(case, rank, world_size),
            }
        save_result(out_dir, rank, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"world{n}")
def rank_results(request: pytest.FixtureRequest) -> Iterator[list[dict[str, Any]]]:
    """Every rank's answers, rank 0 first."""
    world_size: int = request.param
    with tempfile.TemporaryDirectory(prefix="wacc-found-inf-") as tmp:
        work_dir = Path(tmp)
        run_job(_rank_main, (str(work_dir),), world_size=world_size, work_dir=work_dir)
        yield load_results(work_dir, world_size)


@pytest.mark.parametrize("path", ["all_reduce_sums", "all_reduce_mean", "ddp_hook", "fsdp"])
@pytest.mark.parametrize("case", CASES)
def test_every_rank_gets_the_global_found_inf(
    rank_results: list[dict[str, Any]], case: str, path: str
) -> None:
    """found_inf of the reduced window is the same on every rank: False when every value is
    finite, True when one rank's gradient holds an inf (whichever rank's shard it lands in) and
    True when only the reduction overflows."""
    answers = [result[case][path] for result in rank_results]
    assert answers == [case != "clean"] * len(rank_results), (case, path, answers)


def test_a_sum_that_overflows_only_in_the_reduction_is_clean_locally(
    rank_results: list[dict[str, Any]],
) -> None:
    """In the sum_only case every rank's own finish_sums is finite (found_inf False): the
    overflow exists only in the reduced sums, where the helpers find it."""
    for result in rank_results:
        assert result["sum_only"]["all_reduce_sums/local"] is False
        assert result["sum_only"]["all_reduce_sums"] is True
