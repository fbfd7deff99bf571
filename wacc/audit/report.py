"""The audit's findings as text: the stdout table, ``audit.md`` and ``audit.csv``."""

from __future__ import annotations

import csv
import math
import re
import textwrap
from importlib import metadata
from pathlib import Path

from wacc.audit.protocol import Adapter
from wacc.audit.provenance import PROVENANCE_COLUMNS, AuditProvenance
from wacc.audit.results import TEST_LOSS_SCALE, AuditResult, Cell, LoopFacts

__all__ = [
    "CSV_COLUMNS", "basis", "cell_rows", "checked_versions", "fact_rows", "fix_lines",
    "render_table", "write_csv", "write_markdown",
]  # fmt: skip

CELL_COLUMNS = (
    "loop", "window", "verdict", "rel L2", "max rel elem", "err/bound (D run)",
    "err/bound (f64 run)", "tokens counted/true", "deterministic", "basis",
)  # fmt: skip
RANK_COLUMNS = ("world size", "rank tokens", "predicted rel L2", "f64 rel L2", "ranks agree")
"""The cell columns of a run across ranks (after ``window``; audit.md always has them)."""
# The terminal's cell table: the same cells under short headers (a legend follows it), no basis.
_TERMINAL_HEADERS = {
    "err/bound (D run)": "err/bnd D", "err/bound (f64 run)": "err/bnd f64", "deterministic": "det.",
    "world size": "N", "rank tokens": "rank tok.", "predicted rel L2": "pred. rel L2",
    "ranks agree": "agree",
}  # fmt: skip
WIDTH = 120  # the terminal's columns: every line of the stdout report fits
# Across ranks, the terminal's second table (the world size is in its header).
TERMINAL_RANK_COLUMNS = (
    "loop", "window", "rank tokens", "tokens counted/true", "predicted rel L2", "f64 rel L2",
    "ranks agree",
)  # fmt: skip
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


def basis(cell: Cell, dtype: str) -> str:
    """Why the verdict is what it is, with the reason for a number that looks alarming next to
    it: the verdict is the float64 run's (the loop's weighting alone); the run in ``dtype`` also
    carries its own forward/backward rounding, which no bound covers, and which is all of a
    small element's relative error."""
    if cell.status != "ok":
        return ""
    if not cell.finite:
        return "NaN/inf in the gradient"
    f64 = _num(cell.semantic_ratio)
    if cell.verdict == "FAIL":
        return f"the f64 run is {f64} bounds off: the loop's weighting or count"
    parts = [f"the f64 run is within the bound ({f64})"]
    if cell.ratio > 1:
        parts.append(
            f"err/bound (D run) {_num(cell.ratio)} is the {dtype} run's own forward/backward "
            "rounding, which no bound covers"
        )
    if cell.max_rel_normal >= 1:
        parts.append(
            f"max rel elem {_num(cell.max_rel_normal)} is on an element {cell.max_rel_share:.1e}"
            f" of the gradient's largest, which the {dtype} run's rounding (about its unit times"
            " the largest) swamps"
        )
    return "; ".join(parts)


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
                "max rel elem": _num(cell.max_rel_normal) if ran else "-",
                "err/bound (D run)": _num(cell.ratio) if ran else "-",
                "err/bound (f64 run)": _num(cell.semantic_ratio) if ran else "-",
                "tokens counted/true": _tokens(cell),
                "deterministic": "-" if cell.deterministic is None else
                ("yes" if cell.deterministic else "NO"),
                "basis": basis(cell, result.dtype),
            }
        )  # fmt: skip
    return rows


def _windows_passed(result: AuditResult, loop: str) -> str:
    """How ``loop`` fared on this run's windows: "passes all 4 windows", "fails 2 of 4 windows",
    "not in this run", or what kept it from running."""
    cells = [c for c in result.cells if c.adapter == loop]
    if not cells:
        return "not in this run"
    failed = sum(c.verdict != "pass" for c in cells)
    if failed == 0:
        return f"passes all {len(cells)} windows"
    ran = [c for c in cells if c.status == "ok"]
    if not ran:
        return cells[0].verdict.split(":")[0]
    return f"fails {failed} of {len(cells)} windows"


def fix_lines(result: AuditResult) -> list[str]:
    """One line per loop that fails a window: the cause in the framework's source
    (``Adapter.cause``) and the ``+wacc`` row whose integration fixes it (``Adapter.fixed_by``),
    with how that row fared in this run."""
    lines = []
    for fact in result.facts:
        adapter = fact.adapter
        if not any(c.adapter == adapter.name and c.verdict == "FAIL" for c in result.cells):
            continue
        cause = adapter.cause or "cause not recorded."
        if adapter.fixed_by is None:
            fix = "No wacc integration fixes it."
        else:
            fared = _windows_passed(result, adapter.fixed_by)
            where = "" if fared == "not in this run" else " in this run"
            fix = f"Fixed by `{adapter.fixed_by}` ({fared}{where})."
        lines.append(f"- `{adapter.name}` ({_windows_passed(result, adapter.name)}): {cause} {fix}")
    return lines


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


_PAIR = re.compile(r"([A-Za-z][\w.-]*) (\d[\w.+-]*)")


def checked_versions(adapter: Adapter) -> str:
    """``checked: …`` for the loop, saying so when an installed distribution it names has
    another version than the one it was checked with (a local label such as ``+cpu`` and a
    ``.x`` wildcard match)."""
    if not adapter.checked:
        return "checked: n/a"
    differ = []
    for name, checked in _PAIR.findall(adapter.checked):
        try:
            installed = metadata.version(name)
        except (metadata.PackageNotFoundError, ValueError):
            continue  # not a distribution installed here (a commit, "record format 1")
        public = installed.split("+")[0]
        if checked.endswith(".x"):
            same = public.startswith(checked[:-1])
        else:
            same = public == checked.split("+")[0]
        if not same:
            differ.append(f"{name} {installed}")
    text = f"checked: {adapter.checked}"
    if differ:
        text += f" (installed: {', '.join(differ)}: the versions differ)"
    return text


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


def _wrap(text: str, first: str = "") -> str:
    """``text`` in lines of at most :data:`WIDTH`, the first indented by ``first``, the others
    by 2 more (4 at least)."""
    rest = " " * max(4, len(first) + 2)
    return textwrap.fill(text, width=WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False)  # fmt: skip


def _legend(result: AuditResult) -> str:
    return _wrap(
        f"err/bnd: ‖F − T‖/‖B‖ of the {result.dtype} run (D) and of the float64 run (f64, the "
        "verdict: pass iff <= 1); max rel elem: over the elements whose exact value is in "
        f"{result.dtype}'s normal range and above its own bound (elsewhere a microbatch's "
        "gradient cancels, one spacing off reads as 1e12 and the bound judges it; audit.csv "
        "has both); det.: two runs hash the same."
    )


def _why(result: AuditResult) -> list[str]:
    """One line per passing cell with a number that looks alarming (its D run above its bound,
    a max rel elem of 1 or more): why it passes."""
    return [
        _wrap(f"{c.adapter} / {c.window}: pass: {basis(c, result.dtype)}.", "  ")
        for c in result.cells
        if c.status == "ok" and c.verdict == "pass" and (c.ratio > 1 or c.max_rel_normal >= 1)
    ]


def _fact_blocks(result: AuditResult) -> str:
    """Per loop, its facts as wrapped lines (the wide table is audit.md's)."""
    blocks = []
    for fact, row in zip(result.facts, fact_rows(result), strict=True):
        head = f"{row['loop']}: version {row['version']}; {checked_versions(fact.adapter)}; "
        head += f"model {row['model']}"
        if fact.status != "ok":
            blocks.append(_wrap(f"{head}: {fact.status}"))
            continue
        rest = "; ".join(f"{c}: {row[c]}" for c in FACT_COLUMNS[3:])
        blocks.append(_wrap(head) + "\n" + _wrap(rest, "    "))
    return "\n".join(blocks)


def render_table(result: AuditResult) -> str:
    """The stdout report, every line at most :data:`WIDTH` columns (a loop name permitting):
    the cells under short headers, a legend, why a pass shows a D run above its bound, across
    ranks the rank columns of the cells that ran (:data:`TERMINAL_RANK_COLUMNS`), and per loop
    its facts (the wide tables are :func:`write_markdown`'s)."""
    ranks = result.world_size > 1
    header = _wrap(
        f"wacc audit — dtype {result.dtype}"
        + (f"; world size {result.world_size}; windows (per rank, | between ranks): " if ranks
           else "; windows: ")
        + _describe_windows(result)
    )  # fmt: skip
    # The basis is audit.md's (the reasons follow); across ranks the rank columns and the counts
    # are a table of their own, for the rows that ran, so that both fit in WIDTH.
    shown = tuple(c for c in CELL_COLUMNS[:-1] if not (ranks and c in TERMINAL_RANK_COLUMNS[2:]))
    all_rows = cell_rows(result)
    cells = "\n".join([_terminal_table(all_rows, shown), _legend(result), *_why(result)])
    across = [r for r, c in zip(all_rows, result.cells, strict=True) if c.status == "ok"]
    blocks = [header, cells]
    if ranks and across:
        blocks.append(
            f"Across {result.world_size} ranks (rank 0's gradient):\n"
            + _terminal_table(across, TERMINAL_RANK_COLUMNS)
        )
    facts = "Per loop (the full table is audit.md's):\n" + _fact_blocks(result)
    fixes = [_wrap(line, "  ") for line in fix_lines(result)]
    return "\n\n".join(
        [*blocks, facts] + (["Causes and fixes:\n" + "\n".join(fixes)] if fixes else [])
    )


def _terminal_table(rows: list[dict[str, str]], shown: tuple[str, ...]) -> str:
    """The ``shown`` columns of ``rows`` under the terminal's short headers."""
    columns = tuple(_TERMINAL_HEADERS.get(c, c) for c in shown)
    short = [{_TERMINAL_HEADERS.get(c, c): r[c] for c in shown} for r in rows]
    return _text_table(short, columns)


_METHOD = """\
**How to read it.** Truth: the gradient of the mean token loss over the whole window, in float64
on a float64 copy of the same model (its own cross-entropy on the logits, `-100` ignored, over the
labels its family's loss uses: shifted for a causal LM, unshifted for a masked LM or a seq2seq
decoder). `rel L2` = ‖F − T‖/‖T‖ and `max rel elem` = max |F_i − T_i|/|T_i| for the gradient F the
loop hands its optimizer in the audited dtype, over the elements where a relative error means
something: T_i in the dtype's normal range and above its own bound B_i (where B_i ≥ |T_i| a
microbatch's gradient cancels, one spacing off a tiny T_i reads as 1e12, and the bound judges the
element; `audit.csv` has it over every nonzero T_i too, `max_rel_element`). `err/bound` =
‖F − T‖/‖B‖ with B the per-element bound of `wacc_ref.bounds.window_error_bound` for summing
the window's per-microbatch loss-sum gradients in the audited dtype and dividing by the true
count (the D run also carries its own forward/backward rounding). `verdict` = pass iff the
loop's run *in float64* is within that bound (it isolates what the loop computes from rounding)
and its gradient is finite; `basis` says so per row, and why a pass may show an `err/bound (D
run)` above 1 (the D run's own forward/backward rounding, which no bound covers).
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
    fixes = fix_lines(result)
    paths = [
        f"- `{f.adapter.name}` — {f.adapter.title} ({checked_versions(f.adapter)}): "
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
        ]
        + (["## Causes and fixes\n\n" + "\n".join(fixes)] if fixes else [])
        + [
            _METHOD.format(scale=TEST_LOSS_SCALE),
            "## Code paths driven\n\n" + "\n".join(paths),
        ]
        + (["## Notes\n\n" + "\n".join(notes)] if notes else [])
    )
    path.write_text(text + "\n", encoding="utf-8")


CSV_COLUMNS = (
    "loop", "window", "status", "verdict", "version", "model", "dtype", "rel_l2",
    "max_rel_element", "max_rel_element_normal", "normal_elements", "max_rel_element_share",
    "err_over_bound",
    "element_err_over_bound", "f64_rel_l2",
    "f64_err_over_bound", "f64_element_err_over_bound", "tokens_counted", "tokens_true",
    "finite", "deterministic", "sha256", "reads_window_first", "mid_window_resume",
    "resumed_rel_l2", "fixed_loss_scale", "fp16_overflow", "truth_casts", "loss_casts", "cause",
    "fixed_by", "world_size", "rank_tokens", "rank_tokens_counted", "predicted_rel_l2",
    "ranks_agree", *PROVENANCE_COLUMNS,
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
                    repr(c.max_rel), "max_rel_element_normal": repr(c.max_rel_normal),
                    "normal_elements": c.normal_elements,
                    "max_rel_element_share": repr(c.max_rel_share), "err_over_bound": repr(c.ratio),
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
                    "cause": f.adapter.cause or "", "fixed_by": f.adapter.fixed_by or "",
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
