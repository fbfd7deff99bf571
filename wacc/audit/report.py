"""The audit's findings as text: the stdout table, ``audit.md`` and ``audit.csv``."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from wacc.audit.provenance import PROVENANCE_COLUMNS, AuditProvenance
from wacc.audit.runner import TEST_LOSS_SCALE, AuditResult, Cell, LoopFacts

__all__ = ["CSV_COLUMNS", "cell_rows", "fact_rows", "render_table", "write_csv", "write_markdown"]

CELL_COLUMNS = (
    "loop", "window", "verdict", "rel L2", "max rel elem", "err/bound (D run)",
    "err/bound (f64 run)", "tokens counted/true", "deterministic",
)  # fmt: skip
RANK_COLUMNS = ("world size", "rank tokens", "predicted rel L2", "f64 rel L2", "ranks agree")
"""The cell columns of a run across ranks (after ``window``; audit.md always has them)."""
FACT_COLUMNS = (
    "loop", "version", "model", "float64 copy", "reads window first", "zero-target window",
    "mid-window resume", "resumed rel L2", "fixed loss scale", "fp16 overflow",
)  # fmt: skip


def _num(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    return "0" if value == 0 else f"{value:.3g}"


def _tokens(cell: Cell) -> str:
    if cell.status != "ok":
        return "-"
    if cell.world_size > 1 and any(c is not None for c in cell.rank_counted):
        # what each rank divided by, against every rank's tokens
        counted = ";".join(_counted(c) for c in cell.rank_counted)
        right = all(c == cell.true_count for c in cell.rank_counted)
        return f"{counted}/{cell.true_count}{'' if right else ' (!)'}"
    if cell.counted is None:
        return f"per-microbatch mean/{cell.true_count}"
    counted = f"{cell.counted:g}"
    mark = "" if cell.counted == cell.true_count else " (!)"
    return f"{counted}/{cell.true_count}{mark}"


def _counted(value: float | None) -> str:
    return "mean" if value is None else f"{value:g}"


def _rank_tokens(cell: Cell) -> str:
    return ";".join(str(n) for n in cell.rank_tokens) if cell.rank_tokens else str(cell.true_count)


def _agree(cell: Cell) -> str:
    if cell.ranks_agree is None:
        return "-"
    return "yes" if cell.ranks_agree else f"NO (rel L2 {_num(cell.rank_spread)})"


def cell_rows(result: AuditResult) -> list[dict[str, str]]:
    """One row per loop × window, keyed by :data:`CELL_COLUMNS` and :data:`RANK_COLUMNS`."""
    rows = []
    for cell in result.cells:
        ran = cell.status == "ok"
        rows.append(
            {
                "world size": str(cell.world_size),
                "rank tokens": _rank_tokens(cell),
                "predicted rel L2": _num(cell.predicted_rel_l2),
                "f64 rel L2": _num(cell.semantic_rel_l2) if ran else "-",
                "ranks agree": _agree(cell),
                "loop": cell.adapter,
                "window": cell.window,
                "verdict": cell.verdict.split(":")[0],
                "rel L2": _num(cell.rel_l2) if ran else "-",
                "max rel elem": _num(cell.max_rel) if ran else "-",
                "err/bound (D run)": _num(cell.ratio) if ran else "-",
                "err/bound (f64 run)": _num(cell.semantic_ratio) if ran else "-",
                "tokens counted/true": _tokens(cell),
                "deterministic": "-" if cell.deterministic is None else
                ("yes" if cell.deterministic else "NO"),
            }
        )  # fmt: skip
    return rows


def _float64_copy(fact: LoopFacts) -> str:
    if fact.status != "ok":
        return "-"
    if not fact.truth_casts and not fact.loss_casts:
        return "clean"
    parts = []
    if fact.truth_casts:
        parts.append("forward casts to float32 (" + ", ".join(_names(fact.truth_casts)) + ")")
    if fact.loss_casts:
        parts.append("own loss casts to float32 (" + ", ".join(_names(fact.loss_casts)) + ")")
    return "; ".join(parts)


def _names(casts: tuple[str, ...], *, most: int = 4) -> list[str]:
    names = sorted({c.split(" -> ")[0] for c in casts})
    return names if len(names) <= most else names[:most] + [f"+{len(names) - most} more"]


def _zero_target(result: AuditResult, fact: LoopFacts) -> str:
    for cell in result.cells:
        if cell.adapter == fact.adapter.name and cell.window == "zero":
            if cell.status != "ok":
                return cell.status
            finite = "finite" if cell.finite else "NaN/inf gradient"
            return f"{finite}, {cell.verdict}"
    return "-"


def fact_rows(result: AuditResult) -> list[dict[str, str]]:
    """One row per loop, keyed by :data:`FACT_COLUMNS`."""
    rows = []
    for fact in result.facts:
        ran = fact.status == "ok"
        rows.append(
            {
                "loop": fact.adapter.name,
                "version": fact.version or "-",
                "model": fact.model,
                "float64 copy": _float64_copy(fact),
                "reads window first": fact.needs_total if ran else fact.status,
                "zero-target window": _zero_target(result, fact) if ran else "-",
                "mid-window resume": fact.resume if ran else "-",
                "resumed rel L2": _num(fact.resume_rel_l2) if ran else "-",
                "fixed loss scale": fact.loss_scale if ran else "-",
                "fp16 overflow": fact.fp16 if ran else "-",
            }
        )
    return rows


def _text_table(rows: list[dict[str, str]], columns: tuple[str, ...]) -> str:
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines.append("  ".join("-" * widths[c] for c in columns))
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _md_table(rows: list[dict[str, str]], columns: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r[c].replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _cell_columns(*, ranks: bool) -> tuple[str, ...]:
    """:data:`CELL_COLUMNS` with :data:`RANK_COLUMNS` after the window when ``ranks``."""
    if not ranks:
        return CELL_COLUMNS
    return CELL_COLUMNS[:2] + RANK_COLUMNS + CELL_COLUMNS[2:]


def _describe_windows(result: AuditResult) -> str:
    if result.world_size == 1:
        return "; ".join(w.describe() for w in result.windows)
    return "; ".join(
        f"{name} (" + " | ".join(", ".join(str(n) for n in w.targets) for w in ranks) + ")"
        for name, ranks in result.rank_windows.items()
    )


def render_table(result: AuditResult) -> str:
    """The stdout report: both tables, plain text (the rank columns at world size > 1)."""
    header = (
        f"wacc audit — dtype {result.dtype}; world size {result.world_size}; windows"
        + (" (per rank, | between ranks)" if result.world_size > 1 else "")
        + ": "
        + _describe_windows(result)
    )
    return "\n\n".join(
        [
            header,
            _text_table(cell_rows(result), _cell_columns(ranks=result.world_size > 1)),
            _text_table(fact_rows(result), FACT_COLUMNS),
        ]
    )


_METHOD = """\
**How to read it.** Truth: the gradient of the mean token loss over the whole window, in float64
on a float64 copy of the same model (its own cross-entropy on the logits, `-100` ignored, over the
labels its family's loss uses: shifted for a causal LM, unshifted for a masked LM or a seq2seq
decoder). `rel L2` = ‖F − T‖/‖T‖ and `max rel elem` = max |F_i − T_i|/|T_i| for the gradient F the
loop hands its optimizer in the audited dtype. `err/bound` = ‖F − T‖/‖B‖ with B the per-element
bound of `wacc_ref.bounds.window_error_bound` for summing the window's per-microbatch loss-sum
gradients in the audited dtype and dividing by the true count (the D run also carries its own
forward/backward rounding). `verdict` = pass iff the loop's run *in float64* is within that
bound (it isolates what the loop computes from rounding) and its gradient is finite.
`world size`: ranks per loop (each a process of its own, gloo), each with a window of its own;
the truth is then the mean over every rank's tokens, `rank tokens` each rank's true total,
`tokens counted/true` what each rank divided by against all ranks' tokens, the row's errors rank
0's gradient, the verdict the worst rank's, `ranks agree` whether every rank handed its optimizer
the same gradient (bit for bit). `predicted rel L2`: for a loop that weighs ranks equally (the
mean over ranks of each rank's token mean: DDP's average of per-rank means), the error computed
from the per-rank totals and per-rank exact gradients alone, to compare with `f64 rel L2`, the
error of the loop's run in float64.
`reads window first`: whether every microbatch was read before the first backward (measured).
`mid-window resume`: checkpoint after K // 2 microbatches with the loop's own checkpoint call,
restore into fresh objects, finish the window. `fixed loss scale`: a run with S = {scale:g}
compared bit for bit with S = 1. `deterministic`: two runs hash the same. `fp16 overflow`: the
loop's own float16 mixed-precision path (autocast float16 + its loss scaler, SGD with lr > 0) on
a window in which one microbatch's float16 logits overflow (a spike token), read from the
parameters after the step and the scaler's scale: "skips the whole window" (parameters unchanged,
scale before -> after), "applies non-finite gradients", "drops the microbatch", or "no float16
compute" when the path never ran in float16 (accelerate, and so Trainer, off-GPU; Lightning's
`16-mixed`, which it runs as `bf16-mixed` on CPU).
"""


def write_markdown(result: AuditResult, path: Path, provenance: AuditProvenance) -> None:
    """``audit.md``: provenance, windows, both tables, how to read them, notes."""
    notes = [f"- `{f.adapter.name}`: {n}" for f in result.facts for n in dict.fromkeys(f.notes)]
    paths = [
        f"- `{f.adapter.name}` — {f.adapter.title} (checked: {f.adapter.checked or 'n/a'}): "
        f"`{f.adapter.code_path}`"
        for f in result.facts
    ]
    text = "\n\n".join(
        [
            "# wacc audit",
            f"dtype **{result.dtype}**, world size **{result.world_size}**; {provenance.line()}",
            "Windows (target tokens per microbatch"
            + ("; per rank, `|` between ranks" if result.world_size > 1 else "")
            + "): `"
            + _describe_windows(result).replace("; ", "`; `")
            + "`",
            "## Per loop and window",
            _md_table(cell_rows(result), _cell_columns(ranks=True)),
            "## Per loop",
            _md_table(fact_rows(result), FACT_COLUMNS),
            _METHOD.format(scale=TEST_LOSS_SCALE),
            "## Code paths driven\n\n" + "\n".join(paths),
        ]
        + (["## Notes\n\n" + "\n".join(notes)] if notes else [])
    )
    path.write_text(text + "\n", encoding="utf-8")


CSV_COLUMNS = (
    "loop", "window", "status", "verdict", "version", "model", "dtype", "rel_l2",
    "max_rel_element", "err_over_bound", "element_err_over_bound", "f64_rel_l2",
    "f64_err_over_bound", "f64_element_err_over_bound", "tokens_counted", "tokens_true",
    "finite", "deterministic", "sha256", "reads_window_first", "mid_window_resume",
    "resumed_rel_l2", "fixed_loss_scale", "fp16_overflow", "truth_casts", "loss_casts",
    "world_size", "rank_tokens", "rank_tokens_counted", "predicted_rel_l2", "ranks_agree",
    *PROVENANCE_COLUMNS,
)  # fmt: skip
"""``audit.csv``'s columns, the run's provenance on every row."""


def write_csv(result: AuditResult, path: Path, provenance: AuditProvenance) -> None:
    """``audit.csv``: one row per loop × window, full precision, the loop's facts and the run's
    provenance repeated."""
    facts = {f.adapter.name: f for f in result.facts}
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for c in result.cells:
            f = facts[c.adapter]
            writer.writerow(
                {
                    "loop": c.adapter, "window": c.window, "status": c.status,
                    "verdict": c.verdict, "version": f.version, "model": f.model,
                    "dtype": result.dtype, "rel_l2": repr(c.rel_l2), "max_rel_element":
                    repr(c.max_rel), "err_over_bound": repr(c.ratio),
                    "element_err_over_bound": repr(c.element_ratio),
                    "f64_rel_l2": repr(c.semantic_rel_l2),
                    "f64_err_over_bound": repr(c.semantic_ratio),
                    "f64_element_err_over_bound": repr(c.semantic_element_ratio),
                    "tokens_counted": "" if c.counted is None else repr(c.counted),
                    "tokens_true": c.true_count, "finite": c.finite,
                    "deterministic": "" if c.deterministic is None else c.deterministic,
                    "sha256": c.digest, "reads_window_first": f.needs_total,
                    "mid_window_resume": f.resume, "resumed_rel_l2": repr(f.resume_rel_l2),
                    "fixed_loss_scale": f.loss_scale, "fp16_overflow": f.fp16,
                    "truth_casts": ";".join(f.truth_casts),
                    "loss_casts": ";".join(f.loss_casts),
                    "world_size": c.world_size, "rank_tokens": _rank_tokens(c),
                    "rank_tokens_counted": ";".join(
                        "" if n is None else repr(float(n)) for n in c.rank_counted
                    ),
                    "predicted_rel_l2": "" if math.isnan(c.predicted_rel_l2) else
                    repr(c.predicted_rel_l2),
                    "ranks_agree": "" if c.ranks_agree is None else c.ranks_agree,
                    **provenance.columns(),
                }
            )  # fmt: skip
