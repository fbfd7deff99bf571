"""The CI numerical regression gate: the seeded corpus and the ci profile against a baseline.

Runs the report's deterministic corpus and `wacc check`'s families under the derandomized ci
profile against IMPL, and compares per work dtype x family x source with the committed
baseline (reports/baseline.json): any oracle violation is a hard failure; a metric (max ulps,
max error/bound) worse than the baseline beyond the derived headroom is a regression;
improvements are reported. The baseline changes only with --update-baseline.

Spread it over N runners: each runs `wacc gate --shard K/N --results DIR/shard-K.json` (a
deterministic slice; exit 1 on a hard failure in it), then one job runs `wacc gate --merge DIR`
for the verdict against the baseline. N may be 1: --results makes any run a shard.

A failure is acted on: every failing scenario is written under --out (default ./wacc-gate) as
a replay file, failures are grouped by signature (one bug in many scenarios, keys and dtypes is
one group, with counts) and each group prints one `wacc replay` command. The baseline records
the IMPL it was made for; judging another one is refused unless --allow-other-impl.

examples:
  wacc gate                                         # wacc_torch vs reports/baseline.json
  wacc gate --junit-xml gate.xml --summary-md gate.md
  wacc gate --impl mypkg.acc:make --baseline my-baseline.json --update-baseline
  wacc gate --impl mypkg.acc:make --baseline my-baseline.json --out gate-failures/
  wacc gate --shard 2/4 --results gate-results/shard-2.json
  wacc gate --merge gate-results/

Features (wacc.judge.contract, as in `wacc check`): an IMPL without a core feature (records,
async_records, checksum) fails before the run unless --allow-missing FEATURE names it; one
without an extension feature (found_inf, set_loss_scale, loss_scaler: dynamic loss scaling)
fails nothing, and the keys that need it are not run (rows "not judged" in the table, gate.md
and the JUnit XML, with why). The baseline records the features it was made with: a feature the
IMPL has lost since is a regression.

exit codes: 0 = pass, 1 = divergence, regression (a lost feature included) or a missing core
feature not allowed, 2 = usage or environment error (missing, corrupt or foreign baseline, a
baseline of another IMPL, bad shard)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from wacc.choices import DEFAULT_IMPL
from wacc.commands._common import (
    add_allow_missing,
    check_device,
    check_out_file,
    check_out_folder,
    hypothesis_home,
)
from wacc.errors import UsageError
from wacc.gate.shards import Shard
from wacc.spec import check_module, check_spec

if TYPE_CHECKING:  # the judge is imported when the command runs (a fast --help)
    from collections.abc import Sequence

    from wacc.gate.compare import Comparison
    from wacc.gate.groups import FailureGroup
    from wacc.gate.metrics import Metrics

__all__ = ["add_arguments", "run"]

# Where a shard run without --results writes its results: a folder of the working directory.
_DEFAULT_RESULTS = Path("wacc-gate-results")
_DEFAULT_NOTE = f" (no --results: the default, ./{_DEFAULT_RESULTS}/ in the working directory)"


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
    parser.add_argument("--results", type=Path, metavar="FILE", help="write this shard's results "
                        "for --merge (1/1 included: the verdict is then --merge's); a --shard "
                        f"K/N run without it writes ./{_DEFAULT_RESULTS}/shard-K-of-N.json in the "
                        "working directory")  # fmt: skip
    parser.add_argument("--merge", type=Path, nargs="+", metavar="DIR", help="merge shard results")
    add_allow_missing(parser, what="an IMPL")
    parser.add_argument(
        "--out", type=Path, default=Path("wacc-gate"), metavar="DIR",
        help="where every failing scenario is written as a replay file (default: ./wacc-gate; "
        "created only when something fails; a run first removes the replay files an earlier run "
        "of the same shard left there)",
    )  # fmt: skip
    parser.add_argument(
        "--allow-other-impl", action="store_true",
        help="judge IMPL against a baseline recorded for another implementation (refused "
        "otherwise: exit 2)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def implementation_identity(spec: str, baseline: Path) -> str:
    """How a baseline names an IMPL: a file spec by the file's path relative to the baseline's
    folder (so ``acc.py:make``, ``./acc.py:make`` and ``../acc.py:make`` from a subfolder are
    one implementation, and a committed baseline keeps naming it on another machine); a module
    spec as written."""
    location, _, attr = spec.rpartition(":")
    if not location.endswith(".py"):  # a module spec, or a name a results file holds
        return spec
    relative = os.path.relpath(Path(location).resolve(), baseline.resolve().parent)
    return f"{Path(relative).as_posix()}:{attr}"


def _check_implementation(recorded: str, judged: str, baseline: Path, *, allowed: bool) -> None:
    """A baseline made for one IMPL is not silently used for another (a baseline of wacc 0.2
    before identities were recorded names the spec as typed: that is accepted too)."""
    identity = implementation_identity(judged, baseline)
    if recorded in (identity, judged):
        return
    if not allowed:
        raise UsageError(
            f"{str(baseline)!r}: implementation: recorded for {recorded!r}, this run judges "
            f"{identity!r} (record a baseline for it with --update-baseline, or pass "
            "--allow-other-impl)"
        )
    print(
        f"note: the baseline was recorded for {recorded}; judging {identity} (--allow-other-impl)"
    )


def _clear_replays(out: Path, shard: Shard) -> None:
    """Remove the replay files an earlier run of this shard left in ``out`` (``gate-NNNNN-*``
    with a position this shard runs), so that the folder holds this run's failures only;
    another shard's files, writing into the same folder, are left alone."""
    for path in out.glob("gate-*.json") if out.is_dir() else ():
        position = path.name.split("-", 2)[1]
        if position.isdigit() and shard.takes(int(position)):
            path.unlink(missing_ok=True)


def _merge(directories: list[Path]) -> tuple[str, dict[str, Metrics], tuple[str, ...]]:
    from wacc.gate.baseline import RESULTS_FORMAT, read_gate_file
    from wacc.gate.measure import GATE_CORPUS, merge_metrics
    from wacc_ref.strict_json import shown

    files = sorted(path for directory in directories for path in directory.glob("*.json"))
    if not files:
        shown_dirs = ", ".join(repr(str(d)) for d in directories)
        raise UsageError(f"no shard results (*.json) in {shown_dirs}")
    parts = [read_gate_file(path, kind=RESULTS_FORMAT) for path in files]
    first, first_file = parts[0], str(files[0])
    # Each problem names the file and the field, like the reader's own messages.
    for path, part in zip(files, parts, strict=True):
        where = repr(str(path))
        if part.corpus != GATE_CORPUS:
            raise UsageError(
                f"{where}: corpus: recorded on {shown(part.corpus)}, the gate runs {GATE_CORPUS}"
            )
        for name in ("implementation", "hypothesis", "features"):
            if getattr(part, name) != getattr(first, name):
                raise UsageError(
                    f"{where}: {name}: {shown(getattr(part, name))} differs from "
                    f"{shown(getattr(first, name))} in {first_file!r}: shards of one run only"
                )
    seen: dict[Shard, Path] = {}
    for path, part in zip(files, parts, strict=True):
        shard = Shard.parse(part.shard)  # validated by read_gate_file
        if shard.count != Shard.parse(first.shard).count:
            raise UsageError(
                f"{str(path)!r}: shard: {part.shard} is not of the split of {first.shard} in "
                f"{first_file!r}"
            )
        if shard in seen:
            raise UsageError(f"{str(path)!r}: shard: {part.shard} is also in {str(seen[shard])!r}")
        seen[shard] = path
    count = Shard.parse(first.shard).count
    missing: list[str] = []
    index = 1
    while index <= count and len(missing) < 6:  # N may be huge: stop at the first few missing
        if Shard(index, count) not in seen:
            missing.append(str(Shard(index, count)))
        index += 1
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise UsageError(
            f"{first_file!r}: shard: {first.shard} is one of {count} shards, and no results file "
            f"holds shard {', '.join(missing[:5])}{more}"
        )
    return first.implementation, merge_metrics(part.entries for part in parts), first.features


def _write_outputs(
    args: argparse.Namespace,
    comparison: Comparison,
    *,
    implementation: str,
    seconds: float,
    groups: Sequence[FailureGroup],
    artifacts: list[str],
    not_judged: list[str],
) -> None:
    """Write the JUnit XML and the summary that ``args`` asks for (an unwritable path: exit 2)."""
    from wacc.gate.outputs import write_junit, write_summary

    for option, path, write in (
        ("--junit-xml", args.junit_xml,
         lambda path: write_junit(comparison, path, implementation=implementation,
                                  not_judged=not_judged)),
        ("--summary-md", args.summary_md,
         lambda path: write_summary(comparison, path, implementation=implementation,
                                    seconds=seconds, groups=groups, artifacts=artifacts,
                                    not_judged=not_judged)),
    ):  # fmt: skip
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            raise UsageError(f"{option}: cannot write {str(path)!r}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """``wacc gate``; see the module docstring."""
    started = time.perf_counter()
    check_device("cpu")
    if not args.merge:
        check_spec(args.impl)  # a typo answers before the judge is imported
    # Every argument is checked before the judge is imported (seconds): a typo answers at once.
    try:
        shard = Shard.parse(args.shard)
    except ValueError as exc:
        raise UsageError(f"--shard: {exc}") from None
    for option, path in (("--junit-xml", args.junit_xml), ("--summary-md", args.summary_md)):
        # Found now, not after the whole run: an output that can never be written.
        if path is not None:
            check_out_file(option, path)
    check_out_folder("--out", args.out)
    for folder in args.merge or ():
        if not folder.is_dir():
            raise UsageError(f"--merge: {str(folder)!r} is not a folder of shard results")
    if args.merge and (shard.count > 1 or args.results):
        raise UsageError("--merge combines shard results: it takes no --shard or --results")
    # --results makes a run one shard of a matrix, 1/1 included (a one-runner matrix): it writes
    # its results for --merge, which gives the verdict.
    sharded = shard.count > 1 or args.results is not None
    # A shard without --results writes into the working directory (said in --help and docs).
    results = args.results or _DEFAULT_RESULTS / f"shard-{shard.index}-of-{shard.count}.json"
    if sharded:
        check_out_file("--results", results)
    if args.update_baseline and sharded:
        raise UsageError("--update-baseline needs the whole run: merge the shards first (--merge)")
    if args.update_baseline and (args.junit_xml or args.summary_md):
        # Both report a comparison with the baseline, and an update compares with nothing: a
        # JUnit file that always passes would read as a gate that ran. Refused before the run.
        raise UsageError(
            "--junit-xml and --summary-md report the verdict against the baseline; "
            "--update-baseline writes the baseline and judges nothing: run the gate after it"
        )
    if sharded and (args.junit_xml or args.summary_md):
        raise UsageError(
            "--junit-xml and --summary-md are written by the verdict: by --merge of the shards' "
            "results (or a run of the whole gate), not by one shard"
        )
    # The baseline is read and judged (and the IMPL's module found) before the judge and torch
    # are imported: a missing, corrupt or foreign baseline answers in well under a second.
    from importlib import metadata

    from wacc.gate.baseline import (
        BASELINE_FORMAT,
        RESULTS_FORMAT,
        VERSION,
        GateFile,
        read_gate_file,
        write_gate_file,
    )
    from wacc.gate.metrics import GATE_CORPUS, GATE_CORPUS_SEED, GATE_CORPUS_SIZE
    from wacc_ref.strict_json import shown

    if not args.merge:
        check_module(args.impl)
    baseline = None
    if not args.update_baseline and not sharded:
        # Read (and check) the baseline first: a missing or corrupt one answers in a second,
        # not after the whole corpus has run.
        baseline = read_gate_file(args.baseline, kind=BASELINE_FORMAT)
        if baseline.corpus != GATE_CORPUS:
            raise UsageError(
                f"{str(args.baseline)!r}: corpus: recorded on {shown(baseline.corpus)}, the gate "
                f"runs {GATE_CORPUS}: update the baseline"
            )
        if not args.merge:  # a merge learns its IMPL from the shards' results
            _check_implementation(baseline.implementation, args.impl, args.baseline,
                                  allowed=args.allow_other_impl)  # fmt: skip
    from tqdm import tqdm

    from wacc.gate.compare import compare
    from wacc.gate.groups import group_findings
    from wacc.gate.measure import measure, units
    from wacc.gate.outputs import failure_lines, table
    from wacc.judge.contract import Coverage, features_missing, not_judged_line
    from wacc.judge.implementation import load_implementation
    from wacc.report.corpus import build_corpus
    from wacc.report.provenance import collect_provenance

    if args.merge:
        implementation, metrics, present = _merge(args.merge)
        # The shards ran with their features allowed: every missing one is not judged here.
        missing = features_missing(present)
        reasons = [(name, not_judged_line(name)) for name in missing]
        if baseline is not None:
            _check_implementation(baseline.implementation, implementation, args.baseline,
                                  allowed=args.allow_other_impl)  # fmt: skip
    else:
        loaded = load_implementation(args.impl)
        implementation = args.impl
        coverage = loaded.coverage(args.allow_missing)
        reasons = [(name, loaded.not_judged(name)) for name in coverage.not_judged]
        if coverage.unsupported:  # the same verdict as `wacc check`'s, before minutes of running
            for line in loaded.coverage_lines(args.allow_missing):
                print(line)
            # Every output asked for is still written (a CI that reads the JUnit XML shows why).
            stopped = compare({}, {}, features_not_judged=reasons)
            stopped.unsupported = [loaded.unsupported(name) for name in coverage.unsupported]
            _write_outputs(args, stopped, implementation=args.impl,
                           seconds=time.perf_counter() - started, groups=[], artifacts=[],
                           not_judged=[line for _, line in reasons])  # fmt: skip
            return 1
        present, missing = coverage.present, loaded.missing
        corpus = build_corpus(size=GATE_CORPUS_SIZE, corpus_seed=GATE_CORPUS_SEED)
        mine = [u for i, u in enumerate(units(corpus)) if shard.takes(i)]
        quiet = args.quiet or not sys.stderr.isatty()
        with tqdm(total=len(mine), disable=quiet, file=sys.stderr, unit="unit") as bar:

            def progress(key: str) -> None:
                bar.update(1)
                bar.set_description(key)

            _clear_replays(args.out, shard)
            with hypothesis_home():  # its cache of constants: not .hypothesis/ in the user's cwd
                metrics = measure(
                    loaded, shard=shard, corpus=corpus, out=args.out, progress=progress
                )
    not_judged = [line for _, line in reasons]
    seconds = time.perf_counter() - started
    provenance = collect_provenance(
        devices=["cpu"], corpus_seed=GATE_CORPUS_SEED, corpus_size=GATE_CORPUS_SIZE,
        scenarios=sum(m.scenarios for m in metrics.values()),
    ).__dict__  # fmt: skip
    # The time spent judging: this run's, or for a merge the shards' measured times together.
    provenance["wall_seconds"] = (
        sum(m.milliseconds for m in metrics.values()) / 1000 if args.merge else seconds
    )
    failing = sum(m.failing for m in metrics.values())
    groups = group_findings(metrics)
    if sharded:
        write_gate_file(
            GateFile(kind=RESULTS_FORMAT, implementation=implementation, entries=metrics,
                     shard=str(shard), provenance=provenance, features=present),
            results,
        )  # fmt: skip
        for line in failure_lines(groups, implementation=implementation) + not_judged:
            print(line)
        print(f"wacc gate shard {shard}: {len(metrics)} keys, {failing} failing scenario(s); "
              f"results in {results}{_DEFAULT_NOTE if args.results is None else ''} "
              f"({seconds:.1f} s)")  # fmt: skip
        return 1 if failing else 0
    if args.update_baseline:
        if failing:
            for line in failure_lines(groups, implementation=implementation):
                print(line)
            print(f"not updating the baseline: {failing} scenario(s) fail an oracle")
            return 1
        write_gate_file(
            GateFile(kind=BASELINE_FORMAT, entries=metrics,
                     implementation=implementation_identity(implementation, args.baseline),
                     provenance=provenance, features=present),
            args.baseline,
        )  # fmt: skip
        for line in not_judged:
            print(line)
        print(f"baseline written: {args.baseline} ({len(metrics)} keys, {seconds:.1f} s)")
        return 0
    assert baseline is not None  # read above: not an update, not a shard
    hypothesis_version = metadata.version("hypothesis")
    if baseline.hypothesis != hypothesis_version:
        # The gated corpus is frozen; only the check's examples (never compared) move with it.
        print(f"note: the baseline was recorded with hypothesis {baseline.hypothesis}, "
              f"this run has {hypothesis_version}")  # fmt: skip
    if baseline.version < VERSION:
        print(f"note: {args.baseline} records no features (format version {baseline.version}): "
              f"read as made with {', '.join(baseline.features) or 'none of them'} (what its "
              "passing keys show); --update-baseline records them all")  # fmt: skip
    # Keys this run could not judge (a missing feature), and keys the baseline could not have.
    skipped = set(Coverage(missing=missing).skipped_families)
    unknown = set(Coverage(missing=features_missing(baseline.features)).skipped_families)
    lost = [
        f"lost feature since the baseline: {name}: {args.baseline} was made with it, "
        f"{implementation} lacks it ({not_judged_line(name)})"
        for name in baseline.features
        if name in missing
    ]
    try:
        comparison = compare(
            metrics, baseline.entries,
            not_judged={key for key in baseline.entries if key.split("/")[1] in skipped},
            new={key for key in metrics if key.split("/")[1] in unknown},
            lost=lost, features_not_judged=reasons,
        )  # fmt: skip
    except UsageError as exc:
        raise UsageError(f"{str(args.baseline)!r}: {exc}") from None
    print(table(comparison))
    for line in not_judged:
        print(line)
    for line in comparison.lost:
        print(f"REGRESSION: {line}")
    for line in failure_lines(groups, implementation=implementation):
        print(line)
    # A key that fails a scenario is already a FAILURE above: its metrics' regressions are
    # counted, not listed (they restate the same bug once per metric).
    failing_keys = {key for key, m in metrics.items() if m.failing}
    regressions = [r for r in comparison.regressions if r.split(":", 1)[0] not in failing_keys]
    for item in regressions:
        print(f"REGRESSION: {item}")
    if len(regressions) < len(comparison.regressions):
        print(f"({len(comparison.regressions) - len(regressions)} regression(s) of keys that "
              "fail already: in the table and the JUnit XML)")  # fmt: skip
    for item in comparison.improvements:
        print(f"improvement: {item}")
    verdict = "passed" if comparison.passed else "FAILED"
    print(f"wacc gate {verdict}: {implementation} against {args.baseline} ({seconds:.1f} s)")
    artifacts = []
    replays = sum(len(group.replays) for group in groups)
    if replays:
        folders = sorted({str(Path(r).parent) for group in groups for r in group.replays})
        artifacts.append(f"{replays} replay file(s) in {', '.join(folders)}")
    if args.junit_xml is not None:
        artifacts.append(f"JUnit XML {args.junit_xml} (every key)")
    _write_outputs(args, comparison, implementation=implementation, seconds=seconds,
                   groups=groups, artifacts=artifacts, not_judged=not_judged)  # fmt: skip
    return 0 if comparison.passed else 1
