"""The report's section on training frameworks: a ``wacc audit --out`` folder read back.

``wacc report --audit DIR`` puts that audit's table and figure into ``index.md`` (the repository
keeps its committed run in ``reports/audit/``). ``DIR/audit.csv`` is read strictly — every field
the section shows, and the run's provenance, each checked: a bad one is a
:class:`~wacc.errors.UsageError` naming the file, the line, the column and the value — and
``DIR/audit.png`` is copied next to the report's figures. Light: csv and pathlib only, so a bad
folder is answered before the judge is imported."""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path

from wacc.commands._common import FLOAT_TEXT, TABLE_BREAKERS, read_bounded
from wacc.errors import UsageError

__all__ = ["AuditRun", "AuditRow", "audit_markdown", "copy_figure", "read_audit"]

# What the section reads of audit.csv (wacc.audit.report.CSV_COLUMNS has them all: tested).
COLUMNS = (
    "loop", "window", "verdict", "version", "dtype", "f64_rel_l2", "tokens_counted",
    "tokens_true", "mid_window_resume", "wacc_version", "wacc_commit", "date", "machine",
    "torch", "python", "wall_seconds",
)  # fmt: skip
# Read when present (an audit.csv of wacc 0.2.0 has neither): why a loop fails and its fix row.
OPTIONAL_COLUMNS = ("cause", "fixed_by")
_DTYPES = ("float32", "bfloat16", "float16")
_MAX_BYTES = 64 * 2**20  # audit.csv and audit.png: a few kB each for every built-in loop
# A count as the audit writes it: ASCII digits (``str.isdigit`` also takes '²' and '١٢').
_COUNT = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class AuditRow:
    """One loop on one window, as the section shows it."""

    loop: str
    window: str
    verdict: str  # pass | FAIL | the status of a loop that did not run
    version: str
    f64_rel_l2: float
    tokens_counted: float | None
    tokens_true: int
    mid_window_resume: str
    cause: str = ""  # why the loop fails, in the framework's source ("" when not recorded)
    fixed_by: str = ""  # the `+wacc` row whose integration fixes it ("" when none)


@dataclass(frozen=True)
class AuditRun:
    """A ``wacc audit`` folder's rows and the run's provenance."""

    folder: Path
    rows: tuple[AuditRow, ...]
    dtype: str
    provenance: dict[str, str]


def _fail(path: Path, line: int, column: str, value: str, why: str) -> UsageError:
    return UsageError(f"--audit: {path} line {line}, column {column}: {value!r} {why}")


def _number(path: Path, line: int, column: str, value: str, *, empty: bool = False) -> float:
    if empty and value == "":
        return math.nan
    if FLOAT_TEXT.fullmatch(value) is None:
        raise _fail(path, line, column, value, "is not a number")
    number = float(value)
    if number < 0 and not math.isnan(number):
        raise _fail(path, line, column, value, "is negative")
    return number


def _text(path: Path, line: int, column: str, value: str) -> str:
    if not value.strip():
        raise _fail(path, line, column, value, "is empty")
    return value


def _name(path: Path, line: int, column: str, value: str) -> str:
    """A loop or window name: not empty, and nothing that breaks the section's table."""
    if TABLE_BREAKERS.search(_text(path, line, column, value)):
        raise _fail(path, line, column, value, "holds '|' or a line break (breaks the table)")
    return value


def _one_line(path: Path, line: int, column: str, value: str) -> str:
    """A sentence the section shows under its table: no line break."""
    if "\n" in value or "\r" in value:
        raise _fail(path, line, column, value, "holds a line break")
    return value


def _fix_name(path: Path, line: int, value: str) -> str:
    """``fixed_by``: empty, or a loop name (:func:`_name`)."""
    return value if value == "" else _name(path, line, "fixed_by", value)


def _error(path: Path, line: int, verdict: str, value: str) -> float:
    """``f64_rel_l2``: a finite error for a pass; finite or inf (a non-finite gradient) for a
    FAIL; for a loop that did not run, what the audit writes there (nan)."""
    number = _number(path, line, "f64_rel_l2", value)
    if verdict == "pass" and not math.isfinite(number):
        raise _fail(path, line, "f64_rel_l2", value, "is not finite, but the verdict is pass")
    if verdict == "FAIL" and math.isnan(number):
        raise _fail(path, line, "f64_rel_l2", value, "is not a number, but the verdict is FAIL")
    return number


def read_audit(folder: Path) -> AuditRun:
    """``folder/audit.csv`` checked field by field (module docstring); ``folder/audit.png``
    must exist. Raises :class:`UsageError` naming what is wrong."""
    path = folder / "audit.csv"
    if not path.exists() or not (folder / "audit.png").exists():  # a FIFO too: read bounded
        raise UsageError(
            f"--audit: {str(folder)!r} holds no audit.csv and audit.png (a folder `wacc audit "
            f"--out` wrote)"
        )
    data = read_bounded(path, _MAX_BYTES, what="an audit.csv")
    try:
        with io.StringIO(data.decode("utf-8"), newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise UsageError(
                    f"--audit: {path} has no column {missing[0]!r} (written by a wacc before "
                    f"0.2, or not by `wacc audit`: run the audit again)"
                )
            records = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise UsageError(f"--audit: {path}: {exc}") from None
    if not records:
        raise UsageError(f"--audit: {path} has no rows")
    rows = []
    seen: dict[tuple[str, str], int] = {}
    first = records[0]
    for line, record in enumerate(records, start=2):
        if None in record or any(v is None for v in record.values()):
            raise UsageError(f"--audit: {path} line {line}: not as many fields as columns")
        for column in ("dtype", *COLUMNS[9:]):
            if record[column] != first[column]:
                raise _fail(path, line, column, record[column], f"differs from line 2's "
                            f"{first[column]!r}: one audit per folder")  # fmt: skip
        if record["dtype"] not in _DTYPES:
            raise _fail(path, line, "dtype", record["dtype"], f"is not one of {_DTYPES}")
        counted = _number(path, line, "tokens_counted", record["tokens_counted"], empty=True)
        true = record["tokens_true"]
        if _COUNT.fullmatch(true) is None:
            raise _fail(path, line, "tokens_true", true, "is not a count")
        verdict = _text(path, line, "verdict", record["verdict"])
        rows.append(
            AuditRow(
                loop=_name(path, line, "loop", record["loop"]),
                window=_name(path, line, "window", record["window"]),
                verdict=verdict,
                version=record["version"],
                f64_rel_l2=_error(path, line, verdict, record["f64_rel_l2"]),
                tokens_counted=None if math.isnan(counted) else counted,
                tokens_true=int(true),
                mid_window_resume=record["mid_window_resume"],
                cause=_one_line(path, line, "cause", record.get("cause", "")),
                fixed_by=_fix_name(path, line, record.get("fixed_by", "")),
            )
        )
        key = (rows[-1].loop, rows[-1].window)
        if key in seen:  # the section shows one cell per loop and window
            raise UsageError(f"--audit: {path} line {line}: loop {key[0]!r} on window "
                             f"{key[1]!r} is also on line {seen[key]}")  # fmt: skip
        seen[key] = line
    for column in COLUMNS[9:]:
        _text(path, 2, column, first[column])
    _number(path, 2, "wall_seconds", first["wall_seconds"])
    return AuditRun(
        folder=folder,
        rows=tuple(rows),
        dtype=first["dtype"],
        provenance={column: first[column] for column in COLUMNS[9:]},
    )


def _cell(row: AuditRow) -> str:
    if row.verdict == "pass":
        return "pass"
    if row.verdict == "FAIL":
        return f"**FAIL** {row.f64_rel_l2:.3g}"
    return row.verdict.split(":")[0]  # not installed, not run, error


def audit_markdown(run: AuditRun, figure: str) -> list[str]:
    """The section's lines: provenance, one row per loop, the figure."""
    windows = list(dict.fromkeys(row.window for row in run.rows))
    loops = list(dict.fromkeys(row.loop for row in run.rows))
    by = {(row.loop, row.window): row for row in run.rows}
    first_window = windows[0]
    p = run.provenance
    failing = sorted({row.loop for row in run.rows if row.verdict == "FAIL"})
    lines = [
        "## Training frameworks (`wacc audit`)",
        "",
        f"From `{run.folder.as_posix()}`: wacc {p['wacc_version']} at commit `{p['wacc_commit']}`, "
        f"{p['date']}, {p['machine']}, torch {p['torch']}, Python {p['python']}, dtype "
        f"{run.dtype}; wall time {float(p['wall_seconds']):.0f} s. Each loop's real code path "
        "hands its optimizer a gradient, compared with the exact float64 gradient of the mean "
        "token loss over the whole window; a window's cell is the verdict with the relative L2 "
        "error of the loop's float64 run (what the loop computes, free of rounding). "
        f"`tokens` is what the loop divided by on the `{first_window}` window against the true "
        f"count. {len(failing)} of {len(loops)} loops fail a window. The audit's own "
        "`audit.md` has every column and the cause of each failure.",
        "",
        "| loop | version | " + " | ".join(windows) + " | tokens | mid-window resume | fixed by |",
        "|" + "---|" * (len(windows) + 5),
    ]
    causes = []
    for loop in loops:
        rows = [by.get((loop, w)) for w in windows]
        head = next(r for r in rows if r is not None)
        first = by.get((loop, first_window))
        tokens = "-"
        if first is not None and first.verdict in ("pass", "FAIL"):
            tokens = (
                "per-microbatch mean"
                if first.tokens_counted is None
                else f"{first.tokens_counted:g}/{first.tokens_true}"
            )
        resume = head.mid_window_resume.replace("|", "\\|") or "-"
        cells = [_cell(r) if r is not None else "-" for r in rows]
        failed = any(r is not None and r.verdict == "FAIL" for r in rows)
        fix = f"`{head.fixed_by}`" if failed and head.fixed_by else "-"
        lines.append(
            f"| {loop} | {head.version or '-'} | "
            + " | ".join(cells)
            + f" | {tokens} | {resume} | {fix} |"
        )
        if failed and head.cause:
            causes.append(f"- `{loop}`: {head.cause}")
    if causes:
        lines += ["", "Why each failing loop fails, in its framework's source:", "", *causes]
    lines += ["", f"![wacc audit]({figure})", ""]
    return lines


def copy_figure(run: AuditRun, figures: Path) -> Path:
    """``audit.png`` into the report's figure folder."""
    target = figures / "audit.png"
    target.write_bytes(read_bounded(run.folder / "audit.png", _MAX_BYTES, what="an audit.png"))
    return target
