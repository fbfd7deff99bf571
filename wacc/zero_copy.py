"""``wacc_torch``'s zero-copy mode behind the judge's protocol: every gradient through a backward.

The judge hands an implementation its gradients as a ``grads`` mapping; the zero-copy mode takes
them only from a backward inside ``acc.microbatch(...)``. :class:`ZeroCopyAdapter` bridges the
two honestly: it keeps a *mirror* of the judge's module (the same parameter names, shapes,
devices and ``requires_grad``, in the work dtype D, since the mode refuses any other parameter
dtype) and feeds each microbatch as a real ``torch.autograd.backward`` of the mirror's parameters
with the given gradients as seeds, so the gradients reach the mode's hooks on ``AccumulateGrad``
exactly as a training loop's would. Each gradient is converted to D first (``.to(D)``, the same
copy kernel as the buffered mode's ``work.copy_(grad)``): conv_D is the first step of semantics
§5 and §6 anyway, and autograd hands a parameter's hook gradients in the parameter's dtype. A
None (or missing) gradient is left out of the backward, so its parameter receives nothing.

The mirror's parameters are reused across calls (their ``.grad`` are the pending buffers) and
replaced only when the judge's module changed; after a finish the ``.grad`` are set to None, as
``optimizer.zero_grad(set_to_none=True)`` does after a step. The gradients' structure is
checked with the buffered mode's rules and error class (:class:`ParameterMismatchError`) in
semantics §5's check order: the weight's own validity first (``wacc_torch``'s own rule), then the
gradients' structure, then, by entering the block, the tracked set (which never changes inside a
judged scenario), the environment and whether a mean's weight survives D. So a call with both a
malformed gradient and a mean weight that does not survive D names the gradient, as the buffered
mode does (the structural family hands such calls: :mod:`wacc_ref.faults`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from wacc.judge.modules import module_of
from wacc_torch import (
    AccumulatedGradients,
    AccumulatorState,
    ParameterMismatchError,
    StateDictHandle,
    WeightedGradientsAccumulator,
)
from wacc_torch._dtypes import GRADIENT_DTYPES
from wacc_torch._weights import read_weight
from wacc_torch.zero_copy import Kind

__all__ = ["ZeroCopyAdapter"]


class ZeroCopyAdapter:
    """A zero-copy ``WeightedGradientsAccumulator`` with the buffered API (see the module doc)."""

    def __init__(self, accumulator: WeightedGradientsAccumulator) -> None:
        if not accumulator.state.zero_copy:
            raise ValueError("ZeroCopyAdapter needs an accumulator made with zero_copy=True")
        self._accumulator = accumulator
        self._dtype = accumulator.state.dtype
        self._mirrors: dict[str, nn.Parameter] = {}

    @property
    def state(self) -> AccumulatorState:
        """The zero-copy accumulator's state (``zero_copy=True``)."""
        return self._accumulator.state

    def _mirror(self, module: nn.Module) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        """The mirror of ``module`` and its parameters, the previous ones wherever they fit."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        mirrors: dict[str, nn.Parameter] = {}
        for name, parameter in module.named_parameters():
            mirror = self._mirrors.get(name)
            if (
                mirror is None
                or mirror.shape != parameter.shape
                or (mirror.device != parameter.device)
            ):
                mirror = nn.Parameter(
                    torch.zeros(parameter.shape, dtype=self._dtype, device=parameter.device)
                )
            mirror.requires_grad_(parameter.requires_grad)
            mirrors[name] = mirror
        return module_of(mirrors), mirrors

    def _seeds(
        self, mirrors: Mapping[str, nn.Parameter], grads: Mapping[str, Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The backward's roots (mirror parameters) and seeds (gradients in D), checked."""
        if not isinstance(grads, Mapping):
            raise TypeError(
                f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
            )
        tracked = {name: p for name, p in mirrors.items() if p.requires_grad}
        unknown = [name for name in grads if name not in tracked]
        if unknown:
            raise ParameterMismatchError(
                f"grads names parameter(s) {unknown!r} that are not tracked "
                f"(tracked: {list(tracked)!r})"
            )
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor] = []
        for name, parameter in tracked.items():
            grad = grads.get(name)
            if grad is None:
                continue
            if not isinstance(grad, torch.Tensor):
                raise ParameterMismatchError(
                    f"gradient of {name!r} must be a tensor or None, got {type(grad).__name__}"
                )
            if grad.dtype not in GRADIENT_DTYPES or grad.layout != torch.strided:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has dtype {grad.dtype} and layout {grad.layout}: a "
                    f"dense gradient of one of {sorted(map(str, GRADIENT_DTYPES))} is required"
                )
            if grad.shape != parameter.shape or grad.device != parameter.device:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has shape {list(grad.shape)} on {grad.device}, the "
                    f"parameter has shape {list(parameter.shape)} on {parameter.device}"
                )
            roots.append(parameter)
            seeds.append(grad.detach().to(self._dtype))  # conv_D: semantics §5/§6's first step
        return roots, seeds

    def _accumulate(
        self,
        module: nn.Module,
        weight: float | torch.Tensor,
        grads: Mapping[str, Any] | None,
        *,
        kind: Kind,
    ) -> None:
        shadow, mirrors = self._mirror(module)
        taken = grads is None
        if grads is None:  # like the buffered mode: the module's .grad, taken out on success
            grads = {name: p.grad for name, p in module.named_parameters() if p.requires_grad}
        read_weight(weight)  # §5's first check, before the gradients' structure
        roots, seeds = self._seeds(mirrors, grads)
        with self._accumulator.microbatch(shadow, weight=weight, kind=kind):
            if roots:
                torch.autograd.backward(roots, grad_tensors=seeds)
        self._mirrors = mirrors
        if taken:
            for parameter in module.parameters():
                if parameter.requires_grad:
                    parameter.grad = None

    def accumulate_sum(
        self,
        module: nn.Module,
        weight: float | torch.Tensor,
        *,
        grads: Mapping[str, Any] | None = None,
    ) -> None:
        """``accumulate_sum`` as one zero-copy ``kind="sum"`` block with a real backward."""
        self._accumulate(module, weight, grads, kind="sum")

    def accumulate_mean(
        self,
        module: nn.Module,
        weight: float | torch.Tensor,
        *,
        grads: Mapping[str, Any] | None = None,
    ) -> None:
        """``accumulate_mean`` as one zero-copy ``kind="mean"`` block with a real backward."""
        self._accumulate(module, weight, grads, kind="mean")

    def _release(self) -> None:
        # After a finish the result holds the tensors; the mirror's .grad start the next window
        # empty, as optimizer.zero_grad(set_to_none=True) leaves them after a step.
        for mirror in self._mirrors.values():
            mirror.grad = None

    def finish_sums(self) -> AccumulatedGradients:
        """The window's sums (the mirror's ``.grad`` until now); the ``.grad`` are released."""
        result = self._accumulator.finish_sums()
        self._release()
        return result

    def finish_mean(self) -> AccumulatedGradients:
        """The window's mean (divided in ``.grad``); the ``.grad`` are released."""
        result = self._accumulator.finish_mean()
        self._release()
        return result

    def set_loss_scale(self, loss_scale: float) -> None:
        """The accumulator's ``set_loss_scale`` (no block is open between calls)."""
        self._accumulator.set_loss_scale(loss_scale)

    def state_dict(self) -> dict[str, Any]:
        """The zero-copy accumulator's record (the buffered mode's schema)."""
        return self._accumulator.state_dict()

    def state_dict_async(self) -> StateDictHandle:
        """The zero-copy accumulator's asynchronous record."""
        return self._accumulator.state_dict_async()

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        """Restore ``record`` into the mirror of ``module`` (its buffers become the ``.grad``)."""
        shadow, mirrors = self._mirror(module)
        self._accumulator.load_state_dict(record, shadow)
        self._mirrors = mirrors
