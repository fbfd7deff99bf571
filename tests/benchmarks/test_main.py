"""``python -m benchmarks`` end to end, as a subprocess, at ``--quick`` sizes (a smoke test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.results import COLUMNS, NOT_AVAILABLE, read_csv

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_quick_run_writes_csv_and_report(tmp_path: Path) -> None:
    """A quick run of every suite exits 0 and writes the CSV (documented columns, every target
    row with a ratio and a verdict, or marked not available) and a report with provenance."""
    out = tmp_path / "perf"
    completed = _run("--quick", "--out", str(out))
    assert completed.returncode == 0, completed.stderr
    header = (out / "results.csv").read_text(encoding="utf-8").splitlines()[0]
    assert header.split(",") == list(COLUMNS)
    rows = read_csv(out / "results.csv")
    assert {row["suite"] for row in rows} == {
        "step",
        "overhead",
        "large",
        "memory",
        "reference",
        "shapes",
        "decoder",
    }
    targets = [row for row in rows if row["target"]]
    assert len(targets) >= 10
    for row in targets:
        if row["value"] == NOT_AVAILABLE:
            assert (row["ratio"], row["met"]) == ("", "n/a")
        else:
            assert float(row["ratio"]) > 0 and row["met"] in {"yes", "no"}
            assert row["met"] == ("yes" if float(row["ratio"]) <= float(row["target"]) else "no")
    assert not any(row["case"] == "wacc gate" for row in rows)  # --quick skips the gate
    report = (out / "README.md").read_text(encoding="utf-8")
    provenance = report.split("## Provenance", 1)[1]
    for key in ("date", "git commit", "python", "torch", "numpy", "CPU", "torch threads"):
        assert f"- {key}: " in provenance
    assert "## Targets" in report and "## memory" in report
    assert completed.stdout.startswith("# wacc performance")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_device_is_refused(tmp_path: Path) -> None:
    """``--device cuda`` on a machine without CUDA exits non-zero, saying why, writing nothing."""
    completed = _run("--device", "cuda", "--suite", "overhead", "--out", str(tmp_path / "x"))
    assert completed.returncode != 0 and "no CUDA device" in completed.stderr
    assert not (tmp_path / "x").exists()
