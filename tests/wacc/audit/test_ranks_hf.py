"""``transformers.Trainer`` and accelerate across two data-parallel ranks: each a real
``torch.distributed.run`` world (gloo, CPU) whose ranks read windows of different token totals
(211 and 17, one with a zero-token microbatch); what every rank hands its optimizer is compared
with the float64 gradient of the mean token loss over both ranks' tokens and with what a loop that
weighs ranks (or microbatches) alike computes (the `frameworks` extra; skipped without it)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.typing import NDArray

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.expected import (  # noqa: E402
    assert_close_to_prediction,
    assert_rel_l2_matches,
)
from tests.wacc.audit.ranks_driver import (  # noqa: E402
    Expected,
    RankResult,
    expected,
    rank_windows,
    run_world,
)
from wacc.audit.adapters import accelerate, trainer  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
ROUNDING = "float64"  # float64 runs: what differs only in the order of float64 additions
# A float64 run through transformers' own loss (ForCausalLMLoss: ``logits.float()``, a cast down
# to float32) or Llama's float32 RMSNorm is float32-accurate only.
FLOAT32_LOSS = "float32"


def _label_count(rank: int) -> int:
    """Rank ``rank``'s labels != -100, unshifted (what accelerate's guide and Trainer count for a
    model whose loss type Trainer cannot map, GPT-2's): the true count plus one per sequence."""
    window = rank_windows(WORLD)[rank]
    return sum(int(mb["labels"].ne(-100).sum()) for mb in window.microbatches)


def _agree(results: list[RankResult]) -> None:
    """Every rank handed its optimizer the same gradient, after reading its own window whole."""
    assert all(r.steps_seen == 1 for r in results)
    assert all(r.fetched == [0, 1, 2, 3] for r in results)
    for other in results[1:]:
        np.testing.assert_array_equal(other.gradient, results[0].gradient)


def _divided_by_gathered_count(loop: str, tolerance: str) -> tuple[Expected, NDArray[np.float64]]:
    """Runs ``wacc.audit.adapters.<loop>`` (GPT-2) across the ranks; checks that every rank
    reports and divides by the unshifted label count gathered over all ranks, C:
    Σ_r Σ_k g_rk / C to ``tolerance``'s rounding.  Returns the truth and the measured gradient."""
    results = run_world(f"wacc.audit.adapters.{loop}", WORLD)
    _agree(results)
    want = expected("gpt2", WORLD)
    gathered = _label_count(0) + _label_count(1)
    assert [r.counted for r in results] == [gathered, gathered]
    as_counted = np.sum(want.rank_sums, axis=0) / gathered
    bound = want.divided_by_bound([gathered / WORLD] * WORLD, tolerance)
    assert_close_to_prediction(results[0].gradient, as_counted, bound)
    return want, results[0].gradient


def test_trainer_average_tokens_across_devices_weighs_every_token() -> None:
    """With ``average_tokens_across_devices`` (5.x default) Trainer gathers the window's count over
    the ranks and multiplies each rank's loss by the world size, so DDP's mean gives
    Σ_r Σ_k g_rk / C exactly (C the gathered count): the ranks weigh by their tokens, not alike;
    GPT-2's count is the unshifted one (one per sequence too many), the error that remains."""
    assert trainer.HUB.ranks is True
    want, gradient = _divided_by_gathered_count("trainer:HUB", FLOAT32_LOSS)
    assert want.rel(gradient) < 0.05 < want.predicted_equal_ranks


def test_trainer_rank_tokens_weighs_ranks_alike() -> None:
    """``average_tokens_across_devices=False``: each rank divides by its own count and DDP averages
    the ranks, mean_r Σ_k g_rk / T_r: the error predicted from the per-rank totals (211 and 17)
    measured to rounding (Llama: Trainer counts its shifted labels, the true totals)."""
    assert trainer.LLAMA_RANK_TOKENS.ranks is True
    results = run_world("wacc.audit.adapters.trainer:LLAMA_RANK_TOKENS", WORLD)
    _agree(results)
    want = expected("llama", WORLD)
    assert [r.counted for r in results] == list(want.rank_tokens) == [211, 17]
    bound = want.divided_by_bound(want.rank_tokens, FLOAT32_LOSS)
    assert_close_to_prediction(results[0].gradient, want.equal_ranks, bound)
    measured = want.rel(results[0].gradient)
    assert_rel_l2_matches(measured, want.predicted_equal_ranks, bound, want.truth)
    assert want.predicted_equal_ranks > 1  # a FAIL, not a rounding


def test_accelerate_accumulate_weighs_microbatches_alike() -> None:
    """``accumulate()`` under DDP: ``loss / K`` per microbatch mean, ``no_sync`` until the K-th
    batch, DDP's mean over ranks: every microbatch of every rank weighs 1 / (N K), the error
    predicted from the microbatch counts, to the float32 rounding of transformers' loss."""
    assert accelerate.ACCUMULATE.ranks is True
    results = run_world("wacc.audit.adapters.accelerate:ACCUMULATE", WORLD)
    _agree(results)
    want = expected("gpt2", WORLD)
    assert [r.counted for r in results] == [None, None]
    bound = want.equal_microbatches_bound(FLOAT32_LOSS)
    assert_close_to_prediction(results[0].gradient, want.equal_microbatches, bound)
    assert want.rel(results[0].gradient) > 1


def test_accelerate_variable_size_guide_gathers_the_count() -> None:
    """The variable-size guide under DDP: the count gathered over the ranks, the loss sum times
    K·N over it, ``no_sync`` but on the last batch: Σ_r Σ_k g_rk / C, exactly as counted (C
    the guide's unshifted count: its remaining error is that count's, not the ranks')."""
    assert accelerate.VARIABLE.ranks is True
    _divided_by_gathered_count("accelerate:VARIABLE", ROUNDING)
