"""The device check's rehearsal, run as CI runs it: ``scripts/device_check.sh OUT --cpu-rehearsal
--quick`` on this CPU writes at most 8 files, none nested deeper than two folders, each non-empty
and parseable, every one saying it is a rehearsal where it has room to."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.wacc.test_report_device import check_tables_match_csv
from wacc.report.device_section import DEVICE_CSV_FIELDS, REHEARSAL
from wacc.report.reduction import REDUCTION_CSV_FIELDS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_check.sh"
EXPECTED = {
    "device-check.log",
    "device/device.md",
    "device/device.csv",
    "device/reduction.csv",
    "device/reduction_error.png",
    "cuda-tests.xml",
    "perf/README.md",
    "perf/results.csv",
}

pytestmark = pytest.mark.slow


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHON": sys.executable}, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The rehearsal's output folder and what it printed."""
    out = tmp_path_factory.mktemp("device-check") / "out"
    result = _script(str(out), "--cpu-rehearsal", "--quick")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return out, result.stdout


def test_the_rehearsal_writes_at_most_eight_files_two_folders_deep(
    rehearsal: tuple[Path, str],
) -> None:
    """Exactly the documented files (8), none deeper than two folders, none empty."""
    out, _ = rehearsal
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert files == EXPECTED
    assert all(len(Path(name).parts) <= 3 for name in files)
    assert all((out / name).stat().st_size > 0 for name in files)


def test_every_file_parses_and_says_it_is_a_rehearsal(rehearsal: tuple[Path, str]) -> None:
    """The JUnit is XML with the cuda tests (skipped on a CPU) under a suite named a rehearsal;
    the CSVs have their documented headers and rows; device.md's tables are device.csv's rows
    and it says it is a rehearsal; the log names the mode and every part's exit 0."""
    out, printed = rehearsal
    suite = ET.parse(out / "cuda-tests.xml").getroot().find("testsuite")
    assert suite is not None and "rehearsal" in suite.get("name", "")
    assert int(suite.get("tests", "0")) > 0 and suite.get("failures") == "0"
    rows = {}
    for name, header in (
        ("device/device.csv", DEVICE_CSV_FIELDS),
        ("device/reduction.csv", REDUCTION_CSV_FIELDS),
        ("perf/results.csv", None),
    ):
        with (out / name).open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            rows[name] = list(reader)
        assert rows[name], name
        if header is not None:
            assert tuple(reader.fieldnames or ()) == header, name
    tables = {row["table"] for row in rows["device/device.csv"]}
    assert tables == {"ops", "precision", "fp8", "gloo", "loops"}
    rehearsed = [r for r in rows["device/device.csv"] if r["table"] in ("precision", "fp8")]
    assert rehearsed and all(r["device"] == REHEARSAL for r in rehearsed)
    assert {r["model"] for r in rows["device/reduction.csv"]} >= {"gloo_measured", "nccl_avg"}
    markdown = (out / "device" / "device.md").read_text(encoding="utf-8")
    assert "**Rehearsal:**" in markdown and "(reduction_error.png)" in markdown
    check_tables_match_csv(markdown, out / "device" / "device.csv")
    log = (out / "device-check.log").read_text(encoding="utf-8")
    assert "mode cpu-rehearsal" in log
    for part in ("device", "cuda-tests", "benchmarks"):
        assert f"--- part {part}: exit 0" in log, part
    assert log.strip().endswith("exit 0 (cpu-rehearsal)") and printed.strip() in log


@pytest.mark.parametrize("args", [[], ["--cpu-rehearsal"], ["out", "--bogus"]])
def test_the_script_refuses_bad_arguments(tmp_path: Path, args: list[str]) -> None:
    """No folder, an option where the folder goes, an unknown option: usage on stderr, exit 2,
    no folder created."""
    result = _script(*[str(tmp_path / a) if a == "out" else a for a in args])
    assert result.returncode == 2 and "usage: scripts/device_check.sh OUT" in result.stderr
    assert not (tmp_path / "out").exists()
