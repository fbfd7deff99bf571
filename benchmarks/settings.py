"""What a run was asked for: sizes (``--quick``, ``--shape-scale``), devices, repeats, output
folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Settings:
    """The options every suite reads."""

    quick: bool
    devices: tuple[torch.device, ...]
    repeats: int | None
    out: Path
    shape_scale: float = 1.0  # the ``shapes`` suite's --shape-scale

    def repeats_or(self, default: int) -> int:
        """``--repeats`` if given, else the suite's default (3 with ``--quick``)."""
        if self.repeats is not None:
            return self.repeats
        return 3 if self.quick else default
