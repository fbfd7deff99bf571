"""The one import rule for everything a user names on the command line: an implementation's
factory (``wacc check``, ``replay``, ``gate``, ``report``, the pytest plugin) and a training loop
(``wacc audit --loop``).

* ``module:attr`` imports ``module`` as ``python -m`` would: the working directory first on the
  import path, then the installed packages.
* ``path/to/file.py:attr`` loads that file, with the file's own folder first on the import path,
  so the file imports its sibling modules as it would when run as a script.

:func:`check_spec` checks a spec's shape (and that a named file exists) without importing
anything, so the commands answer a typo before they import torch; :func:`import_target` imports
and returns the attribute. Every problem is a one-line :class:`~wacc.errors.UsageError` (exit 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from wacc.errors import UsageError

__all__ = ["check_module", "check_spec", "import_target"]


def check_spec(spec: str, *, what: str = "implementation") -> tuple[str, str]:
    """``(location, attr)`` of ``spec``; :class:`UsageError` naming it when it is malformed or
    names a ``.py`` file that does not exist (``what``: how messages call it)."""
    if spec.count(":") != 1:
        raise UsageError(f"{what} {spec!r} must be 'module:attr' or 'path/file.py:attr'")
    location, attr = spec.split(":")
    if not location or not attr:
        raise UsageError(f"{what} {spec!r} must be 'module:attr' or 'path/file.py:attr'")
    if location.endswith(".py") and not Path(location).is_file():
        raise UsageError(f"{what} file {location!r} does not exist")
    return location, attr


def check_module(spec: str, *, what: str = "implementation") -> None:
    """:class:`UsageError` at once when the module of a ``module:attr`` spec cannot be found
    (found as the import rule finds it, importing at most its parent packages); a file spec was
    checked by :func:`check_spec`."""
    location, _ = check_spec(spec, what=what)
    if location.endswith(".py"):
        return
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(location) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(f"cannot import module {location!r}: no such module ({what} {spec!r})")


def _first_on_path(folder: str) -> None:
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)


# folder of a user file loaded -> the modules its loading imported from that folder. Two files
# in two folders may each import a sibling of the same name (v1/acc.py and v2/acc.py, both
# `import helpers`): Python would hand the second the first one's module from sys.modules.
_FOLDER_MODULES: dict[Path, dict[str, object]] = {}


def _in_folder(module: object, folder: Path) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is not None and Path(origin).resolve().is_relative_to(folder)


def _user_line(exc: BaseException, folder: Path) -> str:
    """`` (at file:line)`` of the last frame of ``exc`` in the user's folder, or ``""``."""
    # "<frozen importlib._bootstrap>" is no file (it would resolve under the working directory).
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<")
              and Path(f.filename).resolve().is_relative_to(folder)]  # fmt: skip
    if not frames:
        return ""
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})"


def _load_file(path: Path, location: str) -> object:
    """Execute the user file ``path`` with its folder first on the path and the sibling modules
    other user folders loaded out of sys.modules, so that its own siblings are the ones found."""
    folder = path.parent
    for other, modules in _FOLDER_MODULES.items():
        if other != folder:
            for name, module in modules.items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]  # the other file keeps its own objects
    _first_on_path(str(folder))
    before = set(sys.modules)
    name = f"_wacc_user_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"cannot load {location!r} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any failure is an environment error
        del sys.modules[name]
        raise UsageError(
            f"importing {location!r} failed: {type(exc).__name__}: {exc}{_user_line(exc, folder)}"
        ) from None
    own = _FOLDER_MODULES.setdefault(folder, {})
    for loaded in set(sys.modules) - before - {name}:
        if _in_folder(sys.modules[loaded], folder):
            own[loaded] = sys.modules[loaded]
    return module


def import_target(spec: str, *, what: str = "implementation") -> object:
    """The attribute ``spec`` names, imported by the rule of the module docstring (``what`` is
    how messages call it)."""
    location, attr = check_spec(spec)
    if location.endswith(".py"):
        # the file's siblings import as they would in a script, from its own folder
        module = _load_file(Path(location).resolve(), location)
    else:
        # Like ``python -m``: a module in the working directory is importable by name.
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(location)
        except Exception as exc:  # the user's module: any failure is an environment error
            raise UsageError(
                f"cannot import module {location!r}: {type(exc).__name__}: {exc}"
            ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"{what} {spec!r}: {location!r} has no attribute {attr!r}") from None
