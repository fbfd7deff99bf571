"""The ``step`` suite: a quick run times every mode, the ``sum`` diagnostics included."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import step
from benchmarks.settings import Settings

QUICK = Settings(quick=True, devices=(torch.device("cpu"),), repeats=1, out=Path("unused"))


def test_quick_step_rows_time_the_mean_modes_and_their_sum_rows() -> None:
    """Per variant: the plain loop, the two mean modes (with their targets) and the two ``sum``
    rows (no target), each a ratio to the plain loop."""
    rows = step.run(QUICK)
    for variant in ("float32", "fp16-autocast"):
        got = {row.mode: row for row in rows if row.dtype == variant}
        assert list(got) == [*step.MODES, *step.SUM_MODES]
        assert got["plain"].ratio == 1.0 and got["plain"].floor == ""
        for mode in (*step.MODES[1:], *step.SUM_MODES):
            assert got[mode].ratio is not None and got[mode].value is not None
            assert got[mode].target == step.TARGETS.get(mode)
        assert all(got[mode].target is None for mode in step.SUM_MODES)
