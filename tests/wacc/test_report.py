"""``wacc report --quick`` through a real subprocess: every file, plot and replay it promises."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from wacc.report.rows import IMPLEMENTATIONS
from wacc.report.sweeps import overflow_map
from wacc.report.writer import CSV_COLUMNS
from wacc_ref import formats

REPO = Path(__file__).resolve().parents[2]
FIGURES = (
    "error_bound_vs_window.png",
    "skew.png",
    "loss_scaling.png",
    "overflow_map.png",
    "double_rounding.png",
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A quick report written by the real command."""
    out = tmp_path_factory.mktemp("report") / "wacc-report"
    result = subprocess.run(
        [sys.executable, "-m", "wacc", "report", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "report: " in result.stdout
    return out


def test_index_has_provenance_the_headline_table_and_every_figure(report: Path) -> None:
    """index.md states its provenance, one headline row per dtype x implementation, all plots."""
    index = (report / "index.md").read_text(encoding="utf-8")
    for fact in ("at commit", "torch", "hypothesis", "gmpy2", "corpus: seed 0", "wall time"):
        assert fact in index
    for dtype in formats.WORK_DTYPES:
        for name in IMPLEMENTATIONS:
            assert f"| {dtype} | `{name}` | cpu |" in index
    for figure in FIGURES:
        assert f"(figures/{figure})" in index


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
    assert len(rows) == len(scenarios) * len(IMPLEMENTATIONS)
    ours = [row for row in rows if row["implementation"].startswith("wacc_torch")]
    names = {row["implementation"] for row in ours}
    assert names == {"wacc_torch", "wacc_torch_fused", "wacc_torch_zero_copy"}
    assert all(row["verdict"] == "pass" for row in ours)
    failing = [row for row in rows if row["verdict"] != "pass"]
    assert failing and all((report / row["replay"]).is_file() for row in failing)
    assert {row["grad_dtype"] for row in rows} == set(formats.FORMATS)


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
