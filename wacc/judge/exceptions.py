"""The implementation's exceptions as the judge reports them: the class, the text and the
implementation's own file and line (never the judge's, torch's or the standard library's)."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

import torch

__all__ = ["exception_text", "implementation_frame", "shown_path"]


# Frames that are never the implementation's own: the judge (this package), torch and Python's
# standard library (an exception raised by torch inside the implementation's call still names the
# implementation's line that called it).
_NOT_THE_IMPLEMENTATION = tuple(
    Path(path).resolve()
    for path in (
        Path(__file__).parent.parent,  # all of wacc, not only the judge's core
        Path(torch.__file__).parent,
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
    )
)


def shown_path(filename: str) -> str:
    """A file as a user finds it: relative to the working directory when it lies below it."""
    path = Path(filename).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def implementation_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The last frame of ``exc``'s traceback in the implementation's code (not the judge's,
    torch's or the standard library's), or None when there is none."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()  # (wacc_torch/ is not under wacc/: whole parts)
        if not any(path.is_relative_to(folder) for folder in _NOT_THE_IMPLEMENTATION):
            return frame
    return None


def exception_text(exc: BaseException) -> str:
    """``<Class>: <text>`` and the implementation's own file and line that raised it."""
    frame = implementation_frame(exc)
    where = f" (at {shown_path(frame.filename)}:{frame.lineno}, in {frame.name})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"
