"""The CI numerical regression gate: the seeded corpus and the ci profile against a baseline.

Runs the report's deterministic corpus and `wacc check`'s families under the derandomized ci
profile against IMPL, and compares per work dtype x family x source with the committed
baseline (reports/baseline.json): any oracle violation is a hard failure; a metric (max ulps,
max error/bound) worse than the baseline beyond the derived headroom is a regression;
improvements are reported. The baseline changes only with --update-baseline.

Spread it over N runners: each runs `wacc gate --shard K/N --results DIR/shard-K.json` (a
deterministic slice; exit 1 on a hard failure in it), then one job runs `wacc gate --merge DIR`
for the verdict against the baseline.

examples:
  wacc gate                                         # wacc_torch vs reports/baseline.json
  wacc gate --junit-xml gate.xml --summary-md gate.md
  wacc gate --impl mypkg.acc:make --baseline my-baseline.json --update-baseline
  wacc gate --shard 2/4 --results gate-results/shard-2.json
  wacc gate --merge gate-results/

exit codes: 0 = pass, 1 = divergence or regression, 2 = usage or environment error (missing,
corrupt or foreign baseline, bad shard)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hypothesis import __version__ as hypothesis_version
from tqdm import tqdm

from wacc.commands._common import check_device
from wacc.errors import UsageError
from wacc.gate.baseline import (
    BASELINE_FORMAT,
    RESULTS_FORMAT,
    GateFile,
    read_gate_file,
    write_gate_file,
)
from wacc.gate.compare import compare
from wacc.gate.measure import (
    GATE_CORPUS,
    GATE_CORPUS_SEED,
    GATE_CORPUS_SIZE,
    Metrics,
    Shard,
    measure,
    merge_metrics,
    units,
)
from wacc.gate.outputs import table, write_junit, write_summary
from wacc.implementation import DEFAULT_IMPL, load_implementation
from wacc.report.corpus import build_corpus
from wacc.report.provenance import collect_provenance

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``wacc gate``."""
    parser.add_argument("--impl", default=DEFAULT_IMPL, metavar="IMPL", help="default: wacc_torch")
    parser.add_argument(
        "--baseline", type=Path, default=Path("reports/baseline.json"),
        help="the committed baseline (default: reports/baseline.json)",
    )  # fmt: skip
    parser.add_argument(
        "--update-baseline", action="store_true", help="write the baseline from this run"
    )
    parser.add_argument("--junit-xml", type=Path, metavar="PATH", help="write JUnit XML")
    parser.add_argument("--summary-md", type=Path, metavar="PATH", help="write a markdown summary")
    parser.add_argument(
        "--shard", default="1/1", metavar="K/N", help="run shard K of N (default 1/1)"
    )
    parser.add_argument("--results", type=Path, metavar="FILE", help="write this shard's results")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="DIR", help="merge shard results")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _merge(directories: list[Path]) -> tuple[str, dict[str, Metrics]]:
    files = sorted(path for directory in directories for path in directory.glob("*.json"))
    if not files:
        raise UsageError(f"no shard results (*.json) in {', '.join(map(str, directories))}")
    parts = [read_gate_file(path, kind=RESULTS_FORMAT) for path in files]
    identities = {part.identity() for part in parts}
    if len(identities) != 1:
        raise UsageError(
            "the shard results come from different implementations, corpora or versions"
        )
    shards = sorted(Shard.parse(part.shard) for part in parts)
    count = shards[0].count
    if [(s.index, s.count) for s in shards] != [(k, count) for k in range(1, count + 1)]:
        raise UsageError(
            f"the shard results are not shards 1..N of one split: {[p.shard for p in parts]}"
        )
    return parts[0].implementation, merge_metrics(part.entries for part in parts)


def run(args: argparse.Namespace) -> int:
    """``wacc gate``; see the module docstring."""
    started = time.perf_counter()
    check_device("cpu")
    try:
        shard = Shard.parse(args.shard)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.merge and (shard.count > 1 or args.results):
        raise UsageError("--merge combines shard results: it takes no --shard or --results")
    if args.update_baseline and shard.count > 1:
        raise UsageError("--update-baseline needs the whole run: merge the shards first (--merge)")
    if args.merge:
        implementation, metrics = _merge(args.merge)
    else:
        loaded = load_implementation(args.impl)
        implementation = args.impl
        corpus = build_corpus(size=GATE_CORPUS_SIZE, corpus_seed=GATE_CORPUS_SEED)
        mine = [u for i, u in enumerate(units(corpus)) if shard.takes(i)]
        quiet = args.quiet or not sys.stderr.isatty()
        with tqdm(total=len(mine), disable=quiet, file=sys.stderr, unit="unit") as bar:

            def progress(key: str) -> None:
                bar.update(1)
                bar.set_description(key)

            metrics = measure(loaded, shard=shard, corpus=corpus, progress=progress)
    provenance = collect_provenance(
        devices=["cpu"], corpus_seed=GATE_CORPUS_SEED, corpus_size=GATE_CORPUS_SIZE,
        scenarios=sum(m.scenarios for m in metrics.values()),
    ).__dict__  # fmt: skip
    seconds = time.perf_counter() - started
    failing = sum(m.failing for m in metrics.values())
    if shard.count > 1:
        path = (
            args.results or Path("wacc-gate-results") / f"shard-{shard.index}-of-{shard.count}.json"
        )
        write_gate_file(
            GateFile(kind=RESULTS_FORMAT, implementation=implementation, entries=metrics,
                     shard=args.shard, provenance=provenance),
            path,
        )  # fmt: skip
        print(f"wacc gate shard {args.shard}: {len(metrics)} keys, {failing} failing scenario(s); "
              f"results in {path} ({seconds:.1f} s)")  # fmt: skip
        return 1 if failing else 0
    if args.update_baseline:
        if failing:
            print(f"not updating the baseline: {failing} scenario(s) fail an oracle")
            for key, m in metrics.items():
                for finding in m.findings:
                    print(f"  {key}: {finding}")
            return 1
        write_gate_file(
            GateFile(kind=BASELINE_FORMAT, implementation=implementation, entries=metrics,
                     provenance=provenance),
            args.baseline,
        )  # fmt: skip
        print(f"baseline written: {args.baseline} ({len(metrics)} keys, {seconds:.1f} s)")
        return 0
    baseline = read_gate_file(args.baseline, kind=BASELINE_FORMAT)
    if baseline.corpus != GATE_CORPUS:
        raise UsageError(
            f"{str(args.baseline)!r} was recorded on another corpus ({baseline.corpus}): update it"
        )
    if baseline.hypothesis != hypothesis_version:
        # The gated corpus is frozen; only the check's examples (never compared) move with it.
        print(f"note: the baseline was recorded with hypothesis {baseline.hypothesis}, "
              f"this run has {hypothesis_version}")  # fmt: skip
    if baseline.implementation != implementation:
        print(
            f"note: the baseline was recorded for {baseline.implementation}; "
            f"judging {implementation}"
        )
    comparison = compare(metrics, baseline.entries)
    print(table(comparison))
    for title, items in (("FAILURE", comparison.failures), ("REGRESSION", comparison.regressions),
                         ("improvement", comparison.improvements)):  # fmt: skip
        for item in items:
            print(f"{title}: {item}")
    verdict = "passed" if comparison.passed else "FAILED"
    print(f"wacc gate {verdict}: {implementation} against {args.baseline} ({seconds:.1f} s)")
    if args.junit_xml:
        write_junit(comparison, args.junit_xml, implementation=implementation, seconds=seconds)
    if args.summary_md:
        write_summary(comparison, args.summary_md, implementation=implementation, seconds=seconds)
    return 0 if comparison.passed else 1
