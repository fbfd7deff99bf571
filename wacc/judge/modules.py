"""A module made from named parameters, for the judge's runs and adapters."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["module_of"]


def module_of(parameters: Mapping[str, nn.Parameter]) -> nn.Module:
    """A module whose ``named_parameters()`` are exactly ``parameters`` (dotted names nest)."""
    root = nn.Module()
    for name, parameter in parameters.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, parameter)
    return root
