"""Cheap detection of a change in a module's parameter structure within a window.

Walking ``named_parameters()`` costs about 1 µs per parameter, more than accumulating a small
tensor; within a window the tracked set is fixed, so the walk is done once, when the window binds,
and every later call compares what can change against that snapshot in C-speed passes: which
objects each submodule's ``_parameters`` and ``_modules`` hold (a parameter or submodule replaced,
added or deleted; a dict replaced wholesale), each submodule's class (``fully_shard`` swaps it in
place), and every parameter's ``requires_grad`` (frozen or unfrozen). Anything different sends the
caller back to the full check (:func:`wacc_torch._binding.check_bound`), which names the change or
accepts the new structure; the full check looks at nothing else, so the snapshot accepts exactly
what it accepts (the suite checks both on random mutations of real modules).

Not part of either (semantics §3 Reading): a parameter's ``.data`` (shape, device, dtype). The
buffered mode reads gradients, never parameters' values, and checks each gradient against the
tracked shapes and devices; reading three attributes of every parameter at every call would cost
as much again as the rest of a call on small tensors. The zero-copy mode, whose buffers are the
parameters' ``.grad``, compares them at every block itself.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter

from torch import nn

__all__ = ["ModuleStructure"]

_REQUIRES_GRAD = attrgetter("requires_grad")
_PARAMETER_DICT = attrgetter("_parameters")
_MODULE_DICT = attrgetter("_modules")


class ModuleStructure:
    """A snapshot of ``module``'s parameter structure; :meth:`unchanged` compares it with now."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        modules = list(module.modules())
        self._parameter_dicts = list(map(_PARAMETER_DICT, modules))
        self._module_dicts = list(map(_MODULE_DICT, modules))
        self._dict_ids = self._current_dicts(modules)
        self._parameter_ids = self._current_parameters()
        self._module_ids = self._current_modules()
        self._classes = tuple(map(type, modules))
        # Held, so that their ids stay theirs; also every submodule, for checks of their kind.
        self.modules = modules
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

    @staticmethod
    def _current_dicts(modules: list[nn.Module]) -> tuple[int, ...]:
        # A submodule's _parameters or _modules replaced wholesale (the snapshot holds the old
        # dicts, so their ids stay theirs).
        return tuple(map(id, chain(map(_PARAMETER_DICT, modules), map(_MODULE_DICT, modules))))

    def unchanged(self, module: nn.Module) -> bool:
        """Whether ``module`` is the snapshot's module with the same parameter structure."""
        return (
            module is self.module
            and self._current_dicts(self.modules) == self._dict_ids
            and self._current_parameters() == self._parameter_ids
            and self._current_modules() == self._module_ids
            and tuple(map(type, self.modules)) == self._classes
            and tuple(map(_REQUIRES_GRAD, self._parameters)) == self._flags
        )
