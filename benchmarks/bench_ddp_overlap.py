"""Step time of weighted accumulation under DDP: comm hook vs helper vs plain DDP, side by side.

Two gloo ranks on this machine (spawned), one model of about 20 M parameters (an MLP of
``--layers`` square ``--width`` layers), windows of ``--microbatches`` microbatches of unequal token
counts.  Per step:

- ``plain``: DDP's own accumulation (``no_sync()`` for all but the last microbatch, mean loss per
  microbatch / microbatches, DDP averaging over ranks): what the weighted paths must not cost much
  more than (its result is wrong for unequal counts; see the README);
- ``helper``: every microbatch under ``no_sync()``, ``accumulate_sum``, then
  ``all_reduce_mean(acc.finish_sums()).apply_to(...)``: the reduction starts after the backward;
- ``hook``: :class:`wacc_torch.ddp_hook.WeightedAllReduceHook`: the last backward's bucketed
  all-reduces carry the window and overlap the rest of that backward.

The three variants run interleaved, round after round (the order rotates), so that machine noise
hits them alike; the medians and their ratios come from the same run.  Collectives and payload
bytes per step are counted on the Python side (DDP's own bucket all-reduces in ``plain`` run in
C++: one per bucket, the parameters' dtype).

Usage: ``python benchmarks/bench_ddp_overlap.py [--width 2048 --layers 5 --rounds 8]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from wacc_torch import WeightedGradientsAccumulator, all_reduce_mean
from wacc_torch.ddp_hook import WeightedAllReduceHook

WORLD_SIZE = 2
TOKENS = {0: (3, 17, 8, 30), 1: (25, 1, 12, 6)}  # per rank, one entry per microbatch


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def _batches(rank: int, width: int, microbatches: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    counts = (TOKENS[rank] * microbatches)[:microbatches]
    return [torch.randn(n, width, generator=generator) for n in counts]


def _loss_sum(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


class _Counter:
    """Counts the collectives Python code issues and their payload bytes (per rank)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __enter__(self) -> _Counter:
        self._originals = (dist.all_reduce, dist.all_gather_object)
        all_reduce, all_gather_object = self._originals

        def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
            return all_reduce(tensor, *args, **kwargs)

        def counted_all_gather_object(output: list[Any], obj: Any, *args: Any, **kw: Any) -> Any:
            self.calls.append(("all_gather_object", len(pickle.dumps(obj))))
            return all_gather_object(output, obj, *args, **kw)

        dist.all_reduce = counted_all_reduce  # type: ignore[assignment]
        dist.all_gather_object = counted_all_gather_object  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather_object = self._originals  # type: ignore[assignment]


def _rank(rank: int, init_file: str, options: dict[str, Any], queue: Any) -> None:
    torch.set_num_threads(options["threads"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(minutes=5),
    )
    width, layers = options["width"], options["layers"]
    batches = _batches(rank, width, options["microbatches"])

    plain = DistributedDataParallel(_model(width, layers))
    helper = DistributedDataParallel(_model(width, layers))
    helper_acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    hooked = DistributedDataParallel(_model(width, layers))
    hook_acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    hook = WeightedAllReduceHook(hooked, hook_acc)

    def plain_step() -> None:
        for index, x in enumerate(batches):
            last = index == len(batches) - 1
            with nullcontext() if last else plain.no_sync():
                (_loss_sum(plain, x) / len(x) / len(batches)).backward()
        plain.zero_grad(set_to_none=True)

    def helper_step() -> None:
        with helper.no_sync():
            for x in batches:
                _loss_sum(helper, x).backward()
                helper_acc.accumulate_sum(helper.module, float(len(x)))
        all_reduce_mean(helper_acc.finish_sums()).apply_to(helper.module)
        helper.zero_grad(set_to_none=True)

    def hook_step() -> None:
        with hooked.no_sync():
            for x in batches[:-1]:
                _loss_sum(hooked, x).backward()
                hook_acc.accumulate_sum(hooked.module, float(len(x)))
        loss = _loss_sum(hooked, batches[-1])
        hook.last_microbatch_sum(float(len(batches[-1])))
        loss.backward()
        hooked.zero_grad(set_to_none=True)

    steps: dict[str, Callable[[], None]] = {
        "plain": plain_step,
        "helper": helper_step,
        "hook": hook_step,
    }
    for step in steps.values():  # warm-up (DDP rebuilds its buckets after the first sync)
        step()
        step()
    counts: dict[str, list[tuple[str, int]]] = {}
    for name, step in steps.items():
        with _Counter() as counter:
            step()
        counts[name] = counter.calls
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(options["rounds"]):
        order = names[round_index % 3 :] + names[: round_index % 3]
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        queue.put(
            {
                "times": times,
                "counts": counts,
                "parameters": sum(p.numel() for p in plain.parameters()),
                "tensors": len(list(plain.parameters())),
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    options = vars(args)
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="wacc-bench-ddp-") as tmp:
        init_file = os.path.join(tmp, "store")
        processes = [
            context.Process(target=_rank, args=(rank, init_file, options, queue))
            for rank in range(WORLD_SIZE)
        ]
        for process in processes:
            process.start()
        try:
            result = queue.get(timeout=1800)
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    medians = {name: statistics.median(values) for name, values in result["times"].items()}
    print(
        f"model: {result['parameters'] / 1e6:.1f} M parameters in {result['tensors']} tensors, "
        f"{WORLD_SIZE} gloo ranks, {args.microbatches} microbatches per step, "
        f"{args.rounds} rounds, {args.threads} thread(s) per rank"
    )
    for name, median in medians.items():
        spread = (min(result["times"][name]), max(result["times"][name]))
        print(
            f"  {name:>6}: median {median * 1e3:8.1f} ms/step (min {spread[0] * 1e3:.1f}, "
            f"max {spread[1] * 1e3:.1f})"
        )
    print(
        f"  ratios: hook/plain {medians['hook'] / medians['plain']:.3f}, "
        f"helper/plain {medians['helper'] / medians['plain']:.3f}, "
        f"hook/helper {medians['hook'] / medians['helper']:.3f}"
    )
    for name, calls in result["counts"].items():
        summary = ", ".join(f"{kind} {size} B" for kind, size in calls) or "none from Python"
        print(f"  collectives per step, {name}: {summary}")


if __name__ == "__main__":
    main()
