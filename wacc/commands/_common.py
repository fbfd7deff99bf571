"""Arguments and checks shared by the subcommands (implementation, device, oracles).

Light at import (only :mod:`wacc.choices`): the parser is built, and usage errors and path
checks answer, before torch or the reference is imported; what needs them imports them inside.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from wacc.choices import DEFAULT_IMPL, FEATURES, ORACLE_SET_NAMES
from wacc.errors import UsageError
from wacc.spec import check_spec

if TYPE_CHECKING:
    from wacc.implementation import Implementation

__all__ = ["add_impl_arguments", "check_device", "implementation_from", "oracles_from"]


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
    parser.add_argument(
        "--allow-missing",
        action="append",
        default=[],
        choices=tuple(FEATURES),
        metavar="FEATURE",
        help=f"accept an implementation without FEATURE ({', '.join(FEATURES)}); repeatable",
    )


def check_device(device: str) -> str:
    """``device``, or :class:`UsageError` when CUDA is asked for but absent."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def implementation_from(args: argparse.Namespace) -> Implementation:
    """Load ``args.impl`` (its spec and path were checked first: see :func:`check_spec`)."""
    check_spec(args.impl)
    from wacc.implementation import load_implementation

    return load_implementation(args.impl)


def oracles_from(args: argparse.Namespace) -> tuple[str, ...]:
    """The oracles ``--oracle`` selects."""
    from wacc.verdict import ORACLE_SETS

    return ORACLE_SETS[args.oracle]
