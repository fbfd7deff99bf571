"""``wacc.audit.report``: the terminal tables and ``audit.md``, read back by column name, show
what ``audit.csv`` holds for the same result, cell by cell (issue 33). The result is made here
by hand (every kind of cell: a pass, a FAIL, a loop that did not run, a miscount, a mean per
microbatch, a nondeterministic run), so that each column's values differ from its neighbours'."""

from __future__ import annotations

import csv
import math
from pathlib import Path

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
    FACT_COLUMNS,
    RANK_COLUMNS,
    _cell_columns,
    cell_rows,
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
        Cell("good", "unequal", rel_l2=1.23456e-7, max_rel=2.34567e-6, ratio=0.0345678,
             element_ratio=0.5, semantic_rel_l2=4.5678e-16, semantic_ratio=0.00123456,
             semantic_element_ratio=0.25, counted=211.0, true_count=211, deterministic=True,
             digest="ab12"),
        Cell("good", "zero", rel_l2=0.0, max_rel=0.0, ratio=0.0, semantic_ratio=0.0,
             counted=None, true_count=0, finite=False, deterministic=None, digest="cd34"),
        Cell("bad", "unequal", rel_l2=0.456789, max_rel=987.654, ratio=12345.6,
             element_ratio=3.0, semantic_rel_l2=0.3456, semantic_ratio=5678.91,
             semantic_element_ratio=7.0, counted=4.0, true_count=211, deterministic=False,
             digest="ef56"),
        Cell("bad", "zero", rel_l2=math.inf, max_rel=math.nan, ratio=math.inf,
             semantic_ratio=0.125, counted=1.0, true_count=0, deterministic=True),
        # A run that raised after some metrics were measured: none of them is shown.
        Cell("broken", "unequal", status=_BOOM, rel_l2=0.5, max_rel=0.25, ratio=2.0,
             semantic_ratio=4.0, counted=3.0, true_count=211),
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
    common = dict(world_size=2, rank_tokens=(211, 17), true_count=228, deterministic=True)
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
