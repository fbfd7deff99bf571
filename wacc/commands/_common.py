"""Arguments and checks shared by the subcommands (implementation, device, oracles)."""

from __future__ import annotations

import argparse

import torch

from wacc.errors import UsageError
from wacc.implementation import DEFAULT_IMPL, FEATURES, Implementation, load_implementation
from wacc.verdict import ORACLE_SETS

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
        choices=tuple(ORACLE_SETS),
        help="strict: oracles 1-3 (bit-exact emulation, error bound, semantics); bound: 2 and 3 "
        "only, for implementations that do not claim the reproducible order (default: strict)",
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
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but torch sees no CUDA device")
    return device


def implementation_from(args: argparse.Namespace) -> Implementation:
    """Load ``args.impl``."""
    return load_implementation(args.impl)


def oracles_from(args: argparse.Namespace) -> tuple[str, ...]:
    """The oracles ``--oracle`` selects."""
    return ORACLE_SETS[args.oracle]
