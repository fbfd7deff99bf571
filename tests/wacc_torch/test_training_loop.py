r"""§1: microbatches of 1, 7, 200 and 3 tokens give the full-batch gradient of a real model.

The model is ``nn.Linear(8, 5)`` with token-level softmax cross-entropy. The truth is the
full-batch gradient ``g*`` of the mean loss over all N = 211 tokens, computed in float64.

The tolerance is the bound of ``tests/wacc_torch/backward_bounds.py`` (derived there; constants
from ``wacc_ref.bounds``) for the accumulated window, plus the same bound, in float64 with one
batch of all N tokens, for the float64 truth itself.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.wacc_torch.backward_bounds import head_terms, window_bound
from tests.wacc_torch.support import DEVICES
from wacc_torch import WeightedGradientsAccumulator

IN_FEATURES = 8
CLASSES = 5
TOKENS = (1, 7, 200, 3)
SCALE = 2.0**10


def _problem(device: str, dtype: torch.dtype) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(31337)
    total = sum(TOKENS)
    model = nn.Linear(IN_FEATURES, CLASSES)
    with torch.no_grad():
        model.weight.copy_(torch.randn(CLASSES, IN_FEATURES, generator=generator))
        model.bias.copy_(torch.randn(CLASSES, generator=generator))
    inputs = torch.randn(total, IN_FEATURES, generator=generator)
    # A class imbalance that differs between microbatches, so that equal microbatch weights
    # are visibly wrong: the 1-token batch sees class 0, the big one mostly the others.
    labels = torch.randint(1, CLASSES, (total,), generator=generator)
    labels[0] = 0
    return (
        model.to(device=device, dtype=dtype),
        inputs.to(device=device, dtype=dtype),
        labels.to(device),
    )


def _slices() -> list[slice]:
    starts = [sum(TOKENS[:k]) for k in range(len(TOKENS))]
    return [slice(start, start + count) for start, count in zip(starts, TOKENS, strict=True)]


def _full_batch_truth(
    model: nn.Linear, inputs: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model).to(torch.float64)
    loss = F.cross_entropy(reference(inputs.to(torch.float64)), labels, reduction="mean")
    loss.backward()
    return {
        name: p.grad.detach().clone()
        for name, p in reference.named_parameters()
        if p.grad is not None
    }


def _window_bound(
    model: nn.Linear, inputs: torch.Tensor, labels: torch.Tensor, dtype: str, batches: list[slice]
) -> dict[str, torch.Tensor]:
    terms = [head_terms(model.weight, model.bias, inputs[b], labels[b], dtype)[0] for b in batches]
    return window_bound(terms, len(labels), dtype)


def _accumulated(
    model: nn.Linear, inputs: torch.Tensor, labels: torch.Tensor, kind: str
) -> dict[str, torch.Tensor]:
    accumulator = WeightedGradientsAccumulator(dtype=model.weight.dtype, loss_scale=SCALE)
    for batch in _slices():
        reduction = "sum" if kind == "sum" else "mean"
        loss = F.cross_entropy(model(inputs[batch]), labels[batch], reduction=reduction)
        (loss * SCALE).backward()
        count = batch.stop - batch.start
        if kind == "sum":
            accumulator.accumulate_sum(model, count)
        else:
            accumulator.accumulate_mean(model, count)
    result = accumulator.finish_mean()
    assert result.weight == sum(TOKENS) and result.issued == len(TOKENS)
    grads = {}
    for name, grad in result.grads.items():
        assert grad is not None
        grads[name] = grad
    return grads


def _naive_loop(
    model: nn.Linear, inputs: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The common loop: each microbatch's mean loss divided by the number of microbatches."""
    model.zero_grad(set_to_none=True)
    for batch in _slices():
        loss = F.cross_entropy(model(inputs[batch]), labels[batch], reduction="mean")
        loss /= len(TOKENS)
        loss.backward()
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def _ratio(
    actual: dict[str, torch.Tensor], truth: dict[str, torch.Tensor], bound: dict[str, torch.Tensor]
) -> float:
    worst = 0.0
    for name, value in truth.items():
        error = (actual[name].to(torch.float64) - value).abs()
        worst = max(worst, float((error / bound[name]).max()))
    return worst


def _relative_error(actual: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    difference = torch.cat([(actual[n].to(torch.float64) - truth[n]).flatten() for n in truth])
    reference = torch.cat([truth[n].flatten() for n in truth])
    return float(difference.norm() / reference.norm())


@pytest.mark.parametrize("kind", ["sum", "mean"])
@pytest.mark.parametrize("device", DEVICES)
def test_float32_microbatches_give_the_full_batch_gradient(device: str, kind: str) -> None:
    """Token-weighted float32 accumulation of 1/7/200/3-token batches is within the bound of g*."""
    model, inputs, labels = _problem(device, torch.float32)
    truth = _full_batch_truth(model, inputs, labels)
    actual = _accumulated(model, inputs, labels, kind)
    everything = [slice(0, sum(TOKENS))]
    bound32 = _window_bound(model, inputs, labels, "float32", _slices())
    bound64 = _window_bound(model, inputs, labels, "float64", everything)
    bound = {name: bound32[name] + bound64[name] for name in truth}
    ratio = _ratio(actual, truth, bound)
    assert ratio <= 1.0, f"{kind}: error/bound = {ratio}"


@pytest.mark.parametrize("kind", ["sum", "mean"])
@pytest.mark.parametrize("device", DEVICES)
def test_float64_microbatches_give_the_full_batch_gradient(device: str, kind: str) -> None:
    """In float64 the accumulated gradient equals the full-batch one to float64 rounding."""
    model, inputs, labels = _problem(device, torch.float64)
    truth = _full_batch_truth(model, inputs, labels)
    actual = _accumulated(model, inputs, labels, kind)
    bound_windowed = _window_bound(model, inputs, labels, "float64", _slices())
    bound_full = _window_bound(model, inputs, labels, "float64", [slice(0, sum(TOKENS))])
    bound = {name: bound_windowed[name] + bound_full[name] for name in truth}
    ratio = _ratio(actual, truth, bound)
    assert ratio <= 1.0, f"{kind}: error/bound = {ratio}"


@pytest.mark.parametrize("device", DEVICES)
def test_loss_divided_by_accum_steps_is_off_by_more_than_ten_percent(device: str) -> None:
    """The ``loss /= accum_steps`` loop misses g* by > 10% on the same batches."""
    model, inputs, labels = _problem(device, torch.float32)
    truth = _full_batch_truth(model, inputs, labels)
    naive = _naive_loop(model, inputs, labels)
    error = _relative_error(naive, truth)
    assert math.isfinite(error) and error > 0.1, f"relative error of the naive loop: {error}"
