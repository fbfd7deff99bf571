"""The worker of an isolated loop: ``python -m wacc.audit.worker REQUEST RESULT TICKS``.

Started by :func:`wacc.audit.isolation.run_isolated` only. It reads the pickled REQUEST (the
loop's name, the windows, the dtype, the torch threads), runs :func:`wacc.audit.runner.run_audit`
on that one loop, writes one byte to the file descriptor TICKS per finished run (the parent's
progress bar) and pickles the loop's facts and cells to RESULT (whole or not at all).
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

from wacc.audit.adapters import resolve
from wacc.audit.runner import LoopFacts, run_audit

__all__ = ["main"]


def _work(request_path: Path, result_path: Path, tick_fd: int) -> None:
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
        # Plain containers: the classes of a module run as __main__ would not unpickle.
        pickle.dump({"facts": kept, "cells": list(result.cells)}, sink)
    partial.replace(result_path)  # the parent reads a whole result or none


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wacc.audit.worker REQUEST RESULT TICKS`` (for :func:`run_isolated` only)."""
    request, result, ticks = sys.argv[1:] if argv is None else argv
    _work(Path(request), Path(result), int(ticks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
