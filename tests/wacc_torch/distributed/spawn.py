"""Spawning real multi-process gloo jobs for the tests: time-bounded and self-cleaning.

A job is ``world_size`` fresh processes (forked by a fork server that preloaded torch), each running
``target(rank, world_size, init_file, *args)``.  The ranks meet through a file store in a fresh
temporary directory (no port to pick, nothing left behind), each with a short collective timeout,
and the whole job has a wall-clock deadline: ranks still running at the deadline, or after any
failure in this process, are killed before the job returns, so a failing test never leaves stray
processes behind.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.mutant import under_mutant

# What a hung collective costs in a test before it fails (torch.distributed's own knob: the
# ``timeout`` of init_process_group).  Production defaults are 10-30 minutes.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
JOB_DEADLINE_S = 240.0


def init_rank(
    rank: int,
    world_size: int,
    init_file: str,
    *,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
) -> None:
    """Join the job's gloo process group (call first in every rank)."""
    # One thread per rank: the ranks share the machine's few cores.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def save_result(work_dir: str, rank: int, result: Mapping[str, Any]) -> None:
    """Save one rank's results for the judging process (plain values and CPU tensors)."""
    torch.save(dict(result), os.path.join(work_dir, f"rank{rank}.pt"))


def load_results(work_dir: Path, world_size: int) -> list[dict[str, Any]]:
    """Every rank's saved results, rank 0 first (read with ``weights_only=True``)."""
    return [
        torch.load(work_dir / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)
    ]


def _context() -> multiprocessing.context.BaseContext:
    """Fresh processes (no state shared with the test process), started cheaply: a fork server
    that imported torch once forks every rank of every job, instead of each rank importing torch
    anew (seconds per process on a loaded CI machine)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])
    return context


def run_job(
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    world_size: int,
    work_dir: Path,
    deadline_s: float = JOB_DEADLINE_S,
    init_name: str = "store",
    allowed_exit_codes: Mapping[int, int] | None = None,
) -> dict[int, int | None]:
    """Run one job to completion and return each rank's exit code.

    Fails (``AssertionError``) when a rank is still running at ``deadline_s`` or exits with a code
    other than 0 (or than ``allowed_exit_codes[rank]`` for a rank expected to fail).  Every rank
    is dead when this returns or raises.
    """
    if under_mutant():
        # Under mutation testing (mutmut sets the variable to the mutant's name) a job of ranks
        # costs 20-40 s per mutant and mutmut cannot see what a rank calls: the in-process tests
        # judge the mutant, and the report's score is a lower bound for it.
        pytest.skip("spawned ranks are not run under mutation testing")
    init_file = str(work_dir / init_name)
    context = _context()
    processes = [
        context.Process(
            target=target,
            args=(rank, world_size, init_file, *args),
            name=f"wacc-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + deadline_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [p.name for p in processes if p.is_alive()]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join()
    assert not hung, f"ranks {hung} still running after {deadline_s} s (work dir {work_dir})"
    codes = {rank: p.exitcode for rank, p in enumerate(processes)}
    expected = {rank: (allowed_exit_codes or {}).get(rank, 0) for rank in codes}
    assert codes == expected, f"rank exit codes {codes}, expected {expected} (see stderr)"
    return codes
