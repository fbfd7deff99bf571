"""A real gloo SUM all_reduce on this machine's CPU, for the report's reduction section.

``world_size`` fresh processes (a fork server that imported torch once) join a gloo group through
a file store in a temporary folder, SUM-reduce their rows of the values, and rank 0 saves the
result; every rank is killed by a deadline, so a hung job costs at most that.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["gloo_sum"]

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _rank(
    rank: int, world_size: int, folder: str, values: Mapping[str, npt.NDArray[np.float64]]
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    reduced = {}
    for dtype, rows in values.items():
        tensor = torch.from_numpy(rows[rank].copy()).to(_TORCH[dtype])
        dist.all_reduce(tensor)  # SUM
        reduced[dtype] = tensor.to(torch.float64)
    if rank == 0:
        torch.save(reduced, f"{folder}/result.pt")
    dist.destroy_process_group()


def gloo_sum(
    values: Mapping[str, npt.NDArray[np.float64]], *, deadline_s: float = 120.0
) -> dict[str, npt.NDArray[np.float64]]:
    """``values[dtype][rank, element]`` (values of ``dtype``, every dtype with the same number of
    ranks) SUM-reduced by gloo with one process per rank: dtype -> rank 0's result. Raises
    ``RuntimeError`` when a rank fails or the job outlives ``deadline_s``."""
    (world_size,) = {rows.shape[0] for rows in values.values()}
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory(prefix="wacc-gloo-") as folder:
        processes = [
            context.Process(target=_rank, args=(rank, world_size, folder, dict(values)),
                            daemon=True)
            for rank in range(world_size)
        ]  # fmt: skip
        try:
            for process in processes:
                process.start()
            deadline = time.monotonic() + deadline_s
            for process in processes:
                process.join(max(0.0, deadline - time.monotonic()))
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                if process.pid is not None:
                    process.join()
        codes = [process.exitcode for process in processes]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"gloo job of {world_size} ranks: exit codes {codes}")
        result = torch.load(Path(folder) / "result.pt", weights_only=True)
    return {dtype: tensor.numpy() for dtype, tensor in result.items()}
