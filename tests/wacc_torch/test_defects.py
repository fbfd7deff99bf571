"""Issue 10's defects in wacc_torch, one test each: every one failed before the fix."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from tests.wacc_torch.support import (
    TwoLayer,
    assert_bitwise_equal,
    assert_unchanged,
    grads_snapshot,
    one_parameter,
    tracked_shapes,
)
from wacc_torch import (
    AccumulatorState,
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    WeightedGradientsAccumulator,
    normalize_sums,
)


def test_defect_1_buffers_allocated_in_inference_mode_are_ordinary_tensors() -> None:
    """A window started (or restored) under inference_mode continues outside it, losing nothing."""
    module = one_parameter("cpu", (4,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=8.0)
    with torch.inference_mode():
        accumulator.accumulate_sum(module, 1, grads={"weight": torch.full((4,), 8.0)})
        record = accumulator.state_dict()
        restored = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=8.0)
        restored.load_state_dict(record, module)
    for target in (accumulator, restored):
        module.weight.grad = torch.full((4,), 16.0)
        target.accumulate_sum(module, 3)
        assert module.weight.grad is None
        assert (target.state.issued, target.state.total_weight) == (2, 4.0)
        mean = target.finish_mean().grads["weight"]
        assert mean is not None and not mean.is_inference()
        assert_bitwise_equal(mean, torch.full((4,), 0.75), "mean")  # (8 + 16) / 8 / 4


def test_defect_2_from_pending_refuses_overlapping_or_shared_memory() -> None:
    """from_pending refuses an expanded (stride-0) buffer and one overlapping a .grad's memory."""
    module = one_parameter("cpu", (3,))
    module.weight.grad = torch.ones(3)
    state = AccumulatorState(
        dtype=torch.float32, loss_scale=1.0, issued=1, zero_weight=0, total_weight=1.0, fused=False
    )
    before = grads_snapshot(module)
    for pending, message in (
        (torch.ones(1).expand(3), "overlapping memory"),
        (module.weight.grad, "shares the memory of parameter 'weight''s .grad"),
    ):
        with pytest.raises(ParameterMismatchError, match=message):
            WeightedGradientsAccumulator.from_pending(module, {"weight": pending}, state)
    assert_bitwise_equal(module.weight.grad, before["weight"], "weight.grad")


def test_defect_3_unconvertible_gradient_dtype_is_refused_before_any_change() -> None:
    """A float4 gradient raises ParameterMismatchError; no buffer or .grad has changed."""
    module = TwoLayer()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(module, 1, grads={"first.weight": torch.ones(3, 4)})
    shape = tracked_shapes(module)["second.bias"]
    grads = {
        "first.weight": torch.ones(3, 4),  # converted and added first, before the fix
        "second.bias": torch.zeros(shape, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
    }
    record = accumulator.state_dict()
    with pytest.raises(ParameterMismatchError, match="'second.bias'.*float4_e2m1fn_x2"):
        accumulator.accumulate_sum(module, 2, grads=grads)
    assert_unchanged(accumulator, record)


@pytest.mark.parametrize(
    "weight", [Fraction(3, 2), np.longdouble(3)], ids=["Fraction", "longdouble"]
)
def test_defect_5_fraction_and_longdouble_weights_are_refused(weight: object) -> None:
    """Weights the reference refuses (Fraction, longdouble) are refused here too, not rounded."""
    module = one_parameter("cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    record = accumulator.state_dict()
    for method in (accumulator.accumulate_sum, accumulator.accumulate_mean):
        with pytest.raises(InvalidWeightError, match=type(weight).__name__):
            method(module, weight, grads={"weight": torch.ones(1)})  # type: ignore[arg-type]
    assert_unchanged(accumulator, record)
    with pytest.raises(InvalidLossScaleError, match="Fraction"):
        WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=Fraction(2))  # type: ignore[arg-type]


def test_defect_7_normalize_sums_takes_a_0d_tensor_weight_and_is_all_or_nothing() -> None:
    """A 0-d tensor total weight gives the float's result; an in-place failure writes nothing."""
    sums = {"a": torch.tensor([6.0, -3.0]), "b": torch.tensor([1.5])}
    by_float = normalize_sums(sums, loss_scale=2.0, total_weight=3.0)
    by_tensor = normalize_sums(sums, loss_scale=2.0, total_weight=torch.tensor(3.0))
    for name in sums:
        assert_bitwise_equal(by_tensor[name], by_float[name], name)
    first = torch.tensor([6.0, -3.0])
    overlapping = torch.tensor([5.0]).expand(3)
    with pytest.raises(ParameterMismatchError, match="'b' has overlapping memory"):
        normalize_sums(
            {"a": first, "b": overlapping}, loss_scale=2.0, total_weight=3.0, in_place=True
        )
    assert_bitwise_equal(first, torch.tensor([6.0, -3.0]), "a")


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_defect_8_big_integer_weight_is_added_exactly(mean: bool) -> None:
    """W = 1 plus w = 2**53 + 1 gives round_64(2**53 + 2) = 2**53 + 2 (sum): one rounding.

    A mean counts w_D = conv_D(w), PyTorch's conversion (through float64): 2**53, W = 2**53 + 1
    rounded to even, 2**53.
    """
    module = one_parameter("cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=1.0)
    method = accumulator.accumulate_mean if mean else accumulator.accumulate_sum
    method(module, 1, grads={"weight": torch.ones(1, dtype=torch.float64)})
    method(module, 2**53 + 1, grads={"weight": torch.ones(1, dtype=torch.float64)})
    assert accumulator.state.total_weight == (2.0**53 if mean else 2.0**53 + 2)
