"""Mid-window checkpoint on every rank, resumed in a new process group of new processes.

Job 1 (``world_size`` processes): every rank accumulates the first part of its window, saves its
record to its own file (``save_record``: ``torch.save``), then, in the same process, finishes the
window uninterrupted and reduces it (``all_reduce_mean``).  The process group is destroyed and the
processes exit.  Job 2 (new processes, a new process group on a new rendezvous file): every rank
loads its file (``torch.load(weights_only=True)``) into a fresh accumulator, accumulates the rest
of its window and reduces.  Every rank's result must equal job 1's bit for bit, for every work
dtype, sums and means, checkpoints at the start, middle and end of a rank's window.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wacc_torch import (
    AccumulatedGradients,
    WeightedGradientsAccumulator,
    all_reduce_mean,
    load_record,
    save_record,
)

from ..support import WORK_DTYPES, assert_bitwise_equal, awkward_values, dtype_name
from .spawn import init_rank, load_results, run_job, save_result

pytestmark = pytest.mark.slow

LOSS_SCALE = 2.0**4
MODES = ("sum", "mean")
# Per world size and rank: the microbatch weights of the window, and after how many of them the
# checkpoint is taken (0: nothing accumulated yet; the window's length: at its very end).
WINDOWS: Mapping[int, Mapping[int, tuple[tuple[float, ...], int]]] = {
    2: {0: ((1.0, 7.0, 0.0, 3.0), 2), 1: ((200.0, 5.0), 0)},
    4: {
        0: ((1.0, 7.0, 0.0, 3.0), 2),
        1: ((200.0, 5.0), 0),
        2: ((9.0,), 1),
        3: ((0.0, 2.0, 4.0), 1),
    },
}


def _module() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 2))


def _build_inputs(world_size: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(9)
    shapes = {name: tuple(p.shape) for name, p in _module().named_parameters()}
    return {
        dtype_name(dtype): {
            rank: [
                {
                    name: awkward_values(
                        shape, dtype=torch.float32, around=dtype, generator=generator
                    )
                    for name, shape in shapes.items()
                }
                for _ in weights
            ]
            for rank, (weights, _) in WINDOWS[world_size].items()
        }
        for dtype in WORK_DTYPES
    }


def _accumulate(
    accumulator: WeightedGradientsAccumulator,
    module: nn.Module,
    batches: list[tuple[float, dict[str, torch.Tensor]]],
    *,
    mode: str,
) -> None:
    for weight, grads in batches:
        if mode == "sum":
            accumulator.accumulate_sum(module, weight, grads=grads)
        else:
            accumulator.accumulate_mean(module, weight, grads=grads)


def _reduced(result: AccumulatedGradients) -> dict[str, Any]:
    return {
        "grads": dict(result.grads),
        "counters": (result.weight, result.issued, result.zero_weight, result.normalized),
    }


def _window(
    inputs: Mapping[str, Any], world_size: int, rank: int, name: str
) -> tuple[list[tuple[float, dict[str, torch.Tensor]]], int]:
    weights, checkpoint = WINDOWS[world_size][rank]
    return list(zip(weights, inputs[name][rank], strict=True)), checkpoint


def _first_job(rank: int, world_size: int, init_file: str, inputs_file: str, out_dir: str) -> None:
    """Accumulate, checkpoint to this rank's file, finish uninterrupted, reduce."""
    init_rank(rank, world_size, init_file)
    try:
        inputs = torch.load(inputs_file, weights_only=True)
        results: dict[str, Any] = {}
        for dtype in WORK_DTYPES:
            for mode in MODES:
                key = f"{dtype_name(dtype)}/{mode}"
                batches, checkpoint = _window(inputs, world_size, rank, dtype_name(dtype))
                module = _module()
                accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
                _accumulate(accumulator, module, batches[:checkpoint], mode=mode)
                save_record(
                    accumulator.state_dict(), Path(out_dir) / f"{key.replace('/', '-')}-{rank}.pt"
                )
                _accumulate(accumulator, module, batches[checkpoint:], mode=mode)
                results[key] = _reduced(all_reduce_mean(accumulator.finish_sums()))
        save_result(out_dir, rank, results)
    finally:
        dist.destroy_process_group()


def _second_job(rank: int, world_size: int, init_file: str, inputs_file: str, out_dir: str) -> None:
    """Restore this rank's record in a new process, finish the window, reduce."""
    init_rank(rank, world_size, init_file)
    try:
        inputs = torch.load(inputs_file, weights_only=True)
        results: dict[str, Any] = {}
        for dtype in WORK_DTYPES:
            for mode in MODES:
                key = f"{dtype_name(dtype)}/{mode}"
                batches, checkpoint = _window(inputs, world_size, rank, dtype_name(dtype))
                module = _module()
                accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
                record = load_record(Path(out_dir) / f"{key.replace('/', '-')}-{rank}.pt")
                accumulator.load_state_dict(record, module)
                _accumulate(accumulator, module, batches[checkpoint:], mode=mode)
                results[key] = _reduced(all_reduce_mean(accumulator.finish_sums()))
        save_result(out_dir, rank, {f"resumed/{k}": v for k, v in results.items()})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"world{n}")
def world_size(request: pytest.FixtureRequest) -> int:
    """How many ranks both jobs run."""
    size: int = request.param
    return size


@pytest.fixture(scope="module")
def both_jobs(world_size: int) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Run the interrupted job, then the resuming one in new processes and a new group."""
    with tempfile.TemporaryDirectory(prefix="wacc-resume-") as tmp:
        work_dir = Path(tmp)
        inputs_file = work_dir / "inputs.pt"
        torch.save(_build_inputs(world_size), inputs_file)
        args = (str(inputs_file), str(work_dir))
        run_job(_first_job, args, world_size=world_size, work_dir=work_dir, init_name="store1")
        uninterrupted = load_results(work_dir, world_size)
        run_job(_second_job, args, world_size=world_size, work_dir=work_dir, init_name="store2")
        yield uninterrupted, load_results(work_dir, world_size)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", WORK_DTYPES, ids=dtype_name)
def test_resumed_window_is_bit_identical_on_every_rank(
    both_jobs: tuple[list[dict[str, Any]], list[dict[str, Any]]], dtype: torch.dtype, mode: str
) -> None:
    """A window checkpointed on every rank and resumed in a new process group of new processes
    reduces to the uninterrupted run's mean bit for bit, on every rank."""
    uninterrupted, resumed = both_jobs
    key = f"{dtype_name(dtype)}/{mode}"
    for rank, (first, second) in enumerate(zip(uninterrupted, resumed, strict=True)):
        want, got = first[key], second[f"resumed/{key}"]
        assert got["counters"] == want["counters"], f"rank {rank} {key}"
        assert list(got["grads"]) == list(want["grads"])
        for name, grad in want["grads"].items():
            assert grad is not None and grad.dtype == dtype
            assert_bitwise_equal(got["grads"][name], grad, f"rank {rank} {key} {name}")
