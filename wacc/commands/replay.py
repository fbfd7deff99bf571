"""Replay one scenario file (wacc_ref scenario JSON) on IMPL and print every step, judged.

The table shows, per step: the op, its argument (an accumulate's weight, the scale a
set_loss_scale asks for, the found_inf an update_scaler is given), the error class of the
reference and of the implementation, max ulps in the work dtype against the bit-exact
emulation, max relative error and max error/bound against the exact result, and the verdict
(which oracles failed).

examples:
  wacc replay wacc-check/divergence-01-float16-windows.json
  wacc replay scenario.json --impl mypkg.acc:make --device cuda

The file is read strictly, as `wacc check` writes it (every float spelled exactly as Python's
float.hex writes it, no field missing, unknown or repeated): see wacc_ref/strict_json.py.

Features (wacc.judge.contract, as in `wacc check`): a scenario with a step that needs a missing
extension (set_loss_scale, update_scaler) is not run ("not judged", exit 0); without records, it
runs without its checkpoints and restores; a missing core feature fails unless --allow-missing
names it.

exit codes: 0 = every step agrees (or the scenario needs a missing extension: not judged),
1 = a step diverges or a core feature is missing and not allowed, 2 = usage error (an
unreadable, malformed or oversized file: one line naming the file and the field; a bad IMPL)
"""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from wacc.commands._common import (
    add_impl_arguments,
    check_device,
    implementation_from,
    oracles_from,
    raised_line,
    read_bounded,
)
from wacc.errors import UsageError
from wacc.spec import check_spec

if TYPE_CHECKING:  # the judge and the reference are imported when the command runs
    from wacc.judge.verdict import ScenarioVerdict
    from wacc_ref.scenario import Scenario

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_STEPS",
    "MAX_TOTAL_ELEMENTS",
    "add_arguments",
    "load_scenario_file",
    "run",
]

# A replay file is a small test case: anything larger is refused before it is parsed or run.
MAX_FILE_BYTES = 4 * 2**20
MAX_STEPS = 10_000
MAX_TOTAL_ELEMENTS = 2**20  # over all parameters: what one module allocates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``wacc replay``."""
    parser.add_argument("file", type=Path, metavar="FILE", help="a scenario JSON file")
    add_impl_arguments(parser, positional=False)
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="print the whole traceback of an exception the implementation raised",
    )


def load_scenario_file(path: Path) -> Scenario:
    """The scenario in ``path``; :class:`UsageError` naming the file and the field otherwise.

    The file is read as :func:`wacc_ref.scenario.from_json` reads it (strictly: see
    :mod:`wacc_ref.strict_json`), after a size limit, and its parameters and steps are limited
    too: a replay file is a small test case.
    """
    return parse_scenario(path, read_scenario_bytes(path))


def read_scenario_bytes(path: Path) -> bytes:
    """The bytes of ``path`` (at most :data:`MAX_FILE_BYTES`), or :class:`UsageError` naming it:
    nothing but the file system, so it answers before torch or the reference is imported."""
    return read_bounded(path, MAX_FILE_BYTES, what="a scenario file")


def parse_scenario(path: Path, data: bytes) -> Scenario:
    """The scenario in ``data`` (read from ``path``), within the limits of a replay file."""
    from wacc_ref.scenario import ScenarioError, from_json
    from wacc_ref.strict_json import shown

    name = str(path)
    try:
        scenario = from_json(data)
    except ScenarioError as exc:
        raise UsageError(f"{name!r}: {exc}") from None
    # Each zero-size dimension counted as 1: torch computes a tensor's strides from its other
    # dimensions, so [0, 2**62, 2**62] (no element) would still overflow there.
    elements = sum(math.prod(max(d, 1) for d in shape) for _, shape in scenario.parameters)
    if elements > MAX_TOTAL_ELEMENTS:
        raise UsageError(
            f"{name!r}: parameters: {shown(elements)} elements in all (a zero-size dimension "
            f"counted as 1); a scenario file has at most {MAX_TOTAL_ELEMENTS}"
        )
    if len(scenario.steps) > MAX_STEPS:
        raise UsageError(
            f"{name!r}: steps: {len(scenario.steps)} steps; a scenario file has at most {MAX_STEPS}"
        )
    return scenario


def _argument(step: object) -> str:
    """What a step is asked to do, in the table's argument column."""
    from wacc_ref.scenario import Accumulate, SetLossScale, UpdateScaler

    if isinstance(step, Accumulate):
        return repr(step.weight)
    if isinstance(step, SetLossScale):
        return f"S={step.loss_scale!r}"
    if isinstance(step, UpdateScaler):
        return f"found_inf={step.found_inf}"
    return ""


def _table(verdict: ScenarioVerdict) -> str:
    from wacc.tables import format_metric, render_table

    rows = []
    for step, scenario_step in zip(verdict.steps, verdict.scenario.steps, strict=True):
        rows.append(
            [
                str(step.index),
                step.op,
                _argument(scenario_step),
                step.expected_error or "-",
                step.actual_error or "-",
                format_metric(step.max_ulps),
                format_metric(step.max_rel_error),
                format_metric(step.max_ratio),
                "FAIL " + ",".join(step.failed) if step.failed else "ok",
            ]
        )
    header = [
        "step",
        "op",
        "argument",
        "error ref",
        "error impl",
        "max ulps",
        "max rel err (normal)",
        "err/bound",
        "verdict",
    ]
    return render_table(header, rows)


def run(args: argparse.Namespace) -> int:
    """``wacc replay``; see the module docstring."""
    data = read_scenario_bytes(args.file)  # the path and the spec first: no import needed
    check_spec(args.impl)
    device = check_device(args.device)
    scenario = parse_scenario(args.file, data)
    implementation = implementation_from(args)
    from wacc.judge.verdict import judge

    if implementation.fused != scenario.fused:
        raise UsageError(
            f"{str(args.file)!r}: fused: the scenario has {str(scenario.fused).lower()}, but "
            f"{args.impl} declares state.fused={implementation.fused}"
        )
    coverage = implementation.coverage(args.allow_missing)
    judged = implementation.judgeable(scenario)
    oracles = oracles_from(args)
    print(
        f"wacc replay {args.file} on {args.impl} ({device}): D={scenario.work_dtype}, "
        f"G={scenario.grad_dtype}, S={scenario.loss_scale!r}; oracles {', '.join(oracles)}"
    )
    for line in implementation.coverage_lines(args.allow_missing):
        print(line)
    if judged is None:  # a step needs a missing feature: nothing of the scenario is run
        lacking = ", ".join(coverage.lacking(ops=(step.op for step in scenario.steps)))
        print(f"not judged: the scenario has steps that need {lacking}, which {args.impl} lacks")
        return 1 if coverage.unsupported else 0
    if judged != scenario:
        print("note: run without its checkpoints and restores (the implementation has no records)")
    verdict = judge(implementation, judged, device=device, oracles=oracles)
    print(_table(verdict))
    for line in verdict.describe(limit=20):
        print(line)
    for index, message in sorted(verdict.messages.items()):
        print(raised_line(verdict, index, message))
        if args.traceback and index in verdict.tracebacks:
            print(textwrap.indent(verdict.tracebacks[index].rstrip(), "    "))
    for step in verdict.steps:
        for note in step.notes:
            print(f"note: {note}")
    print("DIVERGES" if verdict.failed else "agrees with the reference")
    return 1 if verdict.failed or coverage.unsupported else 0
