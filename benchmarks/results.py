"""Result rows, the CSV writer, the markdown report and its provenance block.

One :class:`Row` per measurement. A row with a ``target`` is a target row: its ``ratio`` (the
mode's figure divided by the floor's, measured in the same run) is met when ``ratio <= target``.
A row whose feature is missing from the installed ``wacc_torch`` has ``value=None`` and reads
``n/a (not available)``.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

COLUMNS = (
    "suite",
    "case",
    "mode",
    "dtype",
    "device",
    "value",
    "unit",
    "ratio",
    "floor",
    "target",
    "met",
)
NOT_AVAILABLE = "n/a (not available)"
TABLE_BEGIN = "<!-- perf-targets:begin -->"
TABLE_END = "<!-- perf-targets:end -->"


@dataclass(frozen=True)
class Row:
    """One measurement: what was measured (suite, case, mode, dtype, device) and its figures."""

    suite: str
    case: str
    mode: str
    dtype: str
    device: str
    value: float | None
    unit: str
    ratio: float | None = None
    floor: str = ""
    target: float | None = None

    @property
    def met(self) -> str:
        """``yes``/``no`` for a measured target row, ``n/a`` for a missing feature, else ``""``."""
        if self.target is None:
            return ""
        if self.ratio is None:
            return "n/a"
        return "yes" if self.ratio <= self.target else "no"

    def cells(self) -> dict[str, str]:
        """The row as the CSV writes it (numbers with enough digits to recompute the ratio)."""
        return {
            "suite": self.suite,
            "case": self.case,
            "mode": self.mode,
            "dtype": self.dtype,
            "device": self.device,
            "value": NOT_AVAILABLE if self.value is None else repr(float(self.value)),
            "unit": self.unit,
            "ratio": "" if self.ratio is None else repr(float(self.ratio)),
            "floor": self.floor,
            "target": "" if self.target is None else repr(float(self.target)),
            "met": self.met,
        }


def write_csv(rows: Iterable[Row], path: Path) -> None:
    """Write the rows to ``path`` with the header :data:`COLUMNS`."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow(row.cells())


def read_csv(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV written by :func:`write_csv`, as strings."""
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _number(value: float | None, unit: str = "") -> str:
    if value is None:
        return NOT_AVAILABLE
    text = f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return f"{text} {unit}".rstrip()


def _table(header: Sequence[str], lines: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return out


def targets_table(rows: Iterable[Row]) -> str:
    """The main table: every target row, its ratio, the target and whether it is met."""
    lines = [
        (
            row.suite,
            row.case,
            row.mode,
            row.dtype,
            row.device,
            "" if row.ratio is None else f"{row.ratio:.3f}",
            f"<= {row.target:g}",
            row.met,
        )
        for row in rows
        if row.target is not None
    ]
    header = ("suite", "case", "mode", "dtype", "device", "ratio", "target", "met")
    return "\n".join(_table(header, lines))


def suite_table(rows: Iterable[Row]) -> str:
    """Every row of one suite: value, ratio to its floor, target and verdict."""
    lines = [
        (
            row.case,
            row.mode,
            row.dtype,
            row.device,
            _number(row.value, row.unit),
            "" if row.ratio is None else f"{row.ratio:.3f}",
            row.floor,
            "" if row.target is None else f"<= {row.target:g}",
            row.met,
        )
        for row in rows
    ]
    header = ("case", "mode", "dtype", "device", "value", "ratio", "floor", "target", "met")
    return "\n".join(_table(header, lines))


def _cpu_model() -> str:
    try:
        listing = subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in listing.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    return platform.processor() or "unknown"


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(*, devices: Sequence[str], command: Sequence[str]) -> dict[str, str]:
    """Where and how the numbers were made: date, commit, versions, CPU, threads, devices."""
    root = Path(__file__).resolve().parents[1]
    names = []
    for device in devices:
        if torch.device(device).type == "cuda":
            names.append(f"{device} ({torch.cuda.get_device_name(device)})")
        else:
            names.append(device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git commit": _git_commit(root),
        "command": " ".join(command),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "CPU": _cpu_model(),
        "CPU cores visible": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "devices": ", ".join(names),
        "platform": platform.platform(),
    }


def markdown(
    rows: Sequence[Row],
    *,
    suites: Sequence[str],
    notes: Mapping[str, str],
    info: Mapping[str, str],
) -> str:
    """The report: the main (targets) table, one table per suite with its notes, provenance."""
    parts = [
        "# wacc performance",
        "",
        "Written by `python -m benchmarks`; do not edit by hand. Ratios are a mode's median "
        "divided by the floor's median, both measured in the same run, the modes interleaved "
        "round-robin after a warm-up.",
        "",
        "## Targets",
        "",
        TABLE_BEGIN,
        targets_table(rows),
        TABLE_END,
    ]
    for suite in suites:
        suite_rows = [row for row in rows if row.suite == suite]
        parts += ["", f"## {suite}", "", suite_table(suite_rows)]
        if suite in notes:
            parts += ["", notes[suite]]
    parts += ["", "## Provenance", ""]
    parts += [f"- {key}: {value}" for key, value in info.items()]
    return "\n".join(parts) + "\n"


def targets_block(text: str) -> str:
    """The main table between the markers, as it appears in ``text`` (a docs page or a report)."""
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    return text[start : text.index(TABLE_END, start)].strip()


def replace_targets_block(text: str, table: str) -> str:
    """``text`` with the table between the markers replaced by ``table``."""
    start = text.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    end = text.index(TABLE_END, start)
    return text[:start] + "\n" + table + "\n" + text[end:]
