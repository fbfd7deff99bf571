"""One loop across ranks: a world of N real ``torch.distributed`` processes (``wacc audit
--world-size N``).

:func:`run_world` starts N Python processes as ``torchrun`` starts its workers: each with
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR=127.0.0.1`` and
``TORCHELASTIC_USE_AGENT_STORE=True`` set, running ``python -m wacc.audit.world REQUEST RESULTS``:
as under torchrun's agent, this process hosts each run's ``TCPStore`` (on a port the system picks
when it is created, held until the world ends) and every rank is its client, so no other process
(another world of a ``--jobs`` audit, a gloo connection) can take the port between its choice and
its use, and no rank can join another world's store.  Per run (a dtype; the audit asks for
three, run one after the other in the same processes, each with a store and ``MASTER_PORT`` of
its own), rank ``r`` builds its own
:class:`~wacc.audit.protocol.LoopTask` (rank ``r``'s window, ``task.rank``/``task.world_size``/
``task.backend``, a workdir of its own), calls ``adapter.run(task)`` — which brings the process
group up and syncs gradients the framework's own way — destroys the process group if it is still
up, and pickles what it captured right before its optimizer step to
``RESULTS/rank<r>-run<i>.pickle``.
A rank that raises reports the error; when one rank has finished (or died) and another is still
running :data:`STRAGGLER_SECONDS` later (waiting in a collective its peer never joins), the
stragglers are killed and say so.  What the ranks print goes to a log per rank.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wacc.audit.protocol import Adapter, LoopTask
from wacc.audit.windows import Window

__all__ = ["RankOutcome", "STRAGGLER_SECONDS", "WORLD_SIZES", "WORLD_TIMEOUT_SECONDS", "run_world"]

WORLD_SIZES = (1, 2, 4)  # what ``wacc audit --world-size`` takes (the rank windows exist for)
WORLD_TIMEOUT_SECONDS = 1200.0  # a whole world (three runs): far beyond any loop here
STRAGGLER_SECONDS = 30.0  # after the first rank is done: a rank still running hangs


@dataclass(frozen=True)
class RankOutcome:
    """What one rank captured (or why it did not)."""

    rank: int
    captured: dict[str, torch.Tensor] | None  # task.captured: the gradient before its step
    counted: float | None  # LoopRun.counted_tokens
    note: str
    fetched_at_first_backward: int | None
    error: str  # "" when the rank ran to the end


def _store(world_size: int) -> torch.distributed.TCPStore:
    """A run's store, hosted here on a port the system picks (module docstring)."""
    return torch.distributed.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False
    )


def _environment(rank: int, world_size: int, threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
        ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world_size), ROLE_NAME="default",
        TORCHELASTIC_RUN_ID="wacc-audit", TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0", MASTER_ADDR="127.0.0.1",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )  # MASTER_PORT: per run (run_world)  # fmt: skip
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_world(
    adapter: Adapter,
    windows: Sequence[Window],
    *,
    dtypes: Sequence[torch.dtype],
    weights_dtype: torch.dtype,
    backend: str = "gloo",
    threads: int | None = None,
) -> list[list[RankOutcome]]:
    """Run ``adapter`` in a world of ``len(windows)`` ranks, rank ``r`` on ``windows[r]``
    (module docstring), once per dtype of ``dtypes``, one after the other in the same processes
    (each run brings up a process group of its own on a port of its own, and ends it): per run,
    one outcome per rank in rank order; never an exception for a rank that failed (its
    ``error`` says why, and a rank that never reported one run reports none after it)."""
    world_size = len(windows)
    stores = [_store(world_size) for _ in dtypes]  # held (their ports too) until the world ends
    with tempfile.TemporaryDirectory(prefix="wacc-audit-world-") as tmp:
        folder = Path(tmp)
        request = folder / "request.pickle"
        with request.open("wb") as stream:
            pickle.dump(
                {"adapter": adapter.name, "windows": list(windows), "dtypes": list(dtypes),
                 "ports": [store.port for store in stores], "weights_dtype": weights_dtype,
                 "backend": backend, "threads": threads},
                stream,
            )  # fmt: skip
        processes: list[subprocess.Popen[bytes]] = []
        logs = [folder / f"rank{r}.log" for r in range(world_size)]
        try:
            for rank in range(world_size):
                with logs[rank].open("wb") as output:
                    processes.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "wacc.audit.world", str(request), str(folder)],
                            stdin=subprocess.DEVNULL,
                            stdout=output,
                            stderr=subprocess.STDOUT,
                            env=_environment(rank, world_size, threads),
                        )  # fmt: skip
                    )
            killed = _wait(processes)
        finally:
            for process in processes:  # only on an exception here: each is done or killed above
                if process.poll() is None:
                    process.kill()
                    process.wait()
            del stores  # every rank is done with them
        return [
            [_outcome(folder, r, i, processes[r].returncode, logs[r], r in killed)
             for r in range(world_size)]
            for i in range(len(dtypes))
        ]  # fmt: skip


def _wait(processes: Sequence[subprocess.Popen[bytes]]) -> set[int]:
    """Wait for every rank; kill those still running :data:`STRAGGLER_SECONDS` after the first
    one ended (or at :data:`WORLD_TIMEOUT_SECONDS`).  Returns the ranks killed."""
    started = time.monotonic()
    first_done: float | None = None
    killed: set[int] = set()
    while any(p.poll() is None for p in processes):
        now = time.monotonic()
        if first_done is None and any(p.poll() is not None for p in processes):
            first_done = now
        late = first_done is not None and now - first_done > STRAGGLER_SECONDS
        if late or now - started > WORLD_TIMEOUT_SECONDS:
            for rank, process in enumerate(processes):
                if process.poll() is None:
                    process.kill()
                    process.wait()
                    killed.add(rank)
            break
        time.sleep(0.05)
    return killed


def _outcome(
    folder: Path, rank: int, run: int, code: int | None, log: Path, killed: bool
) -> RankOutcome:
    result = folder / f"rank{rank}-run{run}.pickle"
    if result.exists():
        with result.open("rb") as stream:
            loaded: dict[str, Any] = pickle.load(stream)
        return RankOutcome(rank=rank, **loaded)
    if killed:
        error = f"error: rank {rank} still running {STRAGGLER_SECONDS:g} s after another ended"
    else:
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        last = lines[-1].strip()[:160] if lines else "it printed nothing"
        error = f"error: rank {rank}'s process exited with code {code}: {last}"
    return RankOutcome(rank, None, None, "", None, error)


def _rank(request_path: Path, folder: Path) -> None:
    """One rank of :func:`run_world` (this process's ``RANK``): every run of the request."""
    from wacc.audit.adapters import resolve
    from wacc.audit.models import MODEL_KINDS

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with request_path.open("rb") as source:
        request = pickle.load(source)
    if request["threads"] is not None:
        torch.set_num_threads(request["threads"])
    adapter = resolve(request["adapter"])
    for run_index, (dtype, port) in enumerate(
        zip(request["dtypes"], request["ports"], strict=True)
    ):
        os.environ["MASTER_PORT"] = str(port)
        workdir = folder / f"work{rank}-run{run_index}"
        workdir.mkdir()
        task = LoopTask(
            model_spec=MODEL_KINDS[adapter.model], dtype=dtype, window=request["windows"][rank],
            workdir=workdir, weights_dtype=request["weights_dtype"], world_size=world_size,
            rank=rank, backend=request["backend"],
        )  # fmt: skip
        outcome = _run_task(adapter, task)
        partial = folder / f"rank{rank}-run{run_index}.partial"
        with partial.open("wb") as sink:
            pickle.dump(outcome, sink)
        partial.replace(partial.with_suffix(".pickle"))  # the parent reads a whole one or none
        if outcome["error"]:  # the peers may be stuck in this run's collectives: stop here
            break


def _run_task(adapter: Adapter, task: LoopTask) -> dict[str, Any]:
    """One run of the loop on this rank: what it captured, or its error (a plain dict)."""
    import random

    import numpy as np
    import torch.distributed as dist

    from wacc.audit.results import describe_error

    outcome: dict[str, Any] = {"captured": None, "counted": None, "note": "",
                               "fetched_at_first_backward": None, "error": ""}  # fmt: skip
    try:
        # Every rank starts from the audit's RNG state, as a loop at world size 1 does.
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        run = adapter.run(task)
        outcome.update(counted=run.counted_tokens, note=run.note,
                       fetched_at_first_backward=task.fetched_at_first_backward)  # fmt: skip
        if task.captured is None:
            raise RuntimeError("the loop never stepped its optimizer in this window")
        outcome["captured"] = {k: v.detach().cpu() for k, v in task.captured.items()}
    except Exception as exc:  # a loop that raises is a finding: the row says so
        outcome["error"] = f"error: rank {task.rank}: " + describe_error(exc).removeprefix(
            "error: "
        )
    finally:
        # The loop's objects go before the process group: one a framework object still holds
        # (DDP's reducer) would be freed at interpreter exit, where gloo can abort the process.
        task.models.clear()
        gc.collect()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wacc.audit.world REQUEST FOLDER`` (one rank of :func:`run_world` only)."""
    request, folder = sys.argv[1:] if argv is None else argv
    _rank(Path(request), Path(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
