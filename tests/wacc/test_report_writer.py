"""``wacc.report.writer`` in this process: ``index.md``'s tables, read back by column name, show
what ``divergence.csv`` (and the data the writer is given) holds, cell by cell (issue 33). The
rows are made here by hand: every metric differs from its neighbours' in each line, so a swapped
column or another rounding reads as another value. (The real command's report is
``test_report.py``.)"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.wacc.ascii_locale import ascii_locale
from tests.wacc.rendered import markdown_table, section, shows_metric
from wacc.report.corpus import FUSED_SUFFIX, build_corpus
from wacc.report.provenance import Provenance
from wacc.report.rows import NotJudged, Row
from wacc.report.writer import (
    CSV_COLUMNS,
    MANIFEST,
    ORACLE_COLUMNS,
    record_files,
    write_csv,
    write_index,
    write_scenarios,
)
from wacc_ref import formats
from wacc_ref.scenario import from_json, to_json

PROVENANCE = Provenance(
    versions={"wacc": "9.9", "torch": "2.13"}, commit="abc123", devices={"cpu": "test cpu"},
    corpus_seed=7, corpus_size="quick", scenarios=5, date="2026-01-01", wall_seconds=1.25,
)  # fmt: skip


def _row(n: int, dtype: str, name: str, verdict: str = "pass", device: str = "cpu") -> Row:
    # Metrics of many digits, different in each column and each row.
    return Row(
        scenario_id=f"{dtype}-windows-{n:04d}", family="windows", implementation=name,
        device=device, work_dtype=dtype, grad_dtype=dtype, window_length=n + 1,
        weight_skew=1.0 + n, loss_scale=2.0**n, max_ulps=0.0 if n == 0 else 1.23456 * 10**n,
        max_rel_error=3.45678e-3 / (n + 1), max_ratio=0.1234567 * (n + 1),
        verdict=verdict, replay=f"scenarios/{dtype}-windows-{n:04d}.json" if verdict != "pass"
        else "",
    )  # fmt: skip


ROWS = [
    _row(0, "float32", "wacc_torch"),
    _row(1, "float32", "wacc_torch"),
    _row(0, "float32", "wacc_torch", device="meta"),
    _row(2, "float32", "pixparse_loop", verdict="fail: emulation,bound"),
    _row(3, "float32", "pixparse_loop", verdict="fail: bound"),
    _row(4, "float32", "pixparse_loop"),
    _row(1, "bfloat16", "scale_times_weight", verdict="fail: semantics"),
    _row(2, "float64", "mine.py:make"),
    _row(5, "float64", "wacc_torch_fused"),
]
# A ratio just below the bound, and an infinite one: never shown as 1 or as a number.
ROWS.append(
    dataclasses.replace(
        _row(0, "float16", "wacc_torch"), max_ratio=0.99999, max_ulps=math.inf, max_rel_error=0.5
    )
)
NOT_JUDGED = [
    NotJudged("float32-dynamic-0001", "dynamic_scaling", "mine.py:make", "cpu", "float32",
              "float32", ("found_inf", "set_loss_scale")),
]  # fmt: skip
VARIANTS = {
    "cpu": {"float16": Counter({"fma": 3, "mixed": 2}), "float32": Counter({"any": 7})},
    "cuda:0": {"bfloat16": Counter({"two_step": 1})},
}
COMPARED = (
    "old-report",
    ["work dtype", "metric"],
    [["float32", "1 (2)"], ["float16", "inf (0.5)"]],
)


# Per test (not per module): mutmut counts a fixture's calls for the test that set it up first.
@pytest.fixture
def written(tmp_path: Path) -> tuple[str, list[dict[str, str]]]:
    """index.md's text and divergence.csv's rows of one report."""
    out = tmp_path
    write_csv(ROWS, out / "divergence.csv", provenance=PROVENANCE, not_judged=NOT_JUDGED)
    figures = {"A figure": (out / "figures" / "a.png", "What it shows.")}
    write_index(
        out, provenance=PROVENANCE, rows=ROWS, figures=figures, variants=VARIANTS, replay_files=4,
        unsupported={"mine.py:make": ["not judged: found_inf (an extension)"], "x": []},
        not_judged=NOT_JUDGED, compared=COMPARED, audit=["## Audit lines", "", "as given", ""],
    )  # fmt: skip
    with (out / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    return (out / "index.md").read_text(encoding="utf-8"), records


# The headline's columns in index.md and on the terminal, by what they show (a CSV column).
INDEX_COLUMNS = {
    "work_dtype": "work dtype", "device": "device", "scenarios": "scenarios",
    "max_ulps": "max ulps vs emulation", "max_rel_error_normal": "max rel. error (normal range)",
    "max_ratio": "max error/bound", "verdict": "verdict",
}  # fmt: skip
TERMINAL_COLUMNS = {
    **INDEX_COLUMNS, "work_dtype": "dtype", "max_ulps": "max ulps",
    "max_rel_error_normal": "max rel err (normal)", "max_ratio": "max err/bound",
}  # fmt: skip
_SHIPPED = [
    "wacc_torch", "wacc_torch_fused", "wacc_torch_zero_copy", "pixparse_loop",
    "scale_times_weight", "fused_undeclared",
]  # fmt: skip


def assert_headline_shows(
    lines: list[dict[str, str]], records: list[dict[str, str]], columns: dict[str, str], *,
    quoted: bool, ordered: bool = True,
) -> None:  # fmt: skip
    """A headline table read back (``columns``: CSV column -> its header there; ``quoted``: the
    implementation in backticks) against divergence.csv's rows: one line per work dtype x
    implementation x device of its judged rows, in table order (work dtypes in order, the
    shipped implementations first in theirs, a user's last), each cell what those rows give:
    their count, the largest of each metric (4 significant digits) and the verdict with the
    failing count and the oracles that failed. ``ordered=False``: in any order."""
    judged = [r for r in records if not r["verdict"].startswith("not judged")]
    groups: dict[tuple[str, str, str], list[dict[str, str]]] = {}
    for r in judged:
        groups.setdefault((r["work_dtype"], r["implementation"], r["device"]), []).append(r)

    def order(key: tuple[str, str, str]) -> tuple[int, int, str]:
        dtype, name, device = key
        return (
            formats.WORK_DTYPES.index(dtype),
            _SHIPPED.index(name) if name in _SHIPPED else 99,
            device,
        )

    keys = sorted(groups, key=order)
    assert len(lines) == len(keys)
    if not ordered:
        position = {(k[0], f"`{k[1]}`" if quoted else k[1], k[2]): i for i, k in enumerate(keys)}
        lines = sorted(
            lines,
            key=lambda c: position.get(
                (c[columns["work_dtype"]], c["implementation"], c[columns["device"]]), -1
            ),
        )
    for cells, key in zip(lines, keys, strict=True):
        mine = groups[key]
        name = f"`{key[1]}`" if quoted else key[1]
        assert (cells[columns["work_dtype"]], cells["implementation"]) == (key[0], name)
        assert cells[columns["device"]] == key[2]
        assert cells[columns["scenarios"]] == str(len(mine))
        for field in ("max_ulps", "max_rel_error_normal", "max_ratio"):
            value = max(float(r[field]) for r in mine)
            shown = cells[columns[field]]
            assert shows_metric(shown, value), (key, columns[field], shown, value)
        failing = [r for r in mine if any(r[o] == "fail" for o in ORACLE_COLUMNS)]
        oracles = sorted({o for r in failing for o in ORACLE_COLUMNS if r[o] == "fail"})
        expected = f"FAIL {len(failing)}/{len(mine)} ({', '.join(oracles)})" if failing else "pass"
        assert cells[columns["verdict"]] == expected, key


def test_the_headline_shows_what_divergence_csv_holds(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """index.md's headline table, read back by column name, has one line per work dtype x
    implementation x device of divergence.csv, in table order, each cell what the CSV's rows
    give: the count, the largest of each metric (4 significant digits) and the verdict with the
    failing count and the oracles that failed."""
    index, records = written
    lines = markdown_table(section(index, "## Headline"))
    assert_headline_shows(lines, records, INDEX_COLUMNS, quoted=True)


def test_divergence_csv_has_every_row_and_the_not_judged_ones(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """divergence.csv has the CSV's columns, one line per row with each field as the row has it
    (floats as repr), each oracle's pass/fail from the row's verdict, the provenance on every
    line; then a ``not judged`` line per scenario left out, its metrics empty."""
    _, records = written
    assert tuple(records[0]) == CSV_COLUMNS
    assert len(records) == len(ROWS) + len(NOT_JUDGED)
    for record, row in zip(records, ROWS, strict=False):
        assert record["scenario_id"] == row.scenario_id and record["device"] == row.device
        assert float(record["max_ulps"]) == row.max_ulps
        assert float(record["max_rel_error_normal"]) == row.max_rel_error
        assert float(record["max_ratio"]) == row.max_ratio
        assert record["loss_scale"] == repr(row.loss_scale)
        assert record["window_length"] == str(row.window_length)
        assert (record["verdict"], record["replay"]) == (row.verdict, row.replay)
        failed = row.verdict.removeprefix("fail: ").split(",") if row.failed else []
        assert [record[o] for o in ORACLE_COLUMNS] == [
            "fail" if o in failed else "pass" for o in ORACLE_COLUMNS
        ]
        assert [record[c] for c in ("wacc_version", "torch_version", "commit", "corpus_seed",
                                    "corpus_size", "date")] == [
            "9.9", "2.13", "abc123", "7", "quick", "2026-01-01"]  # fmt: skip
    skipped = records[-1]
    assert skipped["verdict"] == "not judged: found_inf, set_loss_scale"
    assert (skipped["scenario_id"], skipped["family"]) == (
        "float32-dynamic-0001",
        "dynamic_scaling",
    )
    assert [skipped[o] for o in ORACLE_COLUMNS] == ["not judged"] * 3
    assert skipped["max_ulps"] == skipped["max_ratio"] == skipped["replay"] == ""
    assert skipped["commit"] == "abc123"


def test_the_fused_variants_table_shows_each_device_and_dtypes_counts(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """The fused-mode table, read back, has one line per device x work dtype that has counts,
    in work-dtype order, its variants sorted by name with their counts."""
    index, _ = written
    lines = markdown_table(section(index, "## Fused mode: the §6 variant each device took"))
    expected = [
        {"device": device, "work dtype": dtype,
         "variants matched (scenarios)": ", ".join(f"{k}: {n}" for k, n in sorted(c.items()))}
        for device, per_dtype in VARIANTS.items()
        for dtype in formats.WORK_DTYPES if (c := per_dtype.get(dtype))
    ]  # fmt: skip
    assert lines == expected


def test_the_comparison_table_shows_the_given_header_and_rows(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """The section comparing with a previous report is the header and rows given, by name."""
    index, _ = written
    folder, header, cells = COMPARED
    lines = markdown_table(section(index, f"## Compared with `{folder}`"))
    assert lines == [dict(zip(header, row, strict=True)) for row in cells]


def test_index_states_provenance_features_audit_and_files(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """index.md states the provenance, what each implementation lacks and how many scenarios it
    was not judged on, the audit's lines as given, and the files with the CSV's row count and
    columns and the replay files' count."""
    index, _ = written
    assert index.startswith("# wacc report\n\n" + "\n".join(PROVENANCE.lines()) + "\n\n## Headline")
    lacking = section(index, "## Features the implementations lack").splitlines()
    assert "- `mine.py:make`: not judged: found_inf (an extension)" in lacking
    assert "- `mine.py:make`: 1 corpus scenario(s) x device(s) not judged" in lacking
    assert not any(line.startswith("- `x`") for line in lacking)
    assert section(index, "## Audit lines").strip() == "as given"
    files = section(index, "## Files").strip().splitlines()
    assert files == [
        f"- `divergence.csv`: {len(ROWS)} rows (scenario x implementation x device): "
        + ", ".join(CSV_COLUMNS),
        "- `scenarios/`: 4 replay files, one per scenario that a row fails "
        "(`wacc replay scenarios/<file> --impl <factory>`)",
    ]


def test_a_device_section_sits_before_the_files_which_name_its_csvs(tmp_path: Path) -> None:
    """With a device section, index.md holds its lines as given, right before the files, and the
    files name ``device.csv`` and ``reduction.csv`` with what each holds; without one, neither."""
    device = ["## Devices", "", "the device lines", ""]
    write_index(tmp_path, provenance=PROVENANCE, rows=ROWS, figures={}, variants={},
                replay_files=0, device_section=device)  # fmt: skip
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "\n## Devices\n\nthe device lines\n\n## Files\n" in index
    files = section(index, "## Files").strip().splitlines()
    assert files[-1] == (
        "- `device.csv`: the device section's tables (column `table`); `reduction.csv`: the "
        "data-parallel reduction's models and gloo measured, per dtype x world size"
    )
    write_index(tmp_path, provenance=PROVENANCE, rows=ROWS, figures={}, variants={},
                replay_files=0)  # fmt: skip
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert "## Devices" not in index and "device.csv" not in index


def test_a_manifest_never_removes_what_is_not_the_reports(tmp_path: Path) -> None:
    """Whatever a manifest lists, only a replay file under scenarios/ or a figure under figures/
    is removed (not another name, a path out of the folder, or a symlink), and only when this
    report did not write it; the new manifest lists what this report wrote."""
    outside = tmp_path / "outside.json"
    out = tmp_path / "report"
    names = ["notes.md", "../outside.json", "scenarios/../notes.md", "scenarios/link.json",
             "scenarios/old.json", "scenarios/new.json", "figures/old.png"]  # fmt: skip
    (out / "scenarios").mkdir(parents=True)
    (out / "figures").mkdir()
    for path in (outside, out / "notes.md", out / "scenarios" / "old.json",
                 out / "scenarios" / "new.json", out / "figures" / "old.png"):  # fmt: skip
        path.write_text("x", encoding="utf-8")
    (out / "scenarios" / "link.json").symlink_to(out / "notes.md")
    (out / MANIFEST).write_text("\n".join(names) + "\n", encoding="utf-8")
    removed = record_files(out, [out / "scenarios" / "new.json"])
    assert sorted(p.relative_to(out).as_posix() for p in removed) == [
        "figures/old.png", "scenarios/old.json"
    ]  # fmt: skip
    assert (
        outside.exists()
        and (out / "notes.md").exists()
        and (out / "scenarios" / "new.json").exists()
    )
    assert (out / "scenarios" / "link.json").is_symlink()
    assert (out / MANIFEST).read_text(encoding="utf-8") == "scenarios/new.json\n"
    # A second report into the folder: what the first wrote and this one did not is removed.
    (out / "scenarios" / "newer.json").write_text("y", encoding="utf-8")
    assert record_files(out, [out / "scenarios" / "newer.json"]) == [out / "scenarios" / "new.json"]
    assert (out / MANIFEST).read_text(encoding="utf-8") == "scenarios/newer.json\n"


def test_a_first_report_removes_nothing_and_lists_its_files(tmp_path: Path) -> None:
    """Without a manifest (a first report, or one by a wacc before 0.3) nothing is removed; the
    new manifest lists this report's files, sorted, one a line, and no temporary is left."""
    out = tmp_path / "report"
    (out / "scenarios").mkdir(parents=True)
    old = out / "scenarios" / "old.json"
    old.write_text("x", encoding="utf-8")
    written = [out / "index.md", out / "scenarios" / "b.json", out / "scenarios" / "a.json"]
    assert record_files(out, written) == []
    assert (out / MANIFEST).read_text(encoding="utf-8") == (
        "index.md\nscenarios/a.json\nscenarios/b.json\n"
    )
    assert old.exists()
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "scenarios"]


def test_each_failing_rows_replay_file_holds_its_scenario(tmp_path: Path) -> None:
    """Every replay file the failing rows name is written once under the report's folder, as
    the scenario's JSON (indented, a final newline), the fused twin for a fused suffix; the
    count returned is the number of files."""
    corpus = build_corpus(size="quick")[:3]
    first, second = corpus[0], corpus[1]
    names = [f"scenarios/{first.scenario_id}.json",
             f"scenarios/{second.scenario_id}{FUSED_SUFFIX}.json"]  # fmt: skip
    rows = [
        dataclasses.replace(ROWS[3], scenario_id=first.scenario_id, replay=names[0]),
        dataclasses.replace(ROWS[4], scenario_id=first.scenario_id, replay=names[0]),
        dataclasses.replace(ROWS[3], scenario_id=second.scenario_id, replay=names[1]),
        dataclasses.replace(ROWS[0], scenario_id=corpus[2].scenario_id),  # passes: no file
    ]
    out = tmp_path / "report"
    assert write_scenarios(rows, corpus, out) == 2
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.json")) == sorted(names)
    for name, scenario in zip(
        names, [first.scenario, dataclasses.replace(second.scenario, fused=True)], strict=True
    ):
        text = (out / name).read_text(encoding="utf-8")
        assert text == to_json(scenario, indent=1) + "\n"
        assert from_json(text) == scenario


def test_a_version_not_recorded_reads_as_a_question_mark(tmp_path: Path) -> None:
    """divergence.csv's wacc and torch versions are ``?`` when the provenance has none."""
    bare = dataclasses.replace(PROVENANCE, versions={"numpy": "2.0"})
    write_csv(ROWS[:1], tmp_path / "d.csv", provenance=bare)
    with (tmp_path / "d.csv").open(newline="", encoding="utf-8") as handle:
        (record,) = list(csv.DictReader(handle))
    assert (record["wacc_version"], record["torch_version"]) == ("?", "?")


def test_index_is_its_sections_in_order_each_heading_set_apart(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """index.md has its title, then the headline, the comparison, the missing features, each
    figure (its caption and the image), the fused variants, the audit's lines and the files, in
    that order; each heading stands between blank lines; the file ends with one newline."""
    index, _ = written
    lines = index.split("\n")
    headings = [line for line in lines if line.startswith("#")]
    assert headings == [
        "# wacc report", "## Headline", "## Compared with `old-report`",
        "## Features the implementations lack", "## A figure",
        "## Fused mode: the §6 variant each device took", "## Audit lines", "## Files",
    ]  # fmt: skip
    for at, line in enumerate(lines):
        if line.startswith("#"):
            assert lines[at + 1] == "" and (at == 0 or lines[at - 1] == ""), line
    assert index.endswith("(`wacc replay scenarios/<file> --impl <factory>`)\n")
    assert section(index, "## A figure") == "\nWhat it shows.\n\n![A figure](figures/a.png)\n"


def _terms(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def test_each_sections_words_are_explained_where_it_is_read(
    written: tuple[str, list[dict[str, str]]],
) -> None:
    """The paragraph above each table names, in code, every metric column of the headline,
    every variant label the fused table can show, every change word and the ``now (before)``
    form of the comparison, and the two kinds of missing feature: a reader finds what a cell
    means above it."""
    index, _ = written
    headline = section(index, "## Headline").split("\n|", 1)[0]
    assert {"max ulps", "max rel. error (normal range)", "max error/bound"} <= _terms(headline)
    assert "three oracles (emulation bit for bit, error within the derived bound, semantics)" in (
        headline
    )
    fused = section(index, "## Fused mode: the §6 variant each device took").split("\n|", 1)[0]
    assert {"fma", "op_rounded", "two_step", "fma+op_rounded", "mixed", "any", "fused=True",
            "docs/semantics.md"} <= _terms(fused)  # fmt: skip
    compared = section(index, "## Compared with `old-report`").split("\n|", 1)[0]
    assert {"now (before)", "divergence.csv", "worse", "better", "new", "gone"} <= _terms(compared)
    lacking = section(index, "## Features the implementations lack").split("\n- ", 1)[0]
    assert {"unsupported", "not judged", "--allow-missing", "wacc.judge.contract"} <= _terms(
        lacking
    )
    # The caveats a reader needs to read the cells right, stated where the cells are.
    said = {name: " ".join(text.split()) for name, text in
            (("headline", headline), ("compared", compared), ("lacking", lacking))}  # fmt: skip
    assert "(a fused mode may legitimately differ)" in said["headline"]
    assert (
        "the bound's absolute part decides: the bound oracle judges those elements"
        in (said["headline"])
    )
    assert "`worse`: a metric or the failing share went up, `better`: down" in said["compared"]
    assert (
        "A report from a wacc before 0.2 measured the relative error over every nonzero exact "
        "value, not only the normal range." in said["compared"]
    )
    assert (
        "The steps and scenarios that need a missing feature are not run, so the rows above "
        "judge the rest" in said["lacking"]
    )
    for paragraph in (headline, fused, compared, lacking):
        text = paragraph.strip()
        assert text[0].isupper() and text.endswith(".") and "\n" not in text, text


def test_the_reports_files_are_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """index.md, divergence.csv and the manifest are written as UTF-8 (a user's implementation
    named with an accent, the § of index.md) even where the locale's encoding is ASCII."""
    rows = [dataclasses.replace(ROWS[0], implementation="mïne.py:make")]
    notes = tmp_path / "notes-é.md"
    with ascii_locale():
        write_csv(rows, tmp_path / "divergence.csv", provenance=PROVENANCE)
        write_index(tmp_path, provenance=PROVENANCE, rows=rows, figures={}, variants=VARIANTS,
                    replay_files=0)  # fmt: skip
        record_files(tmp_path, [notes])
    assert "mïne.py:make" in (tmp_path / "divergence.csv").read_text(encoding="utf-8")
    assert "`mïne.py:make`" in (tmp_path / "index.md").read_text(encoding="utf-8")
    assert (tmp_path / MANIFEST).read_text(encoding="utf-8") == "notes-é.md\n"


def test_a_manifest_that_is_not_utf8_or_too_long_is_read_as_far_as_it_can_be(
    tmp_path: Path,
) -> None:
    """A manifest with bytes that are not UTF-8 is still read (those bytes replaced), so its
    other lines still count; one longer than 16 MiB is read up to there: a name listed beyond
    is never removed."""
    out = tmp_path / "report"
    (out / "scenarios").mkdir(parents=True)
    for name in ("a.json", "b.json"):
        (out / "scenarios" / name).write_text("x", encoding="utf-8")
    (out / MANIFEST).write_bytes(b"scenarios/\xff.json\nscenarios/a.json\n")
    assert record_files(out, []) == [out / "scenarios" / "a.json"]
    padding = b"#" * (16 * 2**20) + b"\n"
    (out / MANIFEST).write_bytes(padding + b"scenarios/b.json\n")
    assert record_files(out, []) == []
    assert (out / "scenarios" / "b.json").exists()
