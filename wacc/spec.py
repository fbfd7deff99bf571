"""An implementation's factory spec, ``module:attr`` or ``path/to/file.py:attr``, checked
without importing anything: its shape, and for a file, that the file exists. The commands call
:func:`check_spec` before they import torch, so a typo answers at once."""

from __future__ import annotations

from pathlib import Path

from wacc.errors import UsageError

__all__ = ["check_spec"]


def check_spec(spec: str) -> tuple[str, str]:
    """``(location, attr)`` of ``spec``; :class:`UsageError` naming it when it is malformed or
    names a ``.py`` file that does not exist."""
    if spec.count(":") != 1:
        raise UsageError(f"implementation {spec!r} must be 'module:attr' or 'path/file.py:attr'")
    location, attr = spec.split(":")
    if not location or not attr:
        raise UsageError(f"implementation {spec!r} must be 'module:attr' or 'path/file.py:attr'")
    if location.endswith(".py") and not Path(location).is_file():
        raise UsageError(f"implementation file {location!r} does not exist")
    return location, attr
