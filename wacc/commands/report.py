"""Run the fixed, seeded corpus on every implementation and write a report with plots.

Every strategy family x work dtype (float64, float32, float16, bfloat16) x gradient dtype
(float8 e4m3fn / e5m2 included), judged on wacc_torch (reproducible, fused and zero-copy) and
on the shipped baselines (pixparse_loop, scale_times_weight, fused_undeclared), plus the sweeps
behind the figures: error/bound vs window length, relative error vs weight skew, the S x W overflow
map, dynamic loss scaling (skipped windows and accepted error vs the initial scale, wacc_torch
next to GradScaler around `loss /= accum_steps`), float64 -> fp16/bf16 double rounding, and
(with --device all) CPU vs CUDA.

Your own implementation: --impl IMPL (repeatable; module:attr or path/to/file.py:attr, as for
`wacc check`) judges it on the same corpus next to wacc_torch, in the headline, the CSV, the
replay files and the figures that sweep (error/bound by window length, relative error vs skew,
the overflow map: a marker wherever it loses the mean that wacc_torch keeps). --compare-to DIR
puts a previous report's headline (from DIR/divergence.csv) next to this one's.
--audit DIR [DIR ...] makes `wacc audit --out` folders (one per world size: their audit.csv,
audit.png) the report's section on training frameworks, with a figure of each loop's error
against world size and rank token imbalance when one of them ran across ranks.

examples:
  wacc report                          # ./wacc-report/index.md, default corpus, CPU
  wacc report --quick --out /tmp/r     # every plot, about a minute on 2 cores
  wacc report --impl mypkg.acc:make --compare-to last-report/
  wacc report --audit reports/audit    # with the committed `wacc audit` run as a section
  wacc report --device all --full      # nightly size, CPU and CUDA

An --impl is judged as `wacc check` judges it (wacc.judge.contract): a missing core feature
(records, async_records, checksum) fails unless --allow-missing names it; a missing extension
(dynamic loss scaling: found_inf, set_loss_scale, loss_scaler) fails nothing, and the corpus
scenarios that need it are not run (index.md, divergence.csv and the terminal say "not judged" and
why).

exit codes: 0 = report written (divergences of the baselines are findings, not failures),
1 = wacc_torch or an --impl diverged (its rows fail) or an --impl lacks a core feature not
allowed, 2 = usage or environment error
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from wacc.choices import WORK_DTYPES
from wacc.commands._common import add_allow_missing, check_out_folder
from wacc.errors import UsageError
from wacc.spec import check_module

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``wacc report``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("wacc-report"),
        help="output folder (default: ./wacc-report)",
    )
    parser.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda", "all"), help="default: cpu"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true",
        help="a small corpus, every plot (about a minute on 2 cores: 42-67 s measured)",
    )  # fmt: skip
    size.add_argument("--full", action="store_true", help="a nightly-size corpus")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default: 0)")
    parser.add_argument(
        "--impl", action="append", default=[], metavar="IMPL",
        help="also judge this implementation (a factory make(dtype, loss_scale) as module:attr "
        "or path/to/file.py:attr); repeatable",
    )  # fmt: skip
    add_allow_missing(parser, what="an --impl")
    parser.add_argument(
        "--compare-to", type=Path, metavar="DIR",
        help="a previous report's folder: its headline next to this one's",
    )  # fmt: skip
    parser.add_argument(
        "--audit", type=Path, nargs="+", metavar="DIR",
        help="`wacc audit --out` folders, one per world size: their table and figures become the "
        "report's section on training frameworks (the repository's committed run: reports/audit)",
    )  # fmt: skip
    parser.add_argument(
        "--device-only", action="store_true",
        help="write only the device section (device.md, device.csv, reduction.csv, "
        "reduction_error.png) into --out, each part written as soon as it is done: what "
        "scripts/device_check.sh runs (its loops: the quick corpus; --quick: 20 scenarios, "
        "--full: the default corpus)",
    )  # fmt: skip
    parser.add_argument(
        "--rehearsal", action="store_true",
        help="with --device cpu: run the device section's CUDA-only parts (TF32 rows, FP8) on "
        "the CPU, marked `cpu (rehearsal)` (the device check's CI run)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _devices(choice: str) -> list[str]:
    import torch

    if choice in ("cuda", "all") and not torch.cuda.is_available():
        raise UsageError(f"--device {choice} was asked for, but torch sees no CUDA device")
    return {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu", "cuda"]}[choice]


def run(args: argparse.Namespace) -> int:
    """``wacc report``; see the module docstring."""
    started = time.perf_counter()
    size = "quick" if args.quick else "full" if args.full else "default"
    out: Path = args.out
    check_out_folder("--out", out)
    for spec in args.impl:  # a typo or a missing module answers before the judge is imported
        check_module(spec)
    if len(set(args.impl)) != len(args.impl):
        raise UsageError(f"--impl: {sorted(s for s in args.impl if args.impl.count(s) > 1)[0]!r} "
                         "given twice")  # fmt: skip
    if args.compare_to is not None and not (args.compare_to / "divergence.csv").exists():
        raise UsageError(
            f"--compare-to: no divergence.csv in {str(args.compare_to)!r} (a folder `wacc "
            "report` wrote)"
        )
    audit = None
    if args.audit is not None:
        from wacc.report.audit_section import read_audits

        audit = read_audits(args.audit)
    if args.rehearsal and args.device != "cpu":
        raise UsageError(f"--rehearsal runs the CUDA parts on the CPU: it needs --device cpu, "
                         f"not --device {args.device}")  # fmt: skip
    if args.device_only and (args.impl or args.compare_to or args.audit):
        raise UsageError("--device-only writes the device section alone: no --impl, "
                         "--compare-to or --audit")  # fmt: skip
    devices = _devices(args.device)
    if args.device_only:
        return _device_only(args, devices, size)
    from tqdm import tqdm

    from wacc.judge.implementation import load_implementation
    from wacc.report import figures
    from wacc.report.corpus import build_corpus
    from wacc.report.devices import device_differences, fused_variants
    from wacc.report.loss_scaling import loss_scaling_sweep
    from wacc.report.previous import (
        COMPARISON_HEADER,
        compare_headlines,
        comparison_rows,
        read_rows,
    )
    from wacc.report.provenance import collect_provenance
    from wacc.report.rows import IMPLEMENTATIONS, NotJudged, judge_corpus
    from wacc.report.sweeps import double_rounding_sweep, overflow_map, skew_sweep
    from wacc.report.writer import (
        headline,
        record_files,
        write_csv,
        write_index,
        write_scenarios,
    )
    from wacc.tables import format_metric, render_table

    users = list(args.impl)  # named in the report by their spec
    taken = [spec for spec in users if spec in IMPLEMENTATIONS]
    if taken:
        raise UsageError(f"--impl: {taken[0]!r} is the name of one of the report's own rows")
    specs = {**IMPLEMENTATIONS, **{spec: spec for spec in users}}
    # Loaded (and probed) once, before minutes of running: a broken IMPL answers now.
    loaded = {name: load_implementation(spec) for name, spec in specs.items()}
    # The report's own rows are shown as they are; an --impl is judged as `wacc check` judges
    # it: a missing core feature fails unless allowed, a missing extension is not judged.
    allowed = {name: tuple(args.allow_missing) if name in users else () for name in loaded}
    coverage_lines = {name: i.coverage_lines(allowed[name]) for name, i in loaded.items()}
    unsupported = [spec for spec in users if loaded[spec].coverage(allowed[spec]).unsupported]
    previous = read_rows(args.compare_to) if args.compare_to is not None else None
    corpus = build_corpus(size=size, corpus_seed=args.seed)
    provenance = collect_provenance(
        devices=devices, corpus_seed=args.seed, corpus_size=size, scenarios=len(corpus)
    )
    quiet = args.quiet or not sys.stderr.isatty()
    total = len(corpus) * len(specs) * len(devices)
    with tqdm(total=total, disable=quiet, file=sys.stderr, unit="run", desc="corpus") as bar:
        not_judged: list[NotJudged] = []
        rows, _ = judge_corpus(
            corpus, implementations=specs, devices=devices, progress=lambda: bar.update(1),
            not_judged=not_judged,
        )  # fmt: skip
    (out / "figures").mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=6, disable=quiet, file=sys.stderr, unit="figure", desc="figures")
    shown: dict[str, tuple[Path, str]] = {}
    shown["Error against the bound, by window length"] = (
        figures.error_bound_figure(
            rows, out / "figures" / "error_bound_vs_window.png", users=users
        ),
        "Each point is one corpus scenario on `wacc_torch` (reproducible, zero-copy and fused)"
        + "".join(f", on `{spec}`" for spec in users)
        + ": the largest |result - exact| / bound over its steps. The dashed line is the bound"
        + ("; a triangle at the top is a scenario above it." if users else "; every point stays "
           "under it, for every window length and work dtype."),
    )  # fmt: skip
    steps.update(1)
    shown["Relative error vs weight skew"] = (
        figures.skew_figure(
            skew_sweep(implementations=("wacc_torch", "pixparse_loop", *users), specs=specs),
            out / "figures" / "skew.png",
        ),
        "Windows of 4 microbatches with 1, 3, 7 and `skew` tokens (all 1 for skew 1), each "
        "microbatch's gradient the mean of its tokens' float32 gradients. `wacc_torch` weighs by "
        "tokens and stays at the work dtype's rounding level; the `loss /= accum_steps` loop "
        "weighs microbatches equally and its error grows with the skew.",
    )
    steps.update(1)
    scaling = loss_scaling_sweep()
    by = {(p.loop, p.grad_dtype, p.window_length, p.init_scale): p for p in scaling}
    top, low = max(p.init_scale for p in scaling), min(p.init_scale for p in scaling)
    shown["Dynamic loss scaling: skipped windows and accepted error"] = (
        figures.loss_scaling_figure(scaling, out / "figures" / "loss_scaling.png"),
        "Windows of 1, 4 and 16 microbatches (Pareto token counts) whose gradients are "
        "heavy-tailed (magnitudes log-uniform over 10^-9..10^-2 times Student-t(2) spikes), "
        "cast through float16 or bfloat16 in a real backward. `wacc_torch` sets one scale per "
        "window (`WindowLossScaler`) and weighs microbatches by tokens; the common loop scales "
        "`loss /= accum_steps` with `torch.amp.GradScaler`. In float16 a high initial scale skips "
        "windows until the scale has backed off (16 microbatches from "
        f"2^{math.log2(top):.0f}: {by['wacc_torch', 'float16', 16, top].skipped} of "
        f"{by['wacc_torch', 'float16', 16, top].windows} skipped with `wacc_torch`, "
        f"{by['GradScaler', 'float16', 16, top].skipped} with GradScaler, whose backward sees "
        "S/16), and a low one underflows the small gradients (median error "
        f"{by['wacc_torch', 'float16', 16, low].median_error:.1e} at S = 1 vs "
        f"{by['wacc_torch', 'float16', 16, top].median_error:.1e} at the top). bfloat16 never "
        "skips and its error does not depend on the scale. The common loop's error "
        f"({by['GradScaler', 'float16', 16, top].median_error:.2f} at 16 microbatches) is the "
        "equal weighting of unequal microbatches, at every scale; with one microbatch the two "
        "loops coincide.",
    )
    steps.update(1)
    maps = {
        dtype: overflow_map(dtype, others={spec: spec for spec in users}) for dtype in WORK_DTYPES
    }
    shown["Overflow map: loss scale x total weight"] = (
        figures.overflow_map_figure(maps, out / "figures" / "overflow_map.png"),
        "One microbatch of W tokens whose true mean gradient is t = 2^-4, scaled by S. Every "
        "cell is classified exactly and checked by running `wacc_torch` (divide by S, then by "
        f"W) and `scale_times_weight` (divide once by S·W formed in D) "
        f"({sum(m.checked for m in maps.values())} cells run). Orange: S·W (or W) overflows D, "
        "only the sequential division is right; blue: S < 1 and the unscaled sum W·t overflows D, "
        "so `buf / S` overflows (the sequential order's own limit); red: the scaled sum overflows "
        "D; grey: it underflows (why losses are scaled up). The true mean t itself never "
        "overflows in this map: that needs t > max_D."
        + "".join(
            f" `{spec}`: a marker on each of the "
            f"{sum(int(m.lost[spec].sum()) for m in maps.values())} cells where it misses the "
            "exact mean that the sequential division keeps."
            for spec in users
        ),
    )
    steps.update(1)
    shown["Double rounding of float64 -> fp16 / bf16"] = (
        figures.double_rounding_figure(
            [double_rounding_sweep(d) for d in ("float16", "bfloat16")],
            out / "figures" / "double_rounding.png",
        ),
        "Values x = m ± d near midpoints m of the work dtype. PyTorch converts float64 to "
        "float16/bfloat16 through float32, so within half a float32 ulp of a midpoint it rounds "
        "to the wrong neighbour for half of the midpoints; farther away it agrees with correct "
        "rounding. The reference models PyTorch's conversion (conv_D), checked against torch here.",
    )
    steps.update(1)
    variants = {device: fused_variants(corpus, device) for device in devices}
    if len(devices) == 2:
        counts = device_differences(corpus, ("cpu", "cuda"))
        shown["CPU vs CUDA"] = (
            figures.device_differences_figure(counts, out / "figures" / "devices.png"),
            "Scenarios whose whole trace differs between CPU and CUDA, per work dtype. The "
            "reproducible order must show none; the fused mode may (see the variant table).",
        )
    steps.update(1)
    steps.close()
    from wacc.report.device_section import (
        build_device_section,
        device_markdown,
        write_reduction_csv,
    )
    from wacc.report.device_section import write_csv as write_device_csv

    section = build_device_section(
        out / "figures", devices, rehearsal=args.rehearsal, quick=size == "quick", judged=rows
    )
    device_files = [write_device_csv(section.rows, out / "device.csv")]
    if section.figure is not None:  # None: the reduction part failed (its row says why)
        device_files += [write_reduction_csv(section.reduction, out / "reduction.csv"),
                         section.figure]  # fmt: skip
    device_lines = device_markdown(
        section.rows, csv_name="device.csv", reduction_csv="reduction.csv",
        figure=section.figure.relative_to(out).as_posix() if section.figure else None,
        rehearsal=args.rehearsal,
    )  # fmt: skip
    provenance = type(provenance)(
        **{**provenance.__dict__, "wall_seconds": time.perf_counter() - started}
    )
    write_csv(rows, out / "divergence.csv", provenance=provenance, not_judged=not_judged)
    replay_files = write_scenarios(rows, corpus, out)
    compared = None
    if previous is not None:
        changes = compare_headlines(rows, previous)
        compared = (str(args.compare_to), COMPARISON_HEADER, comparison_rows(changes))
    audit_lines = None
    written = [out / "divergence.csv", *(path for path, _ in shown.values())]
    written += device_files
    written += [out / row.replay for row in rows if row.replay]
    if audit is not None:
        from wacc.report.audit_section import audit_markdown, copy_figure

        smallest = min(audit, key=lambda run: run.world_size)
        figure = copy_figure(smallest, out / "figures")
        written.append(figure)
        ranks_figure = None
        if any(run.world_size > 1 for run in audit):
            from wacc.report.audit_figure import plot_ranks

            ranks_figure = out / "figures" / "audit-ranks.png"
            plot_ranks(audit, ranks_figure)
            written.append(ranks_figure)
        audit_lines = audit_markdown(
            audit, figure.relative_to(out).as_posix(),
            None if ranks_figure is None else ranks_figure.relative_to(out).as_posix(),
        )  # fmt: skip
    index = write_index(
        out, provenance=provenance, rows=rows, figures=shown, variants=variants,
        replay_files=replay_files, compared=compared, audit=audit_lines,
        unsupported=coverage_lines, not_judged=not_judged,
        device_section=device_lines,
    )  # fmt: skip
    # The previous report's stale files go (only those it listed as its own), never a user's.
    record_files(out, [*written, index])
    table = [
        [h.work_dtype, h.implementation, h.device, str(h.scenarios), format_metric(h.max_ulps),
         format_metric(h.max_rel_error), format_metric(h.max_ratio), h.verdict]
        for h in headline(rows)
    ]  # fmt: skip
    print(render_table(
        ["dtype", "implementation", "device", "scenarios", "max ulps", "max rel err (normal)",
         "max err/bound", "verdict"], table,
    ))  # fmt: skip
    if compared is not None:
        print(f"\ncompared with {args.compare_to} (now (before)):")
        print(render_table(compared[1], compared[2]))
    judged = ("wacc_torch", "wacc_torch_fused", "wacc_torch_zero_copy", *users)
    for name in judged:  # what was not judged, and why (and what fails for lack of a feature)
        for line in coverage_lines[name]:
            print(f"{name}: {line}")
    print(f"report: {index} ({time.perf_counter() - started:.1f} s)")
    failing = [row for row in rows if row.implementation in judged and row.failed]
    return 1 if failing or unsupported else 0


def _device_only(args: argparse.Namespace, devices: list[str], size: str) -> int:
    """``wacc report --device-only``: the device section alone into ``--out``, rewritten after
    each part (a run cut by a time cap keeps what was done); exit 1 when wacc_torch fails."""
    from wacc.report.corpus import build_corpus
    from wacc.report.device_section import (
        PARTS,
        DeviceSection,
        build_device_section,
        device_markdown,
        write_csv,
        write_reduction_csv,
    )
    from wacc.report.provenance import collect_provenance
    from wacc.report.rows import IMPLEMENTATIONS, judge_corpus

    started = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # The loops on each device: the quick corpus (120 scenarios, one per cell: about a minute
    # per device on 2 cores), the default one with --full; with --quick (the CI rehearsal) the
    # first scenario of each family x work dtype (20).
    corpus = build_corpus(size="default" if size == "full" else "quick", corpus_seed=args.seed)
    if size == "quick":
        firsts = {(e.family, e.scenario.work_dtype): e for e in reversed(corpus)}
        corpus = [e for e in corpus if firsts[e.family, e.scenario.work_dtype] is e]
    label = {"quick": "quick, first of each family x work dtype", "default": "quick"}
    provenance = collect_provenance(
        devices=devices, corpus_seed=args.seed, corpus_size=label.get(size, "default"),
        scenarios=len(corpus),
    )  # fmt: skip
    judged: list[object] = []

    def judge() -> list[object]:
        rows, _ = judge_corpus(corpus, implementations=IMPLEMENTATIONS, devices=devices)
        judged.extend(rows)
        return judged

    def write(section: DeviceSection) -> None:
        write_csv(section.rows, out / "device.csv")
        if section.reduction:
            write_reduction_csv(section.reduction, out / "reduction.csv")
        pending = [part for part in PARTS if part not in section.done]
        lines = [
            "# wacc device section", "", *provenance.lines(), "",
            *device_markdown(
                section.rows,
                figure=section.figure.name if section.figure is not None else None,
                csv_name="device.csv", reduction_csv="reduction.csv",
                rehearsal=section.rehearsal,
            ),
            f"Parts done: {', '.join(section.done)}"
            + (f"; not done (cut or still running): {', '.join(pending)}" if pending else "")
            + f" ({time.perf_counter() - started:.1f} s).",
            "",
        ]  # fmt: skip
        temporary = out / f".device.md.{os.getpid()}.tmp"
        temporary.write_text("\n".join(lines), encoding="utf-8")
        os.replace(temporary, out / "device.md")
        print(f"device section: {', '.join(section.done)} done "
              f"({time.perf_counter() - started:.1f} s)", flush=True)  # fmt: skip

    build_device_section(out, devices, rehearsal=args.rehearsal, quick=size == "quick",
                         judge=judge, after_part=write)  # fmt: skip
    failing = [
        row for row in judged
        if getattr(row, "implementation", "").startswith("wacc_torch") and row.failed  # type: ignore[attr-defined]
    ]  # fmt: skip
    print(f"report: {out / 'device.md'} ({time.perf_counter() - started:.1f} s)")
    return 1 if failing else 0
