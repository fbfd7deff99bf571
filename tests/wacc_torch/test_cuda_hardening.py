"""CUDA-only hardening: async snapshots survive their source being freed and reused, the hot
path has no hidden host syncs under a CUDA default device, and a model moves device between
windows. Every test here needs a CUDA device (marked ``cuda``; skipped cleanly without one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.wacc_torch.support import CUDA_AVAILABLE, assert_bitwise_equal
from wacc_torch import WeightedGradientsAccumulator

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA device"),
]

ELEMENTS = 1 << 24  # 64 MiB of float32: a copy long enough to still be in flight


def test_async_snapshot_survives_its_source_being_freed_and_reused() -> None:
    """A snapshot taken on a side stream stays correct when its source buffer is freed and the
    memory reused by the default stream before the copy ran (record_stream + a reference held
    by the handle)."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(ELEMENTS, device="cuda"))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    expected = torch.arange(ELEMENTS, dtype=torch.float32, device="cuda")
    accumulator.accumulate_sum(module, 1, grads={"weight": expected})
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy: the copy starts late
        handle = accumulator.state_dict_async()
    # Drop the accumulator (its buffer's only owner) without any call that would make the
    # default stream wait for the copy: the buffer's memory goes back to the default stream's
    # pool while its copy still waits on the side stream.
    del accumulator
    for _ in range(8):  # reuse that memory on the default stream, overwriting it
        torch.full((ELEMENTS,), -1.0, device="cuda")
    record = handle.result()
    assert_bitwise_equal(record["pending"]["weight"], expected.cpu(), "snapshot")


def test_no_hidden_sync_per_call_under_a_cuda_default_device() -> None:
    """With CUDA as the default device, accumulate and finish_mean never synchronize the host
    (torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call)."""
    with torch.device("cuda"):
        module = nn.Linear(64, 32)
        grads = {name: torch.randn_like(p) for name, p in module.named_parameters()}
        for dtype in (torch.float32, torch.bfloat16):
            accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=8.0)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                accumulator.accumulate_sum(module, 3, grads=grads)
                accumulator.accumulate_mean(module, 5, grads=grads)
                accumulator.finish_mean()
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_moving_the_model_to_cuda_between_windows_rebinds() -> None:
    """A window on the CPU, finish, model.cuda(), the next window binds to the CUDA parameters."""
    module = nn.Linear(3, 2)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(module, 1, grads={"weight": torch.ones(2, 3)})
    accumulator.finish_mean()
    module.cuda()
    accumulator.accumulate_sum(module, 2, grads={"weight": torch.ones(2, 3, device="cuda")})
    result = accumulator.finish_mean().grads["weight"]
    assert result is not None and result.device.type == "cuda"
    assert_bitwise_equal(result.cpu(), torch.full((2, 3), 0.5), "mean")
