"""The notebooks: each ``.ipynb`` is its jupytext ``.py`` twin without outputs, and both run.

They are executed by a real Jupyter kernel (ipykernel through nbclient), from the repository
root, as a user would run them; a failing cell (the notebooks assert their own claims) fails
the test with the cell's traceback.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SEMANTICS = NOTEBOOKS / "loss_scaling_semantics.ipynb"
EXPLORER = NOTEBOOKS / "error_report_explorer.ipynb"
CELL_TIMEOUT_S = 180  # the explorer's fallback runs a quick report (< 60 s) in one cell


def _sources(notebook: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def _execute(path: Path, *, env: Mapping[str, str]) -> nbformat.NotebookNode:
    """``path`` executed in a fresh kernel with ``env`` added to the environment."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute(env={**os.environ, **env})
    return notebook


def _printed(notebook: nbformat.NotebookNode) -> str:
    """Everything the notebook's cells printed (stream outputs), in order."""
    return "".join(
        output.text
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.output_type == "stream"
    )


def _figures(notebook: nbformat.NotebookNode) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )


def _number(text: str, label: str) -> float:
    (match,) = re.findall(rf"^{re.escape(label)}: (\S+)$", text, flags=re.M)
    return float(match)


@pytest.mark.parametrize("ipynb", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_ipynb_is_its_py_twin_without_outputs(ipynb: Path) -> None:
    """Each ``.ipynb`` has the cells of its percent-format ``.py`` twin and no outputs."""
    twin = ipynb.with_suffix(".py")
    assert twin.is_file(), f"{ipynb.name} has no jupytext twin {twin.name}"
    assert _sources(jupytext.read(ipynb)) == _sources(jupytext.read(twin))
    raw: dict[str, Any] = json.loads(ipynb.read_text(encoding="utf-8"))
    for cell in raw["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"]


def test_both_notebooks_exist_as_pairs() -> None:
    """The two notebooks of the suite exist as ``.py`` + ``.ipynb`` pairs."""
    for ipynb in (SEMANTICS, EXPLORER):
        assert ipynb.is_file() and ipynb.with_suffix(".py").is_file()


@pytest.mark.slow
def test_semantics_notebook_runs_and_shows_its_claims() -> None:
    """The semantics walkthrough runs clean: the common loop's error exceeds 10x wacc_torch's,
    S·W zeroes float16 gradients while the sequential division stays finite, a zero-weight
    batch changes nothing and resume is bit-identical, with its three figures."""
    notebook = _execute(SEMANTICS, env={})
    printed = _printed(notebook)
    common = _number(printed, "common loop relative error")
    wacc = _number(printed, "wacc_torch relative error")
    assert common > 10 * wacc
    assert "scale_times_weight: all zero True, relative error: 1.000e+00" in printed
    assert "wacc_torch sequential: all finite True" in printed
    assert "common loop: .grad has NaN: True" in printed
    assert "zero-weight microbatch changes nothing, bit-identical: True" in printed
    assert "finish_mean raised ZeroTotalWeightError" in printed
    assert "state unchanged by the raise: True" in printed
    assert "resume bit-identical: True" in printed
    assert _figures(notebook) == 3


@pytest.fixture(scope="module")
def fallback_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The explorer run with no report where WACC_REPORT_DIR points: it makes its own."""
    scratch = tmp_path_factory.mktemp("explorer")
    notebook = _execute(
        EXPLORER,
        # TMPDIR: the fallback's temporary report lands (and is cleaned up) under pytest's tmp.
        env={"WACC_REPORT_DIR": str(scratch / "absent"), "TMPDIR": str(scratch)},
    )
    assert _figures(notebook) == 2
    printed = _printed(notebook)
    (made,) = re.findall(r"^report: (\S+)$", printed, flags=re.M)
    return printed, Path(made)


def _csv_rows(report: Path) -> list[dict[str, str]]:
    with (report / "divergence.csv").open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_explorer_makes_a_quick_report_when_there_is_none(
    fallback_run: tuple[str, Path],
) -> None:
    """Without a report the explorer makes one and analyses all of its rows, replaying a
    failing one to the verdict the CSV records."""
    printed, report = fallback_run
    assert "no divergence.csv under" in printed and report.parent.name.startswith("explorer")
    rows = _csv_rows(report)
    failing = [row for row in rows if row["verdict"] != "pass"]
    assert f"rows: {len(rows)}, scenarios: {len({row['scenario_id'] for row in rows})}," in printed
    assert f"failing rows: {len(failing)} of {len(rows)}" in printed
    assert "matches: True" in printed


@pytest.mark.slow
def test_explorer_reads_the_report_wacc_report_dir_names(fallback_run: tuple[str, Path]) -> None:
    """Given WACC_REPORT_DIR with a report, the explorer reads that one and makes none."""
    _, report = fallback_run
    printed = _printed(_execute(EXPLORER, env={"WACC_REPORT_DIR": str(report)}))
    assert "no divergence.csv under" not in printed
    assert f"report: {report}\n" in printed
    assert f"rows: {len(_csv_rows(report))}," in printed
    assert "matches: True" in printed
