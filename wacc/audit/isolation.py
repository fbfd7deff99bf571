"""One loop's audit in a Python process of its own (``wacc audit``'s default).

Frameworks leave global state behind — environment variables, ``torch.distributed`` process
groups, logging handlers, warning filters, reseeded generators, monkeypatched modules — and some
can take the process down (a native crash, ``sys.exit`` in a launcher). Each loop therefore runs
in a fresh interpreter: ``python -m wacc.audit.isolation REQUEST RESULT TICKS``, where REQUEST is a
pickle of the loop's name (a built-in name or a ``module:function`` / ``path/file.py:function``
spec: the worker imports it by the same rule), the windows and the dtype; the worker runs
:func:`wacc.audit.runner.run_audit` on that one loop, writes one byte to the file descriptor TICKS
per finished run (the parent's progress bar) and pickles the loop's facts and cells to RESULT.
What the loop prints goes to a log file, not to the caller's terminal; a worker that dies without
a result is a row ``error: the loop's process exited with code N`` with the last line it printed.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from wacc.audit.protocol import Adapter
from wacc.audit.windows import Window

__all__ = ["Isolated", "main", "resolve", "run_isolated"]


@dataclass(frozen=True)
class Isolated:
    """What a worker sends back: the loop's facts (every :class:`LoopFacts` field but the adapter)
    and its cells."""

    facts: dict[str, Any]
    cells: list[Any]  # wacc.audit.runner.Cell


def resolve(name: str) -> Adapter:
    """The adapter a parent named: built-in by name, else a user loop spec."""
    from wacc.audit.adapters import ADAPTERS
    from wacc.audit.protocol import user_adapter

    if name in ADAPTERS:
        return ADAPTERS[name]
    return user_adapter(name)


def run_isolated(
    adapter: Adapter,
    windows: Sequence[Window],
    *,
    dtype: str,
    tick: Callable[[], None],
    threads: int | None = None,
) -> Isolated:
    """Audit ``adapter`` on ``windows`` in a worker process (module docstring), with ``threads``
    torch threads (None: torch's default); the worker's failure to report is an error cell per
    window, never an exception here."""
    with tempfile.TemporaryDirectory(prefix="wacc-audit-worker-") as tmp:
        folder = Path(tmp)
        request, result, log = folder / "request.pickle", folder / "result.pickle", folder / "log"
        with request.open("wb") as stream:
            request_data = {"adapter": adapter.name, "windows": list(windows), "dtype": dtype,
                            "threads": threads}  # fmt: skip
            pickle.dump(request_data, stream)
        read, write = os.pipe()
        try:
            with log.open("wb") as output:
                process = subprocess.Popen(
                    [sys.executable, "-m", "wacc.audit.isolation", str(request), str(result),
                     str(write)],
                    stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                    pass_fds=(write,),
                )  # fmt: skip
                os.close(write)
                write = -1
                with os.fdopen(read, "rb", buffering=0) as ticks:
                    read = -1
                    while chunk := ticks.read(1):
                        del chunk
                        tick()
                code = process.wait()
        finally:
            for fd in (read, write):
                if fd >= 0:
                    os.close(fd)
        if code == 0 and result.exists():
            with result.open("rb") as stream:
                loaded = pickle.load(stream)
            return Isolated(facts=loaded["facts"], cells=loaded["cells"])
        lines = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        last = lines[-1].strip()[:160] if lines else "it printed nothing"
        status = f"error: the loop's process exited with code {code}: {last}"
    from wacc.audit.runner import Cell

    return Isolated(
        facts={"status": status},
        cells=[Cell(adapter.name, w.name, status=status) for w in windows],
    )


def _worker(request_path: Path, result_path: Path, tick_fd: int) -> None:
    from wacc.audit.runner import LoopFacts, run_audit

    with request_path.open("rb") as source:
        request = pickle.load(source)
    if request["threads"] is not None:
        import torch

        torch.set_num_threads(request["threads"])
    adapter = resolve(request["adapter"])
    with os.fdopen(tick_fd, "wb", buffering=0) as out:

        def tick() -> None:
            out.write(b".")

        def progress(total: int) -> Callable[[], None]:
            del total  # the parent counted the runs
            return tick

        result = run_audit([adapter], request["windows"], dtype=request["dtype"],
                           progress=progress)  # fmt: skip
    (facts,) = result.facts
    kept = {f.name: getattr(facts, f.name) for f in fields(LoopFacts) if f.name != "adapter"}
    partial = result_path.with_suffix(".partial")
    with partial.open("wb") as sink:
        # Plain containers: this module runs as __main__ here, its classes would not unpickle.
        pickle.dump({"facts": kept, "cells": list(result.cells)}, sink)
    partial.replace(result_path)  # the parent reads a whole result or none


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wacc.audit.isolation REQUEST RESULT TICKS`` (for :func:`run_isolated` only)."""
    request, result, ticks = sys.argv[1:] if argv is None else argv
    _worker(Path(request), Path(result), int(ticks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
