"""Run generated scenarios and the stateful machine against IMPL; judge them with the oracles.

Every strategy family (windows of unequal microbatches with zero weights and overflow-prone
loss scales, invalid weights, checkpoint interruptions with corrupted restores, NaN/inf
gradients, dynamic loss scaling, malformed gradients that semantics §5 refuses or accepts) and
the stateful machine run on each work dtype; every
scenario is compared with the reference step by step. A divergence is shrunk, written as JSON
under --out, and a one-line `wacc replay` command is printed (divergences with the same
signature in several dtypes or families are one block, naming each); an exception the implementation
raised is printed with its text and the implementation's own file and line (--traceback: the
whole traceback).

Features (wacc.judge.contract). The core, the seed API (each missing one fails unless
--allow-missing names it): records (state_dict and load_state_dict), async_records
(state_dict_async), checksum (records that refuse a changed value: a probe flips bytes of a probe
record; without it the corruptions only an integrity check can refuse are not judged, in either
record layout). The dynamic loss scaling extension (each missing one fails nothing: "not judged:
FEATURE (...)"):
found_inf (a bool on every finished result), set_loss_scale and loss_scaler (the factory's
attribute loss_scaler(dtype, init_scale, **options): a window loss scaler; without both, the
dynamic_scaling family is not run).

examples:
  wacc check                                   # wacc_torch, all four work dtypes, ci profile
  wacc check mypkg.acc:make --dtype bfloat16   # your accumulator, one dtype
  wacc check path/to/my_acc.py:make --oracle bound --allow-missing async_records
  wacc check wacc.baselines:pixparse_loop --out divergences/

exit codes: 0 = every oracle holds, 1 = a divergence (or a missing core feature that was not
allowed), 2 = usage or environment error
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from wacc.choices import FAMILY_NAMES, PROFILES, WORK_DTYPES
from wacc.commands._common import (
    add_impl_arguments,
    check_device,
    check_out_folder,
    hypothesis_home,
    implementation_from,
    oracles_from,
    raised_line,
)
from wacc.errors import UsageError

if TYPE_CHECKING:  # the judge is imported when the command runs (a fast --help, wacc.choices)
    from wacc.judge.engine import CheckConfig, CheckReport, Finding
    from wacc.judge.implementation import Implementation

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``wacc check``."""
    add_impl_arguments(parser, positional=True)
    parser.add_argument(
        "--dtype",
        action="append",
        choices=WORK_DTYPES,
        metavar="D",
        help=f"work dtype to check ({', '.join(WORK_DTYPES)}); repeatable (default: all)",
    )
    parser.add_argument(
        "--profile", default="ci", choices=PROFILES, help="Hypothesis profile (default: ci)"
    )
    parser.add_argument("--seed", type=int, help="Hypothesis seed: the same seed, the same run")
    parser.add_argument(
        "--family",
        action="append",
        choices=FAMILY_NAMES,
        help="strategy family to run; repeatable (default: all, and the stateful machine)",
    )
    parser.add_argument(
        "--examples", type=int, help="examples per dtype and family (default: the profile's)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("wacc-check"),
        help="where shrunk divergences go (default: ./wacc-check); a file already there is "
        "never overwritten: a divergence takes the next free number",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "-x", "--exitfirst", action="store_true",
        help="stop at the first family that finds a divergence (its shrunk scenario is still "
        "written and printed)",
    )  # fmt: skip
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="print the whole traceback of an exception the implementation raised (the "
        "exception's text and its file and line are printed in any case)",
    )


def _print_report(
    report: CheckReport, implementation: Implementation, allowed: tuple[str, ...]
) -> None:
    import wacc_torch
    from wacc.tables import format_metric, render_table

    rows = [
        [
            dtype,
            str(summary.scenarios),
            str(summary.failed),
            format_metric(summary.max_ulps),
            format_metric(summary.max_rel_error),
            format_metric(summary.max_ratio),
        ]
        for dtype, summary in report.summaries.items()
    ]
    denormals = "flushed (FTZ/DAZ on)" if wacc_torch.denormals_flushed() else "preserved"
    print(
        f"wacc check {implementation.spec}: oracles {', '.join(report.oracles)}; "
        f"denormals {denormals}; {report.seconds:.1f} s"
    )
    print(
        render_table(
            ["dtype", "scenarios", "failed", "max ulps", "max rel err (normal)", "max err/bound"],
            rows,
        )
    )
    for line in implementation.coverage_lines(allowed):
        print(line)


def _judged_lines(
    implementation: Implementation, config: CheckConfig, counts: dict[str, int],
    allowed: tuple[str, ...],
) -> list[str]:  # fmt: skip
    """The closing "what was judged" block: what a pass (or a failure) is a statement about."""
    from wacc.judge.profiles import profile_settings

    families = ", ".join(f"{family} {count}" for family, count in counts.items())
    probe = implementation.integrity
    if probe is None:
        records = "none (no state_dict/load_state_dict: checkpoints and restores not judged)"
    elif probe.layout == "schema":
        records = "judged by the schema (the documented layout: pending buffers compared bit "
        records += "for bit after every step, schema corruptions refused with RecordError)"
    elif probe.layout == "opaque":
        records = "opaque (a layout of its own: judged by what a restore gives back, and any "
        records += "§11 error accepted for a corrupted one)"
    else:
        records = f"not probed ({probe.problem})"
    if probe is not None and not probe.has_integrity:
        records += f"; not judged without a checksum: {', '.join(probe.kinds)}"
    if config.seed is not None:
        seed = f"seed {config.seed}"
    elif profile_settings(config.profile).derandomize:
        seed = "derandomized (the same examples every run; --seed N for others)"
    else:
        seed = "random (Hypothesis' own seed; --seed N to repeat a run)"
    fused = "yes" if implementation.fused else "no"
    lines = [
        "what was judged:",
        f"  implementation: {implementation.spec} (fused: {fused})",
        f"  scenarios per family (all dtypes): {families or 'none'}",
        f"  records: {records}",
        f"  profile: {config.profile}; {seed}",
    ]
    coverage = implementation.coverage(allowed)
    if implementation.missing:
        missing = ", ".join(
            f"{f} ({'not judged' if f in coverage.not_judged else 'not allowed'})"
            for f in implementation.missing
        )
        lines.append(f"  features missing: {missing}")
    for family in coverage.skipped_families:
        if family in config.families:
            lacking = ", ".join(coverage.lacking(family=family))
            lines.append(f"  family not run: {family} (it needs {lacking})")
    return lines


def _grouped(findings: list[Finding]) -> list[list[Finding]]:
    """The findings grouped by signature (:mod:`wacc.judge.signature`), in the order each signature
    first appears."""
    from wacc.judge.signature import signature

    groups: dict[str, list[Finding]] = {}
    for finding in findings:
        groups.setdefault(signature(finding.verdict), []).append(finding)
    return list(groups.values())


def run(args: argparse.Namespace) -> int:
    """``wacc check``; see the module docstring."""
    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples must be >= 1, got {args.examples}")
    check_out_folder("--out", args.out)  # before the run: a divergence is written at its end
    device = check_device(args.device)
    implementation = implementation_from(args)
    from tqdm import tqdm

    from wacc.judge.engine import CheckConfig, run_check

    unsupported = implementation.coverage(args.allow_missing).unsupported
    config = CheckConfig(
        dtypes=tuple(args.dtype or WORK_DTYPES),
        device=device,
        profile=args.profile,
        seed=args.seed,
        oracles=oracles_from(args),
        families=tuple(args.family or FAMILY_NAMES),
        examples=args.examples,
        exit_first=args.exitfirst,
        # Failing examples are kept only where asked ($WACC_HYPOTHESIS_DB): a check writes
        # nothing into the working directory but --out.
        example_database="WACC_HYPOTHESIS_DB" in os.environ,
    )
    total = len(config.dtypes) * len(config.families)
    quiet = args.quiet or not sys.stderr.isatty()
    counts: dict[str, int] = {}
    with tqdm(total=total, disable=quiet, file=sys.stderr, unit="family", leave=False) as bar:
        started: list[str] = []

        def progress(dtype: str, family: str) -> None:
            if started:
                bar.update(1)
            started.append(family)
            counts.setdefault(family, 0)
            bar.set_description(f"{dtype} {family}")

        def count(verdict: object) -> None:
            counts[started[-1]] += 1

        with hypothesis_home():
            report = run_check(
                implementation, config, out=args.out, progress=progress, on_verdict=count
            )
        bar.update(1)
    report.unsupported = unsupported
    _print_report(report, implementation, tuple(args.allow_missing))
    for group in _grouped(report.findings):
        finding = group[0]
        verdict = finding.verdict
        where = ", ".join(f"{f.dtype}/{f.family}" for f in group)
        print(
            f"\nDIVERGENCE {where} [{', '.join(verdict.failed_oracles)}]: "
            f"{sum(1 for s in verdict.scenario.steps if s.op.startswith('accumulate'))} accumulate "
            f"step(s) in the shrunk scenario"
            + (f" (the first of {len(group)} with the same signature)" if len(group) > 1 else "")
        )
        for line in verdict.describe(limit=6):
            print(f"  {line}")
        for index, message in sorted(verdict.messages.items()):
            print(f"  {raised_line(verdict, index, message)}")
            if args.traceback and index in verdict.tracebacks:
                print(textwrap.indent(verdict.tracebacks[index].rstrip(), "    "))
        if finding.path is not None:
            command = ["wacc", "replay", str(finding.path), "--impl", args.impl]
            for name in args.allow_missing:  # the replay judges as this check did
                command += ["--allow-missing", name]
            if device != "cpu":
                command += ["--device", device]
            print(f"  replay: {shlex.join(command)}")
            others = [str(f.path) for f in group[1:] if f.path is not None]
            if others:
                print(f"  the others: {', '.join(others)}")
    print()
    print("\n".join(_judged_lines(implementation, config, counts, tuple(args.allow_missing))))
    return 1 if report.findings or unsupported else 0
