"""What an accumulator reports: its state (semantics §3) and a finished window (§7, §8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from wacc_torch import _commit
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._finite import narrower
from wacc_torch.errors import ParameterMismatchError

__all__ = ["AccumulatedGradients", "AccumulatorState"]


@dataclass(frozen=True)
class AccumulatorState:
    """A copy of an accumulator's options and window counters (semantics §3).

    ``total_weight`` is W, the float64 sum of the counted weights in issue order; ``fused``
    says whether means are accumulated in the opt-in one-pass mode; ``zero_copy`` whether the
    pending buffers are the parameters' ``.grad`` (:mod:`wacc_torch.zero_copy`).
    """

    dtype: torch.dtype
    loss_scale: float
    issued: int
    zero_weight: int
    total_weight: float
    fused: bool
    zero_copy: bool = False


@dataclass(frozen=True)
class AccumulatedGradients:
    """What ``finish_sums`` / ``finish_mean`` hand over.

    ``grads`` maps every tracked parameter name to its tensor in the work dtype (the pending
    buffer itself for sums, not a copy), or None when the parameter received no gradient in any
    positive-weight batch of the window. ``normalized`` is False for sums (still scaled by
    ``loss_scale`` and not divided by ``weight``) and True for means. ``found_inf`` says whether
    any element of any of these tensors is NaN or ±inf (for sums, of the scaled sums; for means,
    of the means): the window overflowed, and a dynamic loss scale skips it
    (:class:`wacc_torch.WindowLossScaler`). For ``finish_mean`` and the DDP hook it is also True
    when a mean becomes ±inf in its parameter's dtype, where the optimizer reads it (semantics
    §8). The distributed helpers answer it for the reduced result, the same on every rank.
    """

    grads: dict[str, torch.Tensor | None]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool
    found_inf: bool

    def apply_to(self, module: nn.Module) -> None:
        """Write each gradient into the matching parameter's ``.grad``.

        Each tensor is converted to that parameter's dtype (and device); a None gradient sets
        ``.grad`` to None. Parameters not named in ``grads`` are left alone. When no conversion
        is needed the ``.grad`` is the tensor held here, not a copy. Every name and shape is
        checked and every conversion made before any ``.grad`` is written
        (:class:`ParameterMismatchError`; a failed conversion writes nothing either). A
        conversion of dtype on the CPU rounds with gradual underflow, so it refuses
        flush-to-zero in the calling thread (:class:`UnsupportedEnvironmentError`). With
        ``found_inf`` False, a gradient that the conversion to a narrower parameter dtype makes
        ±inf is refused (:class:`ParameterMismatchError`, nothing written): the optimizer would
        step on an inf the result said was not there.
        """
        parameters = dict(module.named_parameters())
        converting_on_cpu = False
        for name, grad in self.grads.items():
            parameter = parameters.get(name)
            if parameter is None:
                raise ParameterMismatchError(f"the module has no parameter named {name!r}")
            if grad is None:
                continue
            if grad.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"gradient {name!r} has shape {list(grad.shape)} but the parameter has "
                    f"shape {list(parameter.shape)}"
                )
            if grad.dtype != parameter.dtype and "cpu" in (grad.device.type, parameter.device.type):
                converting_on_cpu = True
        if converting_on_cpu:
            check_gradual_underflow("apply_to")
        with _commit.ordinary_tensors():
            converted = {
                name: None
                if grad is None
                else grad.to(dtype=parameters[name].dtype, device=parameters[name].device)
                for name, grad in self.grads.items()
            }
        if not self.found_inf:
            # found_inf False promises finite gradients to the optimizer: a value that the
            # conversion to a narrower parameter dtype made ±inf is refused, nothing written.
            for name, grad in self.grads.items():
                written = converted[name]
                if (
                    grad is not None
                    and written is not None
                    and narrower(grad.dtype, written.dtype) != grad.dtype
                    and not bool(torch.isfinite(written).all())
                ):
                    raise ParameterMismatchError(
                        f"gradient {name!r} is finite in {grad.dtype} (found_inf is False) but "
                        f"overflows the parameter's dtype {written.dtype} (largest magnitude "
                        f"{grad.abs().max().item()!r}): the optimizer would step on inf. Skip "
                        f"the window or keep {name!r} in a wider dtype"
                    )
        with _commit.COMMIT:
            for name, grad in converted.items():
                parameters[name].grad = grad
