"""The report's device section (wacc.report.device_ops, wacc.report.device_section): the rounding
each element-wise update took, classified against exact models and checked against what the CPU
is known to do; the section's tables against its CSV; the CLI's refusals; CUDA's half where a
device is present."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.wacc.test_cli import wacc
from wacc.report.device_ops import BODY, ONE, OP, TWO, OpRow, classify, op_rows
from wacc.report.device_section import DEVICE_CSV_FIELDS, read_csv

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()


def _op(rows: list[OpRow], op: str, dtype: str) -> OpRow:
    (row,) = (r for r in rows if (r.op, r.dtype) == (op, dtype))
    return row


@pytest.fixture(scope="module")
def cpu_rows() -> list[OpRow]:
    """The section's element-wise rows on the CPU, float16 and bfloat16."""
    return op_rows("cpu", dtypes=("float16", "bfloat16"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cpu_add_with_alpha_rounds_alpha_to_the_dtype_first(
    cpu_rows: list[OpRow], dtype: str
) -> None:
    """PyTorch's CPU ``add_(other, alpha=1/3)`` on float16/bfloat16 reads alpha as the tensor's
    dtype (vectorized body): the section says "two roundings" for the body, and the experiment
    here agrees: the body equals ``x + half(alpha)·y`` computed in float32 and rounded to the
    dtype, and differs from the float32-alpha (opmath) result somewhere."""
    torch_dtype = getattr(torch, dtype)
    row = _op(cpu_rows, "add_(alpha)", dtype)
    assert row.rounding == TWO
    assert _op(cpu_rows, "_foreach_add_(alpha)", dtype).rounding == TWO
    generator = torch.Generator().manual_seed(7)
    x = (torch.rand(BODY, generator=generator) + 0.5).to(torch_dtype)
    y = (torch.rand(BODY, generator=generator) + 0.5).to(torch_dtype)
    result = x.clone().add_(y, alpha=1 / 3)
    alpha_in_dtype = torch.tensor(1 / 3).to(torch_dtype).float()
    # A product of two float16/bfloat16 values is exact in float32: one rounding of the sum.
    two = (x.float() + alpha_in_dtype * y.float()).to(torch_dtype)
    opmath = x.double() + torch.tensor(1 / 3, dtype=torch.float32).double() * y.double()
    assert torch.equal(result, two)
    assert not torch.equal(result, opmath.float().to(torch_dtype))


def test_cpu_scalar_tail_is_op_rounded_and_add_without_alpha_is_correctly_rounded(
    cpu_rows: list[OpRow],
) -> None:
    """The CPU kernel's scalar tail computes ``a + alpha * b`` on c10::Half/BFloat16, each
    operation rounded to the dtype: "op-rounded" is among the tail's names; ``add_`` without
    alpha is one correctly rounded sum (0 ulps from exact, every model alike)."""
    for dtype in ("float16", "bfloat16"):
        assert OP in _op(cpu_rows, "add_(alpha)", dtype).tail_rounding.split(" = ")
        plain = _op(cpu_rows, "add_", dtype)
        assert plain.max_ulps == 0.0
        assert plain.rounding.split(" = ") == [ONE, TWO, OP]


def test_classify_names_every_equal_model_and_otherwise_the_shares() -> None:
    """A model equal on every element is named (several joined with " = "); none equal gives
    each model's share; -0.0 and +0.0 are different bits."""
    result = np.array([1.0, 2.0, -0.0])
    assert classify(result, {"a": result.copy(), "b": np.array([1.0, 2.0, 0.0])}) == "a"
    assert classify(result, {"a": result.copy(), "b": result.copy()}) == "a = b"
    assert classify(result, {"a": np.array([1.0, 3.0, -0.0]), "b": np.zeros(3)}) == (
        "none (a 2/3, b 0/3)"
    )


def _tables(markdown: str) -> list[list[str]]:
    """Every data row of every markdown table (cells stripped)."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def check_tables_match_csv(markdown: str, csv_path: Path) -> None:
    """Every CSV row of the ops, precision and fp8 tables is a markdown row, cell for cell, and
    every markdown row of the section is a CSV row or a header."""
    rows = read_csv(csv_path)
    assert rows and tuple(rows[0]) == DEVICE_CSV_FIELDS
    shown = _tables(markdown)
    keys = {
        "ops": ("device", "name", "dtype", "rounding", "tail_rounding", "max_ulps"),
        "precision": ("device", "dtype", "setting", "rel_error", "note"),
        "fp8": ("device", "name", "setting", "rel_error", "note"),
        "gloo": ("name", "dtype", "rounding", "rel_error", "note"),
        "loops": ("device", "name", "dtype", "setting", "max_ulps", "rel_error", "note"),
    }
    expected = [
        [row[key] for key in keys[row["table"]]]
        for row in rows
        if not row["note"].startswith("skipped")
    ]
    for cells in expected:
        assert cells in shown, cells
    headers = [cells for cells in shown if cells not in expected]
    assert all(cells[0] in ("device", "ranks") for cells in headers), headers


def test_a_cut_device_section_keeps_its_finished_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wacc report --device-only`` cut while its second part runs: the device check's time cap
    sends SIGINT, which Python raises as KeyboardInterrupt where the run is; raised here inside
    the precision part, so the cut lands in the same place on any machine (a SIGINT timed from
    outside once arrived after the ~0.1 s the later parts take on a fast CPU). Exit 130;
    device.md and device.csv hold the ops part, parse, agree, and say which parts were not
    done."""
    from wacc import cli
    from wacc.report import device_section

    def cut(*args: object, **kwargs: object) -> list[object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(device_section, "precision_rows", cut)
    out = tmp_path / "device"
    code = cli.main(
        ["report", "--device-only", "--rehearsal", "--quick", "--quiet", "--out", str(out)]
    )
    assert code == 130
    markdown = (out / "device.md").read_text(encoding="utf-8")
    assert "not done (cut or still running)" in markdown
    assert "loops" in markdown.split("not done", 1)[1]
    tables = {row["table"] for row in read_csv(out / "device.csv")}
    assert "ops" in tables and "loops" not in tables
    check_tables_match_csv(markdown, out / "device.csv")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--device", "all", "--rehearsal"], "--rehearsal"),
        (["--device-only", "--impl", "tests.wacc.impls:double_unscale"], "--device-only"),
    ],
)
def test_the_device_options_refuse_what_they_cannot_do(
    tmp_path: Path, args: list[str], says: str
) -> None:
    """--rehearsal with a CUDA device asked for, --device-only with an --impl: one line on
    stderr naming the option, exit 2, nothing written."""
    result = wacc("report", "--quick", "--out", str(tmp_path / "r"), *args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(CUDA, reason="this machine has a CUDA device")
def test_cuda_asked_for_without_one_is_a_usage_error(tmp_path: Path) -> None:
    """--device cuda / all where torch sees no CUDA device: one line, exit 2 (documented)."""
    for device in ("cuda", "all"):
        result = wacc("report", "--device-only", "--device", device, "--out", str(tmp_path))
        assert result.returncode == 2 and "no CUDA device" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_add_with_alpha_keeps_alpha_in_opmath() -> None:
    """On CUDA, ``add_(g, alpha=1/3)`` in float16/bfloat16 keeps alpha in float32 and rounds
    once (PyTorch's opmath kernels, nvcc's FMA contraction): "one rounding" on every element,
    unlike the CPU; every op of the section runs (no "not run" row)."""
    rows = op_rows("cuda")
    assert not [r for r in rows if r.rounding.startswith("not run")]
    for dtype in ("float16", "bfloat16"):
        (row,) = (r for r in rows if (r.op, r.dtype) == ("add_(alpha)", dtype))
        assert ONE in row.rounding.split(" = ") and TWO not in row.rounding.split(" = ")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_precision_and_fp8_rows_run() -> None:
    """The CUDA-only parts run on a CUDA device without a failed row; with TF32 on, the float32
    gradient is further from the truth than with it off."""
    from wacc.report.device_section import fp8_rows, precision_rows

    rows = precision_rows("cuda")
    assert not [r for r in rows if r["note"].startswith("failed")]
    tf32 = {r["setting"]: float(r["rel_error"]) for r in rows if r["dtype"] == "float32"}
    assert tf32["TF32 on (matmul and cuDNN)"] > tf32["TF32 off"]
    fp8 = fp8_rows("cuda", ks=(256,))
    assert not [r for r in fp8 if r["note"].startswith("failed")]
    with open(os.devnull, "w", newline="") as sink:  # the rows are CSV rows
        csv.DictWriter(sink, fieldnames=DEVICE_CSV_FIELDS).writerows(rows + fp8)
