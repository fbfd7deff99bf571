"""The tracked parameter set of a window (semantics §3) and the check that a module still has it.

A window binds to the module's ``requires_grad`` parameters (names in registration order,
shapes, devices) at its first call, or at a load; a window with nothing in it (``issued == 0``)
binds anew, so the set may change between windows. Inside a window every call checks the module
against the binding. :class:`Binder` does that check in full once and then compares a
:class:`~wacc_torch._structure.ModuleStructure` snapshot (C-speed passes) while the module is
unchanged; the snapshot accepts nothing the full check would refuse. The binder holds the module
only within a window: :meth:`Binder.forget` drops it when the window ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from wacc_torch._arena import small_groups
from wacc_torch._structure import ModuleStructure
from wacc_torch._work import chunk_numel
from wacc_torch.errors import ParameterMismatchError

__all__ = ["Binder", "Binding", "Parameters", "binding_of", "check_bound", "tracked_parameters"]

Parameters = list[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class Binding:
    """The tracked parameter set: names in registration order, shapes, devices, dtypes; derived from
    them: the name set, the small parameters per device (:func:`small_groups`), whether any
    is on the CPU, the largest piece per device (:func:`wacc_torch._work.chunk_numel`). It
    holds no tensor and no module, so it may outlive the window."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    devices: tuple[torch.device, ...]
    # The parameters' dtypes when the window bound: what apply_to will write (found_inf, §8).
    dtypes: tuple[torch.dtype, ...]
    name_set: frozenset[str] = field(init=False)
    small: dict[torch.device, tuple[int, ...]] = field(init=False)
    small_count: int = field(init=False)
    large: tuple[int, ...] = field(init=False)
    on_cpu: bool = field(init=False)
    pieces: dict[torch.device, int] = field(init=False)

    def __post_init__(self) -> None:
        small = small_groups(self.shapes, self.devices)
        in_arena = {index for indices in small.values() for index in indices}
        object.__setattr__(self, "name_set", frozenset(self.names))
        object.__setattr__(self, "small", small)
        object.__setattr__(self, "small_count", len(in_arena))
        object.__setattr__(
            self, "large", tuple(i for i in range(len(self.names)) if i not in in_arena)
        )
        object.__setattr__(self, "on_cpu", any(d.type == "cpu" for d in self.devices))
        pieces: dict[torch.device, int] = {}
        for shape, device in zip(self.shapes, self.devices, strict=True):
            pieces[device] = max(pieces.get(device, 0), chunk_numel(shape))
        object.__setattr__(self, "pieces", pieces)


def tracked_parameters(module: nn.Module) -> Parameters:
    """The module's requires_grad parameters in registration order, checked to be accumulable."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    parameters = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not parameters:
        raise ParameterMismatchError(
            f"the module ({type(module).__name__}) has no requires_grad parameter to accumulate"
        )
    for name, parameter in parameters:
        if not parameter.is_floating_point():
            raise ParameterMismatchError(
                f"parameter {name!r} has dtype {parameter.dtype}: only floating-point "
                f"parameters can be accumulated"
            )
    return parameters


def binding_of(parameters: Parameters) -> Binding:
    """The binding of these parameters (as :func:`tracked_parameters` returns them)."""
    return Binding(
        names=tuple(name for name, _ in parameters),
        shapes=tuple(parameter.shape for _, parameter in parameters),
        devices=tuple(parameter.device for _, parameter in parameters),
        dtypes=tuple(parameter.dtype for _, parameter in parameters),
    )


def check_bound(
    module: nn.Module, binding: Binding, *, issued: int, where: str | None = None
) -> Parameters:
    """The full check inside a window: ``module``'s tracked parameters in binding order, or
    :class:`ParameterMismatchError` naming what changed (a parameter frozen, missing or added)
    and ``where`` (default: in the middle of a window of ``issued`` batches).

    The parameters' ``.data`` is not read (semantics §3 Reading): the buffered mode checks each
    gradient against the binding's shapes and devices, and the zero-copy mode compares the
    parameters themselves at every block."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    every = dict(module.named_parameters())
    by_name = {name: p for name, p in every.items() if p.requires_grad}
    if by_name.keys() != binding.name_set:
        frozen = [n for n in binding.names if n in every and n not in by_name]
        missing = [n for n in binding.names if n not in every]
        extra = [n for n in by_name if n not in binding.name_set]
        problems = []
        if frozen:
            problems.append(f"frozen (requires_grad=False) since it was bound: {frozen!r}")
        if missing:
            problems.append(f"missing from the module: {missing!r}")
        if extra:
            problems.append(f"trainable but not tracked: {extra!r}")
        where = f"in the middle of a window (issued={issued})" if where is None else where
        raise ParameterMismatchError(
            f"the module's requires_grad parameters changed {where}; parameter(s) "
            f"{'; '.join(problems)}. The tracked set can change only between windows (after "
            f"finish_sums/finish_mean or discard)"
        )
    return [(name, by_name[name]) for name in binding.names]


_Cached = tuple[Binding, ModuleStructure, Parameters]


class Binder:
    """Binds windows to modules and checks modules against the binding, caching the last check
    that passed (the module, its structure snapshot and its parameters) within one window."""

    def __init__(self) -> None:
        self._cache: _Cached | None = None

    def check(
        self, module: nn.Module, binding: Binding | None, *, issued: int
    ) -> tuple[Binding, Parameters]:
        """The binding for a call with ``module`` (a new one when ``issued == 0`` or nothing is
        bound) and the tracked parameters in its order; raises as :func:`check_bound`."""
        if binding is None or issued == 0:
            parameters = tracked_parameters(module)
            binding = binding_of(parameters)
            self._cache = (binding, ModuleStructure(module), parameters)
            return binding, parameters
        cached = self._cache
        if cached is not None and cached[0] is binding and cached[1].unchanged(module):
            return binding, cached[2]
        parameters = check_bound(module, binding, issued=issued)
        self._cache = (binding, ModuleStructure(module), parameters)
        return binding, parameters

    def snapshot(self, module: nn.Module, binding: Binding, parameters: Parameters) -> _Cached:
        """What :meth:`prime` installs: ``module`` checked (by the caller) to hold ``binding``'s
        parameters, in binding order (may allocate; changes nothing)."""
        return (binding, ModuleStructure(module), parameters)

    def prime(self, cached: _Cached | None) -> None:
        """Commit: remember a module checked elsewhere (a load), or nothing."""
        self._cache = cached

    @property
    def structure(self) -> ModuleStructure | None:
        """The snapshot of the module of the last check that passed (None after :meth:`forget`)."""
        return None if self._cache is None else self._cache[1]

    def current(self, binding: Binding) -> Parameters | None:
        """The tracked parameters of the last module checked for ``binding``, as they are now
        (None when there is none, or it no longer has the binding's parameters: the caller then
        has nothing to compare against, and the next call's full check names the change)."""
        cached = self._cache
        if cached is None or cached[0] is not binding:
            return None
        _, structure, parameters = cached
        if structure.unchanged(structure.module):
            return parameters
        try:
            return check_bound(structure.module, binding, issued=1)
        except ParameterMismatchError:
            return None

    def forget(self) -> None:
        """Drop the module and its parameters (a window ended: nothing of it is held)."""
        self._cache = None
