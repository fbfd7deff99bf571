"""Where an audit comes from: wacc's commit, the machine, the date, torch and Python, wall time.

Written into every row of ``audit.csv`` (as ``divergence.csv`` carries the report's) and at the
top of ``audit.md``; each loop's own framework version is its row's ``version``."""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from importlib import metadata

import torch

from wacc.report.provenance import cpu_name, git_commit

__all__ = ["AuditProvenance", "collect_provenance", "PROVENANCE_COLUMNS"]

PROVENANCE_COLUMNS = ("wacc_version", "wacc_commit", "date", "machine", "torch", "python",
                      "wall_seconds")  # fmt: skip


@dataclass(frozen=True)
class AuditProvenance:
    """The audit's header (wall time filled in at the end)."""

    wacc_version: str
    wacc_commit: str
    date: str
    machine: str
    torch: str
    python: str
    wall_seconds: float = 0.0

    def columns(self) -> dict[str, str]:
        """The CSV's provenance columns (:data:`PROVENANCE_COLUMNS`)."""
        return {
            "wacc_version": self.wacc_version, "wacc_commit": self.wacc_commit,
            "date": self.date, "machine": self.machine, "torch": self.torch,
            "python": self.python, "wall_seconds": f"{self.wall_seconds:.1f}",
        }  # fmt: skip

    def line(self) -> str:
        """One markdown line."""
        return (
            f"wacc {self.wacc_version} at commit `{self.wacc_commit}`, {self.date}, "
            f"{self.machine}, torch {self.torch}, Python {self.python}; wall time "
            f"{self.wall_seconds:.0f} s."
        )


def collect_provenance() -> AuditProvenance:
    """The provenance of an audit about to start."""
    try:
        version = metadata.version("wacc")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return AuditProvenance(
        wacc_version=version,
        wacc_commit=git_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=f"{cpu_name()} ({platform.machine()})",
        torch=torch.__version__,
        python=platform.python_version(),
    )
