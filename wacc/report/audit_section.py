"""The report's section on training frameworks: a ``wacc audit --out`` folder read back.

``wacc report --audit DIR [DIR ...]`` puts those audits' table and figure into ``index.md`` (the
repository keeps its committed run in ``reports/audit/``); one folder per world size (``wacc audit
--world-size N``), the table a row per loop and world size.  ``audit.csv``'s ``world_size``,
``rank_tokens`` and ``predicted_rel_l2`` columns are optional: a file without them (written before
the audit ran across ranks) reads as world size 1. ``DIR/audit.csv`` is read strictly — every field
the section shows, and the run's provenance, each checked: a bad one is a
:class:`~wacc.errors.UsageError` naming the file, the line, the column and the value — and
``DIR/audit.png`` is copied next to the report's figures. Light: csv and pathlib only, so a bad
folder is answered before the judge is imported."""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from wacc.commands._common import FLOAT_TEXT, TABLE_BREAKERS, read_bounded
from wacc.errors import UsageError

__all__ = ["AuditRun", "AuditRow", "audit_markdown", "copy_figure", "read_audit", "read_audits"]

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
    world_size: int = 1
    rank_tokens: tuple[int, ...] = ()  # per rank: its true target tokens (one entry at N = 1)
    predicted_rel_l2: float = math.nan  # a loop that weighs ranks equally: its predicted error
    rank_counted: tuple[float | None, ...] = ()  # per rank: what it divided by (N > 1)

    @property
    def imbalance(self) -> float:
        """Largest over smallest per-rank token total (1 at world size 1; inf with an empty
        rank)."""
        if not self.rank_tokens or min(self.rank_tokens) == 0:
            return 1.0 if len(self.rank_tokens) <= 1 else math.inf
        return max(self.rank_tokens) / min(self.rank_tokens)


@dataclass(frozen=True)
class AuditRun:
    """A ``wacc audit`` folder's rows and the run's provenance."""

    folder: Path
    rows: tuple[AuditRow, ...]
    dtype: str
    provenance: dict[str, str]
    world_size: int = 1


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
    first_size = 0
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
        world_size, rank_tokens = _ranks(path, line, record, int(true))
        first_size = first_size or world_size
        if world_size != first_size:
            raise _fail(path, line, "world_size", record["world_size"], "differs from line 2's "
                        f"{first['world_size']!r}: one audit per folder")  # fmt: skip
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
                world_size=world_size,
                rank_tokens=rank_tokens,
                rank_counted=tuple(
                    None if math.isnan(v) else v
                    for part in record.get("rank_tokens_counted", "").split(";")
                    if record.get("rank_tokens_counted", "")
                    for v in [_number(path, line, "rank_tokens_counted", part, empty=True)]
                ),
                predicted_rel_l2=_number(
                    path, line, "predicted_rel_l2", record.get("predicted_rel_l2", ""), empty=True
                ),
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
        world_size=rows[0].world_size,
    )


def _ranks(path: Path, line: int, record: dict[str, str], true: int) -> tuple[int, tuple[int, ...]]:
    """The row's world size and per-rank token totals (a file without the columns: world size
    1, one rank holding every token); the totals must be one per rank and add up to
    ``tokens_true`` (``true`` 0: not checked)."""
    size_text = record.get("world_size", "1")
    if _COUNT.fullmatch(size_text) is None or int(size_text) < 1:
        raise _fail(path, line, "world_size", size_text, "is not a world size (1, 2, ...)")
    size = int(size_text)
    tokens_text = record.get("rank_tokens", str(true))
    parts = tokens_text.split(";")
    if any(_COUNT.fullmatch(p) is None for p in parts) or len(parts) != size:
        raise _fail(path, line, "rank_tokens", tokens_text, f"is not {size} counts joined by ';'")
    tokens = tuple(int(p) for p in parts)
    if true and sum(tokens) != true:
        raise _fail(path, line, "rank_tokens", tokens_text, f"does not add up to {true}")
    return size, tokens


def read_audits(folders: Sequence[Path]) -> list[AuditRun]:
    """:func:`read_audit` of each folder: one world size each, all in one dtype (a
    :class:`UsageError` names the folder that breaks either)."""
    runs = [read_audit(folder) for folder in folders]
    seen: dict[int, Path] = {}
    for run in runs:
        if run.world_size in seen:
            raise UsageError(
                f"--audit: {str(run.folder)!r} and {str(seen[run.world_size])!r} "
                f"are both world size {run.world_size}: one folder per world size"
            )
        seen[run.world_size] = run.folder
        if run.dtype != runs[0].dtype:
            raise UsageError(f"--audit: {str(run.folder)!r} is dtype {run.dtype}, "
                             f"{str(runs[0].folder)!r} {runs[0].dtype}: one dtype")  # fmt: skip
    return runs


def _cell(row: AuditRow) -> str:
    if row.verdict == "pass":
        return "pass"
    if row.verdict == "FAIL":
        predicted = ""
        if not math.isnan(row.predicted_rel_l2):
            predicted = f" (predicted {row.predicted_rel_l2:.3g})"
        return f"**FAIL** {row.f64_rel_l2:.3g}{predicted}"
    return row.verdict.split(":")[0]  # not installed, not run, error


def audit_markdown(
    runs: Sequence[AuditRun], figure: str, ranks_figure: str | None = None
) -> list[str]:
    """The section's lines: provenance, one row per loop and world size, the figures."""
    rows = [row for run in runs for row in run.rows]
    windows = list(dict.fromkeys(row.window for row in rows))
    loops = list(dict.fromkeys(row.loop for row in rows))
    sizes = sorted({run.world_size for run in runs})
    by = {(row.loop, row.world_size, row.window): row for row in rows}
    first_window = windows[0]
    failing = sorted({row.loop for row in rows if row.verdict == "FAIL"})
    provenances = []
    for run in sorted(runs, key=lambda r: r.world_size):
        p = run.provenance
        provenances.append(
            f"world size {run.world_size} from `{run.folder.as_posix()}`: wacc "
            f"{p['wacc_version']} at commit `{p['wacc_commit']}`, {p['date']}, {p['machine']}, "
            f"torch {p['torch']}, Python {p['python']}; wall time "
            f"{float(p['wall_seconds']):.0f} s"
        )
    across = ""
    if sizes != [1]:
        across = (
            " At world size N > 1 each loop runs as N processes (gloo), each rank on a window of "
            "its own; the truth is the mean over every rank's tokens, and `rank tokens` gives "
            "each rank's total (`predicted`: the error a loop that weighs ranks equally must "
            "have, from those totals)."
        )
    lines = [
        "## Training frameworks (`wacc audit`)",
        "",
        "; ".join(provenances) + f"; dtype {runs[0].dtype}. Each loop's real code path hands "
        "its optimizer a gradient, compared with the exact float64 gradient of the mean token "
        "loss over the whole window; a window's cell is the verdict with the relative L2 error "
        "of the loop's float64 run (what the loop computes, free of rounding). `tokens` is what "
        f"the loop divided by on the `{first_window}` window against the true count."
        f"{across} {len(failing)} of {len(loops)} loops fail a window. The audit's own "
        "`audit.md` has every column and the cause of each failure.",
        "",
        "| loop | version | world size | rank tokens | " + " | ".join(windows)
        + " | tokens | mid-window resume | fixed by |",
        "|" + "---|" * (len(windows) + 7),
    ]  # fmt: skip
    causes = []
    for loop in loops:
        for size in sizes:
            cells_of = [by.get((loop, size, w)) for w in windows]
            present = [r for r in cells_of if r is not None]
            if not present:
                continue
            head = present[0]
            first = by.get((loop, size, first_window))
            tokens = "-"
            if first is not None and first.verdict in ("pass", "FAIL"):
                tokens = (
                    "per-microbatch mean"
                    if first.tokens_counted is None
                    else f"{first.tokens_counted:g}/{first.tokens_true}"
                )
                if any(c is not None for c in first.rank_counted):  # what each rank divided by
                    counted = ";".join(
                        "mean" if c is None else f"{c:g}" for c in first.rank_counted
                    )
                    tokens = f"{counted}/{first.tokens_true}"
            rank_tokens = ";".join(str(n) for n in first.rank_tokens) if first else "-"
            resume = head.mid_window_resume.replace("|", "\\|") or "-"
            cells = [_cell(r) if r is not None else "-" for r in cells_of]
            failed = any(r is not None and r.verdict == "FAIL" for r in cells_of)
            fix = f"`{head.fixed_by}`" if failed and head.fixed_by else "-"
            lines.append(
                f"| {loop} | {head.version or '-'} | {size} | {rank_tokens} | "
                + " | ".join(cells) + f" | {tokens} | {resume} | {fix} |"
            )  # fmt: skip
            if failed and head.cause and f"- `{loop}`: {head.cause}" not in causes:
                causes.append(f"- `{loop}`: {head.cause}")
    if causes:
        lines += ["", "Why each failing loop fails, in its framework's source:", "", *causes]
    lines += ["", f"![wacc audit]({figure})", ""]
    if ranks_figure is not None:
        lines += [
            f"![wacc audit across ranks]({ranks_figure})",
            "",
            "Left: each loop's float64 error on the `unequal` window against the world size. "
            "Right: against the per-rank token imbalance (largest over smallest rank total) at "
            "world size > 1, every window; a loop that weighs ranks equally grows with it, one "
            "that weighs tokens stays at float64 rounding (drawn at 1e-17 when exactly 0).",
            "",
        ]
    return lines


def copy_figure(run: AuditRun, figures: Path) -> Path:
    """``audit.png`` into the report's figure folder (``audit-N<n>.png`` for world size n > 1)."""
    target = figures / ("audit.png" if run.world_size == 1 else f"audit-N{run.world_size}.png")
    target.write_bytes(read_bounded(run.folder / "audit.png", _MAX_BYTES, what="an audit.png"))
    return target
