r"""Error bounds of a softmax cross-entropy head's backward and of a window of them (derived here;
constants from ``wacc_ref.bounds``): the tolerance of every test that compares an accumulated
gradient of a real model with its full-batch float64 gradient.

The head is ``z = W x + b`` with token-level softmax cross-entropy; optionally ``x = E[id]`` (an
embedding row, exact). For token t and class i, with x_t the input, p_t = softmax(z_t), y_t the
one-hot label, u the unit roundoff of the dtype D the backward runs in, γ_n = gamma(n, D), d the
input width and c the number of classes:

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
  |dẑ_ti| <= σ a_ti = σ (|p - y| + e_ti).
  A row whose label is the ignore index has dz_t = 0 exactly (its upstream gradient is 0 and
  log-softmax's backward multiplies by it): e_t = a_t = 0;
* weight/bias gradients Σ_t dẑ_ti x_tj over the microbatch's n rows (any order):
  |ĝ - g| <= σ ε, ε = Σ_t e_ti |x_tj| + γ_n Σ_t a_ti |x_tj|, and
  |ĝ| <= σ α, α = (1 + γ_n) Σ_t a_ti |x_tj|
  (x_tj := 1 for the bias);
* input gradient dx_tj = Σ_i dẑ_ti W_ij (c products, exact W): ε^x_tj = Σ_i e_ti |W_ij| +
  γ_c Σ_i a_ti |W_ij|, α^x_tj = (1 + γ_c) Σ_i a_ti |W_ij|; an embedding row's gradient is the sum
  of dx_t over the rows t with that id (at most n terms): ε = Σ_t ε^x_t + γ_n Σ_t α^x_t,
  α = (1 + γ_n) Σ_t α^x_t.

Accumulation (semantics §5/§6, reproducible order, S a power of two): the contributions are ĝ_k
(sums) or round(ĝ_k n_k) (means); in both cases σ_k m_k = 1. K batches: K - 1 additions plus at
most one product per term (γ_K), then y = buf/S exact, out = round(y / N) (one rounding, u):

    |out - g*| <= ((Σ_k ε_k + γ_K Σ_k α_k)(1 + u) + u (1 + γ_K) Σ_k α_k) / N

(a full-batch backward is the case K = 1, n = N). The bound's own evaluation in float64 has
relative error ~1e-15, far inside its slack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from wacc_ref.bounds import TOLERANCES, gamma

__all__ = ["Terms", "embedding_terms", "head_terms", "window_bound"]

Terms = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (ε, α), float64


def head_terms(
    weight: torch.Tensor,
    bias: torch.Tensor,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    dtype: str,
    *,
    ignore_index: int | None = None,
) -> tuple[Terms, tuple[torch.Tensor, torch.Tensor]]:
    """(ε, α) of the module docstring for one microbatch of ``inputs`` [n, d] and ``labels`` [n],
    in float64: the parameters' (``"weight"``, ``"bias"``) and the input's (per row, [n, d])."""
    u = TOLERANCES[dtype].unit_roundoff
    w = weight.detach().to(torch.float64)
    b = bias.detach().to(torch.float64)
    x = inputs.detach().to(torch.float64)
    classes, width = w.shape
    logits = x @ w.T + b
    logit_error = gamma(width + 1, dtype) * (x.abs() @ w.abs().T + b.abs())
    top = logits.max(dim=1, keepdim=True).values
    spread = (top - logits).max(dim=1).values
    log_sum = torch.logsumexp(logits - top, dim=1)
    error = 2 * logit_error.max(dim=1).values + gamma(classes + 8, dtype) * (
        1 + top.squeeze(1).abs() + log_sum.abs() + spread
    )
    rho = (torch.exp(error) * (1 + 2 * u) - 1).unsqueeze(1)
    probabilities = torch.softmax(logits, dim=1)
    kept = torch.ones_like(labels, dtype=torch.bool)
    if ignore_index is not None:
        kept = labels != ignore_index
    one_hot = F.one_hot(torch.where(kept, labels, 0), classes).to(torch.float64)
    g3 = gamma(3, dtype)
    e = probabilities * rho * (1 + g3) + g3 * (probabilities + one_hot)
    a = (probabilities - one_hot).abs() + e
    mask = kept.to(torch.float64).unsqueeze(1)  # an ignored row's gradient is exactly zero
    e, a = e * mask, a * mask
    g_n = gamma(len(labels), dtype)
    g_c = gamma(classes, dtype)
    parameters = {
        "weight": (e.T @ x.abs() + g_n * (a.T @ x.abs()), (1 + g_n) * (a.T @ x.abs())),
        "bias": (e.sum(0) + g_n * a.sum(0), (1 + g_n) * a.sum(0)),
    }
    return parameters, (e @ w.abs() + g_c * (a @ w.abs()), (1 + g_c) * (a @ w.abs()))


def embedding_terms(
    input_terms: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, vocabulary: int, dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ε, α) of an embedding table's gradient [vocabulary, d] from the rows' input terms
    (``head_terms(...)[1]``) and the rows' ``ids`` [n] (module docstring)."""
    epsilon, alpha = input_terms
    g_n = gamma(len(ids), dtype)
    summed_epsilon = torch.zeros(vocabulary, epsilon.shape[1], dtype=torch.float64)
    summed_alpha = torch.zeros_like(summed_epsilon)
    summed_epsilon.index_add_(0, ids, epsilon)
    summed_alpha.index_add_(0, ids, alpha)
    return summed_epsilon + g_n * summed_alpha, (1 + g_n) * summed_alpha


def window_bound(
    batches: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]], total: float, dtype: str
) -> dict[str, torch.Tensor]:
    """The module docstring's bound of a window of ``batches`` (each a name -> (ε, α) mapping
    over the same names) divided by ``total`` targets."""
    u = TOLERANCES[dtype].unit_roundoff
    g_k = gamma(len(batches), dtype)
    bound = {}
    for name in batches[0]:
        epsilon = torch.stack([terms[name][0] for terms in batches]).sum(0)
        alpha = torch.stack([terms[name][1] for terms in batches]).sum(0)
        bound[name] = ((epsilon + g_k * alpha) * (1 + u) + u * (1 + g_k) * alpha) / total
    return bound
