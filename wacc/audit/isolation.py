"""One loop's audit in a Python process of its own (``wacc audit``'s default).

Frameworks leave global state behind — environment variables, ``torch.distributed`` process
groups, logging handlers, warning filters, reseeded generators, monkeypatched modules — and some
can take the process down (a native crash, ``sys.exit`` in a launcher). Each loop therefore runs
in a fresh interpreter: ``python -m wacc.audit.worker REQUEST RESULT TICKS``
(:mod:`wacc.audit.worker`), where REQUEST is a pickle of the loop's name (a built-in name or a
``module:function`` / ``path/file.py:function`` spec: the worker imports it by the same rule), the
windows and the dtype.
This module is the parent's side; it never imports the audit's runner (the runner imports it), so
a worker that dies without a result comes back as :attr:`Isolated.error` (``error: the loop's
process exited with code N`` with the last line it printed) and the runner makes its rows. What the
loop prints goes to a log file, not to the caller's terminal.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wacc.audit.protocol import Adapter
from wacc.audit.windows import Window

__all__ = ["Isolated", "run_isolated"]


@dataclass(frozen=True)
class Isolated:
    """What a worker sends back: the loop's facts (every :class:`LoopFacts` field but the adapter)
    and its cells."""

    facts: dict[str, Any]
    cells: list[Any]  # wacc.audit.runner.Cell
    error: str | None = None  # the worker exited without a result: why (then no facts, no cells)


def run_isolated(
    adapter: Adapter,
    windows: Sequence[Window],
    *,
    dtype: str,
    tick: Callable[[], None],
    threads: int | None = None,
) -> Isolated:
    """Audit ``adapter`` on ``windows`` in a worker process (module docstring), with ``threads``
    torch threads (None: torch's default); the worker's failure to report is
    :attr:`Isolated.error`, never an exception here."""
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
                    [sys.executable, "-m", "wacc.audit.worker", str(request), str(result),
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
        error = f"error: the loop's process exited with code {code}: {last}"
    return Isolated(facts={}, cells=[], error=error)
