"""wacc_ref.reduction's models against a real gloo all_reduce (torch.distributed on CPU).

Each job is ``N`` gloo ranks that SUM-reduce the same seeded float16, bfloat16 and float32
tensors (values spread over 13 binades, so the association order decides many roundings; an odd
length, so gloo's chunks are uneven).  Two ranks: the result is ``round_T(a + b)`` bit for bit
(the model's, computed exactly).  Three and four ranks: within the derived bound
``γ_{N-1} Σ|x|``, and bit for bit equal to the model of gloo's ring (chunk ``c`` starts at rank
``c - 1`` and travels down to rank ``c``, ``gloo/allreduce.cc``); the NCCL-direction ring and
NCCL's binary tree are reported for comparison (with 3 ranks NCCL's ring adds the same pairs as
gloo's, with 4 it does not).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from wacc_ref import reduction as R
from wacc_ref.bounds import error_ratio

from .spawn import init_rank, load_results, run_job, save_result

pytestmark = pytest.mark.slow

ELEMENTS = 997
SEED = 36
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _values(world_size: int, dtype: str) -> np.ndarray:
    """Every rank's values (rows), exactly values of ``dtype``, the same in every process."""
    rng = np.random.default_rng([SEED, world_size])
    raw = rng.standard_normal((world_size, ELEMENTS)) * np.exp2(
        rng.integers(-6, 7, (world_size, ELEMENTS))
    )
    return torch.tensor(raw).to(DTYPES[dtype]).to(torch.float64).numpy()


def _rank(rank: int, world_size: int, init_file: str, work_dir: str) -> None:
    init_rank(rank, world_size, init_file)
    reduced = {}
    for name, dtype in DTYPES.items():
        tensor = torch.from_numpy(_values(world_size, name)[rank]).to(dtype)
        dist.all_reduce(tensor)  # SUM
        reduced[name] = tensor.to(torch.float64)
    save_result(work_dir, rank, reduced)
    dist.destroy_process_group()


def _reduce(world_size: int) -> list[dict[str, torch.Tensor]]:
    with tempfile.TemporaryDirectory(prefix="wacc-reduction-") as scratch:
        work_dir = Path(scratch)
        run_job(_rank, (str(work_dir),), world_size=world_size, work_dir=work_dir)
        return load_results(work_dir, world_size)


def _gloo_model(values: np.ndarray, dtype: str) -> np.ndarray:
    ranks = values.shape[0]
    chunks = R.gloo_ring_chunks(values.shape[1], ranks)
    return R.ring_sum(values, dtype, chunks=chunks, direction=-1)


def test_two_gloo_ranks_sum_is_round_t_of_a_plus_b_bit_for_bit() -> None:
    """2 ranks: every rank's reduced tensor equals the model's round_T(a + b), bit for bit, for
    float16, bfloat16 and float32 (and some elements do round: the check is not vacuous)."""
    results = _reduce(2)
    for name in DTYPES:
        values = _values(2, name)
        model = R.ring_sum(values, name)
        for rank, result in enumerate(results):
            np.testing.assert_array_equal(result[name].numpy(), model, err_msg=f"{name} {rank}")
        assert R.reduction_errors(model, values, name, mean=False).any(), name


@pytest.mark.parametrize("world_size", [3, 4])
def test_more_gloo_ranks_stay_within_the_bound_and_follow_gloos_ring(world_size: int) -> None:
    """3 and 4 ranks: within γ_{N-1} Σ|x| of the exact sum, every rank alike, and bit for bit the
    model of gloo's ring order (the NCCL-direction ring differs in places with 4 ranks)."""
    results = _reduce(world_size)
    for name in DTYPES:
        values = _values(world_size, name)
        observed = results[0][name].numpy()
        for rank, result in enumerate(results):
            np.testing.assert_array_equal(result[name].numpy(), observed, err_msg=f"{rank}")
        bound = R.sum_error_bound(values, name)
        assert error_ratio(observed, R.exact_sums(values, name), bound) <= 1, name
        np.testing.assert_array_equal(observed, _gloo_model(values, name), err_msg=name)
        nccl_ring = R.ring_sum(values, name)
        if world_size == 4:
            assert not np.array_equal(observed, nccl_ring), name
