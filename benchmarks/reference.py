"""Suite ``reference``: ``wacc gate`` wall time and the reference model's emulation rates.

The gate runs as a subprocess (``python -m wacc gate --quiet``) in a temporary directory against
the committed baseline, its JUnit XML and summary written there; ``--quick`` skips it. The rates
are :func:`benchmarks.bench_reference.emulation_rates` (element-steps per second, ``emulated``
mode, every work dtype). No targets: these are reported.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_reference import emulation_rates
from benchmarks.results import Row
from benchmarks.settings import Settings

SUITE = "reference"
ROOT = Path(__file__).resolve().parents[1]
NOTES = (
    "`wacc gate` wall time: `python -m wacc gate --quiet` against `reports/baseline.json`, as a "
    "subprocess (interpreter start included; skipped with `--quick`), exit status in the mode. "
    "Emulation rates: `wacc_ref.ReferenceAccumulator` in `emulated` mode, element-steps per "
    "second on one parameter of float32 gradients, 4 microbatches of unequal weights."
)


def gate_seconds() -> tuple[float, int]:
    """Wall seconds of one ``wacc gate --quiet`` run and its exit status."""
    with tempfile.TemporaryDirectory(prefix="wacc-bench-gate-") as folder:
        command = [
            sys.executable,
            "-m",
            "wacc",
            "gate",
            "--quiet",
            "--baseline",
            str(ROOT / "reports" / "baseline.json"),
            "--junit-xml",
            str(Path(folder) / "gate.xml"),
            "--summary-md",
            str(Path(folder) / "gate.md"),
        ]
        start = time.perf_counter()
        completed = subprocess.run(command, cwd=folder, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if completed.returncode not in (0, 1):
        raise RuntimeError(f"wacc gate failed ({completed.returncode}): {completed.stderr}")
    return seconds, completed.returncode


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    if not settings.quick:
        seconds, status = gate_seconds()
        rows.append(
            Row(SUITE, "wacc gate", f"wall time (exit {status})", "all", "cpu", seconds, "s")
        )
    elements = 2_000 if settings.quick else 200_000
    for dtype, rates in emulation_rates(elements=elements, steps=4).items():
        for method, rate in rates.items():
            rows.append(
                Row(SUITE, "wacc_ref emulation", method, dtype, "cpu", rate, "element-steps/s")
            )
    return rows
