"""GB/s rows (CUDA): each timed pass's achieved bandwidth against a device-to-device copy.

A pass's bytes are the whole passes over the buffers it must make (read a buffer and a gradient
and write the buffer: 3; ``finish_mean`` reads and writes the buffers: 2), over its median time;
the copy reads and writes each byte once (``torch._foreach_copy_`` of the same buffers, timed in
the same way), and each row's ratio is its rate over the copy's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from benchmarks.results import Row
from benchmarks.timing import Timed, interleaved_medians

D2D = "d2d copy"


def bandwidth_rows(
    suite: str,
    case: str,
    device: torch.device,
    bufs: list[torch.Tensor],
    medians: Mapping[str, float],
    traffic: Mapping[str, int],
    repeats: int,
) -> list[Row]:
    """The copy's row, then one per mode of ``traffic`` (passes) that ``medians`` timed."""
    nbytes = sum(b.numel() * b.element_size() for b in bufs)
    targets = [torch.empty_like(b) for b in bufs]
    copy_seconds = interleaved_medians(
        {D2D: Timed(lambda: torch._foreach_copy_(targets, bufs))}, device=device, repeats=repeats
    )[D2D]
    copy_rate = 2 * nbytes / copy_seconds / 1e9  # read and write each byte
    rows = [Row(suite, case, D2D, "float32", str(device), copy_rate, "GB/s")]
    for mode, passes in traffic.items():
        if mode not in medians:
            continue
        rate = passes * nbytes / medians[mode] / 1e9
        rows.append(
            Row(
                suite,
                case,
                mode,
                "float32",
                str(device),
                rate,
                "GB/s",
                ratio=rate / copy_rate,
                floor=D2D,
            )  # fmt: skip
        )
    return rows
