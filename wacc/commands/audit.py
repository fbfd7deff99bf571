"""Audit training loops: does the gradient a real framework hands its optimizer equal the exact
full-batch gradient on unequal microbatches?

Runs each loop's real public code path (transformers.Trainer, accelerate, Lightning, Keras,
DeepSpeed, PEFT, TRL, torchtune, torchtitan, litgpt, OLMo-core, nanoGPT, the pixparse/timm loop,
plain PyTorch, wacc_torch, or your own as module:function), each in a fresh Python process, on the
same windows and compares the gradient captured right before the optimizer step with the float64
truth. Writes a table to stdout and audit.md, audit.csv and audit.png to --out; progress goes to
stderr. A framework that is not installed is a row saying so. With --repro DIR, also one standalone
script per failure (wacc.audit.repro). Exit 0 when every loop that ran passes, 1 when one fails (a
verdict FAIL, a run that raised, or two runs that differ), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from wacc.errors import UsageError

NAME = "audit"
HELP = "audit training frameworks' gradient accumulation against the exact full-batch gradient"

_BUILTIN = (
    "trainer-hub",
    "trainer-hub+wacc",
    "trainer-hub-ranktok",
    "trainer-hub-ranktok+wacc",
    "trainer-llama",
    "trainer-llama-ranktok",
    "trainer-llama-ranktok+wacc",
    "trainer-qwen2",
    "trainer-gpt_neox",
    "trainer-opt",
    "trainer-bert",
    "trainer-bert+wacc",
    "trainer-t5",
    "trainer-t5+wacc",
    "trainer-plain",
    "trainer-plain+wacc",
    "accelerate",
    "accelerate+wacc",
    "accelerate-variable",
    "accelerate-variable+wacc",
    "lightning",
    "lightning+wacc",
    "lightning-manual",
    "lightning-manual+wacc",
    "keras",
    "keras+wacc",
    "deepspeed",
    "deepspeed+wacc",
    "deepspeed-zero1",
    "deepspeed-zero1+wacc",
    "peft-lora-gpt2",
    "peft-lora-gpt2+wacc",
    "peft-lora-llama",
    "trl-sft",
    "trl-sft-fp32",
    "trl-sft-packing",
    "torchtune",
    "torchtune+wacc",
    "torchtitan",
    "litgpt",
    "litgpt+wacc",
    "litgpt-bf16-mixed",
    "litgpt-bf16-mixed+wacc",
    "olmo-core",
    "olmo-core+wacc",
    "timm",
    "pixparse",
    "pixparse+wacc",
    "nanogpt",
    "nanogpt+wacc",
    "plain",
    "wacc_torch-mean",
    "wacc_torch-sum",
    "wacc_torch-fsdp",
)
_WINDOWS = ("unequal", "equal", "zero", "longtail")
_RANK_WINDOWS = ("unequal", "equal")  # wacc.audit.windows.RANK_WINDOW_NAMES (torch-free here)
_DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``wacc audit`` arguments."""
    parser.add_argument(
        "frameworks",
        nargs="*",
        metavar="FRAMEWORK",
        help=f"built-in loops: {', '.join(_BUILTIN)}; or a user loop as module:function or "
        "path/file.py:function"
        "(see wacc.audit.protocol). Default: every built-in loop",
    )
    parser.add_argument(
        "--windows", nargs="+", choices=_WINDOWS, default=None, metavar="WINDOW",
        help=f"windows to run, of {', '.join(_WINDOWS)} (default: all; across ranks: unequal "
        "and equal, the ones with rank windows)",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="model dtype")
    parser.add_argument(
        "--out", type=Path, default=Path("wacc-audit"), metavar="DIR",
        help="directory for audit.md, audit.csv, audit.png (default: ./wacc-audit)",
    )  # fmt: skip
    parser.add_argument(
        "--repro", type=Path, metavar="DIR",
        help="also write DIR/<loop>-<window>.py per FAIL row (and <loop>-<window>-resume.py per "
        "lost mid-window resume): a standalone script (torch and the framework, no wacc) that "
        "prints the framework's gradient error against the exact float64 gradient",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--jobs", type=int, default=1, metavar="N",
        help="loops run at a time, each in its own process with the cores shared out (default: 1)",
    )  # fmt: skip
    parser.add_argument(
        "--world-size", type=_world_size, default=1, metavar="N",
        help="ranks per loop: 1 (default), or 2 or 4 real torch.distributed processes per loop "
        "(gloo), each rank on a window of its own (windows unequal and equal: rank token totals "
        "that differ, and that agree); a loop without a multi-rank path is a row saying so",
    )  # fmt: skip
    parser.add_argument(
        "--in-process", action="store_true",
        help="run every loop in this process (default: each in a fresh Python process, since "
        "frameworks leave global state behind; in-process is faster, for debugging a loop)",
    )  # fmt: skip


def _world_size(text: str) -> int:
    """``--world-size``: 1, 2 or 4 (argparse turns the ValueError into a usage error, exit 2)."""
    if text not in ("1", "2", "4"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be 1, 2 or 4")
    return int(text)


def _progress(quiet: bool) -> Callable[[int], Callable[[], None]]:
    from tqdm import tqdm

    def start(total: int) -> Callable[[], None]:
        bar = tqdm(total=total, desc="wacc audit", unit="run", file=sys.stderr,
                   disable=quiet or not sys.stderr.isatty(), leave=False)  # fmt: skip

        def tick() -> None:
            bar.update(1)
            if bar.n >= total:
                bar.close()

        return tick

    return start


def run(args: argparse.Namespace) -> int:
    """Run the audit; see the module docstring for the exit codes."""
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: must be at least 1")
    if args.jobs > 1 and args.in_process:
        raise UsageError(f"--jobs {args.jobs} runs loops in processes of their own: not with "
                         "--in-process")  # fmt: skip
    if args.world_size > 1 and args.in_process:
        raise UsageError(f"--world-size {args.world_size} runs every rank in a process of its own: "
                         "not with --in-process")  # fmt: skip
    windows_asked = list(dict.fromkeys(args.windows or _WINDOWS))
    if args.world_size > 1:
        windows_asked = list(dict.fromkeys(args.windows or _RANK_WINDOWS))
        others = [w for w in windows_asked if w not in _RANK_WINDOWS]
        if others:
            raise UsageError(f"--windows {' '.join(others)}: not across ranks; --world-size "
                             f"{args.world_size} has {', '.join(_RANK_WINDOWS)}")  # fmt: skip
    directories = [("--out", args.out)] + ([("--repro", args.repro)] if args.repro else [])
    for option, directory in directories:
        if directory.exists() and not directory.is_dir():
            raise UsageError(f"{option} {directory}: exists and is not a directory")
    # Imported here: torch and the frameworks are slow to import and only this command needs them.
    from wacc.audit.adapters import ADAPTERS
    from wacc.audit.protocol import Adapter, user_adapter

    adapters: list[Adapter] = []
    for name in args.frameworks or list(ADAPTERS):
        if name in ADAPTERS:
            adapters.append(ADAPTERS[name])
        elif ":" in name:
            try:
                adapters.append(user_adapter(name))
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        else:
            raise UsageError(
                f"unknown framework {name!r}; built-in: {', '.join(ADAPTERS)}, or module:function"
            )
    for option, directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"{option} {directory}: {exc.strerror}") from None

    from wacc.audit.plot import plot_errors
    from wacc.audit.provenance import collect_provenance
    from wacc.audit.report import render_table, write_csv, write_markdown
    from wacc.audit.runner import run_audit
    from wacc.audit.windows import build_window

    # Their per-run chatter would bury the table (transformers reads its documented variable
    # when it is first imported, which has not happened yet).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    windows = [build_window(w) for w in windows_asked]
    provenance = collect_provenance()
    started = time.perf_counter()
    result = run_audit(
        adapters, windows, dtype=args.dtype, progress=_progress(args.quiet),
        isolate=not args.in_process, jobs=args.jobs, world_size=args.world_size,
    )  # fmt: skip
    print(render_table(result))
    provenance = replace(provenance, wall_seconds=time.perf_counter() - started)
    write_markdown(result, args.out / "audit.md", provenance)
    write_csv(result, args.out / "audit.csv", provenance)
    plot_errors(result, args.out / "audit.png")
    print(f"\nwrote {args.out / 'audit.md'}, audit.csv, audit.png", file=sys.stderr)
    if args.repro:
        from wacc.audit.repro import write_reproducers

        written, notes = write_reproducers(result, args.repro)
        for note in notes:
            print(f"no reproducer: {note}", file=sys.stderr)
        plural = "" if len(written) == 1 else "s"
        print(f"wrote {len(written)} reproducer{plural} to {args.repro}", file=sys.stderr)
    failed = [
        c for c in result.cells
        if c.status.startswith("error") or c.verdict == "FAIL" or c.deterministic is False
    ]  # fmt: skip
    return 1 if failed else 0
