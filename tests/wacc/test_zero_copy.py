"""The judge's zero-copy implementation (wacc.zero_copy): a real backward per microbatch, the
buffered mode's results and error classes, and a planted zero-copy defect is found."""

from __future__ import annotations

import pytest
import torch

from tests.wacc_torch.support import assert_bitwise_equal, assert_records_equal
from wacc.implementation import wacc_torch_zero_copy
from wacc.judge.engine import CheckConfig, run_check
from wacc.judge.implementation import load_implementation
from wacc.judge.runner import build_module
from wacc_ref.scenario import to_json
from wacc_torch import (
    InvalidWeightError,
    ParameterMismatchError,
    WeightedGradientsAccumulator,
    ZeroCopyError,
)

SPEC = "wacc.implementation:wacc_torch_zero_copy"
SHAPES = {"head.bias": (3,), "w": (2, 2)}


def test_the_factory_declares_the_reproducible_order_with_every_feature() -> None:
    """The zero-copy implementation loads as reproducible (fused False) with records and async
    records, and its state says zero_copy."""
    implementation = load_implementation(SPEC)
    assert implementation.fused is False and implementation.missing == ()
    assert implementation.make(torch.float32, 1.0).state.zero_copy


def test_gradients_reach_the_accumulator_through_a_backward() -> None:
    """Each microbatch runs a backward of the adapter's own parameters in D (the judge's float32
    module keeps no .grad), converted to D first, and gives the buffered mode's bits."""
    dtype = torch.bfloat16
    adapter = wacc_torch_zero_copy(dtype, 2.0)
    buffered = WeightedGradientsAccumulator(dtype=dtype, loss_scale=2.0)
    module = build_module(SHAPES, device=torch.device("cpu"))
    grads = {"w": torch.tensor([[1.0, -0.0], [2.0**-3 + 2.0**-12, -5.0]])}  # float32: conv_D rounds
    for weight in (3, 1001, 0):
        adapter.accumulate_mean(module, weight, grads=grads)
        buffered.accumulate_mean(module, weight, grads=grads)
        assert_records_equal(adapter.state_dict(), buffered.state_dict())
    adapter.accumulate_sum(module, 2.5, grads={"head.bias": None, **grads})
    buffered.accumulate_sum(module, 2.5, grads=grads)
    assert all(p.grad is None for p in module.parameters())
    mirror = adapter._mirrors["w"]
    assert mirror.dtype == dtype and mirror.grad is not None  # .grad is the pending buffer
    result, expected = adapter.finish_mean(), buffered.finish_mean()
    assert result.grads.keys() == expected.grads.keys()
    for name, grad in expected.grads.items():
        assert_bitwise_equal(result.grads[name], grad, name)
    assert mirror.grad is None  # released after the finish, as zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("weight", "grads", "error"),
    [
        (-1.0, {"w": torch.ones(2, 2)}, InvalidWeightError),
        (1.0, {"nope": torch.ones(2, 2)}, ParameterMismatchError),
        (1.0, {"w": torch.ones(4)}, ParameterMismatchError),
        (0.0, {"w": torch.ones(2, 2, dtype=torch.int32)}, ParameterMismatchError),
        (1e-45, {"w": torch.ones(2, 2)}, InvalidWeightError),
    ],
    ids=["negative-weight", "unknown-name", "wrong-shape", "int-gradient", "weight-vanishes"],
)
def test_bad_input_raises_the_buffered_error_class_and_changes_nothing(
    weight: float, grads: dict[str, torch.Tensor], error: type[Exception]
) -> None:
    """A bad weight or gradient raises the buffered mode's class (not ZeroCopyError), with the
    record unchanged."""
    dtype = torch.float16
    module = build_module(SHAPES, device=torch.device("cpu"))
    adapter = wacc_torch_zero_copy(dtype, 1.0)
    adapter.accumulate_mean(module, 2.0, grads={"w": torch.full((2, 2), 0.5)})
    before = adapter.state_dict()
    buffered = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    with pytest.raises(error) as raised:
        adapter.accumulate_mean(module, weight, grads=grads)
    assert not isinstance(raised.value, ZeroCopyError)
    with pytest.raises(error):
        buffered.accumulate_mean(module, weight, grads=grads)
    assert_records_equal(adapter.state_dict(), before)


def test_a_planted_zero_copy_defect_is_found() -> None:
    """A zero-copy variant whose hook adopts the first gradient as the buffer (no +0.0 start)
    is flagged by the emulation oracle on a -0.0 gradient."""
    implementation = load_implementation("tests.wacc.impls:zero_copy_stealing")
    report = run_check(
        implementation, CheckConfig(dtypes=("float32",), families=("non_finite",), examples=100)
    )
    assert not report.passed
    (finding,) = report.findings
    assert finding.verdict.failed_oracles == ("emulation",), to_json(finding.verdict.scenario)
    assert any("-0.0 (-0x0.000000p+0)" in line for line in finding.verdict.describe())
