"""Result rows, the CSV writer and the report's main table."""

from __future__ import annotations

from pathlib import Path

from benchmarks.results import (
    COLUMNS,
    NOT_AVAILABLE,
    Row,
    markdown,
    read_csv,
    targets_block,
    targets_table,
    write_csv,
)

ROWS = [
    Row("s", "c", "floor", "float32", "cpu", 2.0, "ms", 1.0),
    Row("s", "c", "at target", "float32", "cpu", 2.2, "ms", 1.1, "floor", 1.1),
    Row("s", "c", "above", "float32", "cpu", 2.4, "ms", 1.2, "floor", 1.1),
    Row("s", "c", "missing", "float32", "cpu", None, "ms", None, "floor", 1.1),
]


def test_met_is_ratio_at_most_target() -> None:
    """A target is met when ratio <= target, not met above, n/a without a measurement."""
    assert [row.met for row in ROWS] == ["", "yes", "no", "n/a"]


def test_csv_round_trips_every_column(tmp_path: Path) -> None:
    """The CSV has the documented header and gives back each row's figures exactly."""
    path = tmp_path / "results.csv"
    write_csv(ROWS, path)
    assert path.read_text(encoding="utf-8").splitlines()[0] == ",".join(COLUMNS)
    back = read_csv(path)
    assert [line["mode"] for line in back] == [row.mode for row in ROWS]
    assert float(back[2]["value"]) == 2.4 and float(back[2]["ratio"]) == 1.2
    assert back[3]["value"] == NOT_AVAILABLE and back[3]["ratio"] == ""
    assert [line["met"] for line in back] == [row.met for row in ROWS]
    assert back[0]["target"] == "" and float(back[1]["target"]) == 1.1


def test_report_embeds_the_targets_table_between_markers() -> None:
    """The main table holds the target rows only and is found again between its markers."""
    text = markdown(ROWS, suites=["s"], notes={"s": "a note"}, info={"date": "today"})
    assert targets_block(text) == targets_table(ROWS)
    assert "above" in targets_table(ROWS) and "| floor |" not in targets_table(ROWS)
    assert "a note" in text and "- date: today" in text
