"""Many same-shaped parameters and matching gradients (the overhead and large suites)."""

from __future__ import annotations

import torch
from torch import nn


class ManyParameters(nn.Module):
    """``count`` trainable parameters of ``shape``, named ``p.0``, ``p.1``, ..."""

    def __init__(
        self, *, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.p = nn.ParameterList(
            nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(count)
        )


def gradients(module: nn.Module, *, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """One random gradient per parameter of ``module`` (name -> tensor), seeded on its device."""
    grads = {}
    for name, parameter in module.named_parameters():
        generator = torch.Generator(device=parameter.device).manual_seed(seed)
        seed += 1
        grads[name] = torch.randn(parameter.shape, generator=generator, device=parameter.device).to(
            dtype
        )
    return grads
