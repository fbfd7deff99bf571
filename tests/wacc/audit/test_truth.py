"""The truth: the float64 full-window mean-loss gradient, and the float64-cleanliness check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wacc.audit.metrics import bound_for, normwise_ratio
from wacc.audit.models import MODEL_KINDS, causal_lm_loss_sum, logits_of
from wacc.audit.truth import compute_truth, flatten
from wacc.audit.windows import WINDOW_NAMES, build_window


@pytest.mark.parametrize("name", WINDOW_NAMES)
def test_truth_is_the_one_big_batch_gradient(name: str) -> None:
    """The truth agrees with the gradient of one batched float64 forward over the whole window
    within the float32 bound it is used at (a wrong shift, count or weight is ~1e5 beyond it)."""
    window = build_window(name)
    spec = MODEL_KINDS["plain"]
    truth = compute_truth(spec, torch.float32, window)
    model = spec.build(torch.float32).to(torch.float64)
    ids = torch.stack([mb["input_ids"] for mb in window.microbatches])
    labels = torch.stack([mb["labels"] for mb in window.microbatches])
    (causal_lm_loss_sum(logits_of(model(input_ids=ids)), labels) / window.total_targets).backward()
    batched = flatten({n: p.grad for n, p in model.named_parameters()}, truth.names)
    assert normwise_ratio(batched, truth, bound_for(truth, "float32")) <= 1.0
    assert truth.float64_clean


@pytest.mark.parametrize("name", ["unequal", "zero"])
def test_microbatch_sums_bit_for_bit(name: str) -> None:
    """Each g_k is, bit for bit, torch.autograd.grad of that microbatch's float64 loss sum."""
    window = build_window(name)
    spec = MODEL_KINDS["plain"]
    truth = compute_truth(spec, torch.float32, window)
    model = spec.build(torch.float32).to(torch.float64)
    params = dict(model.named_parameters())
    for k, mb in enumerate(window.microbatches):
        logits = logits_of(model(input_ids=mb["input_ids"][None]))
        loss = causal_lm_loss_sum(logits, mb["labels"][None])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        mapping = {n: g if g is not None else torch.zeros_like(params[n])
                   for n, g in zip(params, grads, strict=True)}  # fmt: skip
        assert np.array_equal(flatten(mapping, truth.names), truth.microbatch_sums[k])


def test_truth_sums_are_per_microbatch() -> None:
    """Σ_k g_k / N is the truth, and a zero-target microbatch's g_k is exactly zero."""
    window = build_window("zero")
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, window)
    assert np.array_equal(np.sum(np.stack(truth.microbatch_sums), axis=0) / 48, truth.gradient)
    zero = window.targets.index(0)
    assert not truth.microbatch_sums[zero].any()


def test_casts_to_float32_are_detected() -> None:
    """Llama's float32 RMSNorm and transformers' `logits.float()` loss are reported."""
    pytest.importorskip("transformers")
    window = build_window("unequal")
    llama = compute_truth(MODEL_KINDS["llama"], torch.float32, window)
    assert not llama.float64_clean and any("float32" in c for c in llama.casts)
    gpt2 = compute_truth(MODEL_KINDS["gpt2"], torch.float32, window)
    assert gpt2.float64_clean  # its forward is float64 throughout ...
    assert any(c.startswith("float ") for c in gpt2.loss_casts)  # ... its own loss is not
