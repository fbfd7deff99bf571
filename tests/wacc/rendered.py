"""Reading rendered tables back into rows, so that a test compares what the user reads, cell by
cell and by column *name*, with the data it renders (issue 33).

A test that only looks for a substring passes when two columns are swapped or a value is
rounded the wrong way; one that reads the table back as ``{header: cell}`` rows does not.
Two forms are read: Markdown pipe tables (``index.md``, ``gate.md``, ``audit.md``) and the
fixed-width text tables printed on the terminal (a header, a line of dashes, the rows).

The readers are strict: a row with another number of cells than the header, a header named
twice or a table without its separator line is an error (:class:`TableError`), never a silently
shifted column.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = [
    "TableError",
    "markdown_table",
    "markdown_tables",
    "metric_value",
    "section",
    "shows_metric",
    "text_alignments",
    "text_table",
]

Rows = list[dict[str, str]]

_SEPARATOR_CELL = re.compile(r":?-{3,}:?")
_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")
_DASHES = re.compile(r"-+")


class TableError(ValueError):
    """Text that is not the table a test expected to read."""


def _cells(line: str) -> list[str]:
    """The cells of one ``| a | b |`` line, stripped, ``\\|`` read as ``|``."""
    inner = line.strip()
    if not (inner.startswith("|") and inner.endswith("|")) or len(inner) < 2:
        raise TableError(f"not a table line: {line!r}")
    return [cell.strip().replace("\\|", "|") for cell in _UNESCAPED_PIPE.split(inner[1:-1])]


def _rows(header: list[str], lines: Sequence[str]) -> Rows:
    if len(set(header)) != len(header):
        raise TableError(f"a header named twice: {header}")
    rows = []
    for line in lines:
        cells = _cells(line)
        if len(cells) != len(header):
            raise TableError(f"{len(cells)} cells under {len(header)} headers: {line!r}")
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def markdown_tables(text: str) -> list[Rows]:
    """Every pipe table of a Markdown text, in order, each as its rows keyed by header."""
    tables: list[Rows] = []
    lines = text.splitlines()
    at = 0
    while at < len(lines):
        if not lines[at].lstrip().startswith("|"):
            at += 1
            continue
        end = at
        while end < len(lines) and lines[end].lstrip().startswith("|"):
            end += 1
        block = lines[at:end]
        if len(block) < 2 or not all(_SEPARATOR_CELL.fullmatch(c) for c in _cells(block[1])):
            raise TableError(f"a table without its separator line: {block[:2]!r}")
        header = _cells(block[0])
        if len(_cells(block[1])) != len(header):
            raise TableError(f"a separator of another width than its header: {block[:2]!r}")
        tables.append(_rows(header, block[2:]))
        at = end
    return tables


def markdown_table(text: str) -> Rows:
    """The one pipe table of ``text`` (an error if there are none or several)."""
    tables = markdown_tables(text)
    if len(tables) != 1:
        raise TableError(f"{len(tables)} tables where one was expected")
    return tables[0]


def _heading_level(line: str) -> int | None:
    """``## x`` -> 2; a whole line in bold (``**Regressions**``, gate.md's headings) -> 7, below
    every Markdown level; any other line -> None."""
    marks = len(line) - len(line.lstrip("#"))
    if 0 < marks <= 6 and line[marks : marks + 1] == " ":
        return marks
    if len(line) > 4 and line.startswith("**") and line.endswith("**"):
        return 7
    return None


def section(text: str, heading: str) -> str:
    """The body of the Markdown section whose heading line is ``heading`` (``## Headline``, or a
    line in bold, ``**Regressions**``), up to the next heading of the same or a higher level."""
    level = _heading_level(heading)
    if level is None:
        raise TableError(f"not a heading: {heading!r}")
    lines = text.splitlines()
    try:
        start = lines.index(heading) + 1
    except ValueError:
        raise TableError(f"no section {heading!r}") from None
    end = start
    while end < len(lines):
        found = _heading_level(lines[end])
        if found is not None and found <= level:
            break
        end += 1
    return "\n".join(lines[start:end])


def _layout(text: str) -> tuple[list[str], int, list[tuple[int, int]]]:
    """A text table's lines, the index of its line of dashes, and each column's span."""
    lines = text.splitlines()
    try:
        rule = next(
            i
            for i, line in enumerate(lines)
            if i > 0 and line.strip() and set(line.strip()) <= {"-", " "}
        )
    except StopIteration:
        raise TableError("no line of dashes under a header") from None
    spans = [(m.start(), m.end()) for m in _DASHES.finditer(lines[rule])]
    if any(b[0] - a[1] < 2 for a, b in zip(spans, spans[1:], strict=False)):
        raise TableError(f"columns not two spaces apart: {lines[rule]!r}")
    return lines, rule, spans


def _spans(line: str, spans: list[tuple[int, int]]) -> list[str]:
    """The raw text of each column's span in ``line`` (a cell spilling out of it is an error)."""
    for a, b in zip(spans, spans[1:], strict=False):
        if line[a[1] : b[0]].strip():
            raise TableError(f"a cell wider than its column: {line!r}")
    if line[spans[-1][1] :].strip():
        raise TableError(f"a cell wider than the last column: {line!r}")
    return [line[start:end] for start, end in spans]


def _body(lines: list[str], rule: int) -> list[str]:
    body = []
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        body.append(line)
    return body


def text_table(text: str) -> Rows:
    """A fixed-width terminal table (its header line, a line of dash runs separated by spaces,
    then one line per row) as rows keyed by header. Each column spans its run of dashes: a cell
    is what lies there, left- or right-aligned, stripped. Text before the header is ignored up
    to the first line that is only dash runs; the rows end at the first blank line."""
    lines, rule, spans = _layout(text)
    header = [cell.strip() for cell in _spans(lines[rule - 1], spans)]
    if len(set(header)) != len(header):
        raise TableError(f"a header named twice: {header}")
    return [
        dict(zip(header, (cell.strip() for cell in _spans(line, spans)), strict=True))
        for line in _body(lines, rule)
    ]


def text_alignments(text: str, *, header: bool = False) -> Rows:
    """How each cell of a text table sits in its column: ``left`` (starts where the column
    starts), ``right`` (ends where it ends), ``fills`` (both), ``empty``, or ``middle``; one
    row per body row (the header row first with ``header=True``), keyed by header."""
    lines, rule, spans = _layout(text)
    names = [cell.strip() for cell in _spans(lines[rule - 1], spans)]

    def where(raw: str) -> str:
        if not raw.strip():
            return "empty"
        left, right = raw[:1] != " ", len(raw) == len(raw.rstrip()) and raw[-1:] != " "
        return {(True, True): "fills", (True, False): "left", (False, True): "right"}.get(
            (left, right), "middle"
        )

    rows = ([lines[rule - 1]] if header else []) + _body(lines, rule)
    return [
        dict(
            zip(names, (where(raw) for raw in _spans(line.ljust(spans[-1][1]), spans)), strict=True)
        )
        for line in rows
    ]


def metric_value(cell: str) -> float:
    """The number a metric cell shows (``0``, ``inf``, ``1.234e-05``, ``0.5``)."""
    return math.inf if cell == "inf" else float(cell)


def shows_metric(cell: str, value: float, *, digits: int = 4) -> bool:
    """Whether ``cell`` shows ``value`` as a table should: exactly ``0`` and ``inf`` for those,
    else a number with at most ``digits`` significant digits that is ``value`` to within half a
    unit of its last digit, and below 1 when ``value`` is (a ratio just under the bound must not
    read as 1)."""
    if value == 0 or math.isinf(value):
        return cell == ("0" if value == 0 else "inf")
    try:
        shown = float(cell)
    except ValueError:
        return False
    mantissa = cell.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    if len(mantissa) > digits:
        return False
    if value < 1 <= shown:
        return False
    # Half a unit in the last of `digits` significant digits of the value, plus one for the
    # one case that moves it: 0.99995 shown as 0.9999 rather than 1.
    unit = 10.0 ** (math.floor(math.log10(abs(value))) - digits + 1)
    return abs(shown - value) <= unit * (1.0 if value < 1 <= round(value, digits) else 0.5)
