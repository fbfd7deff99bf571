"""``wacc.audit.report``: the terminal tables and ``audit.md``, read back by column name, show
what ``audit.csv`` holds for the same result, cell by cell (issue 33). The result is made here
by hand (every kind of cell: a pass, a FAIL, a loop that did not run, a miscount, a mean per
microbatch, a nondeterministic run), so that each column's values differ from its neighbours'."""

from __future__ import annotations

import csv
import math
import re
import tempfile
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from tests.wacc.ascii_locale import ascii_locale
from tests.wacc.rendered import (
    markdown_tables,
    section,
    shows_metric,
    text_alignments,
    text_table,
)
from wacc.audit.protocol import Adapter
from wacc.audit.provenance import AuditProvenance
from wacc.audit.report import (
    _TERMINAL_HEADERS,
    CELL_COLUMNS,
    CSV_COLUMNS,
    FACT_COLUMNS,
    RANK_COLUMNS,
    _cell_columns,
    _tokens,
    _why,
    _windows_passed,
    basis,
    cell_rows,
    checked_versions,
    fix_lines,
    render_table,
    write_csv,
    write_markdown,
)
from wacc.audit.runner import AuditResult, Cell, LoopFacts
from wacc.audit.windows import Window


def _adapter(name: str, checked: str = ">=1.0") -> Adapter:
    return Adapter(
        name=name, title=f"{name} | loop", requires=(), model="causal", code_path=f"{name}.step",
        checked=checked, loss_scale=True, checkpoint=None, run=lambda task: None,  # type: ignore[arg-type,return-value]
    )  # fmt: skip


_BOOM = "error: RuntimeError: boom (loop.py:3)"  # as the runner words a loop that raised


def _result() -> AuditResult:
    good, bad, broken = _adapter("good"), _adapter("bad"), _adapter("broken")
    third = _adapter("third", checked="")  # no checked range: n/a
    cells = [
        Cell("good", "unequal", rel_l2=1.23456e-7, max_rel=2.34567e-6, max_rel_normal=1.5e-6,
             ratio=0.0345678,
             element_ratio=0.5, semantic_rel_l2=4.5678e-16, semantic_ratio=0.00123456,
             semantic_element_ratio=0.25, counted=211.0, true_count=211, deterministic=True,
             digest="ab12"),
        Cell("good", "zero", rel_l2=0.0, max_rel=0.0, ratio=0.0, semantic_ratio=0.0,
             counted=None, true_count=0, finite=False, deterministic=None, digest="cd34"),
        Cell("bad", "unequal", rel_l2=0.456789, max_rel=987.654, max_rel_normal=456.7,
             ratio=12345.6,
             element_ratio=3.0, semantic_rel_l2=0.3456, semantic_ratio=5678.91,
             semantic_element_ratio=7.0, counted=4.0, true_count=211, deterministic=False,
             digest="ef56"),
        Cell("bad", "zero", rel_l2=math.inf, max_rel=math.nan, ratio=math.inf,
             semantic_ratio=0.125, counted=1.0, true_count=0, deterministic=True),
        # A run that raised after some metrics were measured: none of them is shown.
        Cell("broken", "unequal", status=_BOOM, rel_l2=0.5, max_rel=0.25, max_rel_normal=0.125,
             ratio=2.0, semantic_rel_l2=0.0625, semantic_ratio=4.0, counted=3.0,
             true_count=211),
        Cell("broken", "zero", status=_BOOM, true_count=0),
        # A zero of either sign reads 0.
        Cell("third", "unequal", rel_l2=6.5e-3, max_rel=-0.0, ratio=0.875, semantic_ratio=0.5,
             counted=None, true_count=211, deterministic=True),
    ]  # fmt: skip
    facts = [
        LoopFacts(good, version="1.2.3", model="causal", needs_total="yes (measured)",
                  resume="bit-identical", resume_rel_l2=0.0, loss_scale="exact",
                  fp16="skips the whole window"),
        LoopFacts(bad, version="", model="seq2seq",
                  truth_casts=("lm_head -> float32", "x -> float32", "y -> float32", "z -> f32"),
                  loss_casts=("loss -> float32", "ce -> float32"), needs_total="no",
                  resume="differs after resume", resume_rel_l2=3.14159e-3,
                  loss_scale="differs with S",
                  fp16="applies non-finite gradients | once",
                  notes=["a note", "another note", "a note"]),
        LoopFacts(broken, status=_BOOM, model="causal", resume_rel_l2=0.5, needs_total="yes"),
        # Only forward casts, five names (one with a space, one cast twice): four and "+1 more".
        LoopFacts(third, version="0.1", model="masked", needs_total="yes", resume="exact",
                  resume_rel_l2=1.5e-9, loss_scale="exact", fp16="no float16 compute",
                  truth_casts=("ab cd -> float32", "a -> float32", "e -> float32",
                               "c -> float32", "b -> float32", "a -> float64")),
    ]  # fmt: skip
    windows = [Window("unequal", (1, 7, 200, 3), ()), Window("zero", (0, 0), ())]
    return AuditResult(dtype="bfloat16", windows=windows, facts=facts, cells=cells)


_STATUSES = {fact.adapter.name: fact.status for fact in _result().facts}
_PROVENANCE = AuditProvenance("9.9", "abc123", "2026-01-01", "test machine", "2.13", "3.12", 1.5)


# Per test (not per module): mutmut counts a fixture's calls for the test that set it up first.
@pytest.fixture
def written(tmp_path: Path) -> tuple[str, str, list[dict[str, str]]]:
    """The terminal text, audit.md and audit.csv's rows of one result."""
    folder = tmp_path
    result = _result()
    write_markdown(result, folder / "audit.md", _PROVENANCE)
    write_csv(result, folder / "audit.csv", _PROVENANCE)
    with (folder / "audit.csv").open(newline="", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    return render_table(result), (folder / "audit.md").read_text(encoding="utf-8"), records


def _number(cell: str, text: str) -> None:
    """A metric cell against the CSV's full-precision value: ``-`` for nan, else 3 digits."""
    value = float(text)
    if math.isnan(value):
        assert cell == "-", (cell, text)
    else:
        assert shows_metric(cell, value, digits=3), (cell, text)


def _assert_cell_row(cells: dict[str, str], record: dict[str, str]) -> None:
    """One row of the per-window table against its audit.csv row, by column name."""
    assert cells["loop"] == record["loop"] and cells["window"] == record["window"]
    assert cells["verdict"] == record["verdict"].split(":")[0]
    ran = record["status"] == "ok"
    for column, field in (("rel L2", "rel_l2"), ("max rel elem", "max_rel_element_normal"),
                          ("err/bound (D run)", "err_over_bound"),
                          ("err/bound (f64 run)", "f64_err_over_bound")):  # fmt: skip
        if ran:
            _number(cells[column], record[field])
        else:
            assert cells[column] == "-", column
    true = record["tokens_true"]
    if not ran:
        expected = "-"
    elif record["tokens_counted"] == "":
        expected = f"per-microbatch mean/{true}"
    else:
        counted = float(record["tokens_counted"])
        expected = f"{counted:g}/{true}" + ("" if counted == int(true) else " (!)")
    assert cells["tokens counted/true"] == expected
    assert (
        cells["deterministic"] == {"True": "yes", "False": "NO", "": "-"}[record["deterministic"]]
    )
    if "world size" in cells:  # the columns of a run across ranks (audit.md always has them)
        assert cells["world size"] == record["world_size"]
        assert cells["rank tokens"] == (record["rank_tokens"] or record["tokens_true"])
        _number(cells["predicted rel L2"], record["predicted_rel_l2"] or "nan")
        if ran:
            _number(cells["f64 rel L2"], record["f64_rel_l2"])
        else:
            assert cells["f64 rel L2"] == "-"
        agree = record["ranks_agree"]
        assert cells["ranks agree"] == {"True": "yes", "": "-"}.get(agree, cells["ranks agree"])
        assert agree != "False" or cells["ranks agree"].startswith("NO")


def _assert_fact_row(cells: dict[str, str], records: list[dict[str, str]], status: str) -> None:
    """One row of the per-loop table against its loop's audit.csv rows, by column name
    (``status``: whether its facts were measured, which audit.csv does not say)."""
    mine = [r for r in records if r["loop"] == cells["loop"]]
    first = mine[0]
    ran = status == "ok"
    assert cells["version"] == (first["version"] or "-")
    assert cells["model"] == first["model"]
    assert cells["reads window first"] == (first["reads_window_first"] if ran else status)
    for column, field in (("mid-window resume", "mid_window_resume"),
                          ("fixed loss scale", "fixed_loss_scale"),
                          ("fp16 overflow", "fp16_overflow")):  # fmt: skip
        assert cells[column] == (first[field] if ran else "-"), column
    if ran:
        _number(cells["resumed rel L2"], first["resumed_rel_l2"])
    else:
        assert cells["resumed rel L2"] == "-"
    copy = cells["float64 copy"]
    if not ran:
        assert copy == "-"
    elif not first["truth_casts"] and not first["loss_casts"]:
        assert copy == "clean"
    else:
        parts = []
        for field, what in (("truth_casts", "forward casts"), ("loss_casts", "own loss casts")):
            names = sorted({c.split(" -> ")[0] for c in first[field].split(";") if c})
            if len(names) > 4:
                names = names[:4] + [f"+{len(names) - 4} more"]
            if names:
                parts.append(f"{what} to float32 ({', '.join(names)})")
        assert copy == "; ".join(parts)
    zero = [r for r in mine if r["window"] == "zero"]
    if not ran or not zero:
        assert cells["zero-target window"] == "-"
    else:
        if zero[0]["status"] != "ok":  # the window did not run: why
            assert cells["zero-target window"] == zero[0]["status"]
        else:
            finite = "finite" if zero[0]["finite"] == "True" else "NaN/inf gradient"
            assert cells["zero-target window"] == f"{finite}, {zero[0]['verdict']}"


def check_tables(
    tables: list[list[dict[str, str]]],
    records: list[dict[str, str]],
    statuses: dict[str, str],
    cell_columns: tuple[str, ...] = CELL_COLUMNS,
) -> None:
    """The per-window and the per-loop table, read back, against audit.csv's rows (also used on
    the real command's output by ``test_cli.py``); ``statuses``: each loop's facts' status."""
    by_cell, by_loop = tables
    assert [tuple(row) for row in by_cell] == [cell_columns] * len(records)
    assert [(r["loop"], r["window"]) for r in by_cell] == [
        (r["loop"], r["window"]) for r in records
    ]
    for cells, record in zip(by_cell, records, strict=True):
        _assert_cell_row(cells, record)
    assert [tuple(row) for row in by_loop] == [FACT_COLUMNS] * len(by_loop)
    assert len(by_loop) == len(statuses)
    assert [r["loop"] for r in by_loop] == list(dict.fromkeys(r["loop"] for r in records))
    for cells in by_loop:
        _assert_fact_row(cells, records, statuses[cells["loop"]])


def test_audit_md_shows_what_audit_csv_holds(
    written: tuple[str, str, list[dict[str, str]]],
) -> None:
    """audit.md's two tables, read back by column name, show for every loop x window and every
    loop what audit.csv has (metrics to 3 significant digits, ``-`` where nothing ran), a ``|``
    in a cell escaped so the table keeps its columns."""
    _, markdown, records = written
    tables = [
        *markdown_tables(section(markdown, "## Per loop and window")),
        *markdown_tables(section(markdown, "## Per loop")),
    ]
    check_tables(tables, records, _STATUSES, CELL_COLUMNS[:2] + RANK_COLUMNS + CELL_COLUMNS[2:])


def terminal_tables(
    text: str, records: list[dict[str, str]], statuses: dict[str, str]
) -> tuple[str, list[list[dict[str, str]]]]:
    """The stdout report read back: its header, and its per-window table (short headers mapped
    back to audit.md's names) and per-loop facts (wrapped lines unwrapped, split at the facts'
    names in their order) as rows keyed like audit.md's tables."""
    header, cells_block, facts_block, *_ = text.split("\n\n")
    lines = cells_block.splitlines()
    long_names = {short: name for name, short in _TERMINAL_HEADERS.items()}
    by_cell = [
        {long_names.get(k, k): v for k, v in row.items()}
        for row in text_table("\n".join(lines[: 2 + len(records)]))
    ]
    loops: list[list[str]] = []
    for line in facts_block.splitlines()[1:]:
        if line.startswith(" "):
            loops[-1].append(line.strip())
        else:
            loops.append([line])
    by_loop = []
    for block in loops:
        joined = " ".join(block)
        loop, _, rest = joined.partition(": version ")
        version, _, rest = rest.partition("; ")
        row = {"loop": loop, "version": version}
        if statuses[loop] != "ok":
            row["model"], _, status = rest.rpartition("; model ")[2].partition(": ")
            assert status == statuses[loop], (joined, statuses[loop])
            row.update({column: "-" for column in FACT_COLUMNS[3:]})
            row["reads window first"] = status
        else:
            row["model"], _, rest = rest.rpartition("; model ")[2].partition(" ")
            for column, following in zip(FACT_COLUMNS[3:], FACT_COLUMNS[4:] + ("",), strict=True):
                assert rest.startswith(f"{column}: "), (column, rest)
                rest = rest[len(column) + 2 :]
                value, _, rest = rest.partition(f"; {following}: " if following else "\0")
                row[column] = value
                rest = f"{following}: {rest}" if following else rest
        by_loop.append(row)
    return header, [by_cell, by_loop]


def test_the_terminal_tables_show_what_audit_csv_holds(
    written: tuple[str, str, list[dict[str, str]]],
) -> None:
    """The stdout report, read back by column name, shows what audit.csv has, as audit.md does:
    the per-window table under its short headers, the per-loop facts as wrapped lines; the
    header names the dtype and every window; no line is wider than 120 columns."""
    text, _, records = written
    header, tables = terminal_tables(text, records, _STATUSES)
    assert header == "wacc audit — dtype bfloat16; windows: unequal (1, 7, 200, 3); zero (0, 0)"
    check_tables(tables, records, _STATUSES, CELL_COLUMNS[:-1])  # the basis is audit.md's
    assert max(len(line) for line in text.splitlines()) <= 120
    table = "\n".join(text.split("\n\n")[1].splitlines()[: 2 + len(records)])
    lines = table.splitlines()
    assert lines[1].startswith("----") and all(line == line.rstrip() for line in lines)
    for row in text_alignments(table, header=True):  # words and numbers alike, left-aligned
        assert set(row.values()) <= {"left", "fills", "empty"}, row


def test_audit_md_states_provenance_windows_code_paths_and_each_note_once(
    written: tuple[str, str, list[dict[str, str]]],
) -> None:
    """audit.md names the dtype and provenance, each window with its targets, each loop's code
    path and checked range, and a loop's repeated note once."""
    _, markdown, _ = written
    assert f"dtype **bfloat16**, world size **1**; {_PROVENANCE.line()}" in markdown
    assert "Windows (target tokens per microbatch): `unequal (1, 7, 200, 3)`; `zero (0, 0)`" in (
        markdown
    )
    assert markdown.startswith("# wacc audit\n\n")
    paths = section(markdown, "## Code paths driven").strip().splitlines()
    assert paths == [
        *(f"- `{n}` — {n} | loop (checked: >=1.0): `{n}.step`" for n in ("good", "bad", "broken")),
        "- `third` — third | loop (checked: n/a): `third.step`",
    ]
    assert section(markdown, "## Notes").strip() == "- `bad`: a note\n- `bad`: another note"
    assert markdown.endswith("\n\n## Notes\n\n- `bad`: a note\n- `bad`: another note\n")


def test_audit_md_and_audit_csv_are_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """audit.md and audit.csv are written as UTF-8 (its dashes and arrows included) even where
    the locale's encoding is ASCII."""
    result = _result()
    result.facts[0].fp16 = "skips the whole window (scale 65536 → 32768)"
    with ascii_locale():
        write_markdown(result, tmp_path / "audit.md", _PROVENANCE)
        write_csv(result, tmp_path / "audit.csv", _PROVENANCE)
    assert "— good | loop" in (tmp_path / "audit.md").read_text(encoding="utf-8")
    assert "65536 → 32768" in (tmp_path / "audit.csv").read_text(encoding="utf-8")


def test_audit_md_without_notes_has_no_notes_section(tmp_path: Path) -> None:
    """A result whose loops noted nothing has no Notes section."""
    result = _result()
    for fact in result.facts:
        fact.notes = []
    write_markdown(result, tmp_path / "audit.md", _PROVENANCE)
    text = (tmp_path / "audit.md").read_text(encoding="utf-8")
    assert "## Notes" not in text and text.endswith("`third.step`\n")


def test_audit_csv_holds_each_cells_values_in_full(
    written: tuple[str, str, list[dict[str, str]]],
) -> None:
    """audit.csv has one row per loop x window, each measured value as its repr (the float
    itself, nan and inf included), the counts and the flags as the cell has them."""
    _, _, records = written
    cells = _result().cells
    assert [(r["loop"], r["window"]) for r in records] == [(c.adapter, c.window) for c in cells]
    fields = {
        "rel_l2": "rel_l2", "max_rel_element": "max_rel", "err_over_bound": "ratio",
        "element_err_over_bound": "element_ratio", "f64_rel_l2": "semantic_rel_l2",
        "f64_err_over_bound": "semantic_ratio",
        "f64_element_err_over_bound": "semantic_element_ratio",
    }  # fmt: skip
    for record, cell in zip(records, cells, strict=True):
        for column, field in fields.items():
            assert record[column] == repr(getattr(cell, field)), (column, cell)
        assert record["tokens_counted"] == ("" if cell.counted is None else repr(cell.counted))
        assert record["tokens_true"] == str(cell.true_count)
        assert (record["status"], record["verdict"]) == (cell.status, cell.verdict)
        assert record["deterministic"] == ("" if cell.deterministic is None else
                                           str(cell.deterministic))  # fmt: skip


_REPORTS = Path(__file__).resolve().parents[3] / "reports"
# The new frameworks' runs, one venv each (reports/audit-new/README.md): some fail nothing.
_NEW_RUNS = sorted(p.parent.relative_to(_REPORTS).as_posix()
                   for p in _REPORTS.glob("audit-new/*/audit.csv"))  # fmt: skip


@pytest.mark.parametrize("report", ["audit", "audit-2-ranks", "audit-4-ranks", *_NEW_RUNS])
def test_every_loop_failing_a_committed_audit_has_a_cause(report: str) -> None:
    """Every loop that fails a window in a committed audit (one process, two and four ranks, the
    new frameworks' runs) has its cause recorded (``Adapter.cause``): its "Causes and fixes" line
    never reads "cause not recorded"."""
    from wacc.audit.adapters import ADAPTERS

    path = _REPORTS / report / "audit.csv"
    with path.open(newline="", encoding="utf-8") as handle:
        failing = sorted({r["loop"] for r in csv.DictReader(handle) if r["verdict"] == "FAIL"})
    assert failing or report.startswith("audit-new/")  # the big runs have failures to explain
    missing = [loop for loop in failing if ADAPTERS[loop].cause is None]
    assert not missing, f"no cause recorded for {missing}"


def _ranks_result() -> AuditResult:
    """A result across 2 ranks with the widest values a real run has: the longest loop name
    (not run at that world size), a per-microbatch mean, a miscount on each rank, ranks that
    disagree, a prediction."""
    names = ("accelerate-variable+wacc", "trainer-llama-ranktok", "accelerate", "plain")
    long, ranktok, mean, plain = (_adapter(n) for n in names)
    common: dict[str, Any] = dict(
        world_size=2, rank_tokens=(211, 17), true_count=228, deterministic=True
    )
    cells = [
        Cell(long.name, "unequal", status="not run at world size 2: its adapter has no "
             "multi-rank path", **common),
        Cell(ranktok.name, "unequal", rel_l2=1.6442034, max_rel=1234.5, max_rel_normal=987.65,
             ratio=4.32e6, semantic_rel_l2=1.6442035, semantic_ratio=4.32e6, counted=235.0,
             rank_counted=(235.0, 20.0), predicted_rel_l2=1.6442034514, **common),
        Cell(mean.name, "unequal", rel_l2=2.6691914, max_rel=3.5e-1, max_rel_normal=2.5e-1,
             ratio=5.28e6, semantic_rel_l2=2.6691913, semantic_ratio=5.28e6, counted=None,
             rank_counted=(None, None), **common),
        Cell(plain.name, "unequal", rel_l2=2.3145, max_rel=0.5, max_rel_normal=0.25,
             ratio=3.97e6, semantic_rel_l2=2.3145001, semantic_ratio=3.97e6, counted=211.0,
             rank_counted=(211.0, 17.0), predicted_rel_l2=2.3145, ranks_agree=False,
             rank_spread=1.25e-3, **common),
    ]  # fmt: skip
    facts = [
        LoopFacts(long, status="not run at world size 2: its adapter has no multi-rank path",
                  model="gpt2"),
        *(LoopFacts(a, version="1.0", model="plain", needs_total="yes")
          for a in (ranktok, mean, plain)),
    ]  # fmt: skip
    ranks = (Window("unequal", (1, 7, 200, 3), ()), Window("unequal", (12, 0, 3, 2), ()))
    joined = Window("unequal", (1, 7, 200, 3, 12, 0, 3, 2), ())
    return AuditResult(dtype="float32", windows=[joined], facts=facts, cells=cells,
                       world_size=2, rank_windows={"unequal": ranks})  # fmt: skip


def test_the_terminal_report_across_ranks_fits_120_columns_and_shows_every_column() -> None:
    """Across ranks the stdout report fits 120 columns as at world size 1, and still shows what
    audit.md's cell table has but the basis and the world size (in its header): the cell columns
    of every row, and the rank columns and counts of the rows that ran in a table of their own."""
    result = _ranks_result()
    text = render_table(result)
    assert max(len(line) for line in text.splitlines()) <= 120, max(text.splitlines(), key=len)
    assert "world size 2" in text.split("\n\n")[0]
    long_names = {short: name for name, short in _TERMINAL_HEADERS.items()}
    cells, across = text.split("\n\n")[1:3]
    cells = "\n".join(cells.splitlines()[: 2 + len(result.cells)])  # the legend follows
    shown: dict[tuple[str, str], dict[str, str]] = {}
    for block in (cells, across):
        for row in text_table(block):
            key = (row["loop"], row["window"])
            shown.setdefault(key, {}).update({long_names.get(k, k): v for k, v in row.items()})
    expected = cell_rows(result)
    assert len(shown) == len(expected)
    for row, cell in zip(expected, result.cells, strict=True):
        seen = shown[(row["loop"], row["window"])]
        columns = set(_cell_columns(ranks=True)) - {"basis", "world size"}
        if cell.status != "ok":  # no rank figures to show: its verdict says why
            columns = set(CELL_COLUMNS[:-1]) - {"tokens counted/true"}
        assert {c: seen[c] for c in columns} == {c: row[c] for c in columns}


# What each writer says, read against the data it renders (issue 33): results built here with
# chosen values, the text asserted exactly where the text is the contract.


def _fixable(name: str, *, cause: str | None, fixed_by: str | None) -> Adapter:
    return replace(_adapter(name), cause=cause, fixed_by=fixed_by)


def _passing(loop: str, window: str, **fields: Any) -> Cell:
    """A cell that ran and passes (its float64 run at half its bound), but for ``fields``."""
    values: dict[str, Any] = dict(rel_l2=1e-3, max_rel=0.5, max_rel_normal=0.5, ratio=0.5,
                                  semantic_ratio=0.5, counted=10.0, true_count=10)  # fmt: skip
    return Cell(loop, window, **(values | fields))


def _failing(loop: str, window: str, **fields: Any) -> Cell:
    """A cell that ran and fails (its float64 run 40 bounds off), but for ``fields``."""
    return _passing(loop, window, **({"semantic_ratio": 40.0} | fields))


def test_basis_says_why_in_each_branch() -> None:
    """The basis: nothing for a cell that did not run; a non-finite gradient; a FAIL's float64
    run so many bounds off; a pass within the bound, with the D run's note only above 1 (not at
    1) and the max rel elem note from 1 on (its value and its element's share of the largest)."""
    assert basis(Cell("l", "w", status="not installed"), "bfloat16") == ""
    assert basis(_passing("l", "w", finite=False), "bfloat16") == "NaN/inf in the gradient"
    assert basis(_passing("l", "w", semantic_ratio=5678.91), "bfloat16") == (
        "the f64 run is 5.68e+03 bounds off: the loop's weighting or count"
    )
    at_one = _passing("l", "w", semantic_ratio=0.00123456, ratio=1.0, max_rel_normal=0.999)
    assert basis(at_one, "bfloat16") == "the f64 run is within the bound (0.00123)"
    both = _passing("l", "w", semantic_ratio=1.0, ratio=2.5, max_rel_normal=1.0,
                    max_rel_share=1.234e-5)  # fmt: skip
    assert basis(both, "float16") == (
        "the f64 run is within the bound (1); err/bound (D run) 2.5 is the float16 run's own "
        "forward/backward rounding, which no bound covers; max rel elem 1 is on an element "
        "1.2e-05 of the gradient's largest, which the float16 run's rounding (about its unit "
        "times the largest) swamps"
    )
    element = _passing("l", "w", ratio=0.25, max_rel_normal=37.5, max_rel_share=4.5e-3)
    assert basis(element, "bfloat16") == (
        "the f64 run is within the bound (0.5); max rel elem 37.5 is on an element 4.5e-03 of "
        "the gradient's largest, which the bfloat16 run's rounding (about its unit times the "
        "largest) swamps"
    )


def test_tokens_show_what_each_rank_divided_by_against_the_true_count() -> None:
    """The ``tokens counted/true`` cell: ``-`` for a cell that did not run; the count it
    divided by against the true one, ``(!)`` when they differ (a fractional count kept);
    ``per-microbatch mean`` when it never divides by a count; across ranks each rank's count
    (``mean`` for a rank that never divides) against every rank's tokens, ``(!)`` unless every
    rank divided by them; a world of ranks that all take the mean reads as one mean."""
    rows = [
        Cell("l", "w", status="not installed", counted=5.0, true_count=5),
        Cell("l", "w", counted=211.0, true_count=211),
        Cell("l", "w", counted=4.0, true_count=211),
        Cell("l", "w", counted=210.5, true_count=211),
        Cell("l", "w", counted=None, true_count=211),
        Cell("l", "w", world_size=2, counted=211.0, true_count=228, rank_counted=(211.0, 17.0)),
        Cell("l", "w", world_size=2, counted=228.0, true_count=228, rank_counted=(228.0, 228.0)),
        Cell("l", "w", world_size=2, counted=None, true_count=228, rank_counted=(None, 228.0)),
        Cell("l", "w", world_size=2, counted=None, true_count=228, rank_counted=(None, None)),
        Cell("l", "w", world_size=3, counted=228.0, true_count=228,
             rank_counted=(228.0, 228.0, 17.0)),
    ]  # fmt: skip
    expected = [
        "-", "211/211", "4/211 (!)", "210.5/211 (!)", "per-microbatch mean/211",
        "211;17/228 (!)", "228;228/228", "mean;228/228 (!)", "per-microbatch mean/228",
        "228;228;17/228 (!)",
    ]  # fmt: skip
    shown = [_tokens(c) for c in rows]
    assert shown == expected, [(s, e) for s, e in zip(shown, expected, strict=True) if s != e]


def test_windows_passed_says_how_a_loop_fared_in_this_run() -> None:
    """How a loop fared: every window passed, how many of how many failed (a window that did
    not run counts as not passed), what kept it from running when no window ran (the status
    before its first colon), or that it is not in the run at all."""
    result = AuditResult(
        dtype="bfloat16", windows=[], facts=[],
        cells=[
            _passing("all", "a"), _passing("all", "b"), _passing("all", "c"),
            _passing("some", "a"), _failing("some", "b"), _failing("some", "c"),
            _failing("one", "a"), Cell("one", "b", status="not installed"),
            Cell("none", "a", status=_BOOM), Cell("none", "b", status=_BOOM),
            Cell("solo", "a", status="not installed"),
        ],
    )  # fmt: skip
    loops = ("all", "some", "one", "none", "solo", "x")
    fared = {loop: _windows_passed(result, loop) for loop in loops}
    assert fared == {
        "all": "passes all 3 windows",
        "some": "fails 2 of 3 windows",
        "one": "fails 2 of 2 windows",
        "none": "error",
        "solo": "not installed",
        "x": "not in this run",
    }


def _fixes_result() -> AuditResult:
    """Loops that fail (with a cause and a fix that ran, one whose fix is not in the run, one
    with neither), a fix that fails a window itself, and loops that fail nothing."""
    cause = "trainer.py:10 divides each microbatch by its own count."
    adapters = [
        _fixable("accel", cause=cause, fixed_by="accel+wacc"),
        _fixable("accel+wacc", cause=None, fixed_by=None),
        _fixable("lightning", cause="module.py:3 averages per step.", fixed_by="lightning+wacc"),
        _fixable("custom", cause=None, fixed_by=None),
        _fixable("broken", cause="never shown.", fixed_by="accel+wacc"),
        _fixable("fine", cause="never shown either.", fixed_by="accel+wacc"),
        _fixable("half", cause="half.py:1 keeps the last count.", fixed_by="halffix"),
        _fixable("halffix", cause=None, fixed_by=None),
    ]
    cells = [
        _passing("accel", "a"), _failing("accel", "b"), _passing("accel+wacc", "a"),
        _passing("accel+wacc", "b"), _failing("lightning", "a"), _failing("lightning", "b"),
        _failing("custom", "a"), Cell("broken", "a", status=_BOOM), _passing("fine", "a"),
        _failing("half", "a"), _failing("halffix", "a"), _passing("halffix", "b"),
    ]  # fmt: skip
    facts = [LoopFacts(a, version="1", model="causal") for a in adapters]
    return AuditResult(dtype="bfloat16", windows=[], facts=facts, cells=cells)


_FIX_LINES = [
    "- `accel` (fails 1 of 2 windows): trainer.py:10 divides each microbatch by its own count. "
    "Fixed by `accel+wacc` (passes all 2 windows in this run).",
    "- `lightning` (fails 2 of 2 windows): module.py:3 averages per step. Fixed by "
    "`lightning+wacc` (not in this run).",
    "- `custom` (fails 1 of 1 windows): cause not recorded. No wacc integration fixes it.",
    "- `half` (fails 1 of 1 windows): half.py:1 keeps the last count. Fixed by `halffix` "
    "(fails 1 of 2 windows in this run).",
    "- `halffix` (fails 1 of 2 windows): cause not recorded. No wacc integration fixes it.",
]


def test_fix_lines_name_each_failing_loop_its_cause_and_how_its_fix_fared() -> None:
    """One "causes and fixes" line per loop that fails a window, in the loops' order: the loop,
    how many of its windows failed, its cause ("cause not recorded." without one), and the row
    that fixes it with how that row fared in this run ("No wacc integration fixes it." without
    one); a loop that only passes or did not run has no line."""
    lines = fix_lines(_fixes_result())
    assert lines == _FIX_LINES, "\n".join(lines)


def test_audit_md_and_the_terminal_end_with_the_causes_and_fixes() -> None:
    """audit.md has a "Causes and fixes" section with exactly :func:`fix_lines`' lines, and the
    stdout report ends with them, each wrapped to 120 columns under a two-space indent (none
    when no loop fails)."""
    result = _fixes_result()
    markdown = _markdown(result)
    fixes = markdown.split("\n\n## Causes and fixes\n\n", 1)[1].split("\n\n", 1)[0]
    assert fixes == "\n".join(_FIX_LINES), fixes
    text = render_table(result)
    head, _, block = text.rpartition("\n\nCauses and fixes:\n")
    assert head and "Causes and fixes" not in head
    unwrapped = re.sub(r"\n {4}", " ", block).splitlines()
    assert unwrapped == ["  " + line for line in _FIX_LINES], block
    assert max(len(line) for line in block.splitlines()) <= 120
    passing = AuditResult(dtype="bfloat16", windows=[], facts=result.facts[5:6],
                          cells=[_passing("fine", "a")])  # fmt: skip
    assert "Causes and fixes" not in render_table(passing)
    assert "Causes and fixes" not in _markdown(passing)


def _markdown(result: AuditResult) -> str:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "audit.md"
        write_markdown(result, path, _PROVENANCE)
        return path.read_text(encoding="utf-8")


def _checked(text: str) -> str:
    return checked_versions(_adapter("loop", checked=text))


def test_checked_versions_say_when_an_installed_distribution_differs() -> None:
    """``checked: …`` repeats the loop's checked versions and adds each installed distribution
    it names whose version differs (local labels such as ``+cpu`` ignored on both sides, a
    ``.x`` matching that release series only); names that are no installed distribution are
    skipped; nothing checked reads ``n/a``."""
    torch_version = metadata.version("torch")  # e.g. 2.13.0+cpu
    public = torch_version.split("+")[0]
    series = public.rsplit(".", 1)[0] + ".x"  # 2.13.x
    shorter = public[: public.index(".") + 2] + ".x"  # 2.1.x, which 2.13.0 is not in
    assert not public.startswith(shorter[:-1]), "a torch whose minor version has one digit"
    numpy_version = metadata.version("numpy")
    assert _checked("") == "checked: n/a"
    for same in (f"torch {public}", f"torch {public}+cu999", f"torch {series}",
                 "nosuchdistribution 1.0, record format 1"):  # fmt: skip
        assert _checked(same) == f"checked: {same}", same
    for checked, installed in (
        ("torch 9.9.9, nosuchdistribution 1.0, numpy 0.0.0",
         f"torch {torch_version}, numpy {numpy_version}"),
        (f"torch {shorter}", f"torch {torch_version}"),
        (f"torch {public}.1", f"torch {torch_version}"),
    ):  # fmt: skip
        assert _checked(checked) == (
            f"checked: {checked} (installed: {installed}: the versions differ)"
        ), checked


def test_why_says_why_each_alarming_pass_passes() -> None:
    """Below the terminal's table, one line per cell that ran and passes with its D run above
    its bound (not at it) or a max rel elem of 1 or more: "loop / window: pass: " and its
    basis, wrapped to 120 columns; a FAIL, a cell that did not run and a quiet pass have none."""
    cells = [
        _passing("quiet", "a", ratio=1.0, max_rel_normal=0.999),
        _passing("d-run", "a", ratio=1.5, semantic_ratio=0.25),
        _passing("element", "b", max_rel_normal=1.0, max_rel_share=2.5e-4),
        _failing("fails", "a", ratio=9.0),
        Cell("broken", "a", status=_BOOM, ratio=3.0, max_rel_normal=7.0),
    ]
    facts = [LoopFacts(_adapter(c.adapter), version="1", model="m") for c in cells]
    result = AuditResult(dtype="float16", windows=[], facts=facts, cells=cells)
    lines = _why(result)
    assert [re.sub(r"\n {4}", " ", line) for line in lines] == [
        "  d-run / a: pass: the f64 run is within the bound (0.25); err/bound (D run) 1.5 is the "
        "float16 run's own forward/backward rounding, which no bound covers.",
        "  element / b: pass: the f64 run is within the bound (0.5); max rel elem 1 is on an "
        "element 2.5e-04 of the gradient's largest, which the float16 run's rounding (about its "
        "unit times the largest) swamps.",
    ]
    assert all(len(x) <= 120 for line in lines for x in line.splitlines())
    table = render_table(result).split("\n\n")[1]
    assert table.endswith("\n" + "\n".join(lines))


def _csv_result() -> AuditResult:
    """Two loops across 2 ranks: one with every fact and a cause, whose ranks disagree and
    miscount; one without a cause whose ranks agree; and a window that did not run."""
    fixed = _fixable("acc", cause="acc.py:10 divides by its own count.", fixed_by="acc+wacc")
    other = _adapter("other")
    cells = [
        Cell("acc", "unequal", rel_l2=0.125, max_rel=1234.5, max_rel_normal=0.75,
             normal_elements=321, max_rel_share=3.5e-4, ratio=2.0, element_ratio=6.0,
             semantic_rel_l2=0.0625, semantic_ratio=12.5, semantic_element_ratio=9.0,
             counted=17.0, true_count=228, finite=False, deterministic=False, digest="feed",
             world_size=2, rank_tokens=(211, 17), rank_counted=(17, None),
             predicted_rel_l2=0.0615, ranks_agree=False, rank_spread=1e-3),
        Cell("acc", "zero", status="not installed", world_size=2, true_count=0),
        Cell("other", "unequal", rel_l2=0.0, max_rel=0.0, max_rel_normal=0.0, normal_elements=7,
             max_rel_share=1.0, ratio=1.5, element_ratio=0.0, semantic_rel_l2=0.0,
             semantic_ratio=0.0, semantic_element_ratio=0.0, counted=228.0, true_count=228,
             deterministic=True, digest="beef", world_size=2, rank_tokens=(200, 28),
             rank_counted=(228.0, 228.0), ranks_agree=True),
    ]  # fmt: skip
    facts = [
        LoopFacts(fixed, version="4.5.6", model="causal", needs_total="no",
                  truth_casts=("lm_head -> float32", "x -> float32"),
                  loss_casts=("loss -> float32",), resume="exact", resume_rel_l2=2.5e-9,
                  loss_scale="differs with S", fp16="skips the whole window"),
        LoopFacts(other, version="", model="masked", needs_total="yes (measured)",
                  resume="differs", loss_scale="exact", fp16="no float16 compute"),
    ]  # fmt: skip
    ranks = (Window("unequal", (1, 7), ()), Window("unequal", (12, 0), ()))
    joined = Window("unequal", (1, 7, 12, 0), ())
    zero = (Window("zero", (0,), ()), Window("zero", (0, 0), ()))
    return AuditResult(dtype="float16", windows=[joined, Window("zero", (0, 0, 0), ())],
                       facts=facts, cells=cells, world_size=2,
                       rank_windows={"unequal": ranks, "zero": zero})  # fmt: skip


_PROVENANCE_ROW = {
    "wacc_version": "9.9", "wacc_commit": "abc123", "date": "2026-01-01",
    "machine": "test machine", "torch": "2.13", "python": "3.12", "wall_seconds": "1.5",
}  # fmt: skip


def test_audit_csv_has_every_column_of_every_cell_its_loops_facts_and_the_provenance(
    tmp_path: Path,
) -> None:
    """audit.csv, parsed with csv, has its columns in order and per loop x window every value
    of the cell (floats as their repr, nan included; a count never taken empty; each rank's
    count as a float, a rank's mean empty; no prediction empty), of its loop's facts (casts
    joined by ``;``, no cause or fix empty) and the run's provenance."""
    write_csv(_csv_result(), tmp_path / "audit.csv", _PROVENANCE)
    with (tmp_path / "audit.csv").open(newline="", encoding="utf-8") as handle:
        assert next(csv.reader(handle)) == list(CSV_COLUMNS)
    with (tmp_path / "audit.csv").open(newline="", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    acc_facts = {
        "version": "4.5.6", "model": "causal", "dtype": "float16", "reads_window_first": "no",
        "mid_window_resume": "exact", "resumed_rel_l2": "2.5e-09",
        "fixed_loss_scale": "differs with S", "fp16_overflow": "skips the whole window",
        "truth_casts": "lm_head -> float32;x -> float32", "loss_casts": "loss -> float32",
        "cause": "acc.py:10 divides by its own count.", "fixed_by": "acc+wacc",
    }  # fmt: skip
    nan = {column: "nan" for column in (
        "rel_l2", "max_rel_element", "max_rel_element_normal", "max_rel_element_share",
        "err_over_bound", "element_err_over_bound", "f64_rel_l2", "f64_err_over_bound",
        "f64_element_err_over_bound")}  # fmt: skip
    expected = [
        {"loop": "acc", "window": "unequal", "status": "ok", "verdict": "FAIL", **acc_facts,
         "rel_l2": "0.125", "max_rel_element": "1234.5", "max_rel_element_normal": "0.75",
         "normal_elements": "321", "max_rel_element_share": "0.00035", "err_over_bound": "2.0",
         "element_err_over_bound": "6.0", "f64_rel_l2": "0.0625", "f64_err_over_bound": "12.5",
         "f64_element_err_over_bound": "9.0", "tokens_counted": "17.0", "tokens_true": "228",
         "finite": "False", "deterministic": "False", "sha256": "feed", "world_size": "2",
         "rank_tokens": "211;17", "rank_tokens_counted": "17.0;", "predicted_rel_l2": "0.0615",
         "ranks_agree": "False", **_PROVENANCE_ROW},
        {"loop": "acc", "window": "zero", "status": "not installed", "verdict": "not installed",
         **acc_facts, **nan, "normal_elements": "0", "tokens_counted": "", "tokens_true": "0",
         "finite": "True", "deterministic": "", "sha256": "", "world_size": "2",
         "rank_tokens": "0", "rank_tokens_counted": "", "predicted_rel_l2": "",
         "ranks_agree": "", **_PROVENANCE_ROW},
        {"loop": "other", "window": "unequal", "status": "ok", "verdict": "pass",
         "version": "", "model": "masked", "dtype": "float16",
         "reads_window_first": "yes (measured)", "mid_window_resume": "differs",
         "resumed_rel_l2": "nan", "fixed_loss_scale": "exact",
         "fp16_overflow": "no float16 compute", "truth_casts": "", "loss_casts": "",
         "cause": "", "fixed_by": "", "rel_l2": "0.0", "max_rel_element": "0.0",
         "max_rel_element_normal": "0.0", "normal_elements": "7",
         "max_rel_element_share": "1.0", "err_over_bound": "1.5",
         "element_err_over_bound": "0.0", "f64_rel_l2": "0.0", "f64_err_over_bound": "0.0",
         "f64_element_err_over_bound": "0.0", "tokens_counted": "228.0", "tokens_true": "228",
         "finite": "True", "deterministic": "True", "sha256": "beef", "world_size": "2",
         "rank_tokens": "200;28", "rank_tokens_counted": "228.0;228.0",
         "predicted_rel_l2": "", "ranks_agree": "True", **_PROVENANCE_ROW},
    ]  # fmt: skip
    assert len(records) == len(expected)
    for record, row in zip(records, expected, strict=True):
        differ = {k: (record[k], row.get(k)) for k in CSV_COLUMNS if record[k] != row.get(k)}
        assert not differ, (record["loop"], record["window"], differ)


def test_audit_md_across_ranks_names_the_world_and_each_ranks_windows() -> None:
    """Across ranks audit.md names the world size and each window's targets per rank, ``|``
    between ranks, in its windows line; its cell table has the rank columns; the method text
    states the fixed loss scale tried (1024); the code paths name each loop's checked range."""
    markdown = _markdown(_csv_result())
    assert f"dtype **float16**, world size **2**; {_PROVENANCE.line()}" in markdown
    assert (
        "\n\nWindows (target tokens per microbatch; per rank, `|` between ranks): "
        "`unequal (1, 7 | 12, 0)`; `zero (0 | 0, 0)`\n\n"
    ) in markdown
    (table,) = markdown_tables(section(markdown, "## Per loop and window"))
    rows = {(r["loop"], r["window"]): r for r in table}
    assert {k: (r["world size"], r["rank tokens"], r["tokens counted/true"], r["ranks agree"],
                r["predicted rel L2"], r["f64 rel L2"]) for k, r in rows.items()} == {
        ("acc", "unequal"): ("2", "211;17", "17;mean/228 (!)", "NO (rel L2 0.001)", "0.0615",
                             "0.0625"),
        ("acc", "zero"): ("2", "0", "-", "-", "-", "-"),
        ("other", "unequal"): ("2", "200;28", "228;228/228", "yes", "-", "0"),
    }  # fmt: skip
    assert {k: r["basis"] for k, r in rows.items()} == {
        ("acc", "unequal"): "NaN/inf in the gradient",
        ("acc", "zero"): "",
        ("other", "unequal"): "the f64 run is within the bound (0); err/bound (D run) 1.5 is the "
        "float16 run's own forward/backward rounding, which no bound covers",
    }
    assert "a run with S = 1024\ncompared bit for bit" in markdown
    assert section(markdown, "## Code paths driven").strip().splitlines() == [
        "- `acc` — acc | loop (checked: >=1.0): `acc.step`",
        "- `other` — other | loop (checked: >=1.0): `other.step`",
    ]


def test_a_metric_reads_to_three_digits_a_zero_of_either_sign_as_0() -> None:
    """A metric cell: 3 significant digits, ``0`` for a zero of either sign (never ``-0``),
    ``inf``, and ``-`` for nan (nothing measured)."""
    cells = [Cell("l", str(i), max_rel_normal=v, rel_l2=v) for i, v in
             enumerate((-0.0, 0.0, 0.000123456, 98765.4, math.inf, math.nan))]  # fmt: skip
    result = AuditResult(dtype="bfloat16", windows=[], facts=[], cells=cells)
    shown = [(row["rel L2"], row["max rel elem"]) for row in cell_rows(result)]
    assert shown == [("0", "0"), ("0", "0"), ("0.000123", "0.000123"), ("9.88e+04", "9.88e+04"),
                     ("inf", "inf"), ("-", "-")]  # fmt: skip


_LEGEND = (
    "err/bnd: ‖F − T‖/‖B‖ of the bfloat16 run (D) and of the float64 run (f64, the verdict: pass "
    "iff <= 1); max rel elem: over the elements whose exact value is in bfloat16's normal range "
    "and above its own bound (elsewhere a microbatch's gradient cancels, one spacing off reads as "
    "1e12 and the bound judges it; audit.csv has both); det.: two runs hash the same."
)
# A fact long enough to wrap, with a hyphenated word across column 120: it moves down whole.
_LONG_FP16 = "applies non-finite gradients " + "and then " * 10 + "once-per-window-after-the-spike"


def test_the_terminal_report_explains_its_columns_and_wraps_each_loops_facts() -> None:
    """Under the terminal's cell table, its legend (the short headers and the verdict's rule,
    wrapped under a 4-space indent); then "Per loop (the full table is audit.md's):" and per
    loop a line naming it, its version, checked range and model, and its facts under a 4-space
    indent, wrapped under 6 spaces at 120 columns, a hyphenated word never split."""
    result = _result()
    result.facts[0].fp16 = _LONG_FP16
    text = render_table(result)
    cells, facts = text.split("\n\n")[1:3]
    legend = "\n".join(cells.splitlines()[2 + len(result.cells) :])
    # the legend, then why a pass shows a D run above its bound (bad / zero's inf)
    assert re.sub(r"\n {4}", " ", legend).startswith(_LEGEND + "\n  bad / zero: pass: "), legend
    lines = facts.splitlines()
    assert lines[0] == "Per loop (the full table is audit.md's):"
    assert lines[1] == "good: version 1.2.3; checked: >=1.0; model causal"
    good = lines[2 : lines.index("bad: version -; checked: >=1.0; model seq2seq")]
    assert good[0].startswith("    float64 copy: clean; ") and len(good) > 1
    assert all(line.startswith(" " * 6) and line[6] != " " for line in good[1:]), good
    assert all(len(line) <= 120 and not line.endswith("-") for line in good), good
    assert " ".join(line.strip() for line in good) == (
        "float64 copy: clean; reads window first: yes (measured); zero-target window: NaN/inf "
        "gradient, FAIL; mid-window resume: bit-identical; resumed rel L2: 0; fixed loss scale: "
        f"exact; fp16 overflow: {_LONG_FP16}"
    )
