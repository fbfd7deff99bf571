"""The gradients of a buffered call, checked against the binding (semantics §5 Readings).

Each tracked parameter's gradient comes from a ``grads`` mapping or from its ``.grad``; it must be
a dense tensor of one of the six gradient dtypes with the binding's (the tracked) shape and
device. :class:`GradientCheck` checks a set in full once and then accepts a complete set whose
signature — type, shape, dtype, device and layout of every gradient, in binding order — equals
the last one accepted for the same binding (one comparison in C). Every element of that signature
decides a full check, so the cache accepts exactly what the full check would: nothing that is
not a tensor of the same type (an object with tensor-like attributes included).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from functools import partial
from operator import attrgetter, itemgetter
from typing import Any

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
_DTYPE = attrgetter("dtype")
_Dtypes = tuple[torch.dtype, ...]


def check_gradients(binding: Binding, candidates: Gradients) -> None:
    """The full check of one gradient per tracked parameter (None = no contribution): a dense
    tensor of a gradient dtype with the tracked shape and device (semantics §5 Readings; the
    parameters' own ``.data`` is not read: §3 Reading)."""
    for name, grad, shape, device in zip(
        binding.names, candidates, binding.shapes, binding.devices, strict=True
    ):
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
        if grad.shape != shape:
            raise ParameterMismatchError(
                f"gradient of {name!r} has shape {list(grad.shape)}, the tracked shape is "
                f"{list(shape)} (the parameter's shape when the window bound; it can change only "
                f"between windows)"
            )
        if grad.device != device:
            raise ParameterMismatchError(
                f"gradient of {name!r} is on {grad.device}, the tracked device is {device} (the "
                f"parameter's device when the window bound; it can change only between windows)"
            )


class GradientCheck:
    """Collects and checks a buffered call's gradients, caching the last complete signature."""

    def __init__(self) -> None:
        self._cache: (
            tuple[Binding, tuple[tuple[type, ...], tuple[tuple[Any, ...], ...]], _Dtypes] | None
        ) = None
        # The dtypes of the set the last call accepted, when it was complete and cached (read
        # from its signature), and which groups of positions share one: see common_dtype.
        self._dtypes: _Dtypes | None = None
        self._common: dict[tuple[int, ...], torch.dtype | None] = {}

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
        self._dtypes = None
        signature: tuple[tuple[type, ...], tuple[tuple[Any, ...], ...]] | None = None
        if not any(map(_IS_NONE, candidates)):
            try:
                # Two passes in C: the types, then the layouts.
                signature = (tuple(map(type, candidates)), tuple(map(_LAYOUT, candidates)))
            except AttributeError:
                signature = None  # not a tensor: the full check names it
            cached = self._cache
            if signature is not None and cached is not None and cached[0] is binding:
                if signature == cached[1]:
                    self._dtypes = cached[2]
                    return candidates
        check_gradients(binding, candidates)
        if signature is not None:
            dtypes = tuple(layout[1] for layout in signature[1])
            self._cache = (binding, signature, dtypes)
            self._common = {}
            self._dtypes = dtypes
        return candidates

    def common_dtype(
        self, indices: tuple[int, ...], grads: Sequence[torch.Tensor | None]
    ) -> torch.dtype | None:
        """The one dtype of ``grads`` (the gradients at ``indices`` of the set the last
        :meth:`collect` returned), or None when one is missing or their dtypes differ. Read from
        the cached signature, once per group, when that set was complete."""
        if self._dtypes is not None:
            if indices not in self._common:
                dtypes = {self._dtypes[index] for index in indices}
                self._common[indices] = dtypes.pop() if len(dtypes) == 1 else None
            return self._common[indices]
        if any(map(_IS_NONE, grads)):
            return None
        found = set(map(_DTYPE, grads))
        return found.pop() if len(found) == 1 else None

    def forget(self) -> None:
        """Drop the cached signature (a window ended)."""
        self._cache = None
        self._dtypes = None
        self._common = {}
