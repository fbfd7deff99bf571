"""The floating-point and device environment: flush-to-zero is refused where it would change
results (both packages, nothing changed), and wacc_torch works under a meta default device."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import wacc_torch
from tests.wacc_torch.support import TwoLayer, assert_records_equal, grads_snapshot
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.errors import UnsupportedEnvironmentError as ReferenceEnvironmentError
from wacc_torch import UnsupportedEnvironmentError

PARAMS = {"w": (2,)}


@pytest.fixture
def flush_denormals() -> Iterator[None]:
    """CPU flush-to-zero / denormals-are-zero on for the test, always off again afterwards."""
    if not torch.set_flush_denormal(True):
        torch.set_flush_denormal(False)
        pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
    try:
        assert torch.tensor([2.0**-130]).mul(1.0).item() == 0.0  # the mode really is on
        assert wacc_torch.denormals_flushed()  # and is detected (what a report shows)
        yield
    finally:
        torch.set_flush_denormal(False)
        assert not wacc_torch.denormals_flushed()


def test_flush_to_zero_is_refused_by_wacc_torch_and_changes_nothing(
    flush_denormals: None,
) -> None:
    """Under FTZ/DAZ accumulate, finish_mean and normalize_sums on the CPU raise
    UnsupportedEnvironmentError, leaving the window and .grad as they were."""
    module = TwoLayer()
    accumulator = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    torch.set_flush_denormal(False)  # a window with a subnormal in it, made in IEEE mode
    accumulator.accumulate_sum(module, 1, grads={"first.bias": torch.full((3,), 2.0**-130)})
    torch.set_flush_denormal(True)
    for parameter in module.parameters():
        parameter.grad = torch.ones_like(parameter)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    calls: list[Callable[[], object]] = [
        lambda: accumulator.accumulate_sum(module, 1),
        lambda: accumulator.accumulate_mean(module, 2),
        accumulator.finish_mean,
        lambda: normalize_in_place(record["pending"]),
    ]
    for call in calls:
        with pytest.raises(UnsupportedEnvironmentError, match="set_flush_denormal"):
            call()
    assert_records_equal(accumulator.state_dict(), record)
    assert all(
        torch.equal(p.grad, grads[n]) for n, p in module.named_parameters() if p.grad is not None
    )
    # Zero-weight batches compute nothing, so they are not refused.
    accumulator.accumulate_sum(module, 0)
    assert accumulator.state.zero_weight == 1


def normalize_in_place(pending: dict[str, torch.Tensor]) -> object:
    return wacc_torch.normalize_sums(
        {name: buffer.clone() for name, buffer in pending.items()},
        loss_scale=1.0,
        total_weight=1.0,
        in_place=True,
    )


def test_flush_to_zero_is_refused_by_wacc_ref_with_the_same_class(flush_denormals: None) -> None:
    """The reference refuses FTZ with its class of the same name, before changing anything."""
    reference = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    with pytest.raises(ReferenceEnvironmentError, match="flush"):
        reference.accumulate_sum(PARAMS, 1, grads={"w": [1.0, 2.0]})
    assert reference.state.issued == 0


@pytest.mark.parametrize(
    ("dtype", "weight"),
    [("float32", 1e-40), ("float32", 1e-50), ("float16", 1e6), ("bfloat16", 3.0)],
    ids=["subnormal-w_D", "w_D-zero", "w_D-inf", "ordinary"],
)
def test_under_flush_to_zero_both_packages_refuse_a_mean_before_reading_its_weight(
    dtype: str, weight: float, flush_denormals: None
) -> None:
    """The environment is checked before w_D and W are computed (semantics §5 Reading: the order
    of the checks), in both packages: a mean weight whose w_D is subnormal in D, 0 or infinite
    raises UnsupportedEnvironmentError like an ordinary one, never an InvalidWeightError that
    flush-to-zero made up (1e-40 survives float32 as a subnormal)."""
    production = wacc_torch.WeightedGradientsAccumulator(
        dtype=getattr(torch, dtype), loss_scale=1.0
    )
    reference = ReferenceAccumulator(dtype=dtype, loss_scale=1.0)
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(2))
    with pytest.raises(UnsupportedEnvironmentError):
        production.accumulate_mean(module, weight, grads={"w": torch.ones(2)})
    with pytest.raises(ReferenceEnvironmentError):
        reference.accumulate_mean(PARAMS, weight, grads={"w": [1.0, 1.0]})
    assert production.state.issued == 0 and reference.state.issued == 0


def _run_window(module: nn.Module) -> tuple[dict[str, object], dict[str, object], object]:
    accumulator = wacc_torch.WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=4.0)
    cpu = torch.device("cpu")  # the caller's tensors; the accumulator's own get no device
    accumulator.accumulate_mean(
        module, 1001, grads={"first.weight": torch.full((3, 4), 3.0, device=cpu)}
    )
    accumulator.accumulate_sum(
        module, torch.tensor(7, device=cpu), grads={"second.bias": torch.ones(2, device=cpu)}
    )
    record = accumulator.state_dict()
    handle = accumulator.state_dict_async()
    restored = wacc_torch.WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=4.0)
    restored.load_state_dict(record, module)
    mean = restored.finish_mean()
    normalized = wacc_torch.normalize_sums(
        dict(mean.grads), loss_scale=1.0, total_weight=2.0, in_place=False
    )
    return record, handle.result(), (mean, normalized)


def test_works_with_a_meta_default_device() -> None:
    """Under torch.set_default_device("meta") every call gives the same results as without:
    the accumulator makes each of its tensors on an explicit device."""
    expected_record, expected_async, (expected_mean, expected_normalized) = _run_window(TwoLayer())
    module = TwoLayer()
    with torch.device("meta"):
        record, from_async, (mean, normalized) = _run_window(module)
    assert_records_equal(record, expected_record)  # type: ignore[arg-type]
    assert_records_equal(from_async, expected_async)  # type: ignore[arg-type]
    for name, grad in expected_mean.grads.items():  # type: ignore[attr-defined]
        got = mean.grads[name]  # type: ignore[attr-defined]
        assert (got is None and grad is None) or torch.equal(got, grad)
        assert (normalized[name] is None) == (grad is None)  # type: ignore[index]
        if grad is not None:
            assert torch.equal(normalized[name], expected_normalized[name])  # type: ignore[index]
