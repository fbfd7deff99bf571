"""Cheap detection of a change in a module's parameter structure within a window.

Walking ``named_parameters()`` costs about 1 µs per parameter, more than accumulating a small
tensor; within a window the tracked set is fixed, so the walk is done once, when the window binds,
and every later call compares what can change against that snapshot in C-speed passes: which
objects each submodule's ``_parameters`` and ``_modules`` hold (a parameter or submodule replaced,
added or deleted) and every parameter's ``requires_grad`` (frozen or unfrozen). Anything
different sends the caller back to the full check, which names the change.

Not compared (it would cost as much again): a parameter's ``.data`` reassigned in place (a move
to another device, a new shape). The gradients handed in are still checked against the tracked
shapes and devices, which is what accumulation needs; ``apply_to`` checks shapes and converts
devices when it writes ``.grad``.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter

from torch import nn

__all__ = ["ModuleStructure"]

_REQUIRES_GRAD = attrgetter("requires_grad")


class ModuleStructure:
    """A snapshot of ``module``'s parameter structure; :meth:`unchanged` compares it with now."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        modules = list(module.modules())
        self._parameter_dicts = [sub._parameters for sub in modules]
        self._module_dicts = [sub._modules for sub in modules]
        self._parameter_ids = self._current_parameters()
        self._module_ids = self._current_modules()
        # Held, so that their ids stay theirs.
        self._modules = modules
        self._parameters = [
            p for p in chain.from_iterable(map(dict.values, self._parameter_dicts)) if p is not None
        ]
        self._flags = tuple(map(_REQUIRES_GRAD, self._parameters))

    # Identities, not objects: == on tensors would compare their elements. The snapshot holds
    # the objects themselves, so no id can be reused while it lives.
    def _current_parameters(self) -> tuple[int, ...]:
        return tuple(map(id, chain.from_iterable(map(dict.values, self._parameter_dicts))))

    def _current_modules(self) -> tuple[int, ...]:
        return tuple(map(id, chain.from_iterable(map(dict.values, self._module_dicts))))

    def unchanged(self, module: nn.Module) -> bool:
        """Whether ``module`` is the snapshot's module with the same parameter structure."""
        return (
            module is self.module
            and self._current_parameters() == self._parameter_ids
            and self._current_modules() == self._module_ids
            and tuple(map(_REQUIRES_GRAD, self._parameters)) == self._flags
        )
