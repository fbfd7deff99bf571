"""``python -m mutation``: run mutmut, write the report, run the CI smoke sample.

Examples::

    python -m mutation run                       # mutmut run (every module), timed
    python -m mutation report                    # reports/mutation/ and docs/mutation.md's table
    python -m mutation run 'wacc_ref.bounds.*'   # one module's mutants (then `report`)
    python -m mutation run --rerun-triaged       # also the triaged survivors a run carries
    python -m mutation smoke                     # the CI sample (at most a few minutes)

Exit status: 0 when the report meets its targets with every survivor triaged (or the sample is
all killed), 1 when it does not, 2 for a usage error or a file that cannot be read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mutation.carry import carried, confirmed_hashes, function_hashes, write_carry
from mutation.outcomes import CARRIED, read_outcomes
from mutation.report import (
    HEADLINE_BEGIN,
    headline,
    judge,
    markdown,
    replace_headline,
    write_csv,
)
from mutation.scope import ROOT, mutmut_config
from mutation.smoke import SmokeError, read_samples, run_smoke
from mutation.triage import TriageError, read_triage, write_triage
from wacc.judge.profiles import MUTATION_EXAMPLES, MUTATION_PROFILE

REPORT_DIR = ROOT / "reports" / "mutation"
RUN_RECORD = "mutants/wacc-run.json"  # under the root the run was made in


def _git_commit(root: Path = ROOT) -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _run(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)]
    profile = os.environ.get("HYPOTHESIS_PROFILE", MUTATION_PROFILE)
    env = dict(os.environ, HYPOTHESIS_PROFILE=profile)
    had_state = (ROOT / "mutants").is_dir()
    try:
        verdicts = {} if args.rerun_triaged else read_triage(REPORT_DIR / "triage.csv")
    except TriageError as exc:
        print(f"mutation run: {exc}", file=sys.stderr)
        return 2
    carry = carried(verdicts, function_hashes(ROOT))
    write_carry(ROOT, carry)  # an empty list too: a file left by an earlier run never applies
    print(f"mutation run: {len(carry)} triaged survivors carried (function unchanged)", flush=True)
    started = time.monotonic()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    code = subprocess.call(command + list(args.mutants), cwd=ROOT, env=env)
    seconds = time.monotonic() - started
    if not args.mutants:  # only runs over every mutant count toward the run time stated
        _record_segment(
            when, seconds, args.max_children, profile, fresh=not had_state, carried=len(carry)
        )
    print(f"mutmut run: exit {code} after {seconds:.0f} s", flush=True)
    return 0 if code == 0 else 1


def _record_segment(
    when: str, seconds: float, workers: int, profile: str, *, fresh: bool, carried: int
) -> None:
    """Add this run to ``mutants/wacc-run.json``: a run that found no ``mutants/`` starts the
    record; a resumed one (mutmut keeps every result already decided) adds a segment to it."""
    path = ROOT / RUN_RECORD
    record = {"segments": []} if fresh or not path.exists() else json.loads(path.read_text("utf-8"))
    record["segments"].append(
        {
            "started": when,
            "seconds": round(seconds, 1),
            "max_children": workers,
            "cpu_count": os.cpu_count(),
            "git_commit": _git_commit(),
            "hypothesis_profile": profile,
            "carried": carried,
        }
    )
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")


def _provenance(root: Path) -> dict[str, str]:
    import importlib.metadata

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git commit (report)": _git_commit(root),
        "command": "python -m mutation run && python -m mutation report (tox -e mutation)",
        "mutmut": importlib.metadata.version("mutmut"),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "hypothesis profile": "not recorded",
        "tests run": " ".join(mutmut_config(root)["pytest_add_cli_args_test_selection"]),  # type: ignore[arg-type]
        "CPU cores visible": str(os.cpu_count()),
        "platform": platform.platform(),
    }
    record = root / RUN_RECORD
    if record.exists():
        segments = json.loads(record.read_text(encoding="utf-8"))["segments"]
        total = sum(segment["seconds"] for segment in segments)
        first = segments[0]
        profiles = sorted({seg.get("hypothesis_profile", "ci") for seg in segments})
        info["hypothesis profile"] = ", ".join(profiles) + (
            f" ({MUTATION_EXAMPLES} examples a property test: a lower bound on the CI suite's "
            "power, see wacc/judge/profiles.py)"
            if profiles == [MUTATION_PROFILE]
            else ""
        )
        info["run time"] = (
            f"{total:.0f} s ({total / 60:.1f} min) wall, {first['max_children']} workers on "
            f"{first['cpu_count']} cores, in {len(segments)} segment(s) (a resumed run keeps "
            f"every result already decided): "
            + "; ".join(
                f"{seg['started']} at {seg['git_commit']}, {seg['seconds']:.0f} s"
                + (f", {seg['carried']} triaged survivors carried" if "carried" in seg else "")
                + (f" ({seg['note']})" if seg.get("note") else "")
                for seg in segments
            )
        )
    else:
        info["run time"] = "not recorded (mutants/ came from a partial or manual run)"
    return info


def _survivors_run(outcomes: list) -> dict[str, str]:
    """name -> change of each mutant this run ran and saw survive (not one it carried)."""
    return {o.name: o.change for o in outcomes if o.survived and o.status != CARRIED}


def _run_hashes(root: Path) -> dict[str, str]:
    """mutmut's hash of each function as the run saw it (its stats file; empty if unreadable)."""
    try:
        stats = json.loads((root / "mutants" / "mutmut-stats.json").read_text(encoding="utf-8"))
        hashes = stats["function_hashes"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {str(k): str(v) for k, v in hashes.items()} if isinstance(hashes, dict) else {}


def _report(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        verdicts = read_triage(REPORT_DIR / "triage.csv")
    except TriageError as exc:
        print(f"mutation report: {exc}", file=sys.stderr)
        return 2
    readme = Path(args.readme) if args.readme else None
    try:  # read before anything is written: a bad --readme leaves the report as it was
        text = readme.read_text(encoding="utf-8") if readme else ""
    except (OSError, UnicodeDecodeError) as exc:
        print(f"mutation report: --readme {str(readme)!r}: {exc}", file=sys.stderr)
        return 2
    try:
        outcomes = read_outcomes(Path(args.root))
    except FileNotFoundError as exc:
        print(f"mutation report: {exc}", file=sys.stderr)
        return 2
    verdicts = confirmed_hashes(verdicts, _survivors_run(outcomes), _run_hashes(Path(args.root)))
    findings = judge(outcomes, verdicts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(
        markdown(findings, _provenance(Path(args.root))), encoding="utf-8"
    )
    write_csv(out / "results.csv", findings)
    write_triage(out / "triage.csv", list(verdicts.values()))
    if readme and HEADLINE_BEGIN in text:
        readme.write_text(replace_headline(text, headline(findings)), encoding="utf-8")
    print(headline(findings))
    for problem in findings.problems:
        print(f"- {problem}")
    return 1 if findings.problems else 0


def _smoke(args: argparse.Namespace) -> int:
    try:
        samples = read_samples(REPORT_DIR / "smoke.csv", REPORT_DIR / "results.csv")
    except (SmokeError, OSError) as exc:
        print(f"mutation smoke: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    problems = run_smoke(ROOT, samples, timeout=args.timeout)
    seconds = time.monotonic() - started
    for problem in problems:
        print(f"mutation smoke: {problem}", file=sys.stderr)
    print(
        f"mutation smoke: {len(samples) - len(problems)} of {len(samples)} sampled mutants "
        f"killed in {seconds:.0f} s",
        flush=True,
    )
    return 1 if problems else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mutation", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run mutmut (all mutants, or the names/globs given)")
    run.add_argument("mutants", nargs="*", help="mutmut names or globs (default: every mutant)")
    run.add_argument(
        "--max-children", type=int, default=os.cpu_count() or 2, help="parallel mutant workers"
    )
    run.add_argument(
        "--rerun-triaged",
        action="store_true",
        help="run the triaged survivors too (by default a survivor whose function is unchanged "
        "since its verdict was confirmed is carried, not run: see mutation/carry.py)",
    )
    run.set_defaults(handler=_run)
    report = commands.add_parser("report", help="write reports/mutation/ from mutants/")
    report.add_argument("--out", default=str(REPORT_DIR), help="directory (default: %(default)s)")
    report.add_argument(
        "--root", default=str(ROOT), help="where `mutmut run` ran (default: this repository)"
    )
    report.add_argument(
        "--readme",
        default=str(ROOT / "docs" / "mutation.md"),
        help="the documentation page whose score table (between its markers) to update "
        "(default: %(default)s)",
    )
    report.set_defaults(handler=_report)
    smoke = commands.add_parser("smoke", help="kill the sampled mutants again (CI)")
    smoke.add_argument("--timeout", type=float, default=300.0, help="seconds (default: 300)")
    smoke.set_defaults(handler=_smoke)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
