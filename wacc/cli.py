"""The ``wacc`` command: one argparse subcommand per module of :mod:`wacc.commands`.

Exit codes, the same for every subcommand: 0 = everything it checked holds; 1 = a divergence
(or, for the gate, a regression) was found; 2 = usage or environment error, answered with one
line on stderr and never a traceback; 3 = an internal error (a bug in wacc: the traceback, then
one line saying so), never confused with a finding. Each command module defines ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; the modules import only :mod:`wacc.choices`
at the top and the judge (torch, the reference) when they run, so ``--help``, a usage error or a
path check answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence

from wacc import __version__
from wacc.errors import UsageError

__all__ = ["COMMANDS", "INTERNAL_ERROR", "build_parser", "main"]

INTERNAL_ERROR = 3  # an exception wacc did not expect (pytest's code for its own internal error)

# subcommand -> (module, one-line help). Order is the order ``wacc --help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("wacc.commands.check", "judge an implementation on generated scenarios"),
    "replay": ("wacc.commands.replay", "replay one scenario file step by step"),
    "report": ("wacc.commands.report", "the dtype error report: corpus, tables, plots"),
    "gate": ("wacc.commands.gate", "the CI numerical regression gate against a baseline"),
    "audit": ("wacc.commands.audit", "audit training loops against the exact full-batch gradient"),
}


# Every character str.splitlines() breaks at, mapped to its escape.
_LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints the whole usage block; one line is the contract (exit 2 all the same).
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, every subcommand's arguments included."""
    parser = _Parser(
        prog="wacc",
        description="Judge gradient accumulators against the exact reference of wacc_ref.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 = all checks hold, 1 = divergence, 2 = usage or environment error, "
        "3 = internal error (a bug in wacc)",
    )
    parser.add_argument("--version", action="version", version=f"wacc {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``wacc`` with ``argv`` (default: ``sys.argv[1:]``) and return its exit code."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args._module.run(args))
    except UsageError as exc:
        # One line is the contract: a line break inside a message (a file name or an argument
        # with one) is shown escaped rather than starting a second line.
        print(f"wacc: error: {str(exc).translate(_LINE_BREAKS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wacc: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in wacc itself: not 1, which would read as a divergence
        traceback.print_exc()
        print(
            f"wacc: internal error: {type(exc).__name__}: {str(exc).translate(_LINE_BREAKS)} "
            "(a bug in wacc, not a finding; please report it with the traceback above)",
            file=sys.stderr,
        )
        return INTERNAL_ERROR
