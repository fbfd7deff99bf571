"""Plain-text tables for the command line (fixed-width columns, right-aligned numbers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["format_metric", "render_table"]


def format_metric(value: float) -> str:
    """A metric for a table: ``0``, ``inf``, or 4 significant digits (never rounded up to 1)."""
    if value == 0:
        return "0"
    if math.isinf(value):
        return "inf"
    text = f"{value:.4g}"
    # An error/bound ratio just below 1 must not read as 1 (the bound held).
    return "0.9999" if value < 1 and float(text) >= 1 else text


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as aligned text columns (numbers right-aligned)."""
    widths = [len(title) for title in header]
    for row in rows:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = []
        for cell, width in zip(cells, widths, strict=True):
            numeric = cell.replace(".", "", 1).replace("e-", "").replace("e+", "").isdigit()
            parts.append(cell.rjust(width) if numeric or cell == "inf" else cell.ljust(width))
        return "  ".join(parts).rstrip()

    return "\n".join(
        [line(header), line(["-" * width for width in widths])] + [line(r) for r in rows]
    )
