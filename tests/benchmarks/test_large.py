"""The `large` suite's bandwidth rows (CUDA only), computed on the CPU from known medians."""

from __future__ import annotations

import torch

from benchmarks.bandwidth import D2D, bandwidth_rows
from benchmarks.large import FLOOR, SUITE, TRAFFIC


def test_bandwidth_rows_count_the_bytes_each_pass_moves() -> None:
    """GB/s = passes x buffer bytes / median seconds, and each ratio is that over the measured
    device-to-device copy's GB/s (read and write of every buffer byte)."""
    bufs = [torch.zeros(1000) for _ in range(4)]  # 16000 bytes
    medians = {FLOOR: 2e-6, "accumulate_sum": 4e-6, "accumulate_mean": 6e-6, "finish_mean": 1e-6}
    rows = bandwidth_rows(SUITE, "c", torch.device("cpu"), bufs, medians, TRAFFIC, 3)
    by_mode = {row.mode: row for row in rows}
    assert list(by_mode) == [D2D, FLOOR, "accumulate_sum", "accumulate_mean", "finish_mean"]
    copy_rate = by_mode[D2D].value
    assert copy_rate is not None and copy_rate > 0 and by_mode[D2D].ratio is None
    nbytes = 16000
    for mode, passes in ((FLOOR, 3), ("accumulate_sum", 3), ("accumulate_mean", 3)):
        assert by_mode[mode].value == passes * nbytes / medians[mode] / 1e9
        assert by_mode[mode].ratio == by_mode[mode].value / copy_rate
    assert by_mode["finish_mean"].value == 2 * nbytes / 1e-6 / 1e9
    assert all(row.unit == "GB/s" and row.floor in ("", D2D) for row in rows)
