"""``python -m benchmarks``: run the suites, write ``results.csv`` and ``README.md``, print both.

Examples::

    python -m benchmarks                          # every suite on the CPU -> reports/perf/
    python -m benchmarks --suite step --repeats 40
    python -m benchmarks --quick --out /tmp/perf  # tiny sizes, no gate run (the smoke test)
    python -m benchmarks --device cuda --suite large --out "$OUT/perf"
    python -m benchmarks --readme docs/performance.md  # and the docs' targets table
    python -m benchmarks --suite shapes --suite decoder   # real layer sets, realistic tokens
    python -m benchmarks --suite shapes --shape-scale 0.25  # a quarter of the layers and rows
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.results import (
    Row,
    markdown,
    provenance,
    replace_targets_block,
    targets_table,
    write_csv,
)
from benchmarks.settings import Settings

# Suite name -> module, imported only when run: a GPU machine without the reference model's
# dependencies (gmpy2) can still run the torch suites.
SUITES = {
    "step": "benchmarks.step",
    "overhead": "benchmarks.overhead",
    "large": "benchmarks.large",
    "memory": "benchmarks.memory_suite",
    "shapes": "benchmarks.shapes",
    "decoder": "benchmarks.decoder",
    "reference": "benchmarks.reference",
}
# The reference model and the gate never run on a GPU: they run once, whatever --device says.
CPU_ONLY = {"reference"}


def _devices(choice: str) -> tuple[torch.device, ...]:
    if choice == "cpu":
        return (torch.device("cpu"),)
    if not torch.cuda.is_available():
        if choice == "cuda":
            raise SystemExit("--device cuda: no CUDA device is available")
        return (torch.device("cpu"),)
    cuda = torch.device("cuda", torch.cuda.current_device())
    return (cuda,) if choice == "cuda" else (torch.device("cpu"), cuda)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="wacc's performance benchmarks: ratios measured side by side in one run.",
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--suite",
        action="append",
        choices=list(SUITES),
        help="a suite to run (repeatable; default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats, no gate run")
    parser.add_argument(
        "--out", type=Path, default=Path("reports/perf"), help="output folder (reports/perf)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="cpu")
    parser.add_argument(
        "--readme",
        type=Path,
        default=None,
        help="also write the targets table into this file, between its perf-targets markers "
        "(the documentation's is docs/performance.md)",
    )
    parser.add_argument(
        "--shape-scale",
        type=_fraction,
        default=1.0,
        help="the shapes suite: keep this fraction of each model's layers and vocabulary rows "
        "(default 1: the whole layer sets)",
    )
    parser.add_argument(
        "--repeats", type=_positive, default=None, help="samples per mode (default: per suite)"
    )
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _suite(name: str) -> ModuleType:
    return importlib.import_module(SUITES[name])


def run_suites(
    names: Sequence[str], settings: Settings, *, log: Callable[[str], None]
) -> list[Row]:
    """Run the named suites in order and return their rows."""
    rows: list[Row] = []
    cpu_only = Settings(
        quick=settings.quick,
        devices=(torch.device("cpu"),),
        repeats=settings.repeats,
        out=settings.out,
        shape_scale=settings.shape_scale,
    )
    for name in names:
        start = time.perf_counter()
        rows += _suite(name).run(cpu_only if name in CPU_ONLY else settings)
        log(f"suite {name}: {time.perf_counter() - start:.1f} s")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = list(dict.fromkeys(args.suite or SUITES))
    devices = _devices(args.device)
    settings = Settings(
        quick=args.quick,
        devices=devices,
        repeats=args.repeats,
        out=args.out,
        shape_scale=args.shape_scale,
    )

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # Before anything is written: the commit measured, not the report's own edits.
    info = provenance(
        devices=[str(device) for device in devices],
        command=["python", "-m", "benchmarks", *(argv if argv is not None else sys.argv[1:])],
    )
    rows = run_suites(names, settings, log=log)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "results.csv")
    notes = {name: str(_suite(name).NOTES) for name in names}
    report = markdown(rows, suites=names, notes=notes, info=info)
    (args.out / "README.md").write_text(report, encoding="utf-8")
    if args.readme is not None:
        text = args.readme.read_text(encoding="utf-8")
        args.readme.write_text(replace_targets_block(text, targets_table(rows)), encoding="utf-8")
    print(report)
    unmet = [row for row in rows if row.met == "no"]
    print(f"{len(unmet)} of {sum(row.target is not None for row in rows)} targets not met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
