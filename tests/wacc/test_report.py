"""``wacc report --quick`` through a real subprocess: every file, plot and replay it promises,
for the shipped implementations and a user's own (``--impl``), next to a previous report
(``--compare-to``)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.wacc.rendered import markdown_table, section, text_table
from tests.wacc.test_report_audit import make_audit_folder
from tests.wacc.test_report_writer import INDEX_COLUMNS, TERMINAL_COLUMNS, assert_headline_shows
from wacc.errors import UsageError
from wacc.report.previous import read_rows
from wacc.report.rows import IMPLEMENTATIONS
from wacc.report.sweeps import overflow_map
from wacc.report.writer import (
    CSV_COLUMNS,
    MANIFEST,
    ORACLE_COLUMNS,
    ROW_COLUMNS,
)
from wacc_ref import formats

REPO = Path(__file__).resolve().parents[2]
USER = "tests.wacc.impls:double_unscale"  # a user's implementation: divides by S twice
PREVIOUS = REPO / "reports" / "cpu-reference"  # the committed report: compared with
FIGURES = (
    "error_bound_vs_window.png",
    "skew.png",
    "loss_scaling.png",
    "overflow_map.png",
    "double_rounding.png",
)


# A user's files in the report's folder, next to its own: never the report's to delete.
USERS_FILES = {
    "scenarios/my-notes.txt": "why these fail\n",
    "scenarios/my-scenario.json": "{}\n",
    "figures/my-plot.png": "not a report's figure\n",
    "notes.md": "mine\n",
}
# What an earlier report wrote (its manifest lists them): a replay file and a figure this run
# does not write (a CPU-only run writes no devices.png).
STALE_FILES = {
    "scenarios/float16-windows-0000000000.json": "{}\n",
    "figures/devices.png": "an earlier run's figure\n",
}


@pytest.fixture(scope="module")
def audit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``wacc audit`` folder (a failing loop and one that raises) for the report's section."""
    return make_audit_folder(tmp_path_factory.mktemp("audit") / "wacc-audit")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, audit: Path) -> tuple[Path, str]:
    """A quick report written by the real command, with a user's implementation that diverges
    (so the command exits 1), compared with the committed report, with an audit's section.

    The folder already holds a user's files and what an earlier report wrote (listed in its
    manifest, one of them a replay file this corpus does not write): see
    test_a_report_removes_only_its_own_stale_files."""
    out = tmp_path_factory.mktemp("report") / "wacc-report"
    for name, text in {**USERS_FILES, **STALE_FILES}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text, encoding="utf-8")
    (out / MANIFEST).write_text("".join(f"{name}\n" for name in STALE_FILES), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "wacc", "report", "--quick", "--out", str(out), "--impl", USER,
         "--compare-to", str(PREVIOUS), "--audit", str(audit)],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr  # the user's rows fail
    assert "report: " in result.stdout
    return out, result.stdout


@pytest.fixture(scope="module")
def report(run: tuple[Path, str]) -> Path:
    return run[0]


def test_index_has_provenance_the_headline_table_and_every_figure(report: Path) -> None:
    """index.md states its provenance, one headline row per dtype x implementation, all plots."""
    index = (report / "index.md").read_text(encoding="utf-8")
    for fact in ("at commit", "torch", "hypothesis", "gmpy2", "corpus: seed 0", "wall time"):
        assert fact in index
    for dtype in formats.WORK_DTYPES:
        for name in (*IMPLEMENTATIONS, USER):
            assert f"| {dtype} | `{name}` | cpu |" in index
    for figure in FIGURES:
        assert f"(figures/{figure})" in index


def test_index_has_the_audits_section_and_figure(report: Path, audit: Path) -> None:
    """The audit folder's table is a section of index.md (its loops, its provenance) and its
    figure is copied beside the report's own, byte for byte."""
    index = (report / "index.md").read_text(encoding="utf-8")
    section = index.split("## Training frameworks (`wacc audit`)", 1)[1].split("\n## ", 1)[0]
    with (audit / "audit.csv").open(newline="", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    for loop in {r["loop"] for r in records}:
        assert f"| {loop} |" in section
    assert f"commit `{records[0]['wacc_commit']}`" in section
    assert "(figures/audit.png)" in section
    assert (report / "figures" / "audit.png").read_bytes() == (audit / "audit.png").read_bytes()


def test_index_has_the_device_section_and_its_tables_are_device_csv(report: Path) -> None:
    """A CPU report has the device section: its tables are device.csv's rows cell for cell, the
    CUDA-only parts are skipped with a reason (no rehearsal asked), the reduction figure and
    reduction.csv (gloo measured beside the models) are written and listed in the manifest."""
    from tests.wacc.test_report_device import check_tables_match_csv
    from wacc.report.device_section import read_csv

    index = (report / "index.md").read_text(encoding="utf-8")
    section = index.split("\n## Devices\n", 1)[1].split("\n## ", 1)[0]
    check_tables_match_csv(section, report / "device.csv")
    rows = read_csv(report / "device.csv")
    skipped = {r["table"] for r in rows if r["note"].startswith("skipped: ")}
    assert skipped == {"precision", "fp8"} and "Rehearsal" not in section
    assert {r["device"] for r in rows if r["table"] == "ops"} == {"cpu"}
    assert "(figures/reduction_error.png)" in section
    with (report / "reduction.csv").open(newline="", encoding="utf-8") as handle:
        assert "gloo_measured" in {row["model"] for row in csv.DictReader(handle)}
    listed = set((report / MANIFEST).read_text(encoding="utf-8").splitlines())
    assert {"device.csv", "reduction.csv", "figures/reduction_error.png"} <= listed


def test_a_report_removes_only_its_own_stale_files(report: Path) -> None:
    """A report into a folder with files in it: the user's files (in scenarios/, figures/ and
    beside them) survive untouched; the files the earlier report listed as its own and this one
    did not write are gone; the new manifest lists exactly this report's files, each there."""
    for name, text in USERS_FILES.items():
        assert (report / name).read_text(encoding="utf-8") == text, name
    for name in STALE_FILES:
        assert not (report / name).exists(), name
    listed = (report / MANIFEST).read_text(encoding="utf-8").splitlines()
    assert all((report / name).is_file() for name in listed)
    with (report / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        replays = {row["replay"] for row in csv.DictReader(handle) if row["replay"]}
    assert {name for name in listed if name.startswith("scenarios/")} == replays
    assert {p.relative_to(report).as_posix() for p in (report / "scenarios").iterdir()} == (
        replays | {name for name in USERS_FILES if name.startswith("scenarios/")}
    )
    assert {"index.md", "divergence.csv", *(f"figures/{f}" for f in FIGURES)} <= set(listed)


def test_index_lists_what_each_implementation_lacks(report: Path) -> None:
    """The baselines' missing features are named as ``wacc check`` names them: no records for
    the plain loop, no integrity check for the records of the spec-built ones; wacc_torch lacks
    nothing."""
    index = (report / "index.md").read_text(encoding="utf-8")
    section = index.split("## Features the implementations lack", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("- `")]
    assert "- `pixparse_loop`: unsupported: records: " in section
    for name in ("scale_times_weight", "fused_undeclared"):
        assert f"- `{name}`: unsupported: checksum: records in the documented layout" in section
    assert not [line for line in lines if line.startswith("- `wacc_torch")]


def test_figures_are_real_readable_images(report: Path) -> None:
    """Each figure is a PNG at least 700 px wide with more than a handful of colours."""
    for figure in FIGURES:
        with Image.open(report / "figures" / figure) as image:
            assert image.format == "PNG" and image.width >= 700 and image.height >= 400
            colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colours is None or len(colours) > 20, figure


def test_csv_rows_cover_the_corpus_and_name_a_replay_file_for_every_failure(report: Path) -> None:
    """divergence.csv has one row per scenario x implementation; failing rows have replay files."""
    with (report / "divergence.csv").open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == CSV_COLUMNS
    scenarios = {row["scenario_id"] for row in rows}
    assert len(rows) == len(scenarios) * (len(IMPLEMENTATIONS) + 1)  # and the user's
    ours = [row for row in rows if row["implementation"].startswith("wacc_torch")]
    names = {row["implementation"] for row in ours}
    assert names == {"wacc_torch", "wacc_torch_fused", "wacc_torch_zero_copy"}
    assert all(row["verdict"] == "pass" for row in ours)
    failing = [row for row in rows if row["verdict"] != "pass"]
    assert failing and all((report / row["replay"]).is_file() for row in failing)
    assert {row["grad_dtype"] for row in rows} == set(formats.FORMATS)


def test_csv_columns_name_each_oracle_and_the_provenance(report: Path) -> None:
    """Each row says pass/fail per oracle in its own column (matching its verdict) and carries
    the report's commit, versions and corpus, so rows of several reports stay attributable."""
    with (report / "divergence.csv").open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    index = (report / "index.md").read_text(encoding="utf-8")
    for row in rows:
        failed = {o for o in ORACLE_COLUMNS if row[o] == "fail"}
        assert {row[o] for o in ORACLE_COLUMNS} <= {"pass", "fail"}
        expected = set(row["verdict"].removeprefix("fail: ").split(",")) if failed else set()
        assert failed == expected and (row["verdict"] == "pass") == (not failed), row
        assert (
            row["commit"] in index and row["corpus_seed"] == "0" and row["corpus_size"] == "quick"
        )
    assert {row["torch_version"] for row in rows} == {__import__("torch").__version__}


def test_a_users_implementation_is_judged_like_the_shipped_ones(run: tuple[Path, str]) -> None:
    """--impl: the user's rows are in the CSV with replay files for its failures (which replay
    as failures with its spec), in the headline on stdout and in the figures' captions; the
    overflow map marks the cells where it loses the mean that wacc_torch keeps."""
    report, stdout = run
    with (report / "divergence.csv").open(encoding="utf-8") as handle:
        mine = [row for row in csv.DictReader(handle) if row["implementation"] == USER]
    failing = [row for row in mine if row["verdict"] != "pass"]
    assert mine and failing and all((report / row["replay"]).is_file() for row in failing)
    assert USER in stdout
    index = (report / "index.md").read_text(encoding="utf-8")
    caption = index.split("## Overflow map", 1)[1].split("\n## ", 1)[0]
    assert f"`{USER}`: a marker on each of the " in caption
    marked = int(caption.split(f"`{USER}`: a marker on each of the ", 1)[1].split()[0])
    assert marked > 0  # it divides by S twice: wrong wherever S != 1
    replayed = subprocess.run(
        [sys.executable, "-m", "wacc", "replay", str(report / failing[0]["replay"]), "--impl",
         USER], cwd=REPO, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    assert replayed.returncode == 1


def test_the_previous_reports_headline_stands_next_to_the_new_one(run: tuple[Path, str]) -> None:
    """--compare-to: index.md and stdout put each headline line's values next to the previous
    report's, as `now (before)`, with a change column; a line only the new report has is
    `new`."""
    report, stdout = run
    index = (report / "index.md").read_text(encoding="utf-8")
    section = index.split(f"## Compared with `{PREVIOUS}`", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines()
             if line.split(" | ")[0].removeprefix("| ") in formats.WORK_DTYPES]  # fmt: skip
    assert len(lines) == len(formats.WORK_DTYPES) * (len(IMPLEMENTATIONS) + 1)
    changes = {line: line.rstrip(" |").rsplit("| ", 1)[-1] for line in lines}
    assert set(changes.values()) <= {"same", "better", "worse", "new"}
    assert {change for line, change in changes.items() if USER in line} == {"new"}
    assert "compared with" in stdout and "(216)" in stdout  # the committed report's 216 each


def test_a_previous_report_of_an_older_format_or_a_broken_one(tmp_path: Path) -> None:
    """--compare-to reads a CSV with only the row columns (an older wacc's, its relative error
    column under its old name too); a missing column, a bad number or a bad verdict is one
    UsageError naming the file, line, column and value."""
    lines = (PREVIOUS / "divergence.csv").read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    keep = [header.index(column) for column in ROW_COLUMNS]
    older = tmp_path / "older"
    older.mkdir()
    rows = [next(csv.reader([line])) for line in lines[:4]]
    with (older / "divergence.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([[row[i] for i in keep] for row in rows])
    assert len(read_rows(older)) == 3
    text = (older / "divergence.csv").read_text(encoding="utf-8").splitlines()
    legacy = tmp_path / "legacy"  # wacc 0.1 named the relative error's column max_rel_error
    legacy.mkdir()
    (legacy / "divergence.csv").write_text(
        "\n".join([text[0].replace("max_rel_error_normal", "max_rel_error"), *text[1:]]) + "\n",
        encoding="utf-8",
    )
    assert read_rows(legacy) == read_rows(older)
    for edit, fragment in (
        (lambda cells: cells[:-1], "line 1: missing column(s) replay"),
        (lambda cells: [*cells[:9], "lots", *cells[10:]], "line 1: missing column(s) max_ulps"),
    ):
        broken = tmp_path / f"b{len(fragment)}"
        broken.mkdir()
        (broken / "divergence.csv").write_text(
            ",".join(edit(text[0].split(","))) + "\n" + "\n".join(text[1:]) + "\n",
            encoding="utf-8",
        )
        with pytest.raises(UsageError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            read_rows(broken)
    column = ROW_COLUMNS.index("max_ratio")
    for value, fragment in (
        ("nan", "must not be NaN"),
        ("-1", "must be >= 0"),
        ("x", "not a number"),
    ):
        bad = tmp_path / f"v{value}"
        bad.mkdir()
        cells = next(csv.reader([text[2]]))
        cells[column] = value
        buffer = [text[0], text[1], ",".join(f'"{c}"' for c in cells)]
        (bad / "divergence.csv").write_text("\n".join(buffer) + "\n", encoding="utf-8")
        with pytest.raises(UsageError, match=f"line 3: max_ratio: {fragment}") as raised:
            read_rows(bad)
        assert str(raised.value).endswith(f"got '{value}'") and str(bad) in str(raised.value)


@pytest.mark.parametrize(
    ("column", "value", "fragment"),
    [
        ("max_ratio", "\u0661", "max_ratio: not a number"),  # float() takes Arabic-Indic digits
        ("max_ratio", "1_0", "max_ratio: not a number"),  # and underscores
        ("implementation", "a|b", "implementation: must not hold '|' or a line break"),
        ("family", "a\nb", "family: must not hold '|' or a line break"),
        ("scenario_id", None, "is also on line 2"),  # line 3 repeats line 2's row
    ],
)
def test_a_previous_reports_fields_are_read_strictly(
    tmp_path: Path, column: str, value: str | None, fragment: str
) -> None:
    """--compare-to refuses a number in another script or with underscores, a name that breaks
    the comparison's markdown table, and a scenario x implementation x device given twice: one
    UsageError naming the file and the line."""
    with (PREVIOUS / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))[:3]
    index = rows[0].index(column)
    rows[2][index] = rows[1][index] if value is None else value
    if value is None:  # the same row twice
        rows[2] = list(rows[1])
    (tmp_path / "divergence.csv").write_text(
        "".join(",".join(f'"{c}"' for c in row) + "\n" for row in rows), encoding="utf-8"
    )
    with pytest.raises(UsageError, match="line 3: ") as raised:
        read_rows(tmp_path)
    assert fragment in str(raised.value) and str(tmp_path) in str(raised.value)


def test_a_failing_rows_replay_file_reproduces_the_divergence(report: Path) -> None:
    """The replay file of a failing baseline row fails again under ``wacc replay`` with it."""
    with (report / "divergence.csv").open(encoding="utf-8") as handle:
        row = next(r for r in csv.DictReader(handle) if r["implementation"] == "scale_times_weight"
                   and r["verdict"] != "pass")  # fmt: skip
    command = [sys.executable, "-m", "wacc", "replay", str(report / row["replay"])]
    spec = IMPLEMENTATIONS["scale_times_weight"]
    assert subprocess.run([*command, "--impl", spec], cwd=REPO, capture_output=True,
                          timeout=300, check=False).returncode == 1  # fmt: skip


@pytest.mark.parametrize("dtype", formats.WORK_DTYPES)
def test_the_overflow_map_is_confirmed_by_running_both_divisions(dtype: str) -> None:
    """Every finite cell of the map was run on both implementations and matched its category."""
    data = overflow_map(dtype)
    assert data.checked > 0 and 1 in data.categories  # S·W overflow is present in every dtype


def test_an_implementation_without_records_runs_the_corpus_without_checkpoints(
    report: Path,
) -> None:
    """pixparse_loop has no records: its interruption scenarios run without their checkpoints
    and restores (the missing feature is listed once, not a semantics failure per scenario):
    each failing row's replay file is that twin (or a scenario that had none), holding no
    checkpoint step."""
    with (report / "divergence.csv").open(encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if r["implementation"] == "pixparse_loop"
                and r["family"] == "interruptions" and r["verdict"] != "pass"]  # fmt: skip
    assert any(row["replay"].endswith("-no-records.json") for row in rows), rows
    for row in rows:  # the twin, or a scenario the generator gave no interruption
        steps = (report / row["replay"]).read_text(encoding="utf-8")
        assert '"checkpoint"' not in steps and '"restore' not in steps, row["replay"]


def _records(folder: Path) -> list[dict[str, str]]:
    with (folder / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_the_headlines_show_what_divergence_csv_holds(run: tuple[Path, str]) -> None:
    """The headline in index.md and the one printed, read back by column name, show for each
    work dtype x implementation x device what the report's divergence.csv rows give (issue 33:
    a swap of two columns, or another rounding, fails here)."""
    report, stdout = run
    records = _records(report)
    index = (report / "index.md").read_text(encoding="utf-8")
    lines = markdown_table(section(index, "## Headline"))
    assert_headline_shows(lines, records, INDEX_COLUMNS, quoted=True)
    assert_headline_shows(text_table(stdout), records, TERMINAL_COLUMNS, quoted=False)


def _now_before(cell: str) -> tuple[str, str]:
    """``now (before)`` split at the parenthesis that matches the last one (a verdict has its
    own: ``FAIL 3/9 (bound) (pass)``)."""
    assert cell.endswith(")"), cell
    depth = 0
    for at in range(len(cell) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(cell[at], 0)
        if depth == 0:
            assert cell[at - 1] == " ", cell
            return cell[: at - 1], cell[at + 1 : -1]
    raise AssertionError(f"unbalanced: {cell!r}")


def test_the_comparison_shows_both_reports_csvs(run: tuple[Path, str]) -> None:
    """The table comparing with the previous report, in index.md and printed, read back by
    column name: each ``now (before)`` cell's two sides are this report's and the previous
    report's headline values, each from its own divergence.csv."""
    report, stdout = run
    index = (report / "index.md").read_text(encoding="utf-8")
    written = markdown_table(section(index, f"## Compared with `{PREVIOUS}`"))
    # What follows the printed table (what each implementation lacks) is not a table's row.
    printed = stdout.split("compared with", 1)[1].splitlines()[1 : 3 + len(written)]
    for table in (written, text_table("\n".join(printed))):
        for side, folder in ((0, report), (1, PREVIOUS)):
            lines = []
            for cells in table:
                pairs = {}
                for column, cell in cells.items():
                    if column in ("dtype", "implementation", "device", "change"):
                        pairs[column] = cell
                    else:
                        pairs[column] = _now_before(cell)[side]
                if pairs["scenarios"] != "-":
                    lines.append(pairs)
            assert_headline_shows(
                lines, _records(folder), TERMINAL_COLUMNS, quoted=False, ordered=False
            )
