"""Whether a zero-copy hook's incoming gradient is the accumulator's to overwrite (semantics §6
Reading).

A reproducible mean needs ``t = round_D(g * w_D)`` in a tensor of its own before ``buf + t``. When
nothing but the accumulator can see ``g`` — the gradient autograd hands a zero-copy hook —
``g.mul_(w_D)`` is that tensor: the zero-copy mode then needs no work tensor at all (its memory
target), and each piece's product is added while it is still in cache. "Nothing else can see it" is
checked, not assumed: a dense, writable, contiguous, ordinary tensor of D whose Python object,
tensor and storage are referenced no more often than a probe's that nothing else holds (a reference
kept by the caller, a tensor hook's, a view of it, memory shared with numpy or a buffer all count).
The buffered mode writes into no gradient it takes: there, a cache-sized work piece measured
faster.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

__all__ = ["calibrate", "hooked_gradient"]

Counts = tuple[int, int, int]


def _counts(items: Sequence[torch.Tensor | None], index: int) -> Counts:
    """References to ``items[index]``: its Python object, its tensor, its storage."""
    item = items[index]
    assert item is not None
    storage = item.untyped_storage()
    tensor_refs: int = item._use_count()  # type: ignore[attr-defined]
    return sys.getrefcount(item), tensor_refs, torch._C._storage_Use_Count(storage._cdata)


def _plain(tensor: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """A dense, contiguous, non-empty tensor of ``dtype`` with memory of PyTorch's own that an
    in-place kernel may write (not a subclass, an inference tensor, part of a graph, or memory
    borrowed from numpy or a buffer: such storages are not resizable)."""
    return (
        type(tensor) is torch.Tensor
        and tensor.dtype == dtype
        and tensor.numel() > 0
        and tensor.is_contiguous()
        and not tensor.requires_grad
        and not tensor.is_inference()
        and tensor.untyped_storage().resizable()
    )


def _owned(
    items: Sequence[torch.Tensor | None], index: int, dtype: torch.dtype, base: Counts
) -> bool:
    if not _plain(items[index], dtype):
        return False
    counts = _counts(items, index)
    return all(count <= limit for count, limit in zip(counts, base, strict=True))


def _hooked_probe() -> Counts:
    """The counts of a fresh gradient in an ``AccumulateGrad`` pre-hook's argument."""
    seen: list[Counts] = []

    def hook(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
        seen.append(_counts(grads, 0))
        return (None,)

    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.set_detect_anomaly(False):
        leaf = torch.zeros(2, requires_grad=True)
        grad_fn = leaf.view_as(leaf).grad_fn
        assert grad_fn is not None
        node = grad_fn.next_functions[0][0]
        assert node is not None
        handle = node.register_prehook(hook)
        try:
            (leaf * 2.0).sum().backward()
        finally:
            handle.remove()
    return seen[0]


_BASES: dict[str, Counts] = {}


def _base(kind: str, probe: Callable[[], Counts]) -> Counts:
    base = _BASES.get(kind)
    if base is None:
        base = probe()
        if base[1] > 2 or base[2] > 2:  # pragma: no cover - a PyTorch that holds more: never own
            base = (0, 0, 0)
        _BASES[kind] = base
    return base


def calibrate() -> None:
    """Read the probe now (outside any backward: it runs one of its own)."""
    _base("hooked", _hooked_probe)


def hooked_gradient(items: Sequence[torch.Tensor | None], index: int, dtype: torch.dtype) -> bool:
    """Whether ``items[index]``, the gradient tuple of an ``AccumulateGrad`` pre-hook, is the
    accumulator's to overwrite (autograd made it and holds nothing else of it)."""
    return _owned(items, index, dtype, _base("hooked", _hooked_probe))
