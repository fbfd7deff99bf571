"""The division of semantics §8: scaled sums divided by the loss scale, then by the total weight.

``finish_mean``, the distributed helpers, the DDP hook and FSDP all divide through
:func:`normalize_sums`; :func:`check_writable` is the test that a tensor can be written in place
element by element (also used when ``from_pending`` adopts buffers).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from wacc_torch import _commit
from wacc_torch._dtypes import check_loss_scale, check_work_dtype, op_dtype
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._finite import FiniteCheck
from wacc_torch._weights import read_total_weight
from wacc_torch._work import Scratch, chunk_numel, pieces
from wacc_torch.errors import ParameterMismatchError

__all__ = ["check_writable", "divide_sums", "may_overlap", "normalize_sums", "scalar_tensor"]


def scalar_tensor(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor ON the buffers' device: CUDA true division by a CPU scalar would multiply by
    the reciprocal instead of dividing (semantics §8)."""
    return torch.tensor(value, dtype=dtype, device=device)


def normalize_sums(
    grads: Mapping[str, torch.Tensor | None],
    *,
    loss_scale: float,
    total_weight: float | torch.Tensor,
    in_place: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Divide scaled gradient sums by the loss scale, then by the total weight (semantics §8).

    Per element, in each tensor's own dtype D: ``y = round_D(g / S)``, then
    ``round_D(round_op(y / round_op(W)))`` with op = float64 for float64 and float32 otherwise.
    The product ``S * W`` is never formed. Both divisors are 0-d tensors on the gradient's
    device. None entries stay None. ``total_weight`` may be a number or a 0-d tensor (what a
    manual ``dist.all_reduce`` of the weight gives), read like a weight; it must be exactly a
    float64. With ``in_place=True`` the result overwrites the given tensors (and the returned
    dict holds them), all or nothing: every divisor and temporary is made before the first
    tensor is written. Otherwise they are left untouched.

    Raises :class:`ZeroTotalWeightError` when ``total_weight == 0``, :class:`InvalidWeightError`
    for a negative, non-finite or non-real one, :class:`InvalidLossScaleError` for a loss scale
    that is not finite, > 0 and exactly representable in every gradient's dtype (float64 when
    every entry is None), :class:`ParameterMismatchError` for a value that is not a dense
    tensor of a work dtype, one that requires grad (or, with ``in_place=True``, one that is not
    safe to write in place),
    and :class:`UnsupportedEnvironmentError` under flush-to-zero in the calling thread (the
    divisors are rounded on the host CPU, and CPU tensors are divided there).
    """
    divided, _ = divide_sums(
        grads, loss_scale=loss_scale, total_weight=total_weight, in_place=in_place, find_inf=False
    )
    return divided


def divide_sums(
    grads: Mapping[str, torch.Tensor | None],
    *,
    loss_scale: float,
    total_weight: float | torch.Tensor,
    in_place: bool,
    find_inf: bool,
    targets: Mapping[str, torch.dtype] | None = None,
) -> tuple[dict[str, torch.Tensor | None], FiniteCheck | None]:
    """:func:`normalize_sums`, and with ``find_inf`` a check of the quotients for NaN and ±inf
    (else None; ask it with ``.found()``): each finished piece is checked right after its
    division, while it is in cache, so ``found_inf`` of the means costs no pass of its own
    (:mod:`wacc_torch._finite`). ``targets`` names the dtype a quotient will be written in (its
    parameter's): a finite quotient that becomes ±inf there counts too (semantics §8)."""
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
        )
    weight = read_total_weight(total_weight, positive=True)
    checked_dtypes: set[torch.dtype] = set()
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, grad in grads.items():
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor) or grad.layout != torch.strided:
            raise ParameterMismatchError(
                f"gradient {name!r} must be a dense tensor or None, got {type(grad).__name__}"
            )
        try:
            check_work_dtype(grad.dtype)
        except ValueError:
            raise ParameterMismatchError(
                f"gradient {name!r} has dtype {grad.dtype}, not a work dtype"
            ) from None
        if grad.requires_grad:
            # What a backward(create_graph=True) leaves in .grad. The division is on values,
            # never a graph: a copy would carry one and out= refuses one, depending on S.
            raise ParameterMismatchError(
                f"gradient {name!r} requires grad (a .grad of backward(create_graph=True)?); "
                f"normalize its values: pass {name!r}.detach()"
            )
        if in_place:
            check_writable(grad, what=f"gradient {name!r}")
        if grad.dtype not in checked_dtypes:
            check_loss_scale(loss_scale, grad.dtype)
            checked_dtypes.add(grad.dtype)
        tensors.append((name, grad))
    if not checked_dtypes:
        # No tensor, so no work dtype to check S against; S itself must still be valid (finite,
        # > 0, a float64), which the check in float64 covers.
        check_loss_scale(loss_scale, torch.float64)
    scale = float(loss_scale)
    # round_op(W) and S are made into tensors on the host whatever the device (torch.tensor
    # converts on the CPU), and CPU tensors are divided in this thread.
    check_gradual_underflow("normalize_sums")

    # Prepare: every divisor and temporary; then the in-place commit cannot fail half-way.
    with _commit.ordinary_tensors():
        divisors: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        for _, grad in tensors:
            key = (grad.device, grad.dtype)
            if key not in divisors:
                divisors[key] = (
                    scalar_tensor(scale, grad.dtype, grad.device),
                    scalar_tensor(weight, op_dtype(grad.dtype), grad.device),
                )
        # Narrow D divides in op(D) = float32 (so a W beyond D's range, e.g. fp16 with
        # W = 70000, stays finite), then rounds once more into D: a float32 work tensor.
        scratch = Scratch(
            (grad.device, op_dtype(grad.dtype), chunk_numel(grad.shape))
            for _, grad in tensors
            if op_dtype(grad.dtype) != grad.dtype
        )
        outputs = {
            name: grad
            if in_place
            else torch.empty_like(grad, memory_format=torch.contiguous_format)
            for name, grad in tensors
        }
        aims = {} if targets is None else targets
        check = (
            FiniteCheck(outputs.values(), [aims.get(name) for name in outputs])
            if find_inf
            else None
        )
        with _commit.COMMIT:
            for name, grad in tensors:
                scale_tensor, weight_tensor = divisors[(grad.device, grad.dtype)]
                out = outputs[name]
                # Both divisions piece by piece, so that the second finds the first's result in
                # cache (a tensor of at most CHUNK_ELEMENTS is one piece).
                for out_piece, grad_piece in pieces(out, grad):
                    # y = round_D(g / S): same-dtype 0-d divisor, so no type promotion. g / 1
                    # is g bit for bit (NaN payloads aside, which no oracle compares): skipped.
                    if scale != 1.0:
                        torch.div(grad_piece, scale_tensor, out=out_piece)
                    elif out is not grad:
                        out_piece.copy_(grad_piece)
                    if out.dtype == weight_tensor.dtype:
                        out_piece.div_(weight_tensor)
                    else:
                        quotient = scratch.view(out.device, weight_tensor.dtype, out_piece.shape)
                        quotient.copy_(out_piece).div_(weight_tensor)
                        out_piece.copy_(quotient)
                    if check is not None:
                        check.add(out_piece, aims.get(name))
    return {name: None if grad is None else outputs[name] for name, grad in grads.items()}, check


def may_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory (an expanded, stride-0 view, ...).

    Sufficient test for "no overlap": with the dims of size > 1 sorted by stride, each stride
    is at least the extent of the previous ones. Exotic non-overlapping layouts that fail it
    are reported as overlapping: refusing them is safe.
    """
    dims = sorted(
        (stride, size)
        for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
        if size > 1
    )
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def check_writable(tensor: torch.Tensor, *, what: str) -> None:
    """Refuse a tensor that an in-place update could not write element by element: overlapping
    memory (an expanded, stride-0 view) or an inference tensor. An inference tensor is refused
    inside ``torch.inference_mode()`` too: every commit of ``wacc_torch`` runs with inference mode
    off (:func:`wacc_torch._commit.ordinary_tensors`, so that the buffers it makes stay ordinary
    tensors), where an in-place update of an inference tensor raises after the first write."""
    if may_overlap(tensor):
        raise ParameterMismatchError(
            f"{what} has overlapping memory (shape {list(tensor.shape)}, strides "
            f"{list(tensor.stride())}): it cannot be updated in place element by element"
        )
    if tensor.is_inference():
        raise ParameterMismatchError(
            f"{what} is an inference tensor (made under torch.inference_mode()): wacc_torch "
            "updates in place outside inference mode, where it cannot be written"
        )
