"""The gradients of a buffered call, checked against the binding (semantics §5 Readings).

Each tracked parameter's gradient comes from a ``grads`` mapping or from its ``.grad``; it must be
a dense tensor of one of the six gradient dtypes with the parameter's (and the binding's) shape
and device. :class:`GradientCheck` checks a set in full once and then accepts a complete set whose
signature — type, shape, dtype, device and layout of every gradient, in binding order — equals
the last one accepted for the same binding (one comparison in C). Every element of that signature
decides a full check, so the cache accepts exactly what the full check would: nothing that is
not a tensor of the same type (an object with tensor-like attributes included).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from functools import partial
from operator import attrgetter, itemgetter

import torch

from wacc_torch._binding import Binding, Parameters
from wacc_torch._dtypes import GRADIENT_DTYPES
from wacc_torch.errors import ParameterMismatchError

__all__ = ["GradientCheck", "GradientMapping", "check_gradients"]

GradientMapping = Mapping[str, torch.Tensor | None]
Gradients = list[torch.Tensor | None]

_GRAD = attrgetter("grad")
_SECOND = itemgetter(1)
_IS_NONE = partial(operator.is_, None)
_LAYOUT = attrgetter("shape", "dtype", "device", "layout")


def check_gradients(binding: Binding, parameters: Parameters, candidates: Gradients) -> None:
    """The full check of one gradient per tracked parameter (None = no contribution)."""
    for (name, parameter), grad in zip(parameters, candidates, strict=True):
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor):
            raise ParameterMismatchError(
                f"gradient of {name!r} must be a tensor or None, got {type(grad).__name__}"
            )
        if grad.dtype not in GRADIENT_DTYPES:
            raise ParameterMismatchError(
                f"gradient of {name!r} has dtype {grad.dtype}: one of "
                f"{sorted(str(dtype) for dtype in GRADIENT_DTYPES)} is required"
            )
        if grad.layout != torch.strided:
            raise ParameterMismatchError(
                f"gradient of {name!r} has layout {grad.layout}: only dense (strided) "
                f"gradients are accepted"
            )
        if grad.shape != parameter.shape:
            raise ParameterMismatchError(
                f"gradient of {name!r} has shape {list(grad.shape)}, the parameter has "
                f"shape {list(parameter.shape)}"
            )
        if grad.device != parameter.device:
            raise ParameterMismatchError(
                f"gradient of {name!r} is on {grad.device}, the parameter is on "
                f"{parameter.device}"
            )
    # The buffers have the binding's shapes and devices (checked against the parameters too,
    # by the binder; this keeps the rule local).
    for name, grad, shape, device in zip(
        binding.names, candidates, binding.shapes, binding.devices, strict=True
    ):
        if grad is not None and (grad.shape != shape or grad.device != device):
            raise ParameterMismatchError(
                f"gradient of {name!r} has shape {list(grad.shape)} on {grad.device}; the "
                f"tracked shape is {list(shape)} on {device} (the tracked set can change only "
                f"between windows)"
            )


class GradientCheck:
    """Collects and checks a buffered call's gradients, caching the last complete signature."""

    def __init__(self) -> None:
        self._cache: tuple[Binding, tuple[object, ...]] | None = None

    def collect(
        self, binding: Binding, parameters: Parameters, grads: GradientMapping | None
    ) -> Gradients:
        """The gradient of each tracked parameter (None = zero), checked, in binding order."""
        if grads is None:
            candidates: Gradients = list(map(_GRAD, map(_SECOND, parameters)))
        else:
            if not isinstance(grads, Mapping):
                raise TypeError(
                    f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
                )
            if not binding.name_set.issuperset(grads):
                unknown = [name for name in grads if name not in binding.name_set]
                raise ParameterMismatchError(
                    f"grads names parameter(s) {unknown!r} that are not tracked "
                    f"(tracked: {list(binding.names)!r})"
                )
            candidates = list(map(grads.get, binding.names))
        signature: tuple[object, ...] | None = None
        if not any(map(_IS_NONE, candidates)):
            try:
                # Two passes in C: the types, then the layouts.
                signature = (tuple(map(type, candidates)), tuple(map(_LAYOUT, candidates)))
            except AttributeError:
                signature = None  # not a tensor: the full check names it
            cached = self._cache
            if signature is not None and cached is not None and cached[0] is binding:
                if signature == cached[1]:
                    return candidates
        check_gradients(binding, parameters, candidates)
        if signature is not None:
            self._cache = (binding, signature)
        return candidates

    def forget(self) -> None:
        """Drop the cached signature (a window ended)."""
        self._cache = None
