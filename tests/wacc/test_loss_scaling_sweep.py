"""wacc.report.loss_scaling: the sweep behind the report's dynamic loss scaling figure.

The decisions are derived without running either loop: a microbatch's gradient overflows the
backward's dtype G exactly when ``|S_eff · g| >= max_G + ulp_G(max_G) / 2`` for some element
(round to nearest even; ``S_eff`` is the scale the backward sees, a power of two times g is exact
in float32), and the reference scaler (wacc_ref, semantics §13) turns those overflows into skips.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from wacc.report import loss_scaling
from wacc.report.loss_scaling import GROWTH_INTERVAL, loss_scaling_sweep
from wacc_ref import formats
from wacc_ref.scaler import ReferenceLossScaler


def _overflow_threshold(dtype: str) -> float:
    """The smallest magnitude that rounds to inf in G: max + half an ulp of max."""
    fmt = formats.get_format(dtype)
    return float(Fraction(fmt.max_finite) + Fraction(2) ** (fmt.emax - fmt.precision))


def _expected_skips(
    dtype: str, length: int, init_scale: float, windows: int, *, divide: bool
) -> int:
    """Skips by the definition: the reference scaler fed found_inf from the data itself."""
    data = loss_scaling._windows(length, windows, length)  # the sweep's draw for seed 0
    threshold = _overflow_threshold(dtype)
    scaler = ReferenceLossScaler(init_scale, growth_interval=GROWTH_INTERVAL)
    skipped = 0
    for window in data:
        seen = scaler.scale / length if divide else scaler.scale
        found_inf = any(
            abs(seen * float(v)) >= threshold for m in window for v in m.gradient.tolist()
        )
        skipped += not scaler.update(found_inf)
    return skipped


def test_the_overflow_threshold_is_fp16s_65520() -> None:
    """The helper's threshold is the textbook one for float16 (65504 + 16)."""
    assert _overflow_threshold("float16") == 65520.0


@pytest.mark.parametrize("length", [1, 4])
def test_both_loops_skip_exactly_the_windows_the_definition_skips(length: int) -> None:
    """In float16, wacc_torch's loop skips the windows where S·g overflows for some microbatch
    and the GradScaler loop those where (S / accum_steps)·g does, window for window as the
    reference scaler decides; at the top scale both skip some, at 2^8 neither does."""
    windows = 30
    points = loss_scaling_sweep(
        grad_dtypes=("float16",), init_scales=(2.0**8, 2.0**24),
        window_lengths=(length,), windows=windows,
    )  # fmt: skip
    for point in points:
        expected = _expected_skips(
            "float16", length, point.init_scale, windows, divide=point.loop == "GradScaler"
        )
        assert point.skipped == expected, point
    assert {p.skipped > 0 for p in points if p.init_scale == 2.0**24} == {True}
    assert {p.skipped for p in points if p.init_scale == 2.0**8} == {0}


def test_bfloat16_never_skips_and_its_error_does_not_depend_on_the_scale() -> None:
    """bfloat16 has float32's range: no S up to 2^24 overflows these gradients (checked from the
    data), so nothing is skipped, and multiplying by a power of two changes no significand, so
    the accepted error is the same at every scale (no element is subnormal in bfloat16)."""
    windows = 12
    data = loss_scaling._windows(4, windows, 4)
    largest = max(abs(float(v)) for w in data for m in w for v in m.gradient.tolist())
    assert 2.0**24 * largest < _overflow_threshold("bfloat16")
    points = loss_scaling_sweep(
        grad_dtypes=("bfloat16",), init_scales=(1.0, 2.0**24), window_lengths=(4,),
        windows=windows,
    )  # fmt: skip
    assert [p.skipped for p in points] == [0, 0, 0, 0]
    for loop in loss_scaling.LOOPS:
        low, high = (p.median_error for p in points if p.loop == loop)
        assert low == high, loop


def test_wacc_torch_is_within_one_float16_rounding_where_nothing_underflows() -> None:
    """With one microbatch per window, every element whose S·g is a normal float16 comes back
    within u_fp16 = 2^-11 (the backward's one rounding) plus the float32 steps (multiply by w,
    divide by S and by W: 3 roundings of 2^-24) of the exact value; the loop with token
    weights and the sweep's exact mean agree on what the truth is."""
    data = loss_scaling._windows(1, 10, 1)
    model = loss_scaling._Model(torch.float16)
    results = loss_scaling._run_wacc(model, data, 2.0**12)
    bound = 2.0**-11 + 3 * 2.0**-24 + 2.0**-35  # (the product of the (1 + δ)s, to first order)
    checked = 0
    for window, result in zip(data, results, strict=True):
        assert result is not None  # 2^12 overflows nothing here
        exact = loss_scaling._exact_mean(window)
        for value, truth in zip(result.tolist(), exact, strict=True):
            if truth != 0 and abs(2.0**12 * truth) >= 2.0**-14:  # normal in float16
                assert abs(value - truth) / abs(truth) <= bound
                checked += 1
    assert checked > 300  # most of the 640 elements


def test_every_point_has_its_share_and_a_finite_error_when_a_window_was_accepted() -> None:
    """The points cover loop x dtype x scale x length once each; a share is skipped / windows."""
    points = loss_scaling_sweep(init_scales=(1.0, 2.0**24), window_lengths=(1, 2), windows=4)
    keys = {(p.loop, p.grad_dtype, p.init_scale, p.window_length) for p in points}
    assert len(keys) == len(points) == 2 * 2 * 2 * 2
    for point in points:
        assert point.skipped_share == point.skipped / 4
        assert math.isnan(point.median_error) == (point.skipped == 4)
