"""``wacc report --audit DIR``: a ``wacc audit`` folder read back strictly into the report's section
on training frameworks (``wacc.report.audit_section``); the section inside a real report is
checked by ``test_report.py``."""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wacc.audit.plot import plot_errors
from wacc.audit.protocol import user_adapter
from wacc.audit.provenance import collect_provenance
from wacc.audit.report import CSV_COLUMNS, write_csv, write_markdown
from wacc.audit.runner import run_audit
from wacc.audit.windows import build_window
from wacc.errors import UsageError
from wacc.report.audit_section import (
    COLUMNS,
    OPTIONAL_COLUMNS,
    audit_markdown,
    read_audit,
    read_audits,
)

REPO = Path(__file__).resolve().parents[2]
LOOPS = REPO / "tests" / "wacc" / "audit" / "loops.py"
CAUSE = "each microbatch's mean loss / K (loops.py:22): equal weighting."


def make_audit_folder(folder: Path) -> Path:
    """What ``wacc audit --out folder`` writes, for a failing loop (equal weighting) and one that
    does not run, on two windows (the command's own writers, in this process); the failing loop
    names its cause and its fix row (``plain``, not in this run)."""
    failing = user_adapter(f"{LOOPS}:equal_weighting")
    failing = dataclasses.replace(failing, cause=CAUSE, fixed_by="plain")
    adapters = [failing, user_adapter(f"{LOOPS}:raises")]
    result = run_audit(adapters, [build_window("unequal"), build_window("equal")])
    folder.mkdir(parents=True, exist_ok=True)
    provenance = collect_provenance()
    write_markdown(result, folder / "audit.md", provenance)
    write_csv(result, folder / "audit.csv", provenance)
    plot_errors(result, folder / "audit.png")
    return folder


@pytest.fixture(scope="module")
def audit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_audit_folder(tmp_path_factory.mktemp("audit") / "wacc-audit")


def _records(folder: Path) -> list[dict[str, str]]:
    with (folder / "audit.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_the_section_reads_only_columns_the_audit_writes() -> None:
    """Every column the section reads is one ``wacc audit`` writes."""
    assert set(COLUMNS) | set(OPTIONAL_COLUMNS) <= set(CSV_COLUMNS)


def test_the_section_shows_each_loop_and_window_as_the_csv_has_it(audit: Path) -> None:
    """One table row per loop; a failing window shows FAIL with the float64 run's relative L2
    error from the CSV, a loop that raised shows its status; the provenance is stated."""
    run = read_audit(audit)
    records = _records(audit)
    text = "\n".join(audit_markdown([run], "figures/audit.png"))
    failing = next(r for r in records if r["verdict"] == "FAIL")
    assert failing["window"] == "unequal"
    expected = f"**FAIL** {float(failing['f64_rel_l2']):.3g}"
    loop = failing["loop"]
    row = next(line for line in text.splitlines() if line.startswith(f"| {loop} |"))
    # world size 1, the window's tokens; unequal fails, the equal control passes
    assert row.split(" | ")[2:6] == ["1", failing["tokens_true"], expected, "pass"]
    raised = next(line for line in text.splitlines() if line.startswith(f"| {LOOPS}:raises |"))
    assert raised.split(" | ")[4:6] == ["error", "error"]
    assert f"commit `{records[0]['wacc_commit']}`" in text
    assert "1 of 2 loops fail a window" in text
    assert "![wacc audit](figures/audit.png)" in text


def test_the_section_names_each_failing_loops_cause_and_fix(audit: Path) -> None:
    """A failing loop's row names its fix row and its cause is listed under the table; a loop
    that did not fail (it raised) names none."""
    text = "\n".join(audit_markdown([read_audit(audit)], "figures/audit.png"))
    lines = text.splitlines()
    failing = next(line for line in lines if line.startswith(f"| {LOOPS}:equal_weighting |"))
    raised = next(line for line in lines if line.startswith(f"| {LOOPS}:raises |"))
    assert failing.endswith("| `plain` |") and raised.endswith("| - |")
    assert f"- `{LOOPS}:equal_weighting`: {CAUSE}" in lines
    assert sum(line.startswith("- `") for line in lines) == 1


def test_an_audit_without_causes_still_reads(audit: Path, tmp_path: Path) -> None:
    """An audit.csv written before causes were recorded (no cause, fixed_by columns) reads, and
    its section names no fix."""
    folder = tmp_path / "old"
    shutil.copytree(audit, folder)
    records = [{k: v for k, v in r.items() if k not in OPTIONAL_COLUMNS} for r in _records(audit)]
    with (folder / "audit.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    run = read_audit(folder)
    assert all(row.cause == "" and row.fixed_by == "" for row in run.rows)
    assert "`plain`" not in "\n".join(audit_markdown([run], "figures/audit.png"))


def test_audit_md_says_why_a_loop_fails_and_what_fixes_it(audit: Path) -> None:
    """audit.md's "Causes and fixes" names the failing loop, how it fared, its cause and its fix
    row, and how that row fared in the run (absent here)."""
    text = (audit / "audit.md").read_text(encoding="utf-8")
    section = text.split("## Causes and fixes\n\n", 1)[1].split("\n\n", 1)[0]
    assert section == (
        f"- `{LOOPS}:equal_weighting` (fails 1 of 2 windows): {CAUSE} Fixed by `plain` (not in "
        f"this run)."
    )


def _corrupt(audit: Path, tmp_path: Path, line: int, column: str, value: str) -> Path:
    folder = tmp_path / "corrupt"
    shutil.copytree(audit, folder)
    records = _records(audit)
    records[line - 2][column] = value
    with (folder / "audit.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return folder


@pytest.mark.parametrize(
    ("line", "column", "value", "why"),
    [
        (2, "f64_rel_l2", "large", "is not a number"),
        (3, "f64_rel_l2", "-1.0", "is negative"),
        (2, "tokens_counted", "many", "is not a number"),
        (2, "tokens_true", "-3", "is not a count"),
        (2, "tokens_true", "2.5", "is not a count"),
        (2, "tokens_true", "\u00b2", "is not a count"),  # '²'.isdigit(), and int('²') raises
        (2, "tokens_true", "\u0661\u0662", "is not a count"),  # Arabic-Indic 12: int() takes it
        (2, "tokens_counted", "\u0661\u0662", "is not a number"),  # and float() too
        (3, "f64_rel_l2", "inf", "is not finite, but the verdict is pass"),
        (3, "f64_rel_l2", "nan", "is not finite, but the verdict is pass"),
        (2, "f64_rel_l2", "nan", "is not a number, but the verdict is FAIL"),
        (2, "loop", "a|b", "holds '|' or a line break (breaks the table)"),
        (2, "window", "one\ntwo", "holds '|' or a line break (breaks the table)"),
        (3, "dtype", "float8", "differs from line 2's"),
        (2, "dtype", "float8", "is not one of"),
        (2, "verdict", " ", "is empty"),
        (2, "loop", "", "is empty"),
        (2, "cause", "one\ntwo", "holds a line break"),
        (2, "fixed_by", "a|b", "holds '|' or a line break (breaks the table)"),
        (4, "wacc_commit", "abc", "differs from line 2's"),
        (3, "wall_seconds", "soon", "differs from line 2's"),
    ],
)
def test_every_field_the_section_reads_is_checked(
    audit: Path, tmp_path: Path, line: int, column: str, value: str, why: str
) -> None:
    """A bad field is a UsageError naming the file, the line, the column and the value."""
    folder = _corrupt(audit, tmp_path, line, column, value)
    with pytest.raises(UsageError) as raised:
        read_audit(folder)
    message = str(raised.value)
    assert f"line {line}, column {column}: {value!r} {why}" in message
    assert str(folder / "audit.csv") in message


def test_a_loop_on_a_window_twice_is_refused(audit: Path, tmp_path: Path) -> None:
    """Two rows of one (loop, window) are refused, naming both lines: the section shows one
    cell per loop and window, and would show either silently."""
    folder = _corrupt(audit, tmp_path, 3, "window", _records(audit)[0]["window"])
    with pytest.raises(UsageError, match=r"line 3: loop .* on window 'unequal' is also on line 2"):
        read_audit(folder)


def test_a_provenance_field_that_is_bad_on_every_row_is_refused(
    audit: Path, tmp_path: Path
) -> None:
    """A field the same on every row (the run's provenance) is checked too, not only compared."""
    folder = tmp_path / "bad"
    shutil.copytree(audit, folder)
    records = _records(audit)
    for record in records:
        record["wall_seconds"] = "soon"
        record["dtype"] = "float8"
    with (folder / "audit.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    with pytest.raises(UsageError, match="column dtype: 'float8' is not one of"):
        read_audit(folder)


@pytest.mark.parametrize("damage", ["no png", "no column", "no rows", "short row", "binary"])
def test_a_folder_that_is_not_an_audit_is_refused(audit: Path, tmp_path: Path, damage: str) -> None:
    """A missing figure or CSV, a missing column, no rows, a short row or undecodable bytes: one
    UsageError each, never a traceback."""
    folder = tmp_path / "damaged"
    shutil.copytree(audit, folder)
    table = folder / "audit.csv"
    lines = table.read_text(encoding="utf-8").splitlines()
    if damage == "no png":
        (folder / "audit.png").unlink()
    elif damage == "no column":
        header = lines[0].split(",")
        lines[0] = ",".join(["wacc_commitment" if h == "wacc_commit" else h for h in header])
        table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    elif damage == "no rows":
        table.write_text(lines[0] + "\n", encoding="utf-8")
    elif damage == "short row":
        table.write_text("\n".join([lines[0], "loop,window"]) + "\n", encoding="utf-8")
    else:
        table.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError, match="^--audit: "):
        read_audit(folder)


def _report_with_audit(folder: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``python -m wacc report --quick --out OUT --audit FOLDER``."""
    return subprocess.run(
        [sys.executable, "-m", "wacc", "report", "--quick", "--out", str(out), "--audit",
         str(folder)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_a_bad_audit_folder_is_answered_at_once_by_the_command(tmp_path: Path) -> None:
    """``wacc report --audit`` with a folder that holds no audit: exit 2, one line, before the
    corpus runs."""
    started = time.perf_counter()
    result = _report_with_audit(tmp_path, tmp_path / "r")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "holds no audit.csv and audit.png" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()
    assert time.perf_counter() - started < 60  # no corpus was judged (a quick one takes minutes)


def test_a_count_in_another_script_is_exit_2_from_the_command(audit: Path, tmp_path: Path) -> None:
    """``wacc report --audit`` on an audit.csv whose tokens_true is '²' (a digit to
    ``str.isdigit``, not to ``int``): exit 2 and one line naming the file, line and column,
    not an internal error."""
    result = _report_with_audit(
        _corrupt(audit, tmp_path, 2, "tokens_true", "\u00b2"), tmp_path / "r"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "line 2, column tokens_true: '\u00b2' is not a count" in result.stderr


def _rewrite(audit: Path, folder: Path, change: dict[str, str], drop: tuple[str, ...] = ()) -> Path:
    """A copy of ``audit`` whose every row has ``change`` applied and ``drop`` columns removed."""
    shutil.copytree(audit, folder)
    records = [{k: v for k, v in {**r, **change}.items() if k not in drop} for r in _records(audit)]
    with (folder / "audit.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return folder


def test_a_csv_without_the_rank_columns_reads_as_world_size_1(audit: Path, tmp_path: Path) -> None:
    """An audit.csv written before the audit ran across ranks (no ``world_size``,
    ``rank_tokens``, ``predicted_rel_l2``, ``rank_tokens_counted`` columns) reads as world size
    1, one rank holding every token, no prediction."""
    old = _rewrite(audit, tmp_path / "old", {}, drop=("world_size", "rank_tokens",
                   "predicted_rel_l2", "rank_tokens_counted", "ranks_agree"))  # fmt: skip
    run = read_audit(old)
    assert run.world_size == 1
    assert all(r.world_size == 1 and r.rank_tokens == (r.tokens_true,) for r in run.rows)
    assert all(math.isnan(r.predicted_rel_l2) for r in run.rows)


def test_the_section_shows_world_sizes_rank_tokens_and_the_prediction(
    audit: Path, tmp_path: Path
) -> None:
    """Two folders, world size 1 and 2: one table row per loop and world size, the per-rank
    token totals in the row, a FAIL with its predicted error beside the measured one, and the
    figure across ranks linked."""
    records = _records(audit)
    failing = next(r for r in records if r["verdict"] == "FAIL")
    true = int(failing["tokens_true"])
    two = _rewrite(audit, tmp_path / "n2", {"world_size": "2"})
    rows = _records(two)
    for row in rows:  # every window: two ranks whose totals add up to the window's
        total = int(row["tokens_true"])
        row["rank_tokens"] = f"{total - 1};1"
        row["predicted_rel_l2"] = "0.25" if row["verdict"] == "FAIL" else ""
    with (two / "audit.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    runs = read_audits([audit, two])
    assert [r.world_size for r in runs] == [1, 2]
    text = "\n".join(audit_markdown(runs, "figures/audit.png", "figures/audit-ranks.png"))
    loop = failing["loop"]
    lines = [line for line in text.splitlines() if line.startswith(f"| {loop} |")]
    measured = f"**FAIL** {float(failing['f64_rel_l2']):.3g}"
    assert [line.split(" | ")[2:5] for line in lines] == [
        ["1", str(true), measured], ["2", f"{true - 1};1", f"{measured} (predicted 0.25)"],
    ]  # fmt: skip
    assert "![wacc audit across ranks](figures/audit-ranks.png)" in text
    with pytest.raises(UsageError, match="both world size 1"):
        read_audits([audit, audit])


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"world_size": "two"}, "is not a world size"),
        ({"world_size": "0"}, "is not a world size"),
        ({"world_size": "2", "rank_tokens": "5"}, "is not 2 counts joined by ';'"),
        ({"world_size": "2", "rank_tokens": "1;x"}, "is not 2 counts joined by ';'"),
        ({"world_size": "2", "rank_tokens": "1;1"}, "does not add up to"),
        ({"predicted_rel_l2": "soon"}, "is not a number"),
    ],
)
def test_bad_rank_columns_are_usage_errors(
    audit: Path, tmp_path: Path, change: dict[str, str], why: str
) -> None:
    """A bad ``world_size``, ``rank_tokens`` or ``predicted_rel_l2`` is a UsageError naming the
    column and the value."""
    folder = _rewrite(audit, tmp_path / "bad", change)
    column, value = next(iter(change.items())) if len(change) == 1 else list(change.items())[-1]
    with pytest.raises(UsageError, match=re.escape(f"column {column}: {value!r} {why}")):
        read_audit(folder)


def test_the_ranks_figure_draws_no_two_loops_alike() -> None:
    """In the figure across ranks, the first 70 loops each get their own (colour, marker): the
    committed run draws 21 loops, and tab10's colours repeat after ten."""
    from wacc.report.audit_figure import loop_marker

    styles = {(index % 10, loop_marker(index)) for index in range(70)}
    assert len(styles) == 70
