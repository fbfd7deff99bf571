"""``tests/wacc/rendered.py``: the readers the rendered-output tests rely on read exactly what a
user reads, and refuse what they cannot read unambiguously (tables written here by hand, not by
the code under test)."""

from __future__ import annotations

import math

import pytest

from tests.wacc.rendered import (
    TableError,
    markdown_table,
    markdown_tables,
    metric_value,
    section,
    shows_metric,
    text_alignments,
    text_table,
)

MARKDOWN = """\
# title

| name | max ulps | note |
|---|---:|---|
| a | 1.5 | x \\| y |
| `b` | inf |  |

## Two

| k | v |
|:---|---:|
| 1 | 2 |
"""


def test_markdown_tables_are_rows_keyed_by_header() -> None:
    """Each pipe table reads as one dict per row, header -> stripped cell, an escaped pipe as a
    pipe and an empty cell as empty; two tables are two lists."""
    first, second = markdown_tables(MARKDOWN)
    assert first == [
        {"name": "a", "max ulps": "1.5", "note": "x | y"},
        {"name": "`b`", "max ulps": "inf", "note": ""},
    ]
    assert second == [{"k": "1", "v": "2"}]


def test_a_swap_of_two_columns_reads_as_other_values() -> None:
    """The same cells under swapped headers give other rows: a test comparing by column name
    notices a swap that a substring test would not."""
    swapped = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    straight = "| b | a |\n|---|---|\n| 1 | 2 |\n"
    assert markdown_table(swapped) != markdown_table(straight)
    assert markdown_table(swapped)[0]["a"] == "1" and markdown_table(straight)[0]["a"] == "2"


@pytest.mark.parametrize(
    "text",
    [
        "| a | b |\n|---|---|\n| 1 |\n",  # a cell missing
        "| a | b |\n|---|---|\n| 1 | 2 | 3 |\n",  # one cell too many
        "| a | a |\n|---|---|\n| 1 | 2 |\n",  # a header named twice
        "| a | b |\n| 1 | 2 |\n",  # no separator line
        "| a | b |\n|---|\n| 1 | 2 |\n",  # a separator narrower than the header
        "| a | b\n|---|---|\n",  # a line that does not end its table
    ],
)
def test_a_malformed_markdown_table_is_an_error(text: str) -> None:
    """A table that cannot be read unambiguously is refused, never read with shifted columns."""
    with pytest.raises(TableError):
        markdown_tables(text)


def test_markdown_table_wants_exactly_one_table() -> None:
    """``markdown_table`` is for a text with one table: none or two is an error."""
    with pytest.raises(TableError):
        markdown_table("no table here\n")
    with pytest.raises(TableError):
        markdown_table(MARKDOWN)


def test_section_ends_at_the_next_heading_of_its_level() -> None:
    """A section's body stops at the next heading of the same or higher level, not at a
    deeper one, nor at a line that merely starts with a hash; a whole line in bold is a heading
    below every level (gate.md's), a line that only starts in bold is not."""
    text = "# t\n## A\nx\n### deeper\ny\n#notaheading\n## B\nz\n"
    assert section(text, "## A") == "x\n### deeper\ny\n#notaheading"
    assert section(text, "## B") == "z"
    with pytest.raises(TableError):
        section(text, "## C")
    with pytest.raises(TableError):
        section(text, "plain words")
    bold = "**Regressions**\n\n- a\n**not a heading** here\n\n**Improvements**\n- b\n## C\nc"
    assert section(bold, "**Regressions**") == "\n- a\n**not a heading** here\n"
    assert section(bold, "**Improvements**") == "- b"


TEXT = """\
wacc something — a title line
name  scenarios  max ulps (baseline)  status
----  ---------  -------------------  ------
a            12            1.5 (0.5)  ok
long         3              inf (0)   FAIL

after the table
"""


def test_text_tables_read_each_column_by_its_dashes() -> None:
    """A fixed-width table reads by the span of each column's dashes: left- and right-aligned
    cells alike, a cell with a space in it whole, the rows ending at the blank line."""
    assert text_table(TEXT) == [
        {"name": "a", "scenarios": "12", "max ulps (baseline)": "1.5 (0.5)", "status": "ok"},
        {"name": "long", "scenarios": "3", "max ulps (baseline)": "inf (0)", "status": "FAIL"},
    ]


@pytest.mark.parametrize(
    "text",
    [
        "a  b\n-  -\nxx  1\n",  # a cell spilling into the gap between columns
        "a  b\n-  -\n1  22\n",  # a cell spilling past the last column
        "a b\n- -\n1 2\n",  # columns one space apart: cannot tell a cell's space from a gap
        "a  a\n-  -\n1  2\n",  # a header named twice
        "a  b\n1  2\n",  # no line of dashes
    ],
)
def test_a_malformed_text_table_is_an_error(text: str) -> None:
    """A text table whose cells do not fit their dashes is refused."""
    with pytest.raises(TableError):
        text_table(text)


@pytest.mark.parametrize(
    ("cell", "value"),
    [
        ("0", 0.0),
        ("inf", math.inf),
        ("0.1235", 0.123456),
        ("1.235e-05", 1.23456e-5),
        ("1.5", 1.5),
        ("2", 2.0),
        ("0.9999", 0.99999),
        ("1.235e+04", 12345.6),
    ],
)
def test_a_metric_shown_to_four_significant_digits_reads_right(cell: str, value: float) -> None:
    """A metric within half a unit of its fourth significant digit, exactly 0 or inf, or a ratio
    just below 1 shown below 1, is shown right."""
    assert shows_metric(cell, value)


@pytest.mark.parametrize(
    ("cell", "value"),
    [
        ("0.123", 0.123456),  # three digits: rounded too far
        ("0.12346", 0.123456),  # five digits
        ("0.1234", 0.123456),  # truncated, not rounded
        ("1", 0.99999),  # a ratio below the bound reading as the bound
        ("0.0", 0.0),  # zero is written 0
        ("1e308", math.inf),
        ("0", 1e-300),
        ("ulps", 1.0),
        ("1.5", 2.5),  # another value
    ],
)
def test_a_metric_shown_wrong_is_noticed(cell: str, value: float) -> None:
    """Another rounding, another precision, another value or a non-number is not ``value``."""
    assert not shows_metric(cell, value)


def test_metric_value_reads_inf_and_numbers() -> None:
    """The number a metric cell shows."""
    assert metric_value("inf") == math.inf and metric_value("1.5e-05") == 1.5e-5


def test_text_alignments_say_where_each_cell_sits() -> None:
    """Each cell of a text table is left-aligned, right-aligned, fills its column, is empty, or
    sits in the middle; a line shorter than the table (its trailing spaces stripped) reads as
    padded."""
    text = "name  count  note\n----  -----  ------\na        12  x\nlong  12345\n  b     1     ok\n"
    assert text_alignments(text, header=True) == [
        {"name": "fills", "count": "fills", "note": "left"},
        {"name": "left", "count": "right", "note": "left"},
        {"name": "fills", "count": "fills", "note": "empty"},
        {"name": "middle", "count": "middle", "note": "middle"},
    ]
    assert text_alignments(text)[0] == {"name": "left", "count": "right", "note": "left"}
