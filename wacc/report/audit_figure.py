"""The report's figure of the audit across ranks: each loop's error against the world size and
against the per-rank token imbalance (``wacc report --audit DIR [DIR ...]``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display is needed or wanted
import matplotlib.pyplot as plt  # noqa: E402

from wacc.report.audit_section import AuditRow, AuditRun  # noqa: E402

__all__ = ["FLOOR", "loop_marker", "plot_ranks"]

FLOOR = 1e-17  # where an exactly-zero error is drawn (log axis); the caption says so
TOP = 1e3  # where a non-finite error is drawn


def _error(row: AuditRow) -> float | None:
    if row.verdict not in ("pass", "FAIL"):
        return None
    return TOP if not math.isfinite(row.f64_rel_l2) else max(row.f64_rel_l2, FLOOR)


def plot_ranks(runs: Sequence[AuditRun], path: Path, *, window: str = "unequal") -> None:
    """Two panels into ``path`` (PNG): left, each loop's float64 error on ``window`` against the
    world size (a line per loop); right, every row at world size > 1 against its per-rank token
    imbalance (largest over smallest rank total).  Filled markers: verdict FAIL."""
    rows = [row for run in runs for row in run.rows]
    # Only the loops that ran across ranks: the others have a world-size-1 point and nothing to
    # compare it with (the section's table has them).
    loops = list(dict.fromkeys(
        row.loop for row in rows if row.world_size > 1 and _error(row) is not None
    ))  # fmt: skip
    sizes = sorted({run.world_size for run in runs})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12.0, 5.0), dpi=130)
    colors = plt.get_cmap("tab10")
    for index, loop in enumerate(loops):
        color, marker = colors(index % 10), loop_marker(index)
        points = []
        for size in sizes:
            row = next((r for r in rows if (r.loop, r.world_size, r.window) ==
                        (loop, size, window)), None)  # fmt: skip
            error = None if row is None else _error(row)
            if row is not None and error is not None:
                points.append((size, error, row.verdict == "FAIL"))
        if points:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            left.plot(xs, ys, color=color, linewidth=1.2, marker=marker, markerfacecolor="white",
                      label=loop)  # fmt: skip
            for x, y, failed in points:
                left.scatter([x], [y], color=color, marker=marker, s=50, zorder=3,
                             facecolors=color if failed else "white")  # fmt: skip
        for row in rows:
            error = _error(row)
            if row.loop != loop or row.world_size == 1 or error is None:
                continue
            right.scatter([min(row.imbalance, 1e3)], [error], color=color, marker=marker, s=50,
                          facecolors=color if row.verdict == "FAIL" else "white",
                          zorder=3)  # fmt: skip
            if not math.isnan(row.predicted_rel_l2):
                right.scatter([min(row.imbalance, 1e3)], [max(row.predicted_rel_l2, FLOOR)],
                              color="black", marker="x", s=30, zorder=4)  # fmt: skip
    for ax in (left, right):
        ax.set_yscale("log")
        ax.set_ylim(FLOOR / 10, TOP * 10)
        ax.grid(alpha=0.3)
        ax.set_ylabel("rel L2 error of the float64 run vs the truth (log)")
    left.set_xticks(sizes)
    left.set_xlabel(f"world size (window {window})")
    left.set_title("error against world size")
    right.set_xscale("log")
    imbalances = [min(r.imbalance, 1e3) for r in rows if r.world_size > 1 and r.loop in loops]
    right.set_xlim(0.7, max(imbalances, default=10.0) * 1.6)
    right.set_xlabel("per-rank token imbalance: largest / smallest rank total (log)")
    right.set_title("error against rank imbalance (world size > 1)")
    fig.legend(*left.get_legend_handles_labels(), fontsize=9, loc="upper center", ncols=6,
               title="loop (filled marker: verdict FAIL; x: the error predicted from the rank "
               "totals)", bbox_to_anchor=(0.5, 0.02))  # fmt: skip
    fig.suptitle("wacc audit across data-parallel ranks")
    fig.tight_layout(rect=(0.0, 0.08, 1.0, 1.0))
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


# Seven markers against tab10's ten colours: (colour, marker) repeats only after 70 loops (ten
# markers, as many as the colours, gave the 1st, 11th and 21st loop the same blue circle).
_MARKERS = "osD^v<>"


def loop_marker(index: int) -> str:
    """The marker of the ``index``-th loop; with colour ``index % 10`` no two of the first 70
    loops look alike."""
    return _MARKERS[index % len(_MARKERS)]
