r"""The integrations across two data-parallel ranks (real torchrun worlds, gloo, CPU; the
``frameworks`` extra): ``WaccAccumulation`` in accelerate's ``accumulate()`` loop and
``WaccTrainer.train()``, each under DDP, on a token-level ``nn.Linear`` classifier whose ranks hold
211 and 17 tokens (rank 1 with a zero-token microbatch).

What every rank hands its optimizer is compared with the float64 gradient of the mean loss over
both ranks' 228 tokens, within the error bound of ``tests/wacc_torch/test_training_loop.py``
(constants from ``wacc_ref.bounds``) taken over all eight microbatches as one window: each rank
adds its four contributions in float32 (three additions), the SUM all-reduce of two ranks adds once
more (seven additions for eight terms: the γ_8 of an eight-microbatch window), the loss scale is 1
and the division by the global count one rounding, as in one process.  The bound is tight enough to
reject DDP's mean of the two ranks' token means (checked here too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

from tests.wacc_torch.integrations.ranks_worker import (  # noqa: E402
    RANK_TOKENS,
    build_model,
    rank_data,
    run_ranks,
)
from tests.wacc_torch.test_training_loop import _ratio, _window_bound  # noqa: E402

pytestmark = pytest.mark.slow

TOTAL = sum(sum(tokens) for tokens in RANK_TOKENS)  # 228


def _everything() -> tuple[torch.Tensor, torch.Tensor, list[slice]]:
    """Both ranks' microbatches end to end (rank 0's first) and each microbatch's slice."""
    batches = [b for rank in range(len(RANK_TOKENS)) for b in rank_data(rank)]
    slices, start = [], 0
    for inputs, _ in batches:
        slices.append(slice(start, start + len(inputs)))
        start += len(inputs)
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]), slices


def _truth(inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 gradient of the mean loss over ``labels`` (every target counted once)."""
    model = build_model().to(torch.float64)
    F.cross_entropy(model(inputs.to(torch.float64)), labels).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]


def _bound(inputs: torch.Tensor, labels: torch.Tensor, slices: list[slice]) -> dict[str, Any]:
    """The float32 eight-microbatch window's bound plus the float64 truth's own (module doc)."""
    model = build_model()
    windowed = _window_bound(model, inputs, labels, "float32", slices)
    full = _window_bound(model, inputs, labels, "float64", [slice(0, len(labels))])
    return {name: windowed[name] + full[name] for name in windowed}


def _check(results: list[dict[str, Any]]) -> None:
    """Every rank divided by 228 and handed its optimizer the same bits, within the bound of the
    float64 token mean over both ranks; DDP's mean of per-rank token means is not."""
    inputs, labels, slices = _everything()
    truth, bound = _truth(inputs, labels), _bound(inputs, labels, slices)
    assert [r["window_tokens"] for r in results] == [TOTAL, TOTAL]
    for name in truth:
        np.testing.assert_array_equal(results[1]["grads"][name], results[0]["grads"][name])
    ratio = _ratio({n: g for n, g in results[0]["grads"].items()}, truth, bound)
    assert ratio <= 1.0, f"error/bound = {ratio}"
    per_rank = []  # what DDP's average of each rank's own token mean would hand the optimizer
    for rank in range(len(RANK_TOKENS)):
        data = rank_data(rank)
        per_rank.append(_truth(torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])))
    equal_ranks = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in truth}
    assert _ratio(equal_ranks, truth, bound) > 1.0  # the bound tells the weightings apart


def test_accelerate_window_is_the_token_mean_over_both_ranks() -> None:
    """``WaccAccumulation`` in the ``accumulate()`` loop under DDP: the window ends on the 4th
    microbatch on both ranks, and its gradient is the token mean over both ranks' tokens (sums
    and counts reduced once), the same bits on every rank."""
    results = run_ranks("accelerate")
    assert all(r["steps"] == [None, None, None, True] for r in results)
    _check(results)


def test_trainer_window_is_the_token_mean_over_both_ranks() -> None:
    """``WaccTrainer.train()`` under torchrun (the Trainer's own DDP wrapping and sharding):
    every rank's optimizer gets the token mean over both ranks' tokens, the same bits."""
    _check(run_ranks("trainer"))


def test_a_window_without_targets_on_any_rank_is_skipped_on_every_rank() -> None:
    """Not a single target on any rank: every rank's window finishes without a step (False),
    every ``.grad`` stays None and the global count is 0, with no rank left waiting."""
    results = run_ranks("empty")
    for result in results:
        assert result["steps"] == [None, None, None, False]
        assert result["window_tokens"] == 0.0
        assert all(g is None for g in result["grads"].values())


def test_a_mid_window_save_state_keeps_every_ranks_window() -> None:
    """``accelerator.save_state`` after two microbatches on every rank, everything rebuilt and
    ``load_state``: each rank continues its own pending window (accelerate writes one process's
    custom state: every rank's is gathered into it), and the gradient is bit for bit the
    uninterrupted run's on every rank."""
    resumed, uninterrupted = run_ranks("resume"), run_ranks("accelerate")
    for again, once in zip(resumed, uninterrupted, strict=True):
        assert again["window_tokens"] == once["window_tokens"] == TOTAL
        for name, grad in once["grads"].items():
            assert torch.equal(again["grads"][name], grad), name


def test_deepspeed_zero1_window_is_the_token_mean_over_both_ranks() -> None:
    """``TokenWeightedEngine`` on a ZeRO 1 engine with ``"gradient_allreduce_op": "sum"``: each
    rank's sums over both ranks' 228 tokens, added by ZeRO 1's own reduce, give the partitioned
    optimizer the token mean over both ranks, the same bits on every rank."""
    pytest.importorskip("deepspeed")
    _check(run_ranks("zero1", timeout=600))


def test_deepspeed_zero1_rank_without_targets_sends_zeros() -> None:
    """Rank 1's window holds no target (no buffer at all): it hands ZeRO 1's reduce zeros for
    every parameter rank 0 has a buffer for, so both ranks reduce the same buckets and get rank
    0's token mean over its 211 tokens, within the bound of its float64 truth."""
    pytest.importorskip("deepspeed")
    results = run_ranks("zero1-idle", timeout=600)
    data = rank_data(0)
    inputs, labels = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    slices, start = [], 0
    for batch, _ in data:
        slices.append(slice(start, start + len(batch)))
        start += len(batch)
    assert [r["window_tokens"] for r in results] == [211, 211]
    truth = _truth(inputs, labels)
    for name in truth:
        np.testing.assert_array_equal(results[1]["grads"][name], results[0]["grads"][name])
    ratio = _ratio(results[0]["grads"], truth, _bound(inputs, labels, slices))
    assert ratio <= 1.0, f"error/bound = {ratio}"
