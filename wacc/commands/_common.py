"""Arguments and checks shared by the subcommands (implementation, device, oracles).

Light at import (only :mod:`wacc.choices`): the parser is built, and usage errors and path
checks answer, before torch or the reference is imported; what needs them imports them inside.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from wacc.choices import DEFAULT_IMPL, FEATURES, ORACLE_SET_NAMES
from wacc.errors import UsageError
from wacc.judge.contract import feature
from wacc.spec import check_module

if TYPE_CHECKING:
    from wacc.judge.implementation import Implementation
    from wacc.judge.verdict import ScenarioVerdict

__all__ = [
    "FLOAT_TEXT",
    "TABLE_BREAKERS",
    "add_allow_missing",
    "add_impl_arguments",
    "check_device",
    "check_out_file",
    "check_out_folder",
    "implementation_from",
    "hypothesis_home",
    "oracles_from",
    "raised_line",
    "read_bounded",
]


# A float as wacc writes it (``repr``): ASCII only, since ``float()`` also takes other scripts'
# digits ('١٢'), spaces and underscores ('1_0').
FLOAT_TEXT = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|-?inf|nan")
# What ends or breaks a cell of a markdown table: a name with one would break the report's.
TABLE_BREAKERS = re.compile(r"[|\n\r\v\f\x1c-\x1e\x85\u2028\u2029]")


def add_impl_arguments(parser: argparse.ArgumentParser, *, positional: bool) -> None:
    """IMPL (positional or ``--impl``), ``--device``, ``--oracle``, ``--allow-missing``."""
    help_impl = (
        "the implementation under test: a factory make(dtype, loss_scale) as module:attr or "
        f"path/to/file.py:attr (default: {DEFAULT_IMPL}, i.e. wacc_torch)"
    )
    if positional:
        parser.add_argument("impl", nargs="?", default=DEFAULT_IMPL, metavar="IMPL", help=help_impl)
    else:
        parser.add_argument("--impl", default=DEFAULT_IMPL, metavar="IMPL", help=help_impl)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default: cpu")
    parser.add_argument(
        "--oracle",
        default="strict",
        choices=tuple(ORACLE_SET_NAMES),
        help="; ".join(f"{name}: {what}" for name, what in ORACLE_SET_NAMES.items())
        + " (default: strict)",
    )
    add_allow_missing(parser)


def add_allow_missing(parser: argparse.ArgumentParser, *, what: str = "an implementation") -> None:
    """``--allow-missing FEATURE``, the same in every command (wacc.judge.contract: a missing core
    feature fails unless allowed; a missing extension fails nothing, without the flag)."""
    core = [name for name in FEATURES if feature(name).core]
    parser.add_argument(
        "--allow-missing",
        action="append",
        default=[],
        choices=tuple(FEATURES),
        metavar="FEATURE",
        help=f"accept {what} without the core FEATURE ({', '.join(core)}); repeatable. A "
        "missing core feature fails (exit 1) unless allowed; a missing extension feature "
        f"({', '.join(n for n in FEATURES if n not in core)}) fails nothing and is reported "
        "as not judged",
    )


def check_device(device: str) -> str:
    """``device``, or :class:`UsageError` when CUDA is asked for but absent."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def _no_file_on_the_way(option: str, path: Path) -> None:
    """:class:`UsageError` when the nearest existing folder of ``path`` (itself excluded) is a
    file: ``path`` can then never be created (a NotADirectoryError after the whole run)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option} {str(path)!r}: {str(parent)!r} is a file, not a folder")
            return


def check_out_folder(option: str, path: Path) -> None:
    """:class:`UsageError` when the folder ``option`` names can never be made or written: it is
    a file, or a file is on its way. Checked before anything runs, not when the first file is
    written (seconds or minutes later, with a traceback)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {str(path)!r} exists and is not a folder")
    _no_file_on_the_way(option, path)


def check_out_file(option: str, path: Path) -> None:
    """:class:`UsageError` when the file ``option`` names can never be written: it is a folder,
    or a file is on the way to it (checked before the run, as :func:`check_out_folder`)."""
    if path.is_dir():
        raise UsageError(f"{option}: {str(path)!r} is a directory, not a file to write")
    _no_file_on_the_way(option, path)


def implementation_from(args: argparse.Namespace) -> Implementation:
    """Load ``args.impl`` (its spec and path were checked first: see :func:`check_spec`)."""
    check_module(args.impl)  # a module that does not exist answers before torch is imported
    from wacc.judge.implementation import load_implementation

    return load_implementation(args.impl)


@contextlib.contextmanager
def hypothesis_home() -> Iterator[None]:
    """Hypothesis' storage (its example database's default home, and the cache of constants it
    collects from the source) in a temporary folder for the command's run, removed after it, not
    ``.hypothesis/`` in the user's working directory; ``$HYPOTHESIS_STORAGE_DIRECTORY`` names
    one to keep instead."""
    from hypothesis.configuration import set_hypothesis_home_dir

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="wacc-hypothesis-") as home:
        set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)


def oracles_from(args: argparse.Namespace) -> tuple[str, ...]:
    """The oracles ``--oracle`` selects."""
    from wacc.judge.verdict import ORACLE_SETS

    return ORACLE_SETS[args.oracle]


def raised_line(verdict: ScenarioVerdict, index: int, message: str) -> str:
    """``step N raised <message>``, marked when the reference raises the same error class there
    (the implementation was right to raise: the line is context, not a finding)."""
    step = next((s for s in verdict.steps if s.index == index), None)
    expected = step is not None and step.expected_error is not None
    if expected and step is not None and step.expected_error == step.actual_error:
        return f"step {index} raised {message} (expected: the reference raises it too)"
    return f"step {index} raised {message}"


def read_bounded(path: Path, limit: int, *, what: str) -> bytes:
    """The bytes of ``path``, read through one ``open`` and at most ``limit + 1`` bytes of it
    (a regular file, a FIFO, ``/dev/zero``: a size from ``stat()`` says nothing about the last
    two), or :class:`UsageError` naming the file: more than ``limit`` bytes, or not readable.
    ``what`` names what the file should be ("a scenario file")."""
    name = str(path)
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {name!r}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UsageError(f"{name!r} has more than {limit} bytes; {what} has at most {limit}")
    return data
