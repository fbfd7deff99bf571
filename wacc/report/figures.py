"""The report's figures (matplotlib, Agg): one idea per figure, labelled axes with units.

Each function takes the data it plots and a path, writes a PNG and returns the path. Sizes and
fonts are chosen to be readable at 100 % in a markdown viewer (about 1000 px wide).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.artist import Artist  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from PIL import Image  # noqa: E402

from wacc.report.loss_scaling import GROWTH_INTERVAL, ScalingPoint  # noqa: E402
from wacc.report.rows import Row  # noqa: E402
from wacc.report.sweeps import (  # noqa: E402
    OVERFLOW_CATEGORIES,
    DoubleRounding,
    OverflowMap,
    SkewPoint,
)
from wacc_ref import formats  # noqa: E402

__all__ = [
    "device_differences_figure",
    "double_rounding_figure",
    "error_bound_figure",
    "loss_scaling_figure",
    "overflow_map_figure",
    "skew_figure",
]

_DPI = 100
plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "figure.dpi": _DPI})
_COLORS = {
    "wacc_torch": "#1f77b4",
    "wacc_torch_fused": "#2ca02c",
    "wacc_torch_zero_copy": "#9467bd",
    "pixparse_loop": "#d62728",
}


def _save(figure: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=_DPI, bbox_inches="tight")
    plt.close(figure)
    # A 256-colour palette: these figures have few colours, and the files get 3-4x smaller.
    with Image.open(path) as image:
        compressed = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    compressed.save(path, optimize=True)
    return path


_OWN_MODES = ("wacc_torch", "wacc_torch_zero_copy", "wacc_torch_fused")
_RATIO_TOP = 1.08  # ratios above it (the bound broken) are drawn here as triangles
_USER_COLORS = ("#ff7f0e", "#8c564b", "#e377c2", "#17becf")  # a user's --impl, in order
_USER_MARKERS = ("o", "s", "D", "v", "P", "X", "*", "h")  # a new marker per round of the colours


def user_styles(users: Sequence[str]) -> dict[str, tuple[str, str]]:
    """(colour, marker) of each of ``users``, in order: every colour with the first marker, then
    every colour with the next one, ...; any number of users gets one (32 distinct pairs, then
    they repeat)."""
    pairs = [(c, m) for m in _USER_MARKERS for c in _USER_COLORS]
    return {name: pairs[index % len(pairs)] for index, name in enumerate(users)}


def error_bound_figure(rows: Sequence[Row], path: Path, *, users: Sequence[str] = ()) -> Path:
    """Max error/bound per scenario vs its longest window, per work dtype: wacc_torch's modes
    and each of ``users`` (a user's ``--impl``: the report's implementation names)."""
    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True, sharey=True)
    rng = np.random.default_rng(0)  # jitter only, so overlapping points stay visible
    names = (*_OWN_MODES, *users)
    styles = {**{name: (color, "o") for name, color in _COLORS.items()}, **user_styles(users)}
    spread = 0.6 / max(1, len(names) - 1)  # side by side within one window length
    for axis, dtype in zip(axes.flat, formats.WORK_DTYPES, strict=True):
        for position, name in enumerate(names):
            offset = -0.3 + position * spread
            chosen = [
                r
                for r in rows
                if r.implementation == name and r.work_dtype == dtype and math.isfinite(r.max_ratio)
            ]
            x = np.array([r.window_length for r in chosen], dtype=float)
            y = np.array([r.max_ratio for r in chosen])
            x = x + offset + rng.uniform(-0.08, 0.08, x.size)
            above = y > _RATIO_TOP  # a bound broken (a user's implementation): shown at the top
            color, marker = styles[name]
            axis.scatter(x[~above], y[~above], s=10, alpha=0.5, color=color, marker=marker,
                         label=name)  # fmt: skip
            if above.any():
                axis.scatter(x[above], np.full(int(above.sum()), _RATIO_TOP), s=24, marker="^",
                             color=color)  # fmt: skip
        axis.axhline(1.0, color="black", linewidth=1, linestyle="--")
        axis.text(0.01, 1.02, "bound", fontsize=9, transform=axis.get_yaxis_transform())
        axis.set_title(f"work dtype {dtype}")
        axis.set_ylim(-0.03, _RATIO_TOP + 0.04)
        axis.grid(alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("microbatches in the longest window of the scenario")
    for axis in axes[:, 0]:
        axis.set_ylabel("max |error| / derived bound")
    # Below the panels, where it covers no point (the names are the headline table's).
    # Many --impl: more columns, and the figure grows by the legend's rows (0.25 in each).
    handles, labels = axes[0, 0].get_legend_handles_labels()
    columns = 3 if len(labels) <= 9 else 4
    legend_rows = -(-len(labels) // columns)
    height = 7 + 0.25 * max(0, legend_rows - 1)
    figure.set_size_inches(10, height)
    figure.legend(handles, labels, loc="lower center", ncol=columns, fontsize=10, frameon=False,
                  markerscale=2)  # fmt: skip
    figure.suptitle(
        "Error against the exact result relative to the derived bound (≤ 1: within; ▲: above)"
        if users
        else "Error against the exact result stays within the derived bound (≤ 1)"
    )
    bottom = (0.1 + 0.25 * legend_rows) / height  # 0.05 of the figure for one row, as before
    figure.tight_layout(rect=(0, bottom, 1, 1 - 0.21 / height))
    return _save(figure, path)


# Lines that may coincide (the modes of wacc_torch give the same bits) stay visible: each
# implementation has its own marker, the later ones drawn smaller on top of the earlier ones.
_SKEW_MARKERS = {"wacc_torch": ("o", 9), "wacc_torch_zero_copy": ("s", 6),
                 "wacc_torch_fused": ("x", 6), "pixparse_loop": ("D", 6)}  # fmt: skip


def skew_figure(points: Sequence[SkewPoint], path: Path) -> Path:
    """Relative error vs the window's weight skew: wacc_torch against the pixparse loop."""
    figure, axis = plt.subplots(figsize=(9, 5.5))
    floor = 1e-10  # exact results (error 0) are drawn here, on a log axis
    names = sorted({p.implementation for p in points}, key=lambda n: n != "wacc_torch")
    users = user_styles([n for n in names if n not in _SKEW_MARKERS])  # a user's --impl
    for name in names:
        marker, size = _SKEW_MARKERS.get(name) or (users[name][1], 6)
        color = _COLORS.get(name) or users[name][0]
        for dtype, style in (("float32", "-"), ("bfloat16", "--")):
            chosen = [p for p in points if p.implementation == name and p.work_dtype == dtype]
            if not chosen:
                continue
            skews = sorted({p.skew for p in chosen})
            worst = [max(p.max_rel_error for p in chosen if p.skew == s) for s in skews]
            # bfloat16's markers hollow and larger: a curve equal to float32's stays visible.
            hollow = size > 6 or dtype == "bfloat16"
            axis.plot(
                skews, [max(w, floor) for w in worst], style, marker=marker,
                markersize=size + (4 if dtype == "bfloat16" else 0),
                markerfacecolor="none" if hollow else None,
                color=color, label=f"{name}, D = {dtype}",
            )  # fmt: skip
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.axhline(floor, color="gray", linewidth=0.5)
    axis.text(1.05, floor * 1.6, "exact", fontsize=9, color="gray")
    axis.set_xlabel(
        "weight skew: largest / smallest token count in the window (tokens 1, 3, 7, skew)"
    )
    axis.set_ylabel("max relative error vs the exact mean\n(normal-range elements, 4 draws)")
    axis.set_title(
        "Dividing the loss by accum_steps errs more as the skew grows;\n"
        "token weighting stays at rounding level"
    )
    axis.grid(alpha=0.3, which="both")
    # Outside the axes, on the right: it covers no point.
    axis.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _save(figure, path)


_MAP_COLORS = ("#c7e9c0", "#fdae6b", "#9ecae1", "#de2d26", "#bdbdbd", "#54278f")
# A user's implementations (wacc report --impl) on the map: a marker where it loses the mean.
_LOST_MARKERS = (("x", "black"), ("+", "#e7298a"), ("1", "#1b9e77"), ("2", "#7570b3"))


def overflow_map_figure(maps: Mapping[str, OverflowMap], path: Path) -> Path:
    """The overflow map of every work dtype (categories over log2 S x log2 W)."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 9.5))
    cmap = ListedColormap(_MAP_COLORS)
    present: set[int] = set()
    for axis, dtype in zip(axes.flat, formats.WORK_DTYPES, strict=True):
        data = maps[dtype]
        present |= set(np.unique(data.categories).tolist())
        s, w = data.scale_exponents, data.weight_exponents
        axis.imshow(
            data.categories, origin="lower", aspect="auto", cmap=cmap,
            vmin=-0.5, vmax=len(_MAP_COLORS) - 0.5,
            extent=(s[0] - 0.5 * (s[1] - s[0]), s[-1] + 0.5 * (s[1] - s[0]),
                    w[0] - 0.5 * (w[1] - w[0]), w[-1] + 0.5 * (w[1] - w[0])),
        )  # fmt: skip
        for lost, (marker, color) in zip(data.lost.values(), _LOST_MARKERS, strict=False):
            rows, columns = np.nonzero(lost)
            axis.scatter([s[c] for c in columns], [w[r] for r in rows], marker=marker, s=28,
                         color=color, linewidths=1.2)  # fmt: skip
        axis.set_title(f"work dtype {dtype} (max ≈ 2^{formats.get_format(dtype).emax + 1})")
        axis.set_xlabel("log2 loss scale S")
        axis.set_ylabel("log2 total weight W (tokens)")
    handles: list[Artist] = [
        Patch(color=_MAP_COLORS[i], label=OVERFLOW_CATEGORIES[i]) for i in sorted(present)
    ]
    others = next(iter(maps.values())).lost
    handles += [
        plt.Line2D(
            [],
            [],
            linestyle="",
            marker=marker,
            color=color,
            label=f"{name}: not the exact mean where wacc_torch's is",
        )  # fmt: skip
        for name, (marker, color) in zip(others, _LOST_MARKERS, strict=False)
    ]
    figure.legend(handles=handles, loc="lower center", ncol=1, fontsize=9, frameon=False)
    mean = next(iter(maps.values())).mean_exponent
    figure.suptitle(
        f"Where S·W overflows and sequential division does not (true mean gradient t = 2^{mean})"
    )
    figure.tight_layout(rect=(0, 0.15 + 0.02 * len(others), 1, 0.97))
    return _save(figure, path)


def double_rounding_figure(sweeps: Sequence[DoubleRounding], path: Path) -> Path:
    """Share of values near a D midpoint where PyTorch's float64 -> D differs from round_D."""
    figure, axis = plt.subplots(figsize=(9, 5))
    # The two curves coincide: the first drawn wide with large hollow markers, the second
    # dashed with small filled ones on top, so both stay visible.
    styles = (("-", "o", 11, 3.0, "none"), ("--", "s", 5, 1.5, None))
    for sweep, (line, marker, size, width, face) in zip(sweeps, styles, strict=False):
        axis.plot(
            [math.log2(o) for o in sweep.offsets], [100 * f for f in sweep.fraction_differing],
            line, marker=marker, markersize=size, linewidth=width, markerfacecolor=face,
            label=f"float64 → {sweep.work_dtype}",
        )  # fmt: skip
    axis.axvline(-1, color="gray", linestyle=":", linewidth=1)
    axis.text(-1.3, 52, "half a float32 ulp", fontsize=9, color="gray", ha="right")
    axis.set_xlabel("log2 distance of x from a midpoint of D, in float32 ulps")
    axis.set_ylabel("conv_D(x) ≠ round_D(x)  [% of samples]")
    axis.set_ylim(-3, 60)
    axis.set_title("PyTorch rounds float64 → fp16/bf16 twice (via float32): wrong within ½ ulp₃₂")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, path)


def device_differences_figure(counts: Mapping[tuple[str, str], int], path: Path) -> Path:
    """Scenarios whose CPU and CUDA traces differ, per work dtype and implementation."""
    figure, axis = plt.subplots(figsize=(9, 4.5))
    names = sorted({name for _, name in counts})
    width = 0.8 / max(1, len(names))
    for offset, name in enumerate(names):
        values = [counts.get((dtype, name), 0) for dtype in formats.WORK_DTYPES]
        positions = np.arange(len(formats.WORK_DTYPES)) + offset * width
        axis.bar(positions, values, width, label=name)
    axis.set_xticks(np.arange(len(formats.WORK_DTYPES)) + width * (len(names) - 1) / 2)
    axis.set_xticklabels(formats.WORK_DTYPES)
    axis.set_ylabel("scenarios with CPU ≠ CUDA bits")
    axis.set_title("CPU vs CUDA: the reproducible order agrees bit for bit; fused may not")
    axis.legend()
    return _save(figure, path)


_LENGTH_COLORS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a")
_LOOP_STYLES: dict[str, tuple[Any, str, str]] = {
    "wacc_torch": ("-", "o", "wacc_torch (per-window scale, token weights)"),
    "GradScaler": ("--", "s", "GradScaler around loss /= accum_steps"),
}


def loss_scaling_figure(points: Sequence[ScalingPoint], path: Path) -> Path:
    """Skipped windows and the error of accepted ones vs the initial scale: one row per
    gradient dtype, a colour per window length, a line style per loop."""
    dtypes = sorted({p.grad_dtype for p in points}, key=lambda d: d != "float16")
    lengths = sorted({p.window_length for p in points})
    figure, axes = plt.subplots(
        len(dtypes), 2, figsize=(12, 4.6 * len(dtypes)), squeeze=False, sharey="col"
    )
    for row, dtype in enumerate(dtypes):
        skip_axis, error_axis = axes[row]
        for color, length in zip(_LENGTH_COLORS, lengths, strict=False):
            for loop, (style, marker, _) in _LOOP_STYLES.items():
                chosen = sorted(
                    (p for p in points
                     if p.grad_dtype == dtype and p.window_length == length and p.loop == loop),
                    key=lambda p: p.init_scale,
                )  # fmt: skip
                if not chosen:
                    continue
                x = [math.log2(p.init_scale) for p in chosen]
                skip_axis.plot(x, [100 * p.skipped_share for p in chosen], style, marker=marker,
                               color=color, markersize=5)  # fmt: skip
                error_axis.plot(x, [p.median_error for p in chosen], style, marker=marker,
                                color=color, markersize=5)  # fmt: skip
        windows = points[0].windows
        skip_axis.set_title(f"{dtype} backward: windows skipped (of {windows})")
        skip_axis.set_ylabel("skipped windows  [%]")
        top = max(100 * p.skipped_share for p in points)
        skip_axis.set_ylim(-1, max(5.0, 1.15 * top))
        error_axis.set_title(f"{dtype} backward: error of the accepted windows")
        error_axis.set_ylabel("median |result − exact| / |exact|")
        error_axis.set_yscale("log")
        if 1 in lengths:
            error_axis.text(
                0.02, 0.5, "1 microbatch: the two loops coincide (same scale, same weight)",
                transform=error_axis.transAxes, fontsize=9, color=_LENGTH_COLORS[0],
            )  # fmt: skip
        for axis in (skip_axis, error_axis):
            axis.set_xlabel("log2 initial loss scale")
            axis.grid(alpha=0.3, which="both")
    handles = [
        plt.Line2D([], [], color=color, linewidth=3, label=f"{length} microbatch(es) per window")
        for color, length in zip(_LENGTH_COLORS, lengths, strict=False)
    ] + [
        plt.Line2D([], [], color="black", linestyle=style, marker=marker, label=label)
        for style, marker, label in _LOOP_STYLES.values()
    ]
    figure.legend(handles=handles, loc="lower center", ncol=3, fontsize=10, frameon=False)
    figure.suptitle(
        "Dynamic loss scaling on heavy-tailed gradients: a high scale skips windows, a low one "
        f"underflows\n(both scalers back off ×0.5 on an overflow, grow ×2 after "
        f"{GROWTH_INTERVAL} clean windows; token counts Pareto-distributed)"
    )
    figure.tight_layout(rect=(0, 0.08, 1, 0.97))
    return _save(figure, path)
