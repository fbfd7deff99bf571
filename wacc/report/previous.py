"""``wacc report --compare-to DIR``: a previous report's numbers next to the new ones.

The previous report is read from its ``divergence.csv`` (the rows the headline is made of), so
any report this tool wrote can be compared with, including one from an older version whose CSV
lacks the oracle and provenance columns and names ``max_rel_error`` so (only the row's own
columns, :data:`~wacc.report.writer.ROW_COLUMNS`, are read; a ``not judged`` line, a scenario
an implementation was not run on, has no numbers and is skipped). Reading is strict: a file that
is not such a CSV, a missing column, or a field that does not parse is a
:class:`~wacc.errors.UsageError` of one line naming the file, the line, the column and the
value (exit 2), never a traceback or a silently wrong comparison.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from wacc.commands._common import FLOAT_TEXT, TABLE_BREAKERS, read_bounded
from wacc.errors import UsageError
from wacc.judge.verdict import ORACLES
from wacc.report.rows import Row
from wacc.report.writer import CSV_NAMES, ROW_FIELDS, Headline, headline
from wacc.tables import format_metric
from wacc_ref import formats
from wacc_ref.strict_json import shown

__all__ = ["COMPARISON_HEADER", "Change", "compare_headlines", "comparison_rows", "read_rows"]

_MAX_BYTES = 256 * 2**20  # a full-size report's CSV is a few MB
_FLOATS = ("weight_skew", "loss_scale", "max_ulps", "max_rel_error", "max_ratio")
_METRICS = ("max_ulps", "max_rel_error", "max_ratio")  # maxima of magnitudes: >= 0 or inf


class _BadField(Exception):
    pass


def _float(text: str, column: str) -> float:
    if FLOAT_TEXT.fullmatch(text) is None:
        raise _BadField("not a number")
    value = float(text)
    if math.isnan(value):
        raise _BadField("must not be NaN")
    if column in _METRICS and value < 0:
        raise _BadField("must be >= 0 (a maximum of magnitudes)")
    return value


def _int(text: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise _BadField("must be a decimal integer >= 0")
    return int(text)


def _verdict(text: str) -> str:
    if text == "pass":
        return text
    oracles = text.removeprefix("fail: ").split(",")
    if not text.startswith("fail: ") or not set(oracles) <= set(ORACLES) or not all(oracles):
        raise _BadField(f"must be 'pass' or 'fail: ' and oracles from {', '.join(ORACLES)}")
    return text


def _row(record: dict[str, str]) -> Row:
    values: dict[str, object] = {}
    for column in ROW_FIELDS:
        text = record[column]
        try:
            if column in _FLOATS:
                values[column] = _float(text, column)
            elif column == "window_length":
                values[column] = _int(text)
            elif column == "verdict":
                values[column] = _verdict(text)
            elif column == "work_dtype" and text not in formats.WORK_DTYPES:
                raise _BadField(f"must be a work dtype ({', '.join(formats.WORK_DTYPES)})")
            elif column != "replay" and not text:
                raise _BadField("must not be empty")
            elif TABLE_BREAKERS.search(text):  # the comparison is a markdown table in index.md
                raise _BadField("must not hold '|' or a line break")
            else:
                values[column] = text
        except _BadField as exc:
            raise _BadField(f"{column}: {exc}, got {shown(text)}") from None
    return Row(**values)  # type: ignore[arg-type]


def read_rows(folder: Path) -> list[Row]:
    """The rows of ``folder/divergence.csv`` (see the module docstring for what is refused)."""
    path = folder / "divergence.csv"
    name = str(path)
    if not folder.is_dir():
        raise UsageError(f"--compare-to: {str(folder)!r} is not a report folder")
    if not path.exists():
        raise UsageError(
            f"--compare-to: no divergence.csv in {str(folder)!r} (a folder `wacc report` wrote)"
        )
    try:
        text = read_bounded(path, _MAX_BYTES, what="a report's CSV").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name!r}: not UTF-8 text: {exc}") from None
    try:
        lines = list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        raise UsageError(f"{name!r}: not CSV: {exc}") from None
    if not lines:
        raise UsageError(f"{name!r}: empty: no header line")
    header = lines[0]
    repeated = sorted({column for column in header if header.count(column) > 1})
    if repeated:
        raise UsageError(f"{name!r}: line 1: column {repeated[0]!r} appears twice")
    # A field's CSV name (or, from a wacc before 0.2, the field's own name) -> the field.
    by_column = {CSV_NAMES.get(field, field): field for field in ROW_FIELDS}
    by_column.update({field: field for field in CSV_NAMES if CSV_NAMES[field] not in header})
    present = {by_column[column] for column in header if column in by_column}
    missing = [CSV_NAMES.get(field, field) for field in ROW_FIELDS if field not in present]
    if missing:
        raise UsageError(
            f"{name!r}: line 1: missing column(s) {', '.join(missing)} (not a report's CSV)"
        )
    rows: list[Row] = []
    seen: dict[tuple[str, str, str], int] = {}
    for number, cells in enumerate(lines[1:], start=2):
        if len(cells) != len(header):
            raise UsageError(
                f"{name!r}: line {number}: {len(cells)} fields, the header has {len(header)}"
            )
        try:
            record = {by_column[column]: text for column, text in zip(header, cells, strict=True)
                      if column in by_column}  # fmt: skip
            if record["verdict"].startswith("not judged: "):
                continue  # a scenario not run (a missing feature): no numbers to compare
            rows.append(_row(record))
        except _BadField as exc:
            raise UsageError(f"{name!r}: line {number}: {exc}") from None
        key = (rows[-1].scenario_id, rows[-1].implementation, rows[-1].device)
        if key in seen:  # one row per scenario x implementation x device: counted once
            raise UsageError(f"{name!r}: line {number}: scenario {key[0]!r} of {key[1]!r} on "
                             f"{key[2]} is also on line {seen[key]}")  # fmt: skip
        seen[key] = number
    if not rows:
        raise UsageError(f"{name!r}: no rows to compare with")
    return rows


@dataclass(frozen=True)
class Change:
    """A headline line now and in the previous report (either may be None)."""

    now: Headline | None
    before: Headline | None

    @property
    def key(self) -> tuple[str, str, str]:
        line = self.now or self.before
        assert line is not None
        return line.work_dtype, line.implementation, line.device

    @property
    def status(self) -> str:
        """``new``, ``gone``, ``worse`` (a metric up or more failing), ``better`` or ``same``."""
        if self.before is None:
            return "new"
        if self.now is None:
            return "gone"
        now, before = self.now, self.before
        pairs = [(getattr(now, m), getattr(before, m)) for m in _METRICS]
        pairs.append((now.failing / now.scenarios, before.failing / before.scenarios))
        if any(a > b for a, b in pairs):
            return "worse"
        if any(a < b for a, b in pairs):
            return "better"
        return "same"


def compare_headlines(now: Sequence[Row], before: Sequence[Row]) -> list[Change]:
    """The headline lines of both, matched by work dtype x implementation x device (the new
    report's order, then lines only the previous one has)."""
    previous = {(h.work_dtype, h.implementation, h.device): h for h in headline(before)}
    changes = []
    for line in headline(now):
        changes.append(Change(line, previous.pop((line.work_dtype, line.implementation,
                                                  line.device), None)))  # fmt: skip
    changes += [Change(None, line) for line in previous.values()]
    return changes


COMPARISON_HEADER = (
    "dtype", "implementation", "device", "scenarios", "max ulps", "max rel err (normal)",
    "max err/bound", "verdict", "change",
)  # fmt: skip


def comparison_rows(changes: Sequence[Change]) -> list[list[str]]:
    """Table cells: each value as ``now (before)``; ``-`` where a side has no line."""

    def pair(get: str) -> str:
        sides = []
        for line in (change.now, change.before):
            if line is None:
                sides.append("-")
            elif get == "scenarios":
                sides.append(str(line.scenarios))
            elif get == "verdict":
                sides.append(line.verdict)
            else:
                sides.append(format_metric(getattr(line, get)))
        return f"{sides[0]} ({sides[1]})"

    rows = []
    for change in changes:
        dtype, name, device = change.key
        rows.append([dtype, name, device, pair("scenarios"), pair("max_ulps"),
                     pair("max_rel_error"), pair("max_ratio"), pair("verdict"),
                     change.status])  # fmt: skip
    return rows
