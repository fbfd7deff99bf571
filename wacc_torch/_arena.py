"""One flat buffer per device for a window's small parameters, added to in one operation.

A model has many small parameters (biases, norms, 16-element adapters): adding each on its own is
a kernel launch and several Python calls per tensor, which is what a loop of a few hundred of them
costs, not the arithmetic. Their buffers are therefore views into one zero-initialised *arena* per
device (the views are still each parameter's pending buffer, handed over as they are); when every
small parameter of the device has a gradient of one dtype, the gradients are concatenated into a
tensor of their own (preparation: it reads the gradients, nothing else) and the accumulator adds
that one tensor to the arena with the same per-element operations as tensor by tensor, so the
bits are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["SMALL_ELEMENTS", "Arena", "concatenated", "small_groups"]

# A parameter of at most this many elements goes to the arena: below it, the per-tensor cost is
# mostly call overhead; above it, concatenating would be an extra pass over memory worth avoiding.
SMALL_ELEMENTS = 1 << 14


def small_groups(
    shapes: Sequence[torch.Size], devices: Sequence[torch.device]
) -> dict[torch.device, tuple[int, ...]]:
    """Positions of the small parameters (1 <= numel <= SMALL_ELEMENTS, at least 1-d: the
    concatenation needs a dim 0) grouped by device, for devices with at least two of them."""
    groups: dict[torch.device, list[int]] = {}
    for index, (shape, device) in enumerate(zip(shapes, devices, strict=True)):
        if len(shape) >= 1 and 1 <= shape.numel() <= SMALL_ELEMENTS:
            groups.setdefault(device, []).append(index)
    return {device: tuple(indices) for device, indices in groups.items() if len(indices) >= 2}


class Arena:
    """A zero-initialised flat buffer of dtype D holding ``members``' buffers back to back."""

    def __init__(
        self,
        members: Sequence[tuple[str, nn.Parameter]],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        sizes = [parameter.numel() for _, parameter in members]
        self.storage = torch.zeros(sum(sizes), dtype=dtype, device=device)
        self.names = tuple(name for name, _ in members)
        self.name_set = frozenset(self.names)
        # torch.cat concatenates 1-d tensors three times faster than _chunk_cat flattens any.
        self.flat_members = all(parameter.dim() == 1 for _, parameter in members)
        self.views: dict[str, torch.Tensor] = {}
        offset = 0
        for (name, parameter), size in zip(members, sizes, strict=True):
            self.views[name] = self.storage.narrow(0, offset, size).view(parameter.shape)
            offset += size


def concatenated(
    grads: Sequence[torch.Tensor | None], *, arena: Arena, dtype: torch.dtype | None
) -> torch.Tensor | None:
    """The gradients of ``arena``'s members (shapes checked) flattened back to back in a new
    tensor of their common ``dtype``, or None when they have none (one is missing or their
    dtypes differ: then they are added one by one)."""
    if dtype is None:
        return None
    first = grads[0]
    assert first is not None
    flat = torch.empty(arena.storage.numel(), dtype=dtype, device=first.device)
    # One kernel for the whole list; any strides (a transposed or expanded gradient) are read
    # as the tensor's logical elements, like reshape(-1).
    if arena.flat_members:
        torch.cat(list(grads), out=flat)  # type: ignore[arg-type]
    else:
        torch._chunk_cat(list(grads), 0, 1, out=flat.view(1, -1))  # type: ignore[arg-type]
    return flat
