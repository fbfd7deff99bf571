"""``wacc.tables``: a metric reads as its value to 4 significant digits, and a text table keeps
every cell under its own header, numbers right-aligned and words left-aligned."""

from __future__ import annotations

import math

import pytest

from tests.wacc.rendered import shows_metric, text_table
from wacc.tables import format_metric, render_table


@pytest.mark.parametrize(
    "value",
    [0.0, math.inf, 1.0, 2.5, 0.123456789, 1.23456789e-7, 98765.4321, 1.23456e20, 0.99999,
     0.99994, 0.999949, 9.99951, 0.5],
)  # fmt: skip
def test_a_metric_is_its_value_to_four_significant_digits(value: float) -> None:
    """``0`` and ``inf`` as words, any other value to 4 significant digits, a value below 1
    never shown as 1 or more (an error/bound ratio just under the bound held)."""
    assert shows_metric(format_metric(value), value), (value, format_metric(value))


def test_a_ratio_just_below_one_reads_0_9999_and_one_reads_1() -> None:
    """The two sides of the bound: 0.99995 is 0.9999, 1.0 is 1, 1.00004 is 1."""
    assert (format_metric(0.99995), format_metric(1.0), format_metric(1.00004)) == (
        "0.9999", "1", "1",
    )  # fmt: skip
    assert format_metric(0.999949) == "0.9999" and format_metric(1e-300) == "1e-300"


HEADER = ["name", "scenarios", "max ulps", "ratio", "status"]
ROWS = [
    ["a", "12", "1.5", "inf", "ok"],
    ["longer name", "3", "1.235e-05", "0.9999", "FAIL"],
    ["b", "1000", "2e+10", "0", "REGRESSION now"],
]


def test_a_rendered_table_reads_back_as_its_rows() -> None:
    """Read back by column name, the table is exactly the header and rows given."""
    assert text_table(render_table(HEADER, ROWS)) == [
        dict(zip(HEADER, row, strict=True)) for row in ROWS
    ]


def test_numbers_are_right_aligned_and_words_left_aligned() -> None:
    """A number (``1.5``, ``1.235e-05``, ``2e+10``, ``inf``) ends where its column ends; a word
    starts where its column starts; a header is a word; no line ends in spaces."""
    lines = render_table(HEADER, ROWS).splitlines()
    dashes = lines[1]
    spans = []
    at = 0
    for run in dashes.split("  "):
        spans.append((at, at + len(run)))
        at += len(run) + 2
    assert [dashes[a:b] for a, b in spans] == ["-" * (b - a) for a, b in spans]
    for line, cells in zip([lines[0], *lines[2:]], [HEADER, *ROWS], strict=True):
        assert line == line.rstrip()
        for (start, end), cell in zip(spans, cells, strict=True):
            number = cell == "inf" or cell.replace(".", "", 1).replace("e-", "").replace(
                "e+", "").isdigit()  # fmt: skip
            if number:
                assert line[start:end] == cell.rjust(end - start), (line, cell)
            else:
                assert line[start : start + len(cell)] == cell, (line, cell)
                assert line[start + len(cell) : end].strip() == ""
    assert lines[0].startswith("name         scenarios")
    assert lines[2] == "a                   12        1.5     inf  ok"


def test_every_kind_of_number_is_right_aligned_in_a_wide_column() -> None:
    """In a column wider than its cells, ``12``, ``1.5``, ``1.235e-05``, ``2e+10`` and ``inf``
    end where the column ends; ``1.2.3`` (a version, not a number), ``1e5x`` and ``-`` start where
    it starts."""
    cells = ["12", "1.5", "1.235e-05", "2e+10", "inf", "1.2.3", "1e5x", "-"]
    lines = render_table(["a wide column's header"], [[cell] for cell in cells]).splitlines()
    width = len("a wide column's header")
    for line, cell in zip(lines[2:], cells, strict=True):
        if cell in ("1.2.3", "1e5x", "-"):
            assert line == cell, line
        else:
            assert line == cell.rjust(width), line


@pytest.mark.parametrize("row", [["a"], ["a", "b", "c"]])
def test_a_row_of_another_width_than_the_header_is_refused(row: list[str]) -> None:
    """A row with a cell missing or one too many is an error, never a table whose cells stand
    under another column's header."""
    with pytest.raises(ValueError, match="zip"):
        render_table(["x", "y"], [row])
