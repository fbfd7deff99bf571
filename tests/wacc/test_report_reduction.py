"""The report's reduction section (wacc.report.reduction): the figure renders, and the table holds
what the exact models give, recomputed here from the rank values with rationals."""

from __future__ import annotations

import csv
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from wacc.report.reduction import (
    REDUCTION_CSV_FIELDS,
    reduction_report,
    reduction_values,
)
from wacc_ref import reduction as R

WORLD_SIZES = (2, 3, 4)
ELEMENTS = 24


def _row(rows: list[dict[str, str]], dtype: str, n: int, model: str) -> dict[str, str]:
    (row,) = (
        r for r in rows if (r["dtype"], r["world_size"], r["model"]) == (dtype, str(n), model)
    )
    return row


def test_reduction_section_renders_and_its_table_matches_the_models(tmp_path: Path) -> None:
    """The PNG is written and readable; one row per dtype x world size x model; each relative
    error equals the one recomputed here (exact mean from Fractions of the rank values); every
    model within its bound; NCCL's AVG carries +1/512 for bfloat16 at N = 3 and coincides with
    the sum divided once where N is a power of two."""
    figure, rows = reduction_report(tmp_path, world_sizes=WORLD_SIZES, elements=ELEMENTS)
    assert figure == tmp_path / "reduction_error.png"
    with Image.open(figure) as image:
        assert image.width >= 1000 and image.height >= 400
    assert len(rows) == 3 * len(WORLD_SIZES) * 5
    assert all(tuple(row) == REDUCTION_CSV_FIELDS for row in rows)
    with (tmp_path / "table.csv").open("w", newline="") as handle:  # a CSV writer takes them
        writer = csv.DictWriter(handle, fieldnames=REDUCTION_CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert all(float(row["max_error_over_bound"]) <= 1 for row in rows)
    for dtype in ("float16", "bfloat16", "float32"):
        for n in WORLD_SIZES:
            values = reduction_values(dtype, n, elements=ELEMENTS)
            exact_mean = [
                sum(map(Fraction, column), Fraction(0)) / n for column in values.T.tolist()
            ]
            avg = R.nccl_avg(values, dtype)
            relative = [
                abs((Fraction(a) - m) / m) for a, m in zip(avg.tolist(), exact_mean, strict=True)
            ]
            row = _row(rows, dtype, n, "nccl_avg")
            assert float(row["max_rel_error"]) == float(max(relative)), (dtype, n)
            assert float(row["median_rel_error"]) == float(np.median([float(r) for r in relative]))
            if n in (2, 4):
                divided = _row(rows, dtype, n, "sum_then_divide")
                assert divided["max_rel_error"] == row["max_rel_error"], (dtype, n)
    assert Fraction(_row(rows, "bfloat16", 3, "nccl_avg")["avg_factor_bias"]) == Fraction(1, 512)
    assert _row(rows, "bfloat16", 3, "ring_sum")["avg_factor_bias"] == "0"
