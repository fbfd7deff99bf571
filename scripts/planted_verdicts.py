"""The verdicts of ``wacc check``, ``wacc gate`` and ``wacc report`` on the planted bugs, a
seed-API accumulator and wacc_torch, as a Markdown table (issue 33's "Done when" evidence).

Each implementation is judged by the three commands as a user runs them (subprocesses of
``python -m wacc``), with one judge: the ``wacc`` package of ``--judge`` (default: this
repository). The implementations are always this repository's (``tests/wacc/planted.py``,
``tests/wacc/impls.py``, ``wacc/baselines.py``), copied into a scratch folder outside any
repository, so an older judge (``--judge /tmp/old``, a worktree of an older commit) is run on the
same code: only the judge differs between two tables.

    nice -n 10 python scripts/planted_verdicts.py --out /tmp/pv-after
    nice -n 10 python scripts/planted_verdicts.py --judge /tmp/old --out /tmp/pv-before

The commands, per implementation (SPEC; FLAGS: ``--allow-missing checksum`` for the planted
bugs, whose records carry no integrity check, nothing for the others):

- ``wacc check SPEC FLAGS --quiet --out DIR [--examples N]`` (the ci profile);
- ``wacc gate --impl SPEC FLAGS --quiet --results FILE --out DIR``: one shard 1/1 with
  ``--results``, so the exit status is the run's hard failures (oracle violations), not a
  comparison of another implementation's metrics with wacc_torch's committed baseline; the
  gate's profile (ci) and corpus (default size) are fixed;
- ``wacc report --quick --quiet --impl SPEC FLAGS --out DIR`` (``--report-size default``: without
  ``--quick``, the gate's corpus scenarios); its verdict is the rows of SPEC
  in ``divergence.csv`` (``pass`` / a failing oracle / ``not judged``). Where the judge refuses
  a flag (exit 2, "unrecognized arguments": an older report has no ``--allow-missing``), that
  is recorded and the command is run again without the flags.

wacc_torch is the commands' default implementation (no SPEC; in the report, its rows). The
results of each implementation are kept in ``OUT/results.json`` as they come, so a run that is
stopped resumes where it was (``--render`` prints the table of what is there).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BATCH = 15  # --impl per report with --batch-report
PLANTED_FLAGS = ("--allow-missing", "checksum")  # SpecAccumulator's records have no checksum
# Implementations of tests/wacc/impls.py whose methods raise or whose records hold tensors the
# judge once crashed on (exit 3): an implementation's exception is a divergence (semantics §12).
FAULTY = ("state_dict_raises", "async_result_raises", "sparse_record", "stride_zero_record")

# Either location of the judge's implementation module (it moves into wacc/judge/).
_COMPAT = """\
from wacc.implementation import *  # noqa: F403
from wacc.implementation import wacc_torch_loss_scaler  # noqa: F401

try:
    from wacc.judge.implementation import *  # noqa: F403
    from wacc.judge.implementation import Implementation  # noqa: F401
except ImportError:  # a judge older than wacc/judge/
    from wacc.implementation import Implementation  # noqa: F401
"""


# One factory per planted bug, as tests/wacc/planted.py's Planted.implementation builds it.
_FACTORIES = """\
from typing import Any

from pv_baselines import SpecAccumulator
from pv_planted import PLANTED
from wacc_torch import WindowLossScaler


def _factory(planted: Any) -> Any:
    cls = planted.cls
    accumulator = cls if issubclass(cls, SpecAccumulator) else SpecAccumulator
    scaler = cls if issubclass(cls, WindowLossScaler) else WindowLossScaler

    def make(dtype: Any, loss_scale: float) -> Any:
        return accumulator(dtype=dtype, loss_scale=loss_scale)

    def loss_scaler(dtype: Any, init_scale: float, **options: Any) -> Any:
        return scaler(init_scale, **options, dtype=dtype)

    make.loss_scaler = loss_scaler
    return make


for _name, _planted in PLANTED.items():
    globals()[_name] = _factory(_planted)
"""

_IMPORTS = (
    (
        re.compile(r"^(\s*)from wacc(?:\.judge)?\.implementation import", re.M),
        r"\1from pv_compat import",
    ),
    (re.compile(r"^(\s*)from wacc\.baselines import", re.M), r"\1from pv_baselines import"),
    (re.compile(r"^(\s*)from tests\.wacc\.planted import", re.M), r"\1from pv_planted import"),
)


def write_implementations(folder: Path) -> list[str]:
    """Copy this repository's planted bugs, test implementations and SpecAccumulator into
    ``folder`` as top-level modules (``pv_*``) that import nothing of this repository but the
    judge's public modules; return the planted bugs' names, in PLANTED's order."""
    folder.mkdir(parents=True, exist_ok=True)
    baselines = REPO / "wacc" / "baselines.py"
    if not baselines.exists():
        baselines = REPO / "wacc" / "judge" / "baselines.py"
    sources = {
        "pv_baselines.py": baselines,
        "pv_planted.py": REPO / "tests" / "wacc" / "planted.py",
        "pv_test_impls.py": REPO / "tests" / "wacc" / "impls.py",
    }
    for name, source in sources.items():
        text = source.read_text(encoding="utf-8")
        for pattern, replacement in _IMPORTS:
            text = pattern.sub(replacement, text)
        (folder / name).write_text(text, encoding="utf-8")
    (folder / "pv_compat.py").write_text(_COMPAT, encoding="utf-8")
    (folder / "pv_impls.py").write_text(_FACTORIES, encoding="utf-8")
    names = re.findall(r"^\s*Planted\((\w+),", sources["pv_planted.py"].read_text("utf-8"), re.M)
    return names


@dataclass
class Run:
    """One command's outcome."""

    argv: list[str]
    exit: int | None  # None: timed out
    seconds: float
    stdout: str
    stderr: str
    note: str = ""

    def last_error(self) -> str:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1][:160] if lines else ""


@dataclass
class Verdicts:
    """The three commands' outcomes on one implementation, as the table shows them."""

    name: str
    spec: str | None
    flags: list[str]
    check: dict[str, Any] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


def run(argv: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float) -> Run:
    """``python -m wacc ARGV`` in ``cwd``."""
    command = [sys.executable, "-m", "wacc", *argv]
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        exit_code: int | None = done.returncode
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        exit_code = None
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else ""
        stderr = expired.stderr.decode() if isinstance(expired.stderr, bytes) else ""
    # What the command printed, kept beside its outputs (the table shows only a summary).
    log = cwd / f"{argv[0]}.log"
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"$ wacc {' '.join(argv)}\n-> exit {exit_code}\n{stdout}\n{stderr}\n")
    return Run(list(argv), exit_code, time.monotonic() - start, stdout, stderr)


def _refused_flags(result: Run) -> bool:
    return result.exit == 2 and "unrecognized arguments" in result.stderr


def with_fallback(argv: list[str], flags: Sequence[str], **kwargs: Any) -> Run:
    """Run ``argv`` (which holds ``flags``); if the judge refuses the flags, run it again
    without them and say so in the note."""
    result = run(argv, **kwargs)
    if flags and _refused_flags(result):
        refused = f"{' '.join(flags)} refused (exit 2: {result.last_error()})"
        stripped = [a for i, a in enumerate(argv) if not _is_flag(argv, i, flags)]
        result = run(stripped, **kwargs)
        result.note = refused + "; run without it"
    return result


def _is_flag(argv: Sequence[str], index: int, flags: Sequence[str]) -> bool:
    """Whether ``argv[index]`` belongs to a ``flags`` pair (``--allow-missing FEATURE``)."""
    for start in range(len(argv) - len(flags) + 1):
        if list(argv[start : start + len(flags)]) == list(flags):
            if start <= index < start + len(flags):
                return True
    return False


def _outcome(result: Run) -> dict[str, Any]:
    return {
        "argv": result.argv,
        "exit": result.exit,
        "seconds": round(result.seconds, 1),
        "note": result.note,
        "error": result.last_error(),
    }


def judge_check(verdicts: Verdicts, scratch: Path, examples: int | None, **kwargs: Any) -> None:
    argv = [
        "check",
        *([verdicts.spec] if verdicts.spec else []),
        *verdicts.flags,
        "--quiet",
        "--out",
        str(scratch / "check"),
    ]
    if examples is not None:
        argv += ["--examples", str(examples)]
    result = with_fallback(argv, verdicts.flags, **kwargs)
    lines = result.stdout.splitlines()
    verdicts.check = {
        **_outcome(result),
        "divergences": sum(line.startswith("DIVERGENCE") for line in lines),
        "unsupported": sum("unsupported" in line for line in lines),
    }


def judge_gate(verdicts: Verdicts, scratch: Path, baseline: Path, **kwargs: Any) -> None:
    # The judge's committed baseline (wacc_torch's): a 1/1 run with --results reads it in an
    # older gate (a regression fails it there), the current one does not (hard failures only).
    other = ["--impl", verdicts.spec, "--allow-other-impl"] if verdicts.spec else []
    argv = [
        "gate",
        *other,
        *verdicts.flags,
        "--baseline",
        str(baseline),
        "--quiet",
        "--results",
        str(scratch / "gate.json"),
        "--out",
        str(scratch / "gate"),
    ]
    result = with_fallback(argv, verdicts.flags, **kwargs)
    groups = [line for line in result.stdout.splitlines() if line.startswith("FAILURE ")]
    counts = [
        int(m.group(1)) for m in map(re.compile(r"FAILURE (\d+) scenario").match, groups) if m
    ]
    verdicts.gate = {
        **_outcome(result),
        "groups": len(groups),
        "scenarios": sum(counts),
        "phantom": sum("did not recur" in line for line in groups),
        "unsupported": sum("unsupported" in line for line in result.stdout.splitlines()),
        "first": groups[0][:200] if groups else "",
        "all": [line[:200] for line in groups],
    }


def _report_argv(out: Path, size: str) -> list[str]:
    """``wacc report`` of the corpus ``size`` (``--quick``: the first scenario of each cell of
    the default corpus, so a failure it finds a default-size report finds too)."""
    return ["report", *(["--quick"] if size == "quick" else []), "--quiet", "--out", str(out)]


def judge_report(verdicts: Verdicts, scratch: Path, size: str = "quick", **kwargs: Any) -> None:
    out = scratch / "report"
    argv = _report_argv(out, size)
    if verdicts.spec:
        argv += ["--impl", verdicts.spec, *verdicts.flags]
    result = with_fallback(argv, verdicts.flags if verdicts.spec else (), **kwargs)
    name = verdicts.spec or "wacc_torch"
    tally: dict[str, int] = {}
    table = out / "divergence.csv"
    if table.exists():
        with table.open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                if row.get("implementation") == name:
                    key = _row_verdict(row["verdict"])
                    tally[key] = tally.get(key, 0) + 1
    verdicts.report = {**_outcome(result), "rows": tally, "csv": table.exists(), "size": size}


def judge_report_batch(
    batch: Sequence[Verdicts],
    scratch: Path,
    flags: Sequence[str],
    size: str = "quick",
    **kwargs: Any,
) -> None:
    """One ``wacc report`` (``--quick`` unless ``size`` is default) over every implementation of
    ``batch`` (``--impl`` is repeatable; all take the same ``flags``): each is judged on the same
    corpus on its own, so its rows are those of a report of it alone, and wacc_torch's rows are
    computed once instead of once per implementation."""
    out = scratch / "report"
    argv = _report_argv(out, size)
    for verdicts in batch:
        argv += ["--impl", str(verdicts.spec)]
    argv += list(flags)
    result = with_fallback(argv, flags, **kwargs)
    tallies: dict[str, dict[str, int]] = {str(v.spec): {} for v in batch}
    table = out / "divergence.csv"
    if table.exists():
        with table.open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                tally = tallies.get(row.get("implementation", ""))
                if tally is not None:
                    key = _row_verdict(row["verdict"])
                    tally[key] = tally.get(key, 0) + 1
    for verdicts in batch:
        verdicts.report = {
            **_outcome(result),
            "rows": tallies[str(verdicts.spec)],
            "csv": table.exists(),
            "batch": len(batch),
            "size": size,
        }


def _row_verdict(verdict: str) -> str:
    if verdict == "pass":
        return "pass"
    return "not judged" if verdict.startswith("not judged") else "FAIL"


def passed(outcome: dict[str, Any], kind: str) -> bool | None:
    """The command's verdict on the implementation: True (pass), False (fail), None (none:
    a usage error, a crash of the judge, a timeout, no rows)."""
    code = outcome.get("exit")
    if kind == "report":
        rows = outcome.get("rows") or {}
        if not rows.get("pass") and not rows.get("FAIL"):
            return None
        return not rows.get("FAIL")
    if code in (0, 1):
        return bool(code == 0)
    return None


def _exit_text(outcome: dict[str, Any]) -> str:
    code = outcome.get("exit")
    text = "timeout" if code is None else f"exit {code}"
    if code not in (0, 1):
        text += f" ({outcome.get('error', '')})" if outcome.get("error") else ""
    return text


def cells(verdicts: Verdicts) -> list[str]:
    """The table's cells for one implementation."""
    check, gate, report = verdicts.check, verdicts.gate, verdicts.report
    check_text = _exit_text(check)
    if check.get("exit") in (0, 1):
        check_text += ": pass" if check["exit"] == 0 else f": FAIL, {check['divergences']} block(s)"
        if check.get("unsupported"):
            check_text += f", {check['unsupported']} unsupported line(s)"
    gate_text = _exit_text(gate)
    if gate.get("exit") in (0, 1):
        gate_text += f": {gate['groups']} group(s)"
        if gate["groups"]:
            gate_text += f", {gate['scenarios']} scenario(s)"
        if gate.get("phantom"):
            gate_text += f", {gate['phantom']} 'did not recur'"
        if gate.get("unsupported"):
            gate_text += ", unsupported"
    rows = report.get("rows") or {}
    report_text = (
        ("default size, " if report.get("size") == "default" else "")
        + _exit_text(report)
        + ": "
        + (
            ", ".join(f"{key} {rows[key]}" for key in ("pass", "FAIL", "not judged") if key in rows)
            or "no rows"
        )
    )
    for outcome in (check, gate, report):
        if outcome.get("note"):
            note = outcome["note"]
            if outcome is check:
                check_text += f" [{note}]"
            elif outcome is gate:
                gate_text += f" [{note}]"
            else:
                report_text += f" [{note}]"
    verdict = [passed(check, "check"), passed(gate, "gate"), passed(report, "report")]
    crash = any(o.get("exit") == 3 for o in (check, gate, report))
    if None in verdict:
        agree = "no verdict" + (" (exit 3)" if crash else "")
    elif len(set(verdict)) == 1:
        agree = "yes: " + ("pass" if verdict[0] else "FAIL")
    else:
        agree = "NO: " + "/".join("pass" if v else "FAIL" for v in verdict)
    name = f"`{verdicts.name}`" + (f" (`{' '.join(verdicts.flags)}`)" if verdicts.flags else "")
    return [name, check_text, gate_text, report_text, agree]


HEADER = [
    "implementation",
    "check: exit, verdict",
    "gate: exit, groups",
    "report --quick (unless marked default size): exit, rows of the implementation",
    "agree?",
]


def table(results: Sequence[Verdicts]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells(v)) + " |" for v in results]
    return "\n".join(lines)


def _load(path: Path) -> dict[str, Verdicts]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {item["name"]: Verdicts(**item) for item in data["results"]}


def _save(path: Path, results: dict[str, Verdicts], meta: dict[str, Any]) -> None:
    document = {"meta": meta, "results": [asdict(v) for v in results.values()]}
    path.write_text(json.dumps(document, indent=1), encoding="utf-8")


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--judge", type=Path, default=REPO, help="tree whose wacc judges")
    parser.add_argument("--out", type=Path, required=True, help="scratch and results folder")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="judge only this implementation (repeatable; a planted class "
        f"name, seed_api, wacc_torch or one of {', '.join(FAULTY)})",
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=None,
        help="wacc check --examples (default: the ci profile's)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--render", action="store_true", help="print the table and stop")
    parser.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="with --render: also the results of this --out folder (runs made side by side)",
    )
    parser.add_argument(
        "--rerun", action="append", default=[], help="judge NAME again though results has it"
    )
    parser.add_argument(
        "--commands",
        default="check,gate,report",
        help="which commands to run (comma-separated); on a --rerun the others' outcomes stay",
    )
    parser.add_argument(
        "--batch-report",
        action="store_true",
        help="judge the planted bugs in one `wacc report --quick` (--impl repeated) before the "
        "per-implementation check and gate runs; the others still one report each",
    )
    parser.add_argument(
        "--report-size",
        choices=("quick", "default"),
        default="quick",
        help="the report's corpus: quick (--quick, one scenario per cell) or default (six per "
        "cell: the scenarios of the gate's corpus keys)",
    )
    args = parser.parse_args(argv)

    out = args.out.resolve()
    planted = write_implementations(out / "impls")
    known: list[tuple[str, str | None, tuple[str, ...]]] = [
        ("wacc_torch", None, ()),
        ("seed_api", "pv_test_impls:seed_api", ()),
    ]
    known += [(name, f"pv_impls:{name}", PLANTED_FLAGS) for name in planted]
    known += [(name, f"pv_test_impls:{name}", ()) for name in FAULTY]
    unknown = set(args.only) - {k[0] for k in known}
    if unknown:
        parser.error(f"unknown implementation(s): {', '.join(sorted(unknown))}")
    by_name = {k[0]: k for k in known}
    chosen = [by_name[name] for name in args.only] if args.only else known  # in that order
    results_path = out / "results.json"
    results = _load(results_path)
    meta = {"judge": str(args.judge), "commit": _commit(args.judge), "examples": args.examples}
    if args.render and results_path.exists():  # as the runs recorded it
        meta = json.loads(results_path.read_text(encoding="utf-8"))["meta"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(args.judge.resolve()), str(out / "impls")]),
    }
    env.pop("HYPOTHESIS_PROFILE", None)
    if not args.render and args.batch_report and "report" in args.commands.split(","):
        batch = [
            results.get(name) or Verdicts(name=name, spec=spec, flags=list(flags))
            for name, spec, flags in chosen
            if flags == PLANTED_FLAGS and (name not in results or name in args.rerun)
        ]
        # Chunks of BATCH: a judge before 3a74c16 gave at most 16 --impl a colour in its figure
        # (KeyError, exit 3, at the 17th).
        for first in range(0, len(batch), BATCH):
            chunk = batch[first : first + BATCH]
            scratch = out / "runs" / f"planted-batch-{first // BATCH}"
            scratch.mkdir(parents=True, exist_ok=True)
            kwargs = {"cwd": scratch, "env": env, "timeout": args.timeout * 4}
            judge_report_batch(chunk, scratch, PLANTED_FLAGS, args.report_size, **kwargs)
            for verdicts in chunk:
                results[verdicts.name] = verdicts
            _save(results_path, results, meta)
            print(f"report of {len(chunk)} planted bugs in one run", file=sys.stderr, flush=True)
    if not args.render:
        for name, spec, flags in chosen:
            done = results.get(name)
            if done is not None and done.check and name not in args.rerun:
                continue
            verdicts = results.get(name) or Verdicts(name=name, spec=spec, flags=list(flags))
            scratch = out / "runs" / name
            scratch.mkdir(parents=True, exist_ok=True)
            kwargs: dict[str, Any] = {"cwd": scratch, "env": env, "timeout": args.timeout}
            commands = args.commands.split(",")
            if "check" in commands:
                judge_check(verdicts, scratch, args.examples, **kwargs)
            if "gate" in commands:
                baseline = args.judge.resolve() / "reports" / "baseline.json"
                judge_gate(verdicts, scratch, baseline, **kwargs)
            if "report" in commands and not verdicts.report:
                judge_report(verdicts, scratch, args.report_size, **kwargs)
            results[name] = verdicts
            _save(results_path, results, meta)
            print(f"{name}: {' | '.join(cells(verdicts)[1:])}", file=sys.stderr, flush=True)
    for other in args.also if args.render else []:
        results.update(_load(other.resolve() / "results.json"))
    order = [k[0] for k in chosen] + [k[0] for k in known if k not in chosen]
    shown = sorted(
        (v for v in results.values() if not args.only or v.name in args.only),
        key=lambda v: order.index(v.name) if v.name in order else len(order),
    )
    print(
        f"judge: {meta['judge']} at {meta['commit']}; check examples: "
        f"{meta['examples'] or 'the ci profile'}\n"
    )
    print(table(shown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
