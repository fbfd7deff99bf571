"""Shared helpers of the wacc_torch tests: devices, bitwise comparisons, small modules."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from wacc_ref.formats import FORMATS, Format
from wacc_torch import WeightedGradientsAccumulator
from wacc_torch.ddp_hook import WeightedAllReduceHook
from wacc_torch.records import CHECKSUM_KEY

CUDA_AVAILABLE = torch.cuda.is_available()

# Parametrize a test over these to run it on the CPU and, where present, on a CUDA device.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not CUDA_AVAILABLE, reason="needs a CUDA device"),
        ],
    ),
]

WORK_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
WORK_DTYPE_PARAMS = [
    pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in WORK_DTYPES
]

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def format_of(dtype: torch.dtype) -> Format:
    """The reference model's description of a torch floating dtype."""
    return FORMATS[dtype_name(dtype)]


def dtype_name(dtype: torch.dtype) -> str:
    """Torch spelling of a dtype without the ``torch.`` prefix (``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as a CPU integer tensor (NaN payloads and ±0 kept)."""
    return tensor.detach().cpu().contiguous().view(_INT_VIEW[tensor.element_size()])


def hex_values(tensor: torch.Tensor, limit: int = 8) -> list[str]:
    """The first ``limit`` values of a tensor as float64 hex strings, for failure messages."""
    values = tensor.detach().cpu().to(torch.float64).flatten()[:limit].tolist()
    return [float(value).hex() for value in values]


def assert_bitwise_equal(
    actual: torch.Tensor | None, expected: torch.Tensor | None, what: str
) -> None:
    """Assert same None-ness, dtype, shape and bit pattern of every element."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{what}: {actual!r} vs {expected!r}"
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    differ = bits(actual) != bits(expected)
    if bool(differ.any()):
        index = int(differ.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} element(s) differ; first at flat index {index}: "
            f"{hex_values(actual.flatten()[index:])[0]} vs "
            f"{hex_values(expected.flatten()[index:])[0]}"
        )


def assert_records_equal(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Assert two records (state_dicts) are identical, pending buffers bit for bit.

    The ``checksum`` key must be present in both or neither, but its value is not compared: it
    is a function of the other fields (an expected record built by editing a real one keeps a
    stale one), which ``tests/wacc_torch/test_record_checksum.py`` checks on its own.
    """
    assert set(actual) == set(expected), f"keys {sorted(actual)} vs {sorted(expected)}"
    for key in expected:
        if key == CHECKSUM_KEY:
            continue
        if key == "pending":
            assert set(actual[key]) == set(expected[key]), (
                f"pending names {sorted(actual[key])} vs {sorted(expected[key])}"
            )
            for name, buffer in expected[key].items():
                assert_bitwise_equal(actual[key][name], buffer, f"pending[{name!r}]")
        else:
            assert type(actual[key]) is type(expected[key]), (
                f"{key}: type {type(actual[key]).__name__} vs {type(expected[key]).__name__}"
            )
            assert actual[key] == expected[key], f"{key}: {actual[key]!r} vs {expected[key]!r}"


def grads_snapshot(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Copies of every parameter's ``.grad`` (None kept), to compare after a call."""
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in module.named_parameters()
    }


def assert_unchanged(
    accumulator: WeightedGradientsAccumulator,
    record_before: Mapping[str, Any],
    module: nn.Module | None = None,
    grads_before: Mapping[str, torch.Tensor | None] | None = None,
) -> None:
    """Assert the accumulator's record, and optionally the module's .grad, did not change."""
    assert_records_equal(accumulator.state_dict(), record_before)
    if module is not None and grads_before is not None:
        after = grads_snapshot(module)
        assert set(after) == set(grads_before)
        for name, grad in grads_before.items():
            assert_bitwise_equal(after[name], grad, f"{name}.grad")


def one_parameter(device: str, shape: tuple[int, ...] = (1,)) -> nn.Module:
    """A module whose only parameter, ``weight``, is a zero tensor of ``shape`` on ``device``."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(shape, device=device))
    return module


def pending_buffer(accumulator: WeightedGradientsAccumulator, name: str = "weight") -> torch.Tensor:
    """A CPU copy of the accumulator's pending buffer ``name`` (from its record)."""
    buffer: torch.Tensor = accumulator.state_dict()["pending"][name]
    return buffer


class TwoLayer(nn.Module):
    """A small module with two tracked layers and one frozen parameter (not tracked)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.first = nn.Linear(4, 3, device=device)
        self.second = nn.Linear(3, 2, device=device)
        self.frozen = nn.Parameter(torch.ones(5, device=device), requires_grad=False)


def tracked_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Names and shapes of the module's requires_grad parameters."""
    return {name: p.shape for name, p in module.named_parameters() if p.requires_grad}


def assert_matches_reference(actual: torch.Tensor | None, expected: Any, what: str) -> None:
    """Assert a tensor equals a reference float64 array bit for bit (±0 distinct, NaN == NaN)."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{what}: {actual!r} vs {expected!r}"
        return
    got = actual.detach().cpu().to(torch.float64).numpy()
    want = np.asarray(expected, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    same = (got_nan & want_nan) | (
        ~got_nan & ~want_nan & (got.view(np.int64) == want.view(np.int64))
    )
    if not bool(same.all()):
        index = int(np.flatnonzero(~same.reshape(-1))[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} element(s) differ from the reference; first at flat "
            f"index {index}: {float(got.reshape(-1)[index]).hex()} vs "
            f"{float(want.reshape(-1)[index]).hex()}"
        )


def awkward_values(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype,
    around: torch.dtype,
    generator: torch.Generator,
) -> torch.Tensor:
    """Values of ``dtype`` that stress rounding in the work dtype ``around``.

    Mostly moderate magnitudes (where sums round), a quarter spread over ``around``'s whole range
    and a little beyond it (subnormals, overflow) as far as ``dtype``'s own range reaches (no
    overflow when ``dtype`` is no wider than ``around``), plus signed zeros.
    """
    count = int(np.prod(shape)) if shape else 1
    source, target = format_of(dtype), format_of(around)
    # Exponents of 2**e * N(0, 1): from just below the target's smallest subnormal (within the
    # source's range) to just beyond its overflow threshold (within the source's range).
    low = max(target.emin - target.precision - 1, source.emin - source.precision + 2)
    high = min(target.emax + 1, source.emax - 2)
    mantissas = torch.randn(count, generator=generator, dtype=torch.float64)
    moderate = torch.randint(-4, 5, (count,), generator=generator)
    extreme = torch.randint(low, high + 1, (count,), generator=generator)
    use_extreme = torch.rand(count, generator=generator, dtype=torch.float64) < 0.25
    exponents = torch.where(use_extreme, extreme, moderate).to(torch.float64)
    values = torch.ldexp(mantissas, exponents)
    zeros = torch.rand(count, generator=generator, dtype=torch.float64) < 0.05
    values = torch.where(zeros, torch.copysign(torch.zeros(()), mantissas), values)
    return values.to(dtype).reshape(shape)


def hooked_window_weight(weight: object, *, mean: bool) -> float:
    """The global W the DDP hook computes for a window of one sum (weight 1) and a last
    microbatch of ``weight``, after its real backward (a process group must be initialized)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(2, 1))
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    hook = WeightedAllReduceHook(model, acc)
    with model.no_sync():
        model(torch.ones(1, 2)).sum().backward()
        acc.accumulate_sum(model.module, 1)
    loss = model(torch.ones(1, 2)).sum()
    (hook.last_microbatch_mean if mean else hook.last_microbatch_sum)(weight)
    loss.backward()
    assert hook.result is not None
    return hook.result.weight


@contextmanager
def flushing_subnormals() -> Iterator[None]:
    """CPU flush-to-zero / denormals-are-zero on inside the block, always off after it; the test
    is skipped on a CPU that cannot flush (no FTZ/DAZ)."""
    if not torch.set_flush_denormal(True):
        torch.set_flush_denormal(False)
        pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
