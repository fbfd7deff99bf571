"""§6: accumulate_mean — the weight after conversion, multiply then add, the fused mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.wacc_torch.support import (
    DEVICES,
    WORK_DTYPE_PARAMS,
    assert_matches_reference,
    assert_unchanged,
    awkward_values,
    bits,
    dtype_name,
    grads_snapshot,
    one_parameter,
    pending_buffer,
)
from wacc_ref.arith import (
    add_rounded,
    conv_array,
    fused_mean_step_accepts,
    fused_mean_step_candidates,
    mul_rounded,
)
from wacc_ref.formats import conv_to
from wacc_torch import InvalidWeightError, WeightedGradientsAccumulator


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_weight_1001_counts_as_1000(device: str) -> None:
    """In bf16 the weight 1001 becomes 1000 (spacing 4 in [512, 1024)), in W and in the product."""
    module = one_parameter(device, (2,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1.0)
    accumulator.accumulate_mean(
        module, 1001, grads={"weight": torch.tensor([1.0, 0.5], device=device)}
    )
    assert accumulator.state.total_weight == 1000.0
    assert pending_buffer(accumulator).tolist() == [1000.0, 500.0]
    # The mean of one batch is then exactly its gradient: W and the product agree.
    mean = accumulator.finish_mean().grads["weight"]
    assert mean is not None and mean.tolist() == [1.0, 0.5]


@pytest.mark.parametrize("device", DEVICES)
def test_float16_weight_4097_counts_as_4096(device: str) -> None:
    """In fp16 the weight 4097 becomes 4096 (spacing 4 in [4096, 8192)), also as a 0-d tensor."""
    module = one_parameter(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    accumulator.accumulate_mean(
        module,
        torch.tensor(4097.0, dtype=torch.float64),
        grads={"weight": torch.tensor([2.0**-10], device=device)},
    )
    assert accumulator.state.total_weight == 4096.0
    assert pending_buffer(accumulator).tolist() == [4.0]


def test_total_weight_accumulates_converted_weights() -> None:
    """W is the float64 sum of conv_D(w) over the positive-weight batches, in issue order."""
    module = one_parameter("cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1.0)
    weights = [1001, 0.1, 0, 3.0]
    for weight in weights:
        accumulator.accumulate_mean(module, weight, grads={"weight": torch.ones(1)})
    expected = 0.0
    for weight in weights:
        expected += conv_to(float(weight), "bfloat16")
    assert accumulator.state.total_weight == expected
    assert (accumulator.state.issued, accumulator.state.zero_weight) == (4, 1)


def _float32_mean_step(*, fused: bool) -> float:
    module = one_parameter("cpu", (64,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, fused=fused)
    accumulator.accumulate_mean(module, 1, grads={"weight": torch.full((64,), -1.0)})
    # c = w = 1 + 2**-12: c*w = 1 + 2**-11 + 2**-24 exactly. Two steps: round_32(c*w) is a tie
    # at 2**-24 (half the float32 quantum 2**-23 at 1) -> even: 1 + 2**-11; then
    # -1 + (1 + 2**-11) = 2**-11. One FMA: -1 + c*w = 2**-11 + 2**-24, exact in float32.
    accumulator.accumulate_mean(
        module, 1.0 + 2.0**-12, grads={"weight": torch.full((64,), 1.0 + 2.0**-12)}
    )
    values = set(pending_buffer(accumulator).tolist())
    assert len(values) == 1, values
    return values.pop()


def test_float32_mean_multiplies_then_adds() -> None:
    """The default float32 mean step is round(buf + round(c*w)), which here differs from an FMA."""
    assert _float32_mean_step(fused=False) == 2.0**-11


def test_fused_float32_mean_is_an_fma_on_cpu() -> None:
    """With ``fused=True`` on CPU the float32 mean step is one FMA: round(buf + c*w)."""
    assert _float32_mean_step(fused=True) == 2.0**-11 + 2.0**-24


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_mean_negative_zero_first_contribution_gives_positive_zero(
    device: str, dtype: torch.dtype
) -> None:
    """A first mean contribution of -0.0 (or a product that is -0.0) leaves the buffer at +0.0."""
    module = one_parameter(device, (2,))
    for fused in (False, True):
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0, fused=fused)
        accumulator.accumulate_mean(
            module, 3, grads={"weight": torch.tensor([-0.0, -0.0], device=device)}
        )
        assert bits(pending_buffer(accumulator)).tolist() == [0, 0], f"fused={fused}"


_MEAN_WEIGHTS = (1.0, 7.0, 1001.0, 0.1, 3.0, 2.0**-3 * 5)


@pytest.mark.parametrize(
    "grad_dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=dtype_name
)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_mean_matches_stepwise_rounding_reference(
    device: str, dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    """Every buffer element equals round_D(buf + round_D(conv_D(g) * w_D)), bit for bit."""
    generator = torch.Generator().manual_seed(99)
    module = one_parameter(device, (257,))
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    name = dtype_name(dtype)
    expected = np.zeros(257)
    for weight in _MEAN_WEIGHTS:
        gradient = awkward_values((257,), dtype=grad_dtype, around=dtype, generator=generator)
        accumulator.accumulate_mean(module, weight, grads={"weight": gradient.to(device)})
        product = mul_rounded(
            conv_array(gradient.to(torch.float64).numpy(), name), conv_to(weight, name), name
        )
        expected = add_rounded(expected, product, name)
    assert_matches_reference(
        pending_buffer(accumulator), expected, f"mean {dtype_name(grad_dtype)}->{name}"
    )


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_fused_mean_stays_in_the_admissible_set(device: str, dtype: torch.dtype) -> None:
    """Each fused mean step gives one of semantics §6's admissible per-element results."""
    generator = torch.Generator().manual_seed(7)
    module = one_parameter(device, (48,))
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0, fused=True)
    name = dtype_name(dtype)
    for weight in _MEAN_WEIGHTS:
        before = (
            pending_buffer(accumulator).to(torch.float64).tolist()
            if accumulator.state.issued
            else [0.0] * 48
        )
        gradient = awkward_values((48,), dtype=torch.float32, around=dtype, generator=generator)
        accumulator.accumulate_mean(module, weight, grads={"weight": gradient.to(device)})
        after = pending_buffer(accumulator).to(torch.float64).tolist()
        converted = conv_array(gradient.to(torch.float64).numpy(), name).tolist()
        w_d = conv_to(weight, name)
        for index, (buf, c, value) in enumerate(zip(before, converted, after, strict=True)):
            candidates = fused_mean_step_candidates(buf, c, w_d, name)
            assert fused_mean_step_accepts(value, candidates), (
                f"{name} index {index}: buf={buf.hex()} c={c.hex()} w_D={w_d.hex()} gave "
                f"{value.hex()}, admissible {sorted(float(x).hex() for x in candidates)}"
            )


@pytest.mark.parametrize(
    ("dtype", "weight"),
    [
        pytest.param(torch.float16, 2.0**-26, id="fp16-underflow"),
        pytest.param(torch.float16, 65520.0, id="fp16-overflow-at-midpoint"),
        pytest.param(torch.float16, 70000, id="fp16-overflow"),
        pytest.param(torch.bfloat16, 2.0**-134, id="bf16-underflow"),
        pytest.param(torch.float32, 2.0**-150, id="fp32-underflow"),
        pytest.param(torch.float32, 2.0**128, id="fp32-overflow"),
    ],
)
def test_weight_that_does_not_survive_the_work_dtype_is_refused(
    dtype: torch.dtype, weight: float
) -> None:
    """A weight > 0 whose conv_D is 0 or inf raises InvalidWeightError naming it."""
    module = one_parameter("cpu")
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    accumulator.accumulate_mean(module, 1, grads={"weight": torch.ones(1)})
    module.weight.grad = torch.ones(1)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    with pytest.raises(InvalidWeightError, match=str(dtype)) as caught:
        accumulator.accumulate_mean(module, weight)
    assert repr(weight) in str(caught.value)
    assert_unchanged(accumulator, record, module, grads)


def test_smallest_surviving_weight_is_accepted() -> None:
    """The smallest subnormal of fp16 (2**-24) is a valid mean weight and counts exactly."""
    module = one_parameter("cpu")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    accumulator.accumulate_mean(module, 2.0**-24, grads={"weight": torch.tensor([2.0**10])})
    assert accumulator.state.total_weight == 2.0**-24
    assert pending_buffer(accumulator).item() == 2.0**-14


@pytest.mark.parametrize("device", DEVICES)
def test_zero_weight_mean_reads_no_gradient(device: str) -> None:
    """A weight-0 mean batch ignores NaN gradients and takes .grad out of the module."""
    module = one_parameter(device, (3,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=2.0**15)
    accumulator.accumulate_mean(module, 2, grads={"weight": torch.ones(3, device=device)})
    before = accumulator.state_dict()
    module.weight.grad = torch.full((3,), float("nan"), device=device)
    accumulator.accumulate_mean(module, 0)
    assert module.weight.grad is None
    after = accumulator.state_dict()
    assert (after["issued"], after["zero_weight"]) == (2, 1)
    assert after["total_weight"] == before["total_weight"]
    assert torch.equal(after["pending"]["weight"], before["pending"]["weight"])
