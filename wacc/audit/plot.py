"""The audit's one plot: relative L2 error per loop × window, log scale, with the float32 noise
level it should be compared with (the correct loops' own errors sit there)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from wacc.audit.results import AuditResult  # noqa: E402

__all__ = ["plot_errors"]

FLOOR = 1e-12  # where an exactly-zero error is drawn (log axis); labelled as such


def plot_errors(result: AuditResult, path: Path) -> None:
    """A grouped horizontal bar chart (one group per loop, top to bottom in the table's order,
    one bar per window) into ``path`` (PNG): its height grows with the loops, so that thirty
    of them stay legible at a page's width."""
    loops = [f.adapter.name for f in result.facts]
    windows = [w.name for w in result.windows]
    values = {(c.adapter, c.window): c for c in result.cells}
    fig, ax = plt.subplots(figsize=(10.0, max(4.0, 0.42 * len(loops) + 1.6)), dpi=130)
    width = 0.8 / max(len(windows), 1)
    colors = plt.get_cmap("tab10")
    top, bottom = 1.0, 2.0**-24
    for j, window in enumerate(windows):
        xs, heights, hatches = [], [], []
        for i, loop in enumerate(loops):
            cell = values[(loop, window)]
            if cell.status != "ok":
                continue
            err = cell.rel_l2
            if not math.isfinite(err):
                err = 1e3  # drawn at the top, labelled NaN/inf below
            xs.append(i + (j - (len(windows) - 1) / 2) * width)  # a position on the loop axis
            heights.append(max(err, FLOOR))
            hatches.append("" if cell.verdict == "pass" else "//")
            top = max(top, err)
            bottom = min(bottom, max(err, FLOOR))
        bars = ax.barh(xs, heights, height=width * 0.95, color=colors(j), label=window,
                       edgecolor="black", linewidth=0.4)  # fmt: skip
        for bar, hatch in zip(bars, hatches, strict=True):
            bar.set_hatch(hatch)
    for i, loop in enumerate(loops):
        cells = [values[(loop, w)] for w in windows]
        if all(c.status != "ok" for c in cells):
            ax.text(bottom, i, " " + cells[0].status.split(":")[0], ha="left", va="center",
                    fontsize=9, color="dimgray")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlim(bottom / 10, top * 10)
    ax.axvline(2.0**-24, color="gray", linestyle=":", linewidth=1.2)
    ax.set_yticks(np.arange(len(loops)))
    ax.set_yticklabels(loops, fontsize=9)
    ax.set_ylim(len(loops) - 0.5, -0.5)  # the first loop on top, as in the table
    ax.set_xlabel("relative L2 error of the gradient vs the float64 truth (log)")
    ax.set_ylabel("training loop (hatched: verdict FAIL)")
    ranks = f", world size {result.world_size}" if result.world_size > 1 else ""
    ax.set_title(f"wacc audit: gradient handed to the optimizer, dtype {result.dtype}{ranks}")
    handles: list[Artist] = [
        Patch(facecolor=colors(j), edgecolor="black", label=w) for j, w in enumerate(windows)
    ]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="verdict FAIL"))
    handles.append(Line2D([], [], color="gray", linestyle=":", label="float32 u = 2^-24"))
    ax.legend(handles=handles, title="window", fontsize=9, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # fmt: skip
    ax.grid(axis="x", which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
