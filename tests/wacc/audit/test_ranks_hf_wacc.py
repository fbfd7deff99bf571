"""The ``+wacc`` rows of ``transformers.Trainer`` and accelerate across two data-parallel ranks:
``WaccTrainer`` and ``WaccAccumulation`` under DDP (real torchrun worlds, gloo, CPU; the
`frameworks` extra, skipped without it).

One CLI run (a subprocess, as a user runs it) of every such row (in CI one; all, and the float16
worlds, under tox -e audit-extras) at ``--world-size 2`` on the
``unequal`` rank windows (211 and 17 tokens, one rank with a zero-target microbatch): each passes,
divides by the global count on every rank and hands every rank's optimizer the same bits.  The
float16 path across ranks runs on the overflow window spiked on rank 0 only: every rank skips it
(the scaler decides on the reduced values), and its clean twin is applied on every rank.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.ranks_driver import run_world_fp16  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
ALL_ROWS = (
    "trainer-hub+wacc",
    "trainer-hub-ranktok+wacc",
    "trainer-llama-ranktok+wacc",
    "trainer-bert+wacc",
    "trainer-t5+wacc",
    "trainer-plain+wacc",
    "accelerate+wacc",
    "accelerate-variable+wacc",
)
# CI (the frameworks extra, 2 cores, a 25-minute budget) runs one row through the audit (the
# integrations' own worlds are tests/wacc_torch/integrations/test_ranks.py); tox -e audit-extras
# (which installs lightning with the other extras) runs them all: every world here is two
# processes run three times, minutes each on GPT-2.
EVERY_ROW = importlib.util.find_spec("lightning") is not None
ROWS = ALL_ROWS if EVERY_ROW else ("accelerate+wacc",)
_EXTRAS_ONLY = pytest.mark.skipif(
    not EVERY_ROW, reason="a float16 world per row: tox -e audit-extras runs it (CI's time budget)"
)
FP16_LOOPS = [
    pytest.param(loop, marks=_EXTRAS_ONLY)
    for loop in ("trainer_wacc:HUB", "accelerate_wacc:ACCUMULATE")
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """``wacc audit <ROWS> --world-size 2 --windows unequal``: audit.csv's rows by loop."""
    tmp = tmp_path_factory.mktemp("ranks-wacc")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", *ROWS, "--world-size", "2", "--windows",
         "unequal", "--out", str(tmp / "out"), "--quiet"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (tmp / "out" / "audit.csv").open(newline="", encoding="utf-8") as handle:
        return {row["loop"]: row for row in csv.DictReader(handle)}


@pytest.mark.parametrize("loop", ROWS)
def test_the_fix_passes_across_ranks(loop: str, rows: dict[str, dict[str, str]]) -> None:
    """The row runs at world size 2 and passes: every rank divided by the global count (211 +
    17 = 228), the float64 run is the token mean over both ranks' tokens to rounding, and the
    ranks handed their optimizers the same bits, twice alike."""
    assert ADAPTERS[loop].ranks is True
    row = rows[loop]
    assert (row["world_size"], row["rank_tokens"], row["verdict"]) == ("2", "211;17", "pass")
    assert row["rank_tokens_counted"] == "228.0;228.0"
    assert row["ranks_agree"] == "True" and row["deterministic"] == "True"
    assert float(row["f64_err_over_bound"]) <= 1.0


@pytest.mark.parametrize("loop", FP16_LOOPS)
def test_an_overflow_on_one_rank_skips_the_window_on_every_rank(loop: str) -> None:
    """The float16 path (float16 autocast, a WindowLossScaler at 2**12) with the overflow spike
    on rank 0 only: both ranks leave their parameters unchanged and halve the scale (the scaler
    reads the reduced sums, the same bits everywhere); the clean window moves the parameters on
    both ranks and keeps the scale."""
    spec = f"wacc.audit.adapters.{loop}"
    spiked = run_world_fp16(spec, 2)
    assert [r.spike_overflowed for r in spiked] == [True, False]  # rank 1's own data is clean
    assert [(r.changed, r.loss_scales) for r in spiked] == [(False, (4096.0, 2048.0))] * 2
    clean = run_world_fp16(spec, 2, spike=False)
    assert [(r.changed, r.loss_scales) for r in clean] == [(True, (4096.0, 4096.0))] * 2
