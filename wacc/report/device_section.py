"""The report's device section: what each device computes, against the exact reference.

Parts, fastest first (the device check writes the section after each, so a run cut by its time cap
keeps the parts done):

* ``ops``: :mod:`wacc.report.device_ops` on every device (which rounding each element-wise update
  took, max ulps from the exact result rounded once);
* ``precision``: the gradient of the audit's ``plain`` model on its ``unequal`` window, computed
  on the device in float32 with TF32 on and off and in bfloat16 with reduced-precision reductions
  on and off (each a row; PyTorch's default named), relative L2 error against the audit's float64
  truth: CUDA settings, so CUDA only;
* ``fp8``: ``torch._scaled_mm`` of float8_e4m3fn matrices (positive values, so no cancellation)
  against K, with ``use_fast_accum`` on and off, max relative error against the float64 product of
  the same values: where the device has FP8 (CUDA compute capability 8.9 or more);
* ``gloo``: a real gloo SUM all_reduce with 2 and 3 ranks on this CPU beside the exact gloo_ring
  model (bit for bit) and the SUM bound; its points join the reduction figure and CSV;
* ``loops``: the report's corpus on wacc_torch in every mode and on the baseline loops, per device
  (the headline's lines).

A part that cannot run on a device is one row whose ``note`` says ``skipped: <why>``. With
``rehearsal``, the CUDA-only parts run on the CPU instead, their device written ``cpu
(rehearsal)``: the device check's CI run, which proves the code path, not the CUDA numbers.
"""

from __future__ import annotations

import csv
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DEVICE_CSV_FIELDS",
    "REHEARSAL",
    "DeviceSection",
    "build_device_section",
    "device_markdown",
    "fp8_rows",
    "gloo_rows",
    "loop_rows",
    "precision_rows",
    "read_csv",
    "write_csv",
]

DEVICE_CSV_FIELDS: tuple[str, ...] = (
    "table", "device", "name", "dtype", "setting", "rounding", "tail_rounding", "max_ulps",
    "rel_error", "note",
)  # fmt: skip
REHEARSAL = "cpu (rehearsal)"  # the device of a CUDA-only part run on the CPU
FP8_K: tuple[int, ...] = (256, 1024, 4096, 16384)
GLOO_WORLD_SIZES: tuple[int, ...] = (2, 3)

Row = dict[str, str]


def _row(table: str, device: str, name: str, **cells: object) -> Row:
    row = {key: "" for key in DEVICE_CSV_FIELDS}
    row.update(table=table, device=device, name=name)
    row.update({key: str(value) for key, value in cells.items()})
    return row


def _skipped(table: str, device: str, why: str) -> Row:
    return _row(table, device, "-", note=f"skipped: {why}")


def _error_text(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {first[:160]}"


# --- precision -------------------------------------------------------------------------------

# (dtype, setting label, flag values, PyTorch's default?)
_PRECISION = (
    ("float32", "TF32 on (matmul and cuDNN)", True),
    ("float32", "TF32 off", False),
    ("bfloat16", "reduced-precision reduction on", True),
    ("bfloat16", "reduced-precision reduction off", False),
)


def _set_flags(dtype: str, on: bool) -> tuple[bool, bool, bool]:
    """Set the CUDA precision flags of ``dtype``'s row; returns the previous three values."""
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              matmul.allow_bf16_reduced_precision_reduction)  # fmt: skip
    if dtype == "float32":
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    else:
        matmul.allow_bf16_reduced_precision_reduction = on
    return before


def _restore_flags(before: tuple[bool, bool, bool]) -> None:
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[0], before[1]
    matmul.allow_bf16_reduced_precision_reduction = before[2]


def _audit_gradient_error(dtype: str, device: str) -> float:
    """Relative L2 error of the ``plain`` model's window gradient computed on ``device`` in
    ``dtype`` (each microbatch's loss sum / N, backward accumulating into ``.grad``)."""
    from wacc.audit.metrics import relative_l2
    from wacc.audit.models import MODEL_KINDS
    from wacc.audit.results import DTYPES
    from wacc.audit.truth import compute_truth, flatten
    from wacc.audit.windows import build_window

    spec, window = MODEL_KINDS["plain"], build_window("unequal")
    torch_dtype = DTYPES[dtype]
    truth = compute_truth(spec, torch_dtype, window)
    model = spec.build(torch_dtype).to(device)
    family = spec.loss_family
    total = window.total_targets
    for microbatch in window.microbatches:
        batch = {k: v[None].to(device) for k, v in spec.prepare(microbatch).items()}
        loss = family.loss_sum(family.logits(model, batch), batch["labels"]) / total
        loss.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}  # fmt: skip
    return relative_l2(flatten(grads, truth.names), truth.gradient)


def precision_rows(device: str, *, label: str | None = None) -> list[Row]:
    """The ``precision`` rows on ``device`` (written as ``label``; see the module docstring)."""
    rows = []
    for dtype, setting, on in _PRECISION:
        before = _set_flags(dtype, on)
        try:
            default = "PyTorch's default" if before[0 if dtype == "float32" else 2] == on else ""
            error = _audit_gradient_error(dtype, device)
            cells: dict[str, object] = {"rel_error": error, "note": default}
        except Exception as exc:  # a device that cannot run it is a row, never a crash
            cells = {"note": f"failed: {_error_text(exc)}"}
        finally:
            _restore_flags(before)
        rows.append(_row("precision", label or device, "audit plain model, window unequal",
                         dtype=dtype, setting=setting, **cells))  # fmt: skip
    return rows


# --- fp8 -------------------------------------------------------------------------------------


def fp8_reason(device: str) -> str | None:
    """Why ``device`` has no FP8 ``_scaled_mm`` (None: it has)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8_e4m3fn / _scaled_mm"
    if device.startswith("cuda"):
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return f"compute capability {capability[0]}.{capability[1]} < 8.9 (no FP8 tensor cores)"
    return None


def _scaled_mm(
    a: torch.Tensor, b: torch.Tensor, one: torch.Tensor, fast: bool
) -> tuple[torch.Tensor, str]:
    """``a @ b`` in FP8 with float32 output, or bfloat16 where the backend refuses float32."""
    try:
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32,
                               use_fast_accum=fast)  # fmt: skip
        return out, "float32"
    except RuntimeError:
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                               use_fast_accum=fast)  # fmt: skip
        return out, "bfloat16"


def fp8_rows(device: str, *, ks: Sequence[int] = FP8_K, label: str | None = None) -> list[Row]:
    """The ``fp8`` rows on ``device``: one per K x ``use_fast_accum`` (module docstring)."""
    reason = fp8_reason(device)
    if reason is not None:
        return [_skipped("fp8", label or device, reason)]
    rows = []
    generator = torch.Generator().manual_seed(36)
    for k in ks:
        a = torch.rand(32, k, generator=generator).to(torch.float8_e4m3fn)
        b = torch.rand(32, k, generator=generator).to(torch.float8_e4m3fn)
        exact = a.double() @ b.double().t()  # products of e4m3 values: float64 sums them closely
        one = torch.ones((), dtype=torch.float32, device=device)
        for fast in (False, True):
            try:
                out, out_dtype = _scaled_mm(a.to(device), b.to(device).t(), one, fast)
                error = float(((out.double().cpu() - exact).abs() / exact.abs()).max())
                rows.append(_row("fp8", label or device, f"K={k}", dtype="float8_e4m3fn",
                                 setting=f"use_fast_accum={fast}", rel_error=error,
                                 note=f"out_dtype {out_dtype}"))  # fmt: skip
            except Exception as exc:
                rows.append(_row("fp8", label or device, f"K={k}", dtype="float8_e4m3fn",
                                 setting=f"use_fast_accum={fast}",
                                 note=f"failed: {_error_text(exc)}"))  # fmt: skip
    return rows


# --- gloo ------------------------------------------------------------------------------------


def gloo_rows(
    world_sizes: Sequence[int] = GLOO_WORLD_SIZES, *, elements: int
) -> tuple[list[Row], list[object]]:
    """A real gloo SUM for each world size on this CPU: the ``gloo`` rows (bit for bit against
    the gloo_ring model) and the measured points for the reduction figure and CSV."""
    from wacc.report.gloo import gloo_sum
    from wacc.report.reduction import DTYPES, measured_point, reduction_values
    from wacc_ref import reduction as R

    rows: list[Row] = []
    points: list[object] = []
    for n in world_sizes:
        values = {d: reduction_values(d, n, elements=elements) for d in DTYPES}
        try:
            measured = gloo_sum(values)
        except Exception as exc:
            rows.append(_skipped("gloo", "cpu", f"gloo job of {n} ranks: {_error_text(exc)}"))
            continue
        for dtype in DTYPES:
            chunks = R.gloo_ring_chunks(elements, n)
            model = R.ring_sum(values[dtype], dtype, chunks=chunks, direction=-1)
            differ = int((model.view(np.int64) != measured[dtype].view(np.int64)).sum())
            point = measured_point(measured[dtype], values[dtype], dtype)
            points.append(point)
            verdict = (
                "equals the gloo_ring model bit for bit" if not differ
                else f"differs from the gloo_ring model at {differ} of {elements} elements"
            )  # fmt: skip
            rows.append(_row("gloo", "cpu", f"N={n}", dtype=dtype, setting="all_reduce SUM",
                             rounding=verdict, rel_error=point.max_rel_error,
                             note=f"max error / bound {point.max_error_over_bound!r}"))  # fmt: skip
    return rows, points


# --- loops -----------------------------------------------------------------------------------


def loop_rows(judged: Sequence[object]) -> list[Row]:
    """The ``loops`` rows: the headline's lines (work dtype x implementation x device) of the
    judged corpus rows (:class:`wacc.report.rows.Row`)."""
    from wacc.report.writer import headline

    return [
        _row(
            "loops",
            h.device,
            h.implementation,
            dtype=h.work_dtype,
            setting=f"{h.scenarios} scenarios",
            max_ulps=h.max_ulps,
            rel_error=h.max_rel_error,
            note=h.verdict,
        )  # fmt: skip
        for h in headline(judged)  # type: ignore[arg-type]
    ]


# --- the section -----------------------------------------------------------------------------


@dataclass
class DeviceSection:
    """What has been computed so far (the parts run in order; ``done`` names them)."""

    devices: tuple[str, ...]
    rehearsal: bool
    rows: list[Row] = field(default_factory=list)
    reduction: list[dict[str, str]] = field(default_factory=list)
    figure: Path | None = None
    done: list[str] = field(default_factory=list)


PARTS: tuple[str, ...] = ("ops", "precision", "fp8", "reduction", "loops")


def build_device_section(
    figures: Path,
    devices: Sequence[str],
    *,
    rehearsal: bool = False,
    quick: bool = False,
    judged: Sequence[object] | None = None,
    judge: Callable[[], Sequence[object]] | None = None,
    after_part: Callable[[DeviceSection], None] = lambda section: None,
) -> DeviceSection:
    """Run every part (:data:`PARTS`, in that order) and call ``after_part`` after each. The
    loops come from ``judged`` (the report's corpus rows) or, if None, from ``judge()``."""
    from wacc.report.device_ops import op_csv_rows, op_rows
    from wacc.report.reduction import ELEMENTS, WORLD_SIZES, reduction_report

    section = DeviceSection(devices=tuple(devices), rehearsal=rehearsal)
    cuda = "cuda" in devices
    where, label = ("cuda", "cuda") if cuda else ("cpu", REHEARSAL) if rehearsal else (None, "")

    def ops() -> list[Row]:
        return [
            _row(
                "ops",
                op["device"],
                op["op"],
                dtype=op["dtype"],
                rounding=op["rounding"],
                tail_rounding=op["tail_rounding"],
                max_ulps=op["max_ulps"],
            )  # fmt: skip
            for device in devices
            for op in op_csv_rows(op_rows(device))
        ]

    def precision() -> list[Row]:
        if where is None:
            why = "a CUDA setting; this run has no CUDA device (--device cpu)"
            return [_skipped("precision", "cpu", why)]
        return precision_rows(where, label=label)

    def fp8() -> list[Row]:
        if where is None:
            return [_skipped("fp8", "cpu", "CUDA FP8 GEMMs; this run has no CUDA device")]
        return fp8_rows(where, label=label)

    def reduction() -> list[Row]:
        elements = 64 if quick else ELEMENTS
        gloo, measured = gloo_rows(elements=elements)
        figures.mkdir(parents=True, exist_ok=True)
        section.figure, section.reduction = reduction_report(
            figures, world_sizes=(2, 3, 4, 8) if quick else WORLD_SIZES, elements=elements,
            measured=measured,  # type: ignore[arg-type]
        )  # fmt: skip
        return gloo

    def loops() -> list[Row]:
        return loop_rows(judged if judged is not None else (judge() if judge else ()))

    for name, part in zip(PARTS, (ops, precision, fp8, reduction, loops), strict=True):
        try:
            section.rows += part()
        except Exception as exc:  # one part's failure keeps the others' results
            traceback.print_exc()
            table = "gloo" if name == "reduction" else name
            section.rows.append(_row(table, ",".join(devices), "-",
                                     note=f"failed: {_error_text(exc)}"))  # fmt: skip
        section.done.append(name)
        after_part(section)
    return section


def _table(header: Sequence[str], keys: Sequence[str], rows: Sequence[Row]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row[key] for key in keys) + " |" for row in rows]
    return lines


# (table, title, text, header, keys)
_TABLES: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("ops", "Element-wise updates: the rounding each device took",
     "Seeded values of one sign (magnitudes 2^-1..2^1), 1031 elements: the first 1024 (a CPU "
     "kernel's vectorized body) and the last 7 (its scalar tail) classified apart. Scalar 1/3 "
     "(`add_(g, alpha=1/3)`, `mul_(1/3)`, `_foreach_add_(..., alpha=1/3)`, "
     "`addcmul_(t1, t2, value=1/3)`); GradScaler's `unscale_` op and SGD/AdamW (lr 0.1) under "
     "the loss scale 3, unfused (unscale by the float32 reciprocal, then step) and fused "
     "(`grad_scale` handed to the optimizer). A rounding is named when its exact model equals the "
     "device bit for bit on every element of the part (`=`: the models coincide there); `none` "
     "lists each model's share. `one rounding (FMA/opmath)`: the scalar in float32, the "
     "expression rounded once to float32, then to the dtype; `two roundings`: the scalar "
     "converted to the dtype first; `op-rounded`: every operation rounded to the dtype. Max ulps: "
     "from the exact result rounded once.",
     ("device", "op", "dtype", "rounding (first 1024)", "rounding (last 7)", "max ulps"),
     ("device", "name", "dtype", "rounding", "tail_rounding", "max_ulps")),
    ("precision", "Matmul precision: TF32 and reduced-precision reductions",
     "The gradient of the audit's `plain` model on its `unequal` window computed on the device, "
     "each CUDA precision setting a row: relative L2 error against the audit's float64 truth.",
     ("device", "dtype", "setting", "rel. L2 error", "note"),
     ("device", "dtype", "setting", "rel_error", "note")),
    ("fp8", "FP8 `torch._scaled_mm` against K",
     "32 x K times K x 32 float8_e4m3fn matrices of values in [0, 1), out_dtype float32 (the "
     "note says bfloat16 where the backend refuses float32): max relative error against the "
     "float64 product of the same values.",
     ("device", "K", "setting", "max rel. error", "note"),
     ("device", "name", "setting", "rel_error", "note")),
    ("gloo", "gloo measured beside the reduction models",
     "A real gloo all_reduce SUM of the reduction figure's values on this CPU (one process per "
     "rank), against the exact model of gloo's ring and the SUM bound.",
     ("ranks", "dtype", "against the model", "max rel. error", "note"),
     ("name", "dtype", "rounding", "rel_error", "note")),
    ("loops", "Training loops on each device",
     "The report's corpus on `wacc_torch` in every mode and on the baseline loops, per device: "
     "the headline's metrics (max ulps against the reproducible order's emulation, max relative "
     "error in the normal range, the verdict).",
     ("device", "implementation", "work dtype", "scenarios", "max ulps", "max rel. error",
      "verdict"),
     ("device", "name", "dtype", "setting", "max_ulps", "rel_error", "note")),
)  # fmt: skip


def device_markdown(
    rows: Sequence[Row],
    *,
    figure: str | None,
    csv_name: str,
    reduction_csv: str | None,
    rehearsal: bool,
    heading: str = "##",
) -> list[str]:
    """The section's markdown from its CSV rows (every table cell is a CSV cell, verbatim)."""
    parts = [f"{heading} Devices", ""]
    if rehearsal:
        parts += [
            f"**Rehearsal:** the CUDA-only parts ran on the CPU (device `{REHEARSAL}`): their "
            "numbers are the CPU's; the run proves the code path, not a GPU's behaviour.",
            "",
        ]
    parts += [f"Every table is `{csv_name}` (column `table`), cell for cell.", ""]
    for table, title, text, header, keys in _TABLES:
        chosen = [row for row in rows if row["table"] == table]
        if not chosen:
            continue
        parts += [f"{heading}# {title}", "", text, ""]
        parts += _table(header, keys, [r for r in chosen if not r["note"].startswith("skipped")])
        parts += [
            f"- {r['device']}: {r['note']}" for r in chosen if r["note"].startswith("skipped")
        ]
        parts.append("")
        if table == "gloo" and figure is not None:
            parts += [
                f"{heading}# Data-parallel reduction: its own rounding against world size",
                "",
                "Exact models (wacc_ref.reduction) of NCCL's ring and tree SUM in the data type, "
                "of NCCL's AVG (each value times round_T(1/N)), of gloo's ring, and of the sum "
                "divided once (wacc_torch); the gloo points measured above are drawn over them. "
                f"The table: `{reduction_csv}`.",
                "",
                f"![Data-parallel reduction]({figure})",
                "",
            ]
    return parts


def write_csv(rows: Sequence[Row], path: Path) -> Path:
    """``rows`` as CSV (:data:`DEVICE_CSV_FIELDS`), replaced atomically (a cut run keeps the last
    whole file)."""
    return _write_atomic(path, DEVICE_CSV_FIELDS, rows)


def write_reduction_csv(rows: Sequence[dict[str, str]], path: Path) -> Path:
    """The reduction table as CSV (:data:`wacc.report.reduction.REDUCTION_CSV_FIELDS`)."""
    from wacc.report.reduction import REDUCTION_CSV_FIELDS

    return _write_atomic(path, REDUCTION_CSV_FIELDS, rows)


def _write_atomic(path: Path, fields: Sequence[str], rows: Sequence[dict[str, str]]) -> Path:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temporary, path)
    return path


def read_csv(path: Path) -> list[Row]:
    """The rows of a ``device.csv``."""
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))
