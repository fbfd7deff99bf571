"""Where a report comes from: versions, commit, device, corpus, date and wall time."""

from __future__ import annotations

import datetime
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

__all__ = ["Provenance", "collect_provenance", "cpu_name", "git_commit"]

_PACKAGES = ("wacc", "torch", "numpy", "mpmath", "gmpy2", "hypothesis", "matplotlib")


def git_commit() -> str:
    """The commit of wacc's source tree, ``+dirty`` if changed; ``unknown`` outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where it exists)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Provenance:
    """Everything the report's header states."""

    versions: dict[str, str]
    commit: str
    devices: dict[str, str]
    corpus_seed: int
    corpus_size: str
    scenarios: int
    date: str
    wall_seconds: float = 0.0

    def lines(self) -> list[str]:
        """The header as markdown bullet lines."""
        versions = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        devices = "; ".join(f"{name}: {label}" for name, label in self.devices.items())
        return [
            f"- wacc {self.versions.get('wacc', '?')} at commit `{self.commit}`",
            f"- versions: {versions}",
            f"- devices: {devices}",
            f"- corpus: seed {self.corpus_seed}, size `{self.corpus_size}`, "
            f"{self.scenarios} scenarios",
            f"- date: {self.date}; wall time {self.wall_seconds:.1f} s",
        ]


def collect_provenance(
    *, devices: list[str], corpus_seed: int, corpus_size: str, scenarios: int
) -> Provenance:
    """The provenance of a run about to start (wall time is filled in at the end)."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    labels = {
        device: (torch.cuda.get_device_name() if device == "cuda" else cpu_name())
        for device in devices
    }
    return Provenance(
        versions=versions,
        commit=git_commit(),
        devices=labels,
        corpus_seed=corpus_seed,
        corpus_size=corpus_size,
        scenarios=scenarios,
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
