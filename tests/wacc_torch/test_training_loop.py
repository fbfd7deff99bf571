r"""§1: microbatches of 1, 7, 200 and 3 tokens give the full-batch gradient of a real model.

The model is ``nn.Linear(8, 5)`` with token-level softmax cross-entropy. The truth is the
full-batch gradient ``g*`` of the mean loss over all N = 211 tokens, computed in float64.

Error bound of one microbatch's backward (derived here; constants from ``wacc_ref.bounds``)
-------------------------------------------------------------------------------------------
For token t and class i, with x_t the input, z_t = W x_t + b, p_t = softmax(z_t), y_t the one-hot
label, u the unit roundoff of the dtype D the backward runs in, γ_n = gamma(n, D):

* logits (addmm, any summation order, FMA or not): |ẑ_ti - z_ti| <= Δz_ti =
  γ_{d+1} (|b_i| + Σ_j |W_ij| |x_tj|)  (Higham, Thm 3.5 / eq. 3.5 for a dot product plus bias);
* log-softmax ℓ_t = z_t - m_t - L_t, m_t = max_k z_tk, L_t = log Σ_k exp(z_tk - m_t): moving z by
  at most Δz moves ℓ_ti by <= 2 max_k Δz_tk; evaluating it in D costs one subtraction z - m (error
  <= u R_t, R_t = max_k (m_t - z_tk)), exp and log (each <= 1 ulp <= 2u relative), a sum of c terms
  (γ_{c-1}) and at most two more subtractions/additions (<= u (|m_t| + |L_t| + R_t) each): all
  of it is covered by γ_{c+8} (1 + |m_t| + |L_t| + R_t). So |ℓ̂_ti - ℓ_ti| <= E_t =
  2 max_k Δz_tk + γ_{c+8} (1 + |m_t| + |L_t| + R_t);
* backward of log-softmax + NLL: dz_ti = σ (p̂_ti - y_ti) with p̂ = exp(ℓ̂) (1 ulp) and σ = 1 for a
  loss sum, 1/n (rounded) for a loss mean: |p̂ - p| <= p ρ_t, ρ_t = exp(E_t)(1 + 2u) - 1, and at most
  three more roundings (1/n, the product, the subtraction):
  |dẑ_ti - dz_ti| <= σ e_ti, e_ti = p ρ_t (1 + γ_3) + γ_3 (p + y);
  |dẑ_ti| <= σ a_ti = σ (|p - y| + e_ti);
* weight/bias gradients Σ_t dẑ_ti x_tj over the microbatch's n tokens (any order):
  |ĝ - g| <= σ ε, ε = Σ_t e_ti |x_tj| + γ_n Σ_t a_ti |x_tj|, and
  |ĝ| <= σ α, α = (1 + γ_n) Σ_t a_ti |x_tj|
  (x_tj := 1 for the bias).

Accumulation (semantics §5/§6, reproducible order, S a power of two): the contributions are ĝ_k
(sums) or round(ĝ_k n_k) (means); in both cases σ_k m_k = 1. K = 4 batches: K - 1 additions plus at
most one product per term (γ_K), then y = buf/S exact, out = round(y / N) (one rounding, u):

    |out - g*| <= ((Σ_k ε_k + γ_K Σ_k α_k)(1 + u) + u (1 + γ_K) Σ_k α_k) / N  (+ the same bound,
    in float64 with K = 1 and n = N, for the float64 truth itself).

The bound's own evaluation in float64 has relative error ~1e-15, far inside its slack.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.wacc_torch.support import DEVICES
from wacc_ref.bounds import TOLERANCES, gamma
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


def _backward_terms(
    model: nn.Linear, inputs: torch.Tensor, labels: torch.Tensor, dtype: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(ε, α) of the module docstring for one microbatch, per parameter, in float64."""
    u = TOLERANCES[dtype].unit_roundoff
    weight = model.weight.detach().to(torch.float64)
    bias = model.bias.detach().to(torch.float64)
    x = inputs.to(torch.float64)
    logits = x @ weight.T + bias
    logit_error = gamma(IN_FEATURES + 1, dtype) * (x.abs() @ weight.abs().T + bias.abs())
    top = logits.max(dim=1, keepdim=True).values
    spread = (top - logits).max(dim=1).values
    log_sum = torch.logsumexp(logits - top, dim=1)
    error = 2 * logit_error.max(dim=1).values + gamma(CLASSES + 8, dtype) * (
        1 + top.squeeze(1).abs() + log_sum.abs() + spread
    )
    rho = (torch.exp(error) * (1 + 2 * u) - 1).unsqueeze(1)
    probabilities = torch.softmax(logits, dim=1)
    one_hot = F.one_hot(labels, CLASSES).to(torch.float64)
    g3 = gamma(3, dtype)
    e = probabilities * rho * (1 + g3) + g3 * (probabilities + one_hot)
    a = (probabilities - one_hot).abs() + e
    g_n = gamma(len(labels), dtype)
    return {
        "weight": (e.T @ x.abs() + g_n * (a.T @ x.abs()), (1 + g_n) * (a.T @ x.abs())),
        "bias": (e.sum(0) + g_n * a.sum(0), (1 + g_n) * a.sum(0)),
    }


def _window_bound(
    model: nn.Linear, inputs: torch.Tensor, labels: torch.Tensor, dtype: str, batches: list[slice]
) -> dict[str, torch.Tensor]:
    u = TOLERANCES[dtype].unit_roundoff
    g_k = gamma(len(batches), dtype)
    terms = [_backward_terms(model, inputs[b], labels[b], dtype) for b in batches]
    total = len(labels)
    bound = {}
    for name in ("weight", "bias"):
        epsilon = sum(t[name][0] for t in terms)
        alpha = sum(t[name][1] for t in terms)
        assert isinstance(epsilon, torch.Tensor) and isinstance(alpha, torch.Tensor)
        bound[name] = ((epsilon + g_k * alpha) * (1 + u) + u * (1 + g_k) * alpha) / total
    return bound


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
