"""Work tensors for the commit phase, and the pieces that keep them cache-sized.

A two-rounding step (``round_D(c * w_D)`` then the add, or a conversion then the add) needs its
intermediate in a tensor of its own. That tensor is preallocated in the prepare phase (so that the
commit allocates nothing) and sized for one piece of a tensor, not for the whole largest one: a
tensor larger than :data:`CHUNK_ELEMENTS` is processed in pieces of whole rows of dim 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["CHUNK_ELEMENTS", "Scratch", "chunk_numel", "chunk_rows", "piece_count", "pieces"]

# Elementwise passes over a tensor larger than this run in pieces of about this many elements
# (whole rows of dim 0), so the work tensor of a two-rounding step stays cache-sized instead of
# growing to the largest parameter (an embedding of 131 M elements would need 0.5 GB). Only a
# gradient the accumulator does not own goes this way (an owned one in D is multiplied in place:
# wacc_torch._ownership). The benchmarks' `shapes` suite times pieces of 2**14 to 2**24 elements
# on a 4096 x 4096 matrix (its `piece size` rows), the figures to choose this constant by.
CHUNK_ELEMENTS = 1 << 20


def chunk_rows(shape: torch.Size) -> int:
    """Rows of dim 0 per piece of a tensor of ``shape`` (0 for a 0-d tensor: one piece)."""
    if len(shape) == 0 or shape[0] == 0:
        return 0
    row = shape.numel() // shape[0]
    return max(1, CHUNK_ELEMENTS // max(1, row))


def chunk_numel(shape: torch.Size) -> int:
    """Elements of the largest piece of a tensor of ``shape`` (the work tensor it needs)."""
    rows = chunk_rows(shape)
    if rows == 0:
        return shape.numel()
    return min(shape[0], rows) * (shape.numel() // shape[0])


def piece_count(shape: torch.Size) -> int:
    """How many pieces :func:`pieces` cuts a tensor of ``shape`` into."""
    rows = chunk_rows(shape)
    if rows == 0 or rows >= shape[0]:
        return 1
    return -(-shape[0] // rows)


def pieces(*tensors: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """Matching pieces (views along dim 0, any strides) of same-shape tensors."""
    shape = tensors[0].shape
    rows = chunk_rows(shape)
    if rows == 0 or rows >= shape[0]:
        yield tensors
        return
    for start in range(0, shape[0], rows):
        length = min(rows, shape[0] - start)
        yield tuple(tensor.narrow(0, start, length) for tensor in tensors)


class Scratch:
    """One preallocated work tensor per (device, dtype), sized for the largest piece
    (:func:`chunk_numel`), so that a commit phase needs no allocation; :meth:`view` hands out a
    shaped view of its start (one per shape, reused: the users run one after the other)."""

    def __init__(self, needs: Iterable[tuple[torch.device, torch.dtype, int]]) -> None:
        sizes = _sizes(needs)
        self._sizes = sizes
        self._storage = {
            (device, dtype): torch.empty(numel, dtype=dtype, device=device)
            for (device, dtype), numel in sizes.items()
        }
        self._views: dict[tuple[torch.device, torch.dtype, torch.Size], torch.Tensor] = {}

    @classmethod
    def reusing(
        cls, previous: Scratch | None, needs: Iterable[tuple[torch.device, torch.dtype, int]]
    ) -> Scratch:
        """``previous`` if it is large enough for ``needs`` and lives on the CPU only, else a new
        one. A CPU work tensor allocated per call costs its page faults every time (a piece of
        4 MiB: about as much as the arithmetic); CUDA memory comes from the stream-ordered
        caching allocator, which is cheap and keeps calls on different streams apart."""
        sizes = _sizes(needs)
        if previous is not None and all(
            device.type == "cpu" and previous._sizes.get((device, dtype), -1) >= numel
            for (device, dtype), numel in sizes.items()
        ):
            return previous
        return cls((device, dtype, numel) for (device, dtype), numel in sizes.items())

    def view(self, device: torch.device, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        key = (device, dtype, shape)
        view = self._views.get(key)
        if view is None:
            view = self._storage[(device, dtype)].narrow(0, 0, shape.numel()).view(shape)
            self._views[key] = view
        return view


def _sizes(
    needs: Iterable[tuple[torch.device, torch.dtype, int]],
) -> dict[tuple[torch.device, torch.dtype], int]:
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for device, dtype, numel in needs:
        sizes[(device, dtype)] = max(sizes.get((device, dtype), 0), numel)
    return sizes
