"""semantics §9: resume is exact — checkpoint at any point, restore fresh, continue, same bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.wacc_torch.support import (
    DEVICES,
    WORK_DTYPE_PARAMS,
    TwoLayer,
    assert_bitwise_equal,
    awkward_values,
    tracked_shapes,
)
from wacc_torch import (
    AccumulatedGradients,
    InvalidLossScaleError,
    WeightedGradientsAccumulator,
    load_record,
    save_record,
)

# Six microbatches: (weight, names whose gradient is None). A zero-weight batch, a weight that
# bf16 rounds (1001), a parameter without gradient early on (its buffer is allocated late) and
# one that never gets a gradient (finishes as None).
WINDOW: list[tuple[float, frozenset[str]]] = [
    (1.0, frozenset({"second.bias", "first.bias"})),
    (7.0, frozenset({"first.bias"})),
    (0.0, frozenset()),
    (1001.0, frozenset({"first.bias"})),
    (3.0, frozenset({"first.bias"})),
    (0.1, frozenset({"first.bias"})),
]
SCALE = 2.0**3
MODES = [
    pytest.param("sum", False, id="sum"),
    pytest.param("mean", False, id="mean"),
    pytest.param("mean", True, id="mean-fused"),
]


def _gradients(dtype: torch.dtype, device: str) -> list[dict[str, torch.Tensor | None]]:
    generator = torch.Generator().manual_seed(2024)
    shapes = tracked_shapes(TwoLayer())
    window = []
    for _, absent in WINDOW:
        batch: dict[str, torch.Tensor | None] = {}
        for name, shape in shapes.items():
            values = awkward_values(
                tuple(shape), dtype=torch.float32, around=dtype, generator=generator
            )
            batch[name] = None if name in absent else values.to(device)
        window.append(batch)
    return window


def _step(
    accumulator: WeightedGradientsAccumulator,
    module: nn.Module,
    index: int,
    gradients: list[dict[str, torch.Tensor | None]],
    mode: str,
) -> None:
    # Through the module's .grad, as a training loop would hand them over.
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            gradient = gradients[index][name]
            parameter.grad = None if gradient is None else gradient.clone()
    weight = WINDOW[index][0]
    if mode == "sum":
        accumulator.accumulate_sum(module, weight)
    else:
        accumulator.accumulate_mean(module, weight)


def _finish(accumulator: WeightedGradientsAccumulator, mode: str) -> AccumulatedGradients:
    return accumulator.finish_sums() if mode == "sum" else accumulator.finish_mean()


def _assert_same_result(
    actual: AccumulatedGradients, expected: AccumulatedGradients, what: str
) -> None:
    assert (actual.weight, actual.issued, actual.zero_weight, actual.normalized) == (
        expected.weight,
        expected.issued,
        expected.zero_weight,
        expected.normalized,
    ), what
    assert set(actual.grads) == set(expected.grads), what
    for name, grad in expected.grads.items():
        assert_bitwise_equal(actual.grads[name], grad, f"{what}: {name}")


def _uninterrupted(
    dtype: torch.dtype,
    device: str,
    mode: str,
    fused: bool,
    gradients: list[dict[str, torch.Tensor | None]],
) -> AccumulatedGradients:
    module = TwoLayer(device)
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)
    for index in range(len(WINDOW)):
        _step(accumulator, module, index, gradients, mode)
    return _finish(accumulator, mode)


@pytest.mark.parametrize(("mode", "fused"), MODES)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_resume_from_file_at_every_point_is_bit_identical(
    tmp_path: Path, device: str, dtype: torch.dtype, mode: str, fused: bool
) -> None:
    """state_dict -> file -> fresh accumulator and module -> continue equals the full run."""
    gradients = _gradients(dtype, device)
    expected = _uninterrupted(dtype, device, mode, fused, gradients)
    assert any(g is None for g in expected.grads.values()), "the window must leave one grad None"
    for cut in range(len(WINDOW) + 1):
        module = TwoLayer(device)
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)
        for index in range(cut):
            _step(accumulator, module, index, gradients, mode)
        path = tmp_path / f"cut{cut}.pt"
        save_record(accumulator.state_dict(), path)
        del accumulator, module

        fresh_module = TwoLayer(device)
        resumed = WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)
        resumed.load_state_dict(load_record(path), fresh_module)
        for index in range(cut, len(WINDOW)):
            _step(resumed, fresh_module, index, gradients, mode)
        _assert_same_result(_finish(resumed, mode), expected, f"resumed at {cut}")


@pytest.mark.parametrize(("mode", "fused"), MODES)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_async_snapshot_with_accumulation_before_result_resumes_exactly(
    tmp_path: Path, device: str, dtype: torch.dtype, mode: str, fused: bool
) -> None:
    """A state_dict_async snapshot resolved after more accumulation resumes bit-identically."""
    gradients = _gradients(dtype, device)
    expected = _uninterrupted(dtype, device, mode, fused, gradients)
    for cut in range(len(WINDOW) + 1):
        module = TwoLayer(device)
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)
        for index in range(cut):
            _step(accumulator, module, index, gradients, mode)
        handle = accumulator.state_dict_async()
        # The original keeps going (and finishes) before the snapshot is resolved.
        for index in range(cut, len(WINDOW)):
            _step(accumulator, module, index, gradients, mode)
        _assert_same_result(
            _finish(accumulator, mode), expected, f"original after snapshot at {cut}"
        )

        path = tmp_path / f"async{cut}.pt"
        torch.save(handle.result(), path)
        fresh_module = TwoLayer(device)
        resumed = WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)
        resumed.load_state_dict(
            torch.load(path, map_location="cpu", weights_only=True), fresh_module
        )
        for index in range(cut, len(WINDOW)):
            _step(resumed, fresh_module, index, gradients, mode)
        _assert_same_result(
            _finish(resumed, mode), expected, f"resumed from async snapshot at {cut}"
        )


def test_resume_after_finish_keeps_the_binding(tmp_path: Path) -> None:
    """A record taken right after finish binds the parameters and resumes into the next window."""
    module = TwoLayer()
    gradients = _gradients(torch.float32, "cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    _step(accumulator, module, 0, gradients, "sum")
    accumulator.finish_sums()
    record = accumulator.state_dict()
    assert record["param_names"] and record["issued"] == 0 and record["pending"] == {}
    save_record(record, tmp_path / "after_finish.pt")
    resumed = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    resumed.load_state_dict(load_record(tmp_path / "after_finish.pt"), TwoLayer())
    for replica in (accumulator, resumed):
        _step(replica, TwoLayer(), 1, gradients, "mean")
    _assert_same_result(resumed.finish_mean(), accumulator.finish_mean(), "next window")


def test_a_resumed_window_keeps_its_loss_scale_until_it_is_finished() -> None:
    """A window restored with issued microbatches has the record's one loss scale (semantics
    §4 Reading): set_loss_scale raises InvalidLossScaleError naming the new scale, the issued
    count, the window's scale and what to do (finish or discard the window first), changes
    nothing, and the window finishes bit-identically to the uninterrupted one."""
    gradients = _gradients(torch.float32, "cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    module = TwoLayer()
    for index in range(2):
        _step(accumulator, module, index, gradients, "mean")
    resumed = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    resumed.load_state_dict(accumulator.state_dict(), module)
    before = resumed.state_dict()
    message = (
        r"^set_loss_scale\(4\.0\): the window has issued 2 microbatch\(es\) under loss scale "
        r"8\.0, .*every backward of a window has one loss scale; "
        r"finish or discard the window first$"
    )
    with pytest.raises(InvalidLossScaleError, match=message):
        resumed.set_loss_scale(4.0)
    after = resumed.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        if key == "pending":
            assert after[key].keys() == value.keys()
            for name, buffer in value.items():
                assert_bitwise_equal(after[key][name], buffer, name)
        else:
            assert after[key] == value, key
    for replica in (accumulator, resumed):
        for index in range(2, len(WINDOW)):
            _step(replica, module, index, gradients, "mean")
    _assert_same_result(resumed.finish_mean(), accumulator.finish_mean(), "resumed window")
