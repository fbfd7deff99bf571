"""The report's data-parallel reduction section: the reduction's own rounding against world size.

A seeded set of per-rank gradients (each element a shared signal times ``1 + noise/2`` per rank,
so the ranks mostly agree in sign, as gradients of one batch do) is reduced by every model of
:mod:`wacc_ref.reduction` for world sizes 2..64 (powers of two and 3, 5, 6, 12) in float16,
bfloat16 and float32:

* ``ring_sum``: NCCL's ring SUM in the data type (one channel; chunk ``c`` starts at rank ``c+1``);
* ``tree_sum``: NCCL's binary tree (``ncclGetBtree``) SUM in the data type;
* ``gloo_ring``: gloo's ring SUM (the order torch.distributed's gloo backend uses on a CPU,
  checked bit for bit against real gloo jobs in the tests);
* ``nccl_avg``: NCCL's AVG, every value times ``round_T(1/N)`` and then the ring SUM;
* ``sum_then_divide``: the ring SUM, then one division ``round_T(round_op(s / N))``: what
  wacc_torch's ``all_reduce_mean`` does (semantics §7, then §8 with ``S = 1``, ``W = N``).

Every result is exact (wacc_ref rounds each hop exactly); the error is measured against the exact
sum (SUM models) or the exact mean (the means), relative to it, and against each model's derived
bound.  :func:`reduction_report` computes the table, draws the figure and returns both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import numpy.typing as npt

from wacc.report.figures import _save, plt
from wacc_ref import reduction as R
from wacc_ref.arith import round_array
from wacc_ref.bounds import error_ratio, gamma

__all__ = [
    "DTYPES",
    "GLOO_MEASURED",
    "MODELS",
    "REDUCTION_CSV_FIELDS",
    "WORLD_SIZES",
    "ReductionPoint",
    "measured_point",
    "reduction_figure",
    "reduction_points",
    "reduction_report",
    "reduction_rows",
    "reduction_values",
]

WORLD_SIZES: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
MODELS: tuple[str, ...] = ("ring_sum", "tree_sum", "gloo_ring", "nccl_avg", "sum_then_divide")
_MEANS = frozenset({"nccl_avg", "sum_then_divide"})
GLOO_MEASURED = "gloo_measured"  # a real gloo all_reduce on this CPU, beside the models
ELEMENTS = 256
SEED = 36


@dataclass(frozen=True)
class ReductionPoint:
    """One model at one world size and data type, over all elements."""

    dtype: str
    world_size: int
    model: str
    median_rel_error: float  # median over elements of |result - exact| / |exact|
    max_rel_error: float  # the largest of them
    max_error_over_bound: float  # max |result - exact| / derived bound (<= 1: within)
    avg_factor_bias: float  # round_T(1/N)·N - 1 (NCCL AVG's bias; 0 for the other models)


REDUCTION_CSV_FIELDS: tuple[str, ...] = tuple(ReductionPoint.__dataclass_fields__)


def reduction_values(
    dtype: str, world_size: int, *, elements: int = ELEMENTS, seed: int = SEED
) -> npt.NDArray[np.float64]:
    """The seeded gradients ``values[r, e]`` (values of ``dtype``) of the first ``world_size`` of
    64 ranks: every world size reduces the same ranks' data, extended."""
    if not 1 <= world_size <= max(WORLD_SIZES):
        raise ValueError(f"world_size must be in [1, {max(WORLD_SIZES)}], got {world_size}")
    rng = np.random.default_rng(seed)
    signal = rng.choice((-1.0, 1.0), elements) * np.exp2(rng.uniform(-8.0, 0.0, elements))
    noise = rng.standard_normal((max(WORLD_SIZES), elements))
    raw = signal[None, :] * (1.0 + 0.5 * noise)
    return round_array(raw[:world_size], dtype)


def _reduce(model: str, values: npt.NDArray[np.float64], dtype: str) -> npt.NDArray[np.float64]:
    n = values.shape[0]
    if model == "ring_sum":
        return R.ring_sum(values, dtype)
    if model == "tree_sum":
        return R.tree_sum(values, dtype, R.nccl_btree(n))
    if model == "gloo_ring":
        chunks = R.gloo_ring_chunks(values.shape[1], n)
        return R.ring_sum(values, dtype, chunks=chunks, direction=-1)
    if model == "nccl_avg":
        return R.nccl_avg(values, dtype)
    if model == "sum_then_divide":
        return R.sum_then_divide(R.ring_sum(values, dtype), n, dtype)
    raise ValueError(f"unknown model {model!r}; models are {', '.join(MODELS)}")


def _bound(model: str, values: npt.NDArray[np.float64], dtype: str) -> npt.NDArray[np.float64]:
    if model == "nccl_avg":
        return R.avg_error_bound(values, dtype)
    if model == "sum_then_divide":
        return R.sum_then_divide_error_bound(values, dtype)
    return R.sum_error_bound(values, dtype)


def _relative(result: float, exact: Fraction) -> float:
    """``|result - exact| / |exact|`` exactly, rounded once (0 when equal; +inf on a zero)."""
    if not math.isfinite(result):
        return math.inf
    error = abs(Fraction(result) - exact)
    if error == 0:
        return 0.0
    return math.inf if exact == 0 else float(error / abs(exact))


def _point(
    model: str,
    values: npt.NDArray[np.float64],
    dtype: str,
    result: npt.NDArray[np.float64] | None = None,
) -> ReductionPoint:
    n = values.shape[0]
    mean = model in _MEANS
    result = _reduce(model, values, dtype) if result is None else result
    sums = R.exact_sums(values, dtype)
    exact = np.array([s / n for s in sums] if mean else list(sums), dtype=object)
    relative = np.array(
        [_relative(value, ref) for value, ref in zip(result.tolist(), exact, strict=True)]
    )
    return ReductionPoint(
        dtype=dtype,
        world_size=n,
        model=model,
        median_rel_error=float(np.median(relative)),
        max_rel_error=float(relative.max()),
        max_error_over_bound=error_ratio(
            result, exact, _bound("gloo_ring" if model == GLOO_MEASURED else model, values, dtype)
        ),
        avg_factor_bias=float(R.avg_factor_relative_error(n, dtype)) if model == "nccl_avg" else 0,
    )


def reduction_points(
    *,
    world_sizes: Sequence[int] = WORLD_SIZES,
    dtypes: Sequence[str] = DTYPES,
    models: Sequence[str] = MODELS,
    elements: int = ELEMENTS,
    seed: int = SEED,
) -> list[ReductionPoint]:
    """Every model x data type x world size (the table of the section)."""
    points = []
    for dtype in dtypes:
        for n in world_sizes:
            values = reduction_values(dtype, n, elements=elements, seed=seed)
            points += [_point(model, values, dtype) for model in models]
    return points


def measured_point(
    result: npt.NDArray[np.float64], values: npt.NDArray[np.float64], dtype: str
) -> ReductionPoint:
    """The point of a measured gloo SUM ``result`` of ``values`` (model :data:`GLOO_MEASURED`,
    judged against the exact sum and the SUM bound)."""
    return _point(GLOO_MEASURED, values, dtype, result)


def reduction_rows(points: Sequence[ReductionPoint]) -> list[dict[str, str]]:
    """The table as CSV rows (keys :data:`REDUCTION_CSV_FIELDS`; floats in ``repr``, exact)."""
    return [{key: str(value) for key, value in asdict(point).items()} for point in points]


_STYLES: Mapping[str, tuple[str, str, str, str]] = {
    # model: (color, line, marker, label)
    "ring_sum": ("#1f77b4", "-", "o", "ring SUM in T (NCCL)"),
    "tree_sum": ("#ff7f0e", "-", "s", "binary-tree SUM in T (NCCL)"),
    "gloo_ring": ("#9467bd", ":", "x", "gloo ring SUM (torch on CPU; checked bit for bit)"),
    GLOO_MEASURED: ("#000000", "", "+", "gloo SUM measured on this CPU"),
    "nccl_avg": ("#d62728", "-", "^", "NCCL AVG: x·round_T(1/N), ring SUM"),
    "sum_then_divide": ("#2ca02c", "--", "D", "ring SUM, then ÷N once (wacc_torch §7+§8)"),
}


def reduction_figure(points: Sequence[ReductionPoint], path: Path) -> Path:
    """Max relative error against world size, one panel per data type, a line per model, with
    the worst case γ_{N-1} of a SUM in T for scale."""
    dtypes = [d for d in DTYPES if any(p.dtype == d for p in points)]
    figure, axes = plt.subplots(1, len(dtypes), figsize=(4.8 * len(dtypes), 5.2), squeeze=False)
    for axis, dtype in zip(axes[0], dtypes, strict=True):
        chosen = [p for p in points if p.dtype == dtype]
        sizes = sorted({p.world_size for p in chosen})
        positive = [p.max_rel_error for p in chosen if p.max_rel_error > 0]
        floor = min(positive) / 4 if positive else 1e-10  # exact results are drawn here
        for model, (color, line, marker, label) in _STYLES.items():
            series = sorted((p for p in chosen if p.model == model), key=lambda p: p.world_size)
            markersize = 11 if model == GLOO_MEASURED else 6  # drawn over the model it equals
            if not series:
                continue
            axis.plot(
                [p.world_size for p in series], [max(p.max_rel_error, floor) for p in series],
                linestyle=line or "none", marker=marker, color=color, label=label,
                markersize=markersize,
                markerfacecolor="none" if marker in "sD" else None,
            )  # fmt: skip
        worst = [gamma(n - 1, dtype) for n in sizes]
        axis.plot(sizes, worst, color="gray", linestyle="-.", linewidth=1,
                  label=r"worst case of a SUM in T: $\gamma_{N-1}$")  # fmt: skip
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(sizes)
        axis.set_xticklabels([str(n) for n in sizes], fontsize=9)
        axis.set_title(f"gradients in {dtype}")
        axis.set_xlabel("world size N (ranks)")
        axis.grid(alpha=0.3, which="both")
    axes[0, 0].set_ylabel(
        f"max relative error over the elements\nvs the exact sum / exact mean ({ELEMENTS} elements)"
    )
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=10, frameon=False)
    bias = R.avg_factor_relative_error(3, "bfloat16")
    figure.suptitle(
        "Rounding of the data-parallel reduction itself (exact models): NCCL's AVG carries the "
        f"bias of round_T(1/N), e.g. {100 * float(bias):+.3f} % for bfloat16 at N = 3"
    )
    figure.tight_layout(rect=(0, 0.12, 1, 0.96))
    return _save(figure, path)


def reduction_report(
    directory: Path,
    *,
    world_sizes: Sequence[int] = WORLD_SIZES,
    elements: int = ELEMENTS,
    measured: Sequence[ReductionPoint] = (),
) -> tuple[Path, list[dict[str, str]]]:
    """The section in one call: the figure ``directory/reduction_error.png`` and the table rows
    (CSV, :data:`REDUCTION_CSV_FIELDS`), with the ``measured`` points (:func:`measured_point`)
    drawn and listed beside the models."""
    points = reduction_points(world_sizes=world_sizes, elements=elements) + list(measured)
    figure = reduction_figure(points, directory / "reduction_error.png")
    return figure, reduction_rows(points)
