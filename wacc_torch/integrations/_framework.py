"""The one way an integration imports its framework: lazily, with one clear message naming the
extra to install when it is missing."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MissingFrameworkError", "require"]


class MissingFrameworkError(ImportError):
    """The framework an integration needs is not installed (names the extra to install)."""


def require(module: str, *, extra: str, integration: str) -> Any:
    """``importlib.import_module(module)``; :class:`MissingFrameworkError` naming ``extra`` when
    the module (or its top-level package) is not installed.  Any other import failure (a broken
    install) propagates as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise
        raise MissingFrameworkError(
            f"{integration} needs {module!r}, which is not installed: pip install 'wacc[{extra}]'"
        ) from exc
