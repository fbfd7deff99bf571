"""The truth: the gradient of the mean token loss over the whole window, in float64.

Computed once per window on a float64 copy of the audited model (``ModelSpec.build(dtype)`` then
``.to(float64)``: the same weights exactly).  Per microbatch ``k`` the float64 gradient ``g_k`` of
its loss *sum* is kept, because the float32 bound of :mod:`wacc_ref.bounds` is a bound on summing
exactly those; the truth is ``Σ_k g_k / N`` with ``N = Σ_k n_k`` the true target count.  The
microbatch, the forward and the labels the loss counts are the model family's
(:class:`wacc.audit.models.Family`): shifted labels != -100 for a causal LM, unshifted ones for a
masked LM and for a seq2seq decoder (fed the labels shifted right); the family's prepared
microbatch must count exactly the window's ``n_k`` (checked).

Across ranks the truth is computed on every rank's microbatches together
(:func:`wacc.audit.windows.world_window`): ``Σ_k g_k / N`` over all of them, ``N`` every rank's
target tokens; :func:`rank_sums` splits the ``g_k`` back into per-rank sums ``G_r`` and
:func:`equal_rank_mean` is what a loop that averages per-rank means computes.

The gradient is that of the model's *trainable* parameters (``requires_grad``), in
``named_parameters`` order: every parameter for a model trained whole, only the adapters for a
LoRA model (whose frozen base weights get no gradient from any loop; the runner compares the
loops' gradients on exactly these names).

float64-clean: a model that casts to float32 internally (e.g. an RMSNorm computed in float32)
makes a float64 copy only float32-accurate.  Every torch function called in the float64 forward is
watched (``torch.overrides.TorchFunctionMode``); one whose floating result is not float64 is listed:
``Truth.casts`` for the forward to the logits (the truth itself is then float32-accurate there),
``Truth.loss_casts`` for the model's *own* loss (``model(**microbatch)`` with its labels, what the
loops call; e.g. ``transformers``' ``ForCausalLMLoss`` runs ``logits.float()``, which for float64
logits is a cast *down*).  The truth never uses the model's own loss: it applies a float64
cross-entropy to the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.overrides import TorchFunctionMode

from wacc.audit.models import ModelSpec
from wacc.audit.windows import Window

__all__ = ["Truth", "compute_truth", "equal_rank_mean", "flatten", "rank_sums"]


class _CastWatcher(TorchFunctionMode):
    """Notes every torch function whose floating-point result is not float64."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: set[str] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, tuple | list) else (result,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                if out.dtype != torch.float64:
                    self.casts.add(f"{getattr(func, '__name__', repr(func))} -> {out.dtype}")
        return result


@dataclass(frozen=True)
class Truth:
    """The window's exact-in-float64 gradient and what it was computed from."""

    names: tuple[str, ...]
    gradient: NDArray[np.float64]  # Σ_k g_k / N, flattened in ``names`` order
    microbatch_sums: tuple[NDArray[np.float64], ...]  # g_k: gradient of microbatch k's loss sum
    targets: tuple[int, ...]
    casts: tuple[str, ...]  # forward to the logits: functions with a non-float64 float result
    loss_casts: tuple[str, ...]  # the model's own loss path: the same, beyond ``casts``

    @property
    def float64_clean(self) -> bool:
        """Whether the float64 copy computes in float64 throughout."""
        return not self.casts


def flatten(grads: Mapping[str, torch.Tensor], names: Iterable[str]) -> NDArray[np.float64]:
    """The gradients as one float64 vector in ``names`` order (exact: float64 holds them)."""
    parts = [grads[n].detach().to("cpu", torch.float64).reshape(-1).numpy() for n in names]
    return np.concatenate(parts) if parts else np.zeros(0)


def compute_truth(spec: ModelSpec, dtype: torch.dtype, window: Window) -> Truth:
    """The truth for ``window`` on ``spec``'s model converted to ``dtype``, then float64."""
    model: nn.Module = spec.build(dtype).to(torch.float64)
    model.train()
    names = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    family = spec.loss_family
    watcher = _CastWatcher()
    sums: list[NDArray[np.float64]] = []
    prepared = [{k: v[None] for k, v in spec.prepare(mb).items()} for mb in window.microbatches]
    counted = tuple(family.count(batch["labels"]) for batch in prepared)
    if counted != window.targets:  # a family that changed the window's counts: a bug here
        raise AssertionError(f"{spec.name}: {family.name} counts {counted}, not {window.targets}")
    for batch in prepared:
        model.zero_grad(set_to_none=True)
        with watcher:
            logits = family.logits(model, batch)
            loss_sum = family.loss_sum(logits, batch["labels"])
        if not torch.isfinite(loss_sum):
            raise ArithmeticError(f"window {window.name}: the float64 loss is {loss_sum.item()}")
        loss_sum.backward()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p)
                 for n, p in model.named_parameters() if p.requires_grad}  # fmt: skip
        sums.append(flatten(grads, names))
    own_loss = _CastWatcher()
    with own_loss, torch.no_grad():
        model(**prepared[0])
    total = window.total_targets
    # Four to a few dozen float64 additions: their error is ~2**-50 relative, far below any
    # float32/bf16/fp16 bound the truth is compared at.
    gradient = np.sum(np.stack(sums), axis=0) / total
    return Truth(
        names=names,
        gradient=gradient,
        microbatch_sums=tuple(sums),
        targets=window.targets,
        casts=tuple(sorted(watcher.casts)),
        loss_casts=tuple(sorted(own_loss.casts - watcher.casts)),
    )


def rank_sums(truth: Truth, rank_targets: Sequence[Sequence[int]]) -> list[NDArray[np.float64]]:
    """Per rank, the float64 gradient of its window's loss sum, ``G_r = Σ_{k in r} g_k``, for a
    truth computed on :func:`wacc.audit.windows.world_window` (``rank_targets``: each rank's
    ``Window.targets``, in rank order)."""
    sizes = [len(t) for t in rank_targets]
    if (
        sum(sizes) != len(truth.microbatch_sums)
        or tuple(n for t in rank_targets for n in t) != truth.targets
    ):
        raise ValueError(f"rank targets {rank_targets} are not the truth's {truth.targets}")
    out, start = [], 0
    for size in sizes:
        out.append(np.sum(np.stack(truth.microbatch_sums[start : start + size]), axis=0))
        start += size
    return out


def equal_rank_mean(truth: Truth, rank_targets: Sequence[Sequence[int]]) -> NDArray[np.float64]:
    """What a loop that weighs ranks equally computes, exactly: ``(1/R) Σ_r G_r / n_r``, the mean
    over the R ranks of each rank's token mean (NaN where a rank has no target token: its mean is
    0/0).  Its distance from ``truth.gradient = Σ_r G_r / Σ_r n_r`` is the predicted error."""
    means = []
    for total, targets in zip(rank_sums(truth, rank_targets), rank_targets, strict=True):
        n = sum(targets)
        means.append(total / n if n > 0 else np.full_like(total, np.nan))
    return np.sum(np.stack(means), axis=0) / len(means)
