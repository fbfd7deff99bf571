"""A rank that stalls, raises or dies mid-window: the others get an error in bounded time.

The bound is torch.distributed's own knob, the ``timeout`` of ``init_process_group`` /
``new_group`` (gloo: every collective; NCCL: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the
default, the watchdog aborts).  Each job runs two phases on two groups with a short timeout:

1. the last rank stalls (alive, never joins ``all_reduce_mean``): the others raise after about
   the timeout;
2. the last rank fails mid-window, either raising on a bad input of its own
   (``InvalidWeightError``, uncaught, so the process ends) or dying (``os._exit``): the others
   raise within the timeout, never hang.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wacc_torch import WeightedGradientsAccumulator, all_reduce_mean

from .spawn import init_rank, load_results, run_job, save_result

pytestmark = pytest.mark.slow

GROUP_TIMEOUT = timedelta(seconds=3)
# Scheduling slack on a loaded CI machine, on top of the timeout.
SLACK_S = 20.0
DIES_EXIT_CODE = 3
RAISES_EXIT_CODE = 1  # an uncaught exception in a multiprocessing target


def _window(accumulator: WeightedGradientsAccumulator, module: nn.Module) -> None:
    accumulator.accumulate_sum(module, 3.0, grads={"weight": torch.ones(2, 3)})


def _timed_reduction(accumulator: WeightedGradientsAccumulator, group: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        all_reduce_mean(accumulator.finish_sums(), group=group)
    except Exception as error:  # noqa: BLE001 - recorded for the judge
        return {"error": type(error).__name__, "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def _rank_main(rank: int, world_size: int, init_file: str, failure: str, out_dir: str) -> None:
    init_rank(rank, world_size, init_file)
    stall_group = dist.new_group(timeout=GROUP_TIMEOUT)
    failure_group = dist.new_group(timeout=GROUP_TIMEOUT)
    culprit = rank == world_size - 1
    module = nn.Linear(3, 2, bias=False)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    results: dict[str, Any] = {}

    _window(accumulator, module)
    if culprit:
        time.sleep(GROUP_TIMEOUT.total_seconds() + 2)  # alive, but never joins
    else:
        results["stall"] = _timed_reduction(accumulator, stall_group)

    _window(accumulator, module)
    if culprit:
        if failure == "dies":
            os._exit(DIES_EXIT_CODE)
        accumulator.accumulate_sum(module, -1.0)  # InvalidWeightError, uncaught: the rank ends
    results["failure"] = _timed_reduction(accumulator, failure_group)
    save_result(out_dir, rank, results)
    # The group lost a member: leave without a collective teardown.
    os._exit(0)


@pytest.fixture(
    scope="module",
    params=[(2, "raises"), (4, "dies")],
    ids=lambda p: f"world{p[0]}-{p[1]}",
)
def survivors(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Run one job; the surviving ranks' records."""
    world_size, failure = request.param
    with tempfile.TemporaryDirectory(prefix="wacc-fail-") as tmp:
        work_dir = Path(tmp)
        code = DIES_EXIT_CODE if failure == "dies" else RAISES_EXIT_CODE
        run_job(
            _rank_main,
            (failure, str(work_dir)),
            world_size=world_size,
            work_dir=work_dir,
            deadline_s=120.0,
            allowed_exit_codes={world_size - 1: code},
        )
        yield failure, load_results(work_dir, world_size - 1)


def test_stalled_rank_makes_the_others_raise_after_the_timeout(
    survivors: tuple[str, list[dict[str, Any]]],
) -> None:
    """While one rank is alive but never joins, every other rank's all_reduce_mean raises after
    about the group's timeout, not before and not much later."""
    _, records = survivors
    timeout = GROUP_TIMEOUT.total_seconds()
    for rank, record in enumerate(records):
        stall = record["stall"]
        assert stall["error"] is not None, f"rank {rank}: no error while a rank stalled"
        assert timeout * 0.9 <= stall["elapsed"] <= timeout + SLACK_S, f"rank {rank}: {stall}"


def test_failed_rank_makes_the_others_raise_in_bounded_time(
    survivors: tuple[str, list[dict[str, Any]]],
) -> None:
    """When one rank raises on its own bad input or dies mid-window, every other rank's
    all_reduce_mean raises within the group's timeout (plus scheduling slack): never a hang."""
    failure, records = survivors
    for rank, record in enumerate(records):
        outcome = record["failure"]
        assert outcome["error"] is not None, f"rank {rank}: no error after the culprit {failure}"
        assert outcome["elapsed"] <= GROUP_TIMEOUT.total_seconds() + SLACK_S, (
            f"rank {rank}: {outcome}"
        )
        print(f"{failure}: rank {rank} got {outcome['error']} after {outcome['elapsed']:.2f} s")
