"""The ``+wacc`` rows across two data-parallel ranks (``wacc audit --world-size 2``: real gloo
worlds on the CPU): each reduces the window's sums and weights once across the ranks (semantics
§7), so every rank hands its optimizer the same token-weighted mean over both ranks' tokens, and a
float16 overflow on one rank skips the window on every rank.  The pixparse loop's own DDP idiom
weighs every microbatch of every rank alike.  The Lightning and DeepSpeed rows need their extras
(``tox -e audit-extras``; skipped without them); nanoGPT's and pixparse's need torch alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests.wacc.audit.expected import assert_close_to_prediction
from tests.wacc.audit.ranks_driver import expected, run_world, run_world_fp16
from wacc.audit.adapters import ADAPTERS
from wacc.audit.runner import run_audit
from wacc.audit.windows import build_window

pytestmark = pytest.mark.slow

WORLD = 2
# The torch-only rows need no extra, but each is two 2-process worlds (a minute on 2 cores): CI
# (a 25-minute budget) leaves them to tox -e audit-extras, which installs lightning with the other
# extras; CI's own across-ranks worlds are the pixparse DDP test below, test_ranks.py and
# tests/wacc_torch/integrations/test_ranks.py.
_EXTRAS_ONLY = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="two 2-process worlds per row: tox -e audit-extras runs them (CI's time budget)",
)
TORCH_ONLY = [pytest.param(loop, marks=_EXTRAS_ONLY) for loop in ("nanogpt+wacc", "pixparse+wacc")]
EXTRAS = ["lightning+wacc", "lightning-manual+wacc", "deepspeed+wacc"]
# The module each row's ``run`` lives in, for the float16 worlds (module:ATTR).
SPECS = {
    "nanogpt+wacc": "wacc.audit.adapters.nanogpt_wacc:ADAPTER",
    "pixparse+wacc": "wacc.audit.adapters.pixparse_wacc:ADAPTER",
    "lightning+wacc": "wacc.audit.adapters.lightning_wacc:AUTOMATIC",
    "lightning-manual+wacc": "wacc.audit.adapters.lightning_wacc:MANUAL",
    "deepspeed+wacc": "wacc.audit.adapters.deepspeed_wacc:ADAPTER",
}


def _available(loop: str) -> None:
    missing = ADAPTERS[loop].unavailable()
    if missing is not None:
        pytest.skip(f"{loop}: {missing}")


@pytest.mark.parametrize("loop", [*TORCH_ONLY, *EXTRAS, "deepspeed-zero1+wacc"])
def test_wacc_row_passes_every_window_across_ranks(loop: str) -> None:
    """At world size 2 the row runs (``ranks=True``) and passes on the unequal rank windows
    (211 and 17 tokens, one zero-token microbatch; the equal window is the committed audit's):
    every rank divided by the tokens of both ranks together and handed its optimizer the same
    gradient, bit for bit, within the audit's bound of the float64 truth."""
    _available(loop)
    adapter = ADAPTERS[loop]
    assert adapter.ranks is True
    windows = [build_window("unequal")]  # one window: each is a 2-process world, three runs
    result = run_audit([adapter], windows, world_size=WORLD)
    for cell in result.cells:
        assert cell.status == "ok", cell.status
        total = float(sum(cell.rank_tokens))
        assert cell.rank_counted == (total, total), (cell.window, cell.rank_counted)
        assert cell.ranks_agree is True, (cell.window, cell.rank_spread)
        assert cell.verdict == "pass", (cell.window, cell.semantic_ratio)


@pytest.mark.parametrize("loop", [*TORCH_ONLY, *EXTRAS])
def test_wacc_row_skips_a_one_rank_overflow_on_every_rank(loop: str) -> None:
    """The float16 path across two ranks, the overflow spike in rank 0's window only: the
    reduced window overflows on every rank, so no rank applies it (the parameters stay a fresh
    model's) and every rank's scaler backs off alike."""
    _available(loop)
    results = run_world_fp16(SPECS[loop], WORLD)
    assert [r.spike_overflowed for r in results] == [True, False]  # the overflow is rank 0's alone
    assert [r.changed for r in results] == [False, False]
    scales = {r.loss_scales for r in results}
    assert len(scales) == 1, scales
    (pair,) = scales
    assert pair is not None and pair[1] < pair[0]


def test_pixparse_ddp_weighs_every_microbatch_alike() -> None:
    """The pixparse loop's own DDP idiom (``no_sync`` but on the window's last microbatch,
    ``loss /= accum_steps`` on each mean, DDP's average of the ranks): every microbatch of every
    rank weighs 1 / (N K), the equal-microbatch prediction to rounding, far from the truth; the
    ranks agree."""
    adapter = ADAPTERS["pixparse"]
    assert adapter.ranks is True and adapter.weighs_ranks_equally is False
    results = run_world("wacc.audit.adapters.timm:PIXPARSE", WORLD)
    assert all(r.steps_seen == 1 and r.fetched == [0, 1, 2, 3] for r in results)
    np.testing.assert_array_equal(results[1].gradient, results[0].gradient)
    want = expected("plain", WORLD)
    bound = want.equal_microbatches_bound("float64")  # a float64 run: float64 rounding only
    assert_close_to_prediction(results[0].gradient, want.equal_microbatches, bound)
    assert want.rel(results[0].gradient) > 1


def test_keras_rows_say_why_they_run_on_one_rank_only() -> None:
    """Both Keras rows give the reason they never run across ranks, and the Keras source it
    cites says so: on the torch backend ``distribution_lib`` is None (no data-parallel path)."""
    for loop in ("keras", "keras+wacc"):
        why = ADAPTERS[loop].ranks_unavailable(WORLD)
        assert why is not None and "distribution_lib = None" in why, why
    spec = importlib.util.find_spec("keras")
    if spec is None or spec.origin is None:
        pytest.skip("keras is not installed")
    lines = (Path(spec.origin).parent / "src/backend/__init__.py").read_text().splitlines()
    cited = "\n".join(lines[42:47])  # lines 43-47, as the reason cites them
    assert 'backend() == "torch"' in cited and "distribution_lib = None" in cited, cited
