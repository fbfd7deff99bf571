"""Whether a zero-copy hook's incoming gradient is the accumulator's to overwrite (semantics §6
Reading).

A reproducible mean needs ``t = round_D(g * w_D)`` in a tensor of its own before ``buf + t``. When
nothing but the accumulator can see ``g`` — the gradient autograd hands a zero-copy hook —
``g.mul_(w_D)`` is that tensor: the zero-copy mode then needs no work tensor at all (its memory
target), and each piece's product is added while it is still in cache. "Nothing else can see it" is
checked, not assumed: a dense, writable, contiguous, ordinary tensor of D whose Python object,
tensor and storage are referenced no more often than a probe's that nothing else holds (a reference
kept by the caller, a tensor hook's, a view of it, memory shared with numpy or a buffer all count).
Autograd often hands a view: ``nn.Linear``'s weight and bias gradients are views of a tensor made
in the backward (a transpose, a ``sum_to_size``). Such a view is the accumulator's when its base,
too, is referenced no more often than the base of a probe's view gradient (a second view of the
base raises the storage's count, a reference to the base its own counts), so the probe is taken
twice: once for a gradient of its own, once for a view.
The buffered mode writes into no gradient it takes unless the caller says so
(``accumulate_mean(..., disposable=True)``: :func:`disposable_gradients`): a cache-sized work piece
measured faster, and writing into a gradient buys only the memory of that piece.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence

import torch

__all__ = ["calibrate", "disposable_gradients", "hooked_gradient"]

Counts = tuple[int, ...]


def _counts(items: Sequence[torch.Tensor | None], index: int) -> Counts:
    """References to ``items[index]``: its Python object, its tensor, its storage; for a view,
    then those of its base's Python object and tensor (the storage is the same)."""
    item = items[index]
    assert item is not None
    storage = item.untyped_storage()
    tensor_refs: int = item._use_count()  # type: ignore[attr-defined]
    counts = (sys.getrefcount(item), tensor_refs, torch._C._storage_Use_Count(storage._cdata))
    if not item._is_view():
        return counts
    base = item._base
    assert base is not None  # a view's
    base_refs: int = base._use_count()  # type: ignore[attr-defined]
    return (*counts, sys.getrefcount(base), base_refs)


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
    """``base``: the probe's counts for a gradient of this kind (its own, or a view)."""
    if not _plain(items[index], dtype):
        return False
    counts = _counts(items, index)
    # A view's counts are five, its probe's too (or (0, 0, 0): views never owned).
    return len(counts) == len(base) and all(
        count <= limit for count, limit in zip(counts, base, strict=True)
    )


def _probe(shape: tuple[int, ...], loss: Callable[[torch.Tensor], torch.Tensor]) -> Counts:
    """The counts of the gradient a fresh leaf of ``shape`` gets from ``loss(leaf).backward()``,
    read in an ``AccumulateGrad`` pre-hook's argument as the zero-copy hooks read theirs."""
    seen: list[Counts] = []

    def hook(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
        seen.append(_counts(grads, 0))
        return (None,)

    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.set_detect_anomaly(False):
        leaf = torch.zeros(shape, requires_grad=True)
        grad_fn = leaf.view_as(leaf).grad_fn
        assert grad_fn is not None
        node = grad_fn.next_functions[0][0]
        assert node is not None
        handle = node.register_prehook(hook)
        try:
            loss(leaf).backward()
        finally:
            handle.remove()
    return seen[0]


def _hooked_probe() -> Counts:
    """A gradient of its own: ``(p * 2.0)``'s backward makes a new tensor."""
    return _probe((2,), lambda leaf: (leaf * 2.0).sum())


def _hooked_view_probe() -> Counts:
    """A view gradient: ``linear``'s weight, whose gradient autograd hands as a view of the
    tensor its backward made."""
    return _probe((2, 2), lambda leaf: torch.nn.functional.linear(torch.ones(3, 2), leaf).sum())


_BASES: dict[str, Counts] = {}
_NEVER: Counts = (0, 0, 0)  # matches no gradient: a PyTorch whose probe holds more never owns


def _base(kind: str, probe: Callable[[], Counts]) -> Counts:
    base = _BASES.get(kind)
    if base is None:
        base = probe()
        # The storage is held by the gradient, the probe's storage object and, for a view, its
        # base; any more (or a view probe that is no view) and nothing is owned.
        storage_limit = 2 if kind == "hooked" else 3
        if base[1] > 2 or base[2] > storage_limit:  # pragma: no cover - never in torch 2.13
            base = _NEVER
        elif kind == "hooked view" and (len(base) != 5 or base[4] > 2):  # pragma: no cover
            base = _NEVER
        _BASES[kind] = base
    return base


def calibrate() -> None:
    """Read the probes now (outside any backward: each runs one of its own)."""
    _base("hooked", _hooked_probe)
    _base("hooked view", _hooked_view_probe)


def hooked_gradient(items: Sequence[torch.Tensor | None], index: int, dtype: torch.dtype) -> bool:
    """Whether ``items[index]``, the gradient tuple of an ``AccumulateGrad`` pre-hook, is the
    accumulator's to overwrite (autograd made it and holds nothing else of it, nor of its base
    when it is a view)."""
    # No local name for the gradient here: it would be one more reference than the probe's.
    if items[index] is not None and items[index]._is_view():  # type: ignore[union-attr]
        return _owned(items, index, dtype, _base("hooked view", _hooked_view_probe))
    return _owned(items, index, dtype, _base("hooked", _hooked_probe))


def _storage_addresses(tensor: torch.Tensor) -> set[int] | None:
    """The addresses of the storages ``tensor`` keeps its memory in (storage-less ones, a meta
    tensor's, left out), or None when they cannot be read. A sparse tensor has no storage of its
    own but holds its indices and values in dense tensors, whose memory a dense gradient can share
    (``torch.sparse_coo_tensor(indices, values)`` keeps ``values`` itself); an opaque tensor
    (mkldnn's) hides its memory: None, which the caller takes as "may share any memory"."""
    layout = tensor.layout
    if layout == torch.sparse_coo:
        parts = [tensor._indices(), tensor._values()]
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    else:
        parts = [tensor]
    try:
        addresses = {part.untyped_storage().data_ptr() for part in parts}
    except (NotImplementedError, RuntimeError):  # "Cannot access storage of OpaqueTensorImpl"
        return None
    addresses.discard(0)
    return addresses


def disposable_gradients(
    gradients: Sequence[torch.Tensor | None],
    module_tensors: Sequence[torch.Tensor],
    dtype: torch.dtype,
) -> list[bool]:
    """Which of ``gradients``, handed over by a caller who will not read them again
    (``accumulate_mean(..., disposable=True)``), the product may be written into: a plain tensor
    of ``dtype`` (:func:`_plain`) whose storage no other gradient of the call and none of
    ``module_tensors`` (the module's parameters, frozen ones included, and buffers) shares
    (writing it would change them: one tensor passed twice, tied weights' one ``.grad``, a
    parameter's ``.data``, a sparse buffer's values). The caller's word covers references held
    elsewhere; the sharing within the call and the module is checked. (Memory PyTorch allocated,
    as :func:`_plain` requires, is one storage's alone: two storages never overlap.) A tensor of
    the module whose memory cannot be read (mkldnn's) may share any gradient's: then none is
    written — the same bits, through the work piece."""
    users: Counter[int] = Counter()
    for tensor in [*gradients, *module_tensors]:
        if tensor is None:
            continue
        addresses = _storage_addresses(tensor)
        if addresses is None:
            return [False] * len(gradients)
        users.update(addresses)
    return [
        grad is not None and _plain(grad, dtype) and users[grad.untyped_storage().data_ptr()] == 1
        for grad in gradients
    ]
