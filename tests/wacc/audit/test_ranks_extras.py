"""Lightning's DDP strategy and DeepSpeed's engine across two data-parallel ranks, each a real
``torch.distributed.run`` world (gloo, CPU) whose ranks read windows of different token totals
(211 and 17, one with a zero-token microbatch): what every rank hands its optimizer against the
float64 gradient of the mean token loss over both ranks' tokens and against what a loop that
weighs every microbatch alike computes (the `lightning` / `deepspeed` extras, run by
``tox -e audit-extras``; each test skipped without its extra)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.wacc.audit.expected import assert_close_to_prediction
from tests.wacc.audit.ranks_driver import RankResult, expected, run_world

pytestmark = pytest.mark.slow

WORLD = 2
# float64 runs: what differs only in the order of float64 additions
ROUNDING = "float64"
# DeepSpeed's reduce casts each gradient to its float32 communication_data_type and back (a float64
# run is float32-accurate there: wacc.audit.adapters.deepspeed).
FLOAT32_REDUCE = "float32"


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def _equal_microbatches(results: list[RankResult], dtype: str) -> float:
    """Checks that the ranks agree, read their windows whole and hand the optimizer the
    equal-microbatch gradient to ``dtype``'s rounding of it
    (:func:`tests.wacc.audit.expected.prediction_bound`); returns the measured error."""
    assert all(r.steps_seen == 1 and r.fetched == [0, 1, 2, 3] for r in results)
    for other in results[1:]:
        np.testing.assert_array_equal(other.gradient, results[0].gradient)
    want = expected("plain", WORLD)
    # Σ_r Σ_k mean_rk / (N K): each microbatch's mean, every rank alike, to rounding.
    bound = want.equal_microbatches_bound(dtype)
    assert_close_to_prediction(results[0].gradient, want.equal_microbatches, bound)
    return want.rel(results[0].gradient)


@pytest.mark.parametrize("loop", ["AUTOMATIC", "MANUAL"])
def test_lightning_ddp_weighs_microbatches_alike(loop: str) -> None:
    """``Trainer(strategy=DDPStrategy(gloo), devices=2)`` under torchrun (TorchElasticEnvironment:
    no processes spawned), automatic (``loss / accumulate_grad_batches``, DDP sync blocked until
    the K-th batch) and manual (``manual_backward(loss / N)``): DDP's mean of per-rank
    Σ_k mean_k / K, every microbatch weighing 1 / (N K): the predicted error, a FAIL."""
    _needs("lightning")
    from wacc.audit.adapters import lightning

    assert getattr(lightning, loop).ranks is True
    results = run_world(f"wacc.audit.adapters.lightning:{loop}", WORLD)
    assert [r.counted for r in results] == [None, None]
    assert _equal_microbatches(results, ROUNDING) > 1


@pytest.mark.parametrize("loop", ["ADAPTER", "ZERO1"])
def test_deepspeed_weighs_microbatches_alike(loop: str) -> None:
    """DeepSpeed's engine at ZeRO 0 (the reduce of ``allreduce_gradients``) and ZeRO 1 (the
    partitioned reduce, its full gradient read with ``safe_get_full_grad``) on the boundary:
    ``engine.backward`` divides each microbatch's mean by K and the reduce averages the ranks,
    every microbatch weighing 1 / (N K): the predicted error, a FAIL."""
    _needs("deepspeed")
    from wacc.audit.adapters import deepspeed

    assert getattr(deepspeed, loop).ranks is True
    # A first DeepSpeed run on a machine JIT-compiles its shm all-reduce (minutes on 2 cores).
    results = run_world(f"wacc.audit.adapters.deepspeed:{loop}", WORLD, timeout=900)
    assert [r.counted for r in results] == [None, None]
    assert _equal_microbatches(results, FLOAT32_REDUCE) > 1
