"""semantics §5: accumulate_sum — convert then add, lazy +0.0 buffers, gradient sources, weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.wacc_torch.support import (
    DEVICES,
    WORK_DTYPE_PARAMS,
    TwoLayer,
    assert_bitwise_equal,
    assert_matches_reference,
    assert_records_equal,
    awkward_values,
    bits,
    dtype_name,
    one_parameter,
    pending_buffer,
    tracked_shapes,
)
from wacc_ref.arith import add_rounded, conv_array
from wacc_torch import UnsupportedEnvironmentError, WeightedGradientsAccumulator

GRAD_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_sum_converts_then_adds(device: str) -> None:
    """A bf16 buffer adds round_bf16(g), not the single rounding of buf + g in float32."""
    module = one_parameter(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1.0)
    one = torch.tensor([1.0], device=device)
    # g = 2**-8 + 2**-16 (a float32 value). Converted: the bf16 neighbours of g are 2**-8 and
    # 2**-8 + 2**-15; g is their midpoint, ties to even -> c = 2**-8. Then 1 + 2**-8 is the
    # midpoint of 1 and 1 + 2**-7, ties to even -> 1.0. One rounding of 1 + g instead lies
    # above that midpoint -> 1 + 2**-7.
    gradient = torch.tensor([2.0**-8 + 2.0**-16], device=device)
    accumulator.accumulate_sum(module, 1, grads={"weight": one})
    accumulator.accumulate_sum(module, 1, grads={"weight": gradient})
    assert pending_buffer(accumulator).item() == 1.0, pending_buffer(accumulator).item()

    single_rounding = torch.tensor([1.0], dtype=torch.bfloat16, device=device).add_(gradient)
    assert single_rounding.item() == 1.0 + 2.0**-7, "the example must tell the two orders apart"


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_negative_zero_first_contribution_gives_positive_zero(
    device: str, dtype: torch.dtype
) -> None:
    """A buffer starts at +0.0, so a first contribution of -0.0 leaves +0.0 (RNE: +0 + -0 = +0)."""
    module = one_parameter(device, (3,))
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    accumulator.accumulate_sum(module, 2, grads={"weight": torch.full((3,), -0.0, device=device)})
    assert bits(pending_buffer(accumulator)).tolist() == [0, 0, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_float64_gradient_converts_through_float32(device: str) -> None:
    """conv_D of a float64 gradient into bf16 is PyTorch's double rounding through float32."""
    module = one_parameter(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1.0)
    # 1 + 2**-8 + 2**-30 -> float32: 2**-30 is below half the float32 quantum 2**-23 at 1, so
    # 1 + 2**-8; that is the bf16 midpoint of 1 and 1 + 2**-7: ties to even -> 1.0 (correct
    # rounding would give 1 + 2**-7).
    gradient = torch.tensor([1.0 + 2.0**-8 + 2.0**-30], dtype=torch.float64, device=device)
    accumulator.accumulate_sum(module, 1, grads={"weight": gradient})
    assert pending_buffer(accumulator).item() == 1.0


@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_float8_gradients_are_accepted(dtype: torch.dtype, grad_dtype: torch.dtype) -> None:
    """float8 gradients are converted into every work dtype and summed exactly when exact."""
    module = one_parameter("cpu", (4,))
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    # Values with at most 2 significand bits, in both float8 formats' range: sums are exact.
    first = torch.tensor([1.5, -2.0, 0.25, 0.0]).to(grad_dtype)
    second = torch.tensor([0.5, 3.0, -0.125, 6.0]).to(grad_dtype)
    accumulator.accumulate_sum(module, 1, grads={"weight": first})
    accumulator.accumulate_sum(module, 1, grads={"weight": second})
    assert pending_buffer(accumulator).tolist() == [2.0, 1.0, 0.125, 6.0]
    assert pending_buffer(accumulator).dtype == dtype


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_sum_matches_stepwise_rounding_reference(
    device: str, dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    """Every buffer element equals round_D(buf + conv_D(g)) step by step, bit for bit."""
    generator = torch.Generator().manual_seed(1234)
    module = one_parameter(device, (257,))
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    expected = np.zeros(257)
    for _ in range(6):
        gradient = awkward_values((257,), dtype=grad_dtype, around=dtype, generator=generator)
        accumulator.accumulate_sum(module, 1.5, grads={"weight": gradient.to(device)})
        converted = conv_array(gradient.to(torch.float64).numpy(), dtype_name(dtype))
        expected = add_rounded(expected, converted, dtype_name(dtype))
    assert_matches_reference(
        pending_buffer(accumulator), expected, f"sum {dtype_name(grad_dtype)}->{dtype_name(dtype)}"
    )


@pytest.mark.parametrize("device", DEVICES)
def test_module_grad_is_taken_out_also_for_zero_weight(device: str) -> None:
    """Without ``grads`` each tracked .grad is read and set to None, also for weight 0."""
    module = TwoLayer(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for weight in (2, 0):
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.grad = torch.ones_like(parameter)
        accumulator.accumulate_sum(module, weight)
        assert all(p.grad is None for p in module.parameters())
    # Only the positive-weight batch counted: every element is exactly 1.
    sums = accumulator.finish_sums()
    assert all(g is not None and bool((g == 1.0).all()) for g in sums.grads.values())


@pytest.mark.parametrize("device", DEVICES)
def test_grads_mapping_leaves_module_grad_alone(device: str) -> None:
    """With a ``grads`` mapping the module's .grad is neither read nor cleared."""
    module = TwoLayer(device)
    stale = {
        name: torch.full(shape, 7.0, device=device)
        for name, shape in tracked_shapes(module).items()
    }
    for name, parameter in module.named_parameters():
        if name in stale:
            parameter.grad = stale[name].clone()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    mapping = {
        name: torch.ones(shape, device=device) for name, shape in tracked_shapes(module).items()
    }
    accumulator.accumulate_sum(module, 1, grads=mapping)
    for name, parameter in module.named_parameters():
        if name in stale:
            assert parameter.grad is not None and torch.equal(parameter.grad, stale[name])
    assert all(bool((g == 1.0).all()) for g in accumulator.state_dict()["pending"].values())


@pytest.mark.parametrize("device", DEVICES)
def test_missing_or_none_gradient_is_a_zero_contribution(device: str) -> None:
    """A name absent from ``grads`` or mapped to None adds nothing and allocates no buffer."""
    module = TwoLayer(device)
    shapes = tracked_shapes(module)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(
        module, 1, grads={"first.weight": torch.ones(shapes["first.weight"], device=device)}
    )
    accumulator.accumulate_sum(module, 1, grads={"first.weight": None, "first.bias": None})
    assert set(accumulator.state_dict()["pending"]) == {"first.weight"}
    accumulator.accumulate_sum(
        module, 1, grads={"second.bias": torch.full(shapes["second.bias"], 3.0, device=device)}
    )
    sums = accumulator.finish_sums()
    assert set(sums.grads) == set(shapes)
    assert sums.grads["first.bias"] is None and sums.grads["second.weight"] is None
    assert sums.grads["first.weight"] is not None and bool((sums.grads["first.weight"] == 1).all())
    assert sums.grads["second.bias"] is not None and bool((sums.grads["second.bias"] == 3).all())
    assert sums.issued == 3 and sums.zero_weight == 0 and sums.weight == 3.0


@pytest.mark.parametrize("device", DEVICES)
def test_zero_weight_batch_reads_no_gradient(device: str) -> None:
    """A weight-0 batch with NaN/inf gradients changes only ``issued`` and ``zero_weight``."""
    module = TwoLayer(device)
    shapes = tracked_shapes(module)
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=8.0)
    accumulator.accumulate_sum(
        module, 5, grads={name: torch.ones(shape, device=device) for name, shape in shapes.items()}
    )
    before = accumulator.state_dict()
    poison = {
        name: torch.full(shape, float("nan"), device=device) for name, shape in shapes.items()
    }
    poison["second.bias"] = torch.full(shapes["second.bias"], float("inf"), device=device)
    accumulator.accumulate_sum(module, 0, grads=poison)
    accumulator.accumulate_sum(module, 0.0, grads=poison)
    accumulator.accumulate_sum(module, torch.tensor(0), grads=poison)
    expected = dict(before, issued=before["issued"] + 3, zero_weight=before["zero_weight"] + 3)
    assert_records_equal(accumulator.state_dict(), expected)


def test_zero_weight_batches_allocate_no_buffer() -> None:
    """A window of only zero-weight batches has no pending buffer and finishes with None grads."""
    module = TwoLayer()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for _ in range(3):
        for parameter in module.parameters():
            parameter.grad = torch.ones_like(parameter)
        accumulator.accumulate_sum(module, 0)
    assert accumulator.state_dict()["pending"] == {}
    sums = accumulator.finish_sums()
    assert sums.grads == {name: None for name in tracked_shapes(module)}
    assert (sums.issued, sums.zero_weight, sums.weight) == (3, 3, 0.0)


def test_total_weight_is_the_float64_sum_in_issue_order() -> None:
    """W is round_64(W + float(w)) in issue order, for floats, ints and 0-d tensors."""
    module = one_parameter("cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    one = {"weight": torch.ones(1)}
    weight_tensor = torch.tensor(0.1, dtype=torch.float32)
    weights: list[object] = [0.1, 0.2, 3, weight_tensor, torch.tensor(2**40), 2**-1074]
    expected = 0.0
    for weight in weights:
        accumulator.accumulate_sum(module, weight, grads=one)  # type: ignore[arg-type]
        expected += float(weight)  # type: ignore[arg-type]
    # Python evaluates the same float64 additions in the same order: exactly W.
    assert accumulator.state.total_weight == expected
    assert accumulator.state.issued == len(weights)
    # The float32 0.1 counts as its own value, not as the float64 0.1.
    assert float(weight_tensor) != 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_buffers_are_allocated_lazily_in_the_work_dtype(device: str) -> None:
    """A buffer appears at a parameter's first non-None gradient, in D, on its device."""
    module = TwoLayer(device)
    shapes = tracked_shapes(module)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    accumulator.accumulate_sum(module, 1, grads={})
    assert accumulator.state_dict()["pending"] == {}
    accumulator.accumulate_sum(
        module, 1, grads={"second.weight": torch.ones(shapes["second.weight"], device=device)}
    )
    sums = accumulator.finish_sums()
    buffer = sums.grads["second.weight"]
    assert buffer is not None and buffer.dtype == torch.float16
    assert buffer.device.type == torch.device(device).type
    assert [name for name, g in sums.grads.items() if g is not None] == ["second.weight"]


def test_first_accumulate_binds_the_tracked_set_without_frozen_parameters() -> None:
    """The tracked set is the requires_grad parameters, in registration order."""
    module = TwoLayer()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(module, 0)
    record = accumulator.state_dict()
    assert record["param_names"] == ["first.weight", "first.bias", "second.weight", "second.bias"]
    assert record["param_shapes"] == [[3, 4], [3], [2, 3], [2]]


def test_gradient_graph_is_not_kept() -> None:
    """A gradient that requires grad is accumulated detached (no autograd history)."""
    module = one_parameter("cpu", (2,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    gradient = torch.ones(2, requires_grad=True) * 2
    accumulator.accumulate_sum(module, 1, grads={"weight": gradient})
    sums = accumulator.finish_sums()
    assert sums.grads["weight"] is not None and not sums.grads["weight"].requires_grad
    assert_bitwise_equal(sums.grads["weight"], torch.full((2,), 2.0), "buffer")


@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_flush_to_zero_is_refused_naming_the_call(kind: str) -> None:
    """With the CPU flushing subnormals, a positive weight is refused with
    UnsupportedEnvironmentError whose message names the call (semantics §11 Reading: errors name
    the offending call), and the accumulator is left unchanged."""
    module = TwoLayer()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    grads = {name: torch.ones(shape) for name, shape in tracked_shapes(module).items()}
    accumulator.accumulate_sum(module, 1, grads=grads)
    record = accumulator.state_dict()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
    try:
        with pytest.raises(UnsupportedEnvironmentError, match=rf"^accumulate_{kind}: "):
            getattr(accumulator, f"accumulate_{kind}")(module, 2, grads=grads)
    finally:
        torch.set_flush_denormal(False)
    assert_records_equal(accumulator.state_dict(), record)
