"""Cross-rank reduction of accumulated gradient sums over ``torch.distributed`` (semantics §7).

:func:`all_reduce_sums` and :func:`all_reduce_mean` are the only functions of ``wacc_torch`` that
communicate; their names say so (semantics §10).  Both take the local, loss-scaled result of
``finish_sums()`` on every rank of a process group and return the same global result on every
rank:

1. One exchange of small metadata (``all_gather_object``): each rank's dtype, loss scale, parameter
   names, shapes, device type, which buffers exist, weight and counters, plus any problem found
   with its input.  Every rank then runs the same checks on the same gathered data, so either all
   ranks raise the same exception, or none does: a bad input on one rank never leaves another rank
   waiting in a collective.
2. One ``all_reduce`` (SUM) of all pending buffers, flattened into one buffer in the work dtype
   ``D``.  A parameter whose buffer exists on some ranks only is reduced with zeros on the others; a
   parameter without a buffer on every rank stays ``None``.  The weight and counters come from the
   metadata: the global weight is the correctly rounded float64 sum of the per-rank weights
   (``math.fsum``, so it does not depend on rank order), the counters are exact integer sums.
3. :func:`all_reduce_mean` then divides by ``S`` exactly once and by the global weight, through
   :func:`wacc_torch.accumulator.normalize_sums` (semantics §8's sequential division).

Buffers are reduced in ``D`` itself: gloo (PyTorch 2.13) and NCCL both sum float16 and bfloat16.
With two ranks every element is ``round_D(a + b)``; with more ranks the association order is the
backend's.  All of a rank's buffers must live on one device (the common data-parallel layout).
With NCCL, call ``torch.cuda.set_device`` on every rank first: the metadata exchange and the zeros
of a rank without buffers use the current CUDA device, as ``torch.distributed`` itself does.

:mod:`wacc_torch.ddp_hook` does the same reduction inside DDP's bucketed all-reduce of the last
microbatch (overlapped with its backward); :mod:`wacc_torch.fsdp` does it for FSDP2.  A rank that
never joins makes the others raise after the process group's ``timeout``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from wacc_torch._dtypes import WORK_DTYPES, check_loss_scale
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._finite import found_inf
from wacc_torch._weights import read_total_weight
from wacc_torch.errors import (
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroTotalWeightError,
)
from wacc_torch.normalize import divide_sums
from wacc_torch.results import AccumulatedGradients

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ProcessGroupUnavailableError",
    "all_reduce_mean",
    "all_reduce_sums",
]


class ProcessGroupUnavailableError(WeightedAccumulationError, RuntimeError):
    """No usable process group: torch.distributed is missing or not initialized, or this rank is
    not a member of the group.  Raised locally, before any communication."""


@dataclass(frozen=True)
class _RankReport:
    """What one rank tells the others before any buffer is communicated (plain picklable data)."""

    problem: tuple[str, str] | None  # (error class name, message) for an invalid local input
    dtype: str | None  # work dtype of the local buffers; None when this rank has none
    loss_scale: float
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]  # None where this rank has no buffer
    device_type: str | None  # device type of the local buffers; None when this rank has none
    weight: float
    issued: int
    zero_weight: int


# Exception classes a rank report may name; every rank raises the class named by the first bad rank.
_ERROR_CLASSES: Mapping[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        TypeError,
        WeightedAccumulationError,
        InvalidLossScaleError,
        InvalidWeightError,
        ParameterMismatchError,
        UnsupportedEnvironmentError,
        ZeroTotalWeightError,
    )
}


@dataclass(frozen=True)
class _GlobalLayout:
    """The agreed result of the metadata exchange, identical on every rank."""

    dtype: torch.dtype | None  # None when no rank has any buffer
    device_type: str | None
    loss_scale: float
    names: tuple[str, ...]  # rank 0's order
    shapes: Mapping[str, tuple[int, ...]]  # parameters with a buffer on at least one rank
    weight: float
    issued: int
    zero_weight: int


def all_reduce_sums(
    sums: AccumulatedGradients, *, group: ProcessGroup | None = None
) -> AccumulatedGradients:
    """Sum every rank's ``finish_sums()`` result across ``group``; communicates (collective).

    Every rank of ``group`` must call this with its own local sums.  Returns, on every rank, the
    global loss-scaled sums (``normalized=False``, not divided by ``S``), the global weight (the
    correctly rounded float64 sum of the per-rank weights) and the summed counters.  The input is
    not modified: the returned tensors are views into one new flat buffer.  Raises on every rank
    alike (:class:`ParameterMismatchError` for differing dtypes, parameter names, shapes or device
    types; :class:`InvalidLossScaleError` for differing loss scales;
    :class:`WeightedAccumulationError` for an already normalized input; ``TypeError`` for an input
    that is not :class:`AccumulatedGradients`), or locally with
    :class:`ProcessGroupUnavailableError` when there is no process group to talk to.
    """
    return _all_reduce(sums, group=group, caller="all_reduce_sums", normalize=False)


def all_reduce_mean(
    sums: AccumulatedGradients, *, group: ProcessGroup | None = None
) -> AccumulatedGradients:
    """Reduce every rank's ``finish_sums()`` result and normalize it; communicates (collective).

    As :func:`all_reduce_sums`, then divides the global sums by the loss scale exactly once and by
    the global weight, sequentially as ``finish_mean`` does (semantics §8).  Returns
    ``normalized=True`` with ``weight`` = the global weight.  A global weight of 0 raises
    :class:`ZeroTotalWeightError` on every rank, before any buffer is communicated.
    """
    return _all_reduce(sums, group=group, caller="all_reduce_mean", normalize=True)


def _all_reduce(
    sums: AccumulatedGradients,
    *,
    group: ProcessGroup | None,
    caller: str,
    normalize: bool,
) -> AccumulatedGradients:
    layout = _agreed_layout(sums, group=group, caller=caller, normalize=normalize)
    # From here on the input is known to be a valid AccumulatedGradients on every rank.
    reduced = _reduce_buffers(sums.grads, layout=layout, group=group)
    grads: dict[str, torch.Tensor | None] = {name: reduced.get(name) for name in sums.grads}
    loss_scale = layout.loss_scale
    # found_inf of the reduced result: every rank holds the same reduced bits (an all_reduce
    # hands every rank the same result, which data parallelism relies on), so every rank gets
    # the same answer without another collective, and skips the window together.
    if normalize:
        # in_place: the reduced tensors are this call's own copies, never the caller's buffers.
        grads, check = divide_sums(
            grads, loss_scale=loss_scale, total_weight=layout.weight, in_place=True, find_inf=True
        )
        overflowed = check is not None and check.found()
    else:
        overflowed = found_inf(grads.values())
    return AccumulatedGradients(
        grads=grads,
        weight=layout.weight,
        loss_scale=loss_scale,
        issued=layout.issued,
        zero_weight=layout.zero_weight,
        normalized=normalize,
        found_inf=overflowed,
    )


def _agreed_layout(
    sums: object, *, group: ProcessGroup | None, caller: str, normalize: bool
) -> _GlobalLayout:
    """The group's membership checked, then the one metadata exchange of every rank's report on
    ``sums``: the layout every rank agrees on, or the same exception on every rank."""
    world_size = _membership(group, caller=caller)
    return _exchange(
        _local_report(sums, caller=caller),
        group=group,
        world_size=world_size,
        caller=caller,
        normalize=normalize,
    )


def _exchange(
    report: _RankReport,
    *,
    group: ProcessGroup | None,
    world_size: int,
    caller: str,
    normalize: bool,
) -> _GlobalLayout:
    """The one metadata exchange (``all_gather_object``) and the verdict every rank reaches on
    the same gathered data: the agreed layout, or the same exception on every rank."""
    reports: list[_RankReport | None] = [None] * world_size
    dist.all_gather_object(reports, report, group=group)
    gathered = [_checked_report(r, rank=i) for i, r in enumerate(reports)]
    layout = _agree(gathered, caller=caller, world_size=world_size)
    if normalize and layout.weight == 0.0:
        raise ZeroTotalWeightError(
            f"{caller}: the global weight is 0 (weights per rank: "
            f"{[r.weight for r in gathered]}); nothing to normalize"
        )
    if normalize and not math.isfinite(layout.weight):
        raise InvalidWeightError(
            f"{caller}: the global weight overflows float64 (weights per rank: "
            f"{[r.weight for r in gathered]})"
        )
    return layout


def _membership(group: ProcessGroup | None, *, caller: str) -> int:
    """The group size; raises locally when nobody can be talked to."""
    if not dist.is_available():
        raise ProcessGroupUnavailableError(
            f"{caller}: torch.distributed is not available in this PyTorch build"
        )
    if not dist.is_initialized():
        raise ProcessGroupUnavailableError(
            f"{caller}: the default process group is not initialized; call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ProcessGroupUnavailableError(
            f"{caller}: this process (global rank {dist.get_rank()}) is not a member of "
            f"the given process group {group!r}"
        )
    return dist.get_world_size(group)


def _local_report(sums: object, *, caller: str) -> _RankReport:
    """Describe the local input; a bad input becomes a ``problem`` instead of a local raise, so that
    this rank still joins the metadata exchange and every rank can raise together."""
    if not isinstance(sums, AccumulatedGradients):
        return _problem_report(
            TypeError,
            f"{caller} expects the AccumulatedGradients of finish_sums(), got "
            f"{type(sums).__name__}",
        )
    if sums.normalized:
        return _problem_report(
            WeightedAccumulationError,
            f"{caller} expects un-normalized sums (finish_sums()), got an AccumulatedGradients "
            "with normalized=True (finish_mean() or a reduced mean); S and W would be divided "
            "out twice",
        )
    # One rule for numbers (wacc_torch._weights): W exactly a float64, finite, >= 0.
    try:
        weight = read_total_weight(sums.weight, positive=False)
    except WeightedAccumulationError as error:
        return _problem_report(InvalidWeightError, f"{caller}: the weight: {error}")
    issued, zero_weight = sums.issued, sums.zero_weight
    if not (_is_count(issued) and _is_count(zero_weight) and 0 <= zero_weight <= issued):
        return _problem_report(
            WeightedAccumulationError,
            f"{caller}: the counters need 0 <= zero_weight <= issued, got "
            f"zero_weight={zero_weight!r}, issued={issued!r}",
        )
    try:
        loss_scale = check_loss_scale(sums.loss_scale, torch.float64)
    except InvalidLossScaleError as error:
        return _problem_report(InvalidLossScaleError, f"{caller}: {error}")
    names: list[str] = []
    shapes: list[tuple[int, ...] | None] = []
    dtypes: dict[torch.dtype, str] = {}
    devices: dict[torch.device, str] = {}
    for name, buffer in sums.grads.items():
        names.append(name)
        if buffer is None:
            shapes.append(None)
            continue
        if not isinstance(buffer, torch.Tensor):
            return _problem_report(
                TypeError,
                f"{caller}: the pending buffer of {name!r} must be a torch.Tensor or None, got "
                f"{type(buffer).__name__}",
            )
        shapes.append(tuple(buffer.shape))
        dtypes.setdefault(buffer.dtype, name)
        devices.setdefault(buffer.device, name)
    if len(dtypes) > 1:
        return _problem_report(
            ParameterMismatchError,
            f"{caller}: the pending buffers have several dtypes: "
            + ", ".join(f"{_dtype_name(d)} ({n!r})" for d, n in dtypes.items()),
        )
    if len(devices) > 1:
        return _problem_report(
            ParameterMismatchError,
            f"{caller}: the pending buffers of one rank must be on one device, got "
            + ", ".join(f"{d} ({n!r})" for d, n in devices.items()),
        )
    dtype = _dtype_name(next(iter(dtypes))) if dtypes else None
    if dtype is not None and dtype not in WORK_DTYPES:
        return _problem_report(
            ParameterMismatchError,
            f"{caller}: pending buffers of dtype {dtype} are not in a work dtype "
            f"{sorted(WORK_DTYPES)}",
        )
    if dtype is not None:
        try:
            check_loss_scale(loss_scale, WORK_DTYPES[dtype])
        except InvalidLossScaleError as error:
            return _problem_report(InvalidLossScaleError, f"{caller}: {error}")
    # The weights are summed on the host (math.fsum) and divided there: flush-to-zero in this
    # thread is reported, so that every rank raises together instead of one rank alone.
    try:
        check_gradual_underflow(caller)
    except UnsupportedEnvironmentError as error:
        return _problem_report(UnsupportedEnvironmentError, str(error))
    return _RankReport(
        problem=None,
        dtype=dtype,
        loss_scale=loss_scale,
        names=tuple(names),
        shapes=tuple(shapes),
        device_type=next(iter(devices)).type if devices else None,
        weight=weight,
        issued=issued,
        zero_weight=zero_weight,
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem_report(error: type[Exception], message: str) -> _RankReport:
    assert error.__name__ in _ERROR_CLASSES
    return _RankReport(
        problem=(error.__name__, message),
        dtype=None,
        loss_scale=math.nan,
        names=(),
        shapes=(),
        device_type=None,
        weight=math.nan,
        issued=0,
        zero_weight=0,
    )


def _checked_report(report: object, *, rank: int) -> _RankReport:
    # Every rank of the group runs this same module, so anything else is an internal error.
    assert isinstance(report, _RankReport), f"rank {rank} sent {type(report).__name__}"
    return report


def _agree(reports: Sequence[_RankReport], *, caller: str, world_size: int) -> _GlobalLayout:
    """Check that all ranks' reports are compatible; identical data gives identical verdicts, so
    every rank raises the same exception (or none)."""
    for rank, report in enumerate(reports):
        if report.problem is not None:
            class_name, message = report.problem
            raise _ERROR_CLASSES[class_name](
                f"rank {rank} of {world_size}: {message} (raised on every rank)"
            )
    first = reports[0]
    for rank, report in enumerate(reports[1:], start=1):
        if report.loss_scale != first.loss_scale:
            raise InvalidLossScaleError(
                f"{caller}: loss scale {report.loss_scale!r} on rank {rank} differs from "
                f"{first.loss_scale!r} on rank 0; S must be the same on every rank"
            )
        if set(report.names) != set(first.names):
            only_here = sorted(set(report.names) - set(first.names))
            only_first = sorted(set(first.names) - set(report.names))
            unbound = [r for r in (0, rank) if not reports[r].names]
            hint = (
                f" (rank {unbound[0]} tracks no parameter: its accumulator never accumulated; "
                "a zero-weight accumulate_sum there binds the parameter set)"
                if unbound
                else ""
            )
            raise ParameterMismatchError(
                f"{caller}: parameter names differ between rank 0 and rank {rank}: only on "
                f"rank {rank}: {only_here}; only on rank 0: {only_first}{hint}"
            )
    dtypes = {r.dtype for r in reports if r.dtype is not None}
    if len(dtypes) > 1:
        raise ParameterMismatchError(
            f"{caller}: the work dtype differs across ranks: "
            + ", ".join(f"rank {i}: {r.dtype}" for i, r in enumerate(reports) if r.dtype)
        )
    device_types = {r.device_type for r in reports if r.device_type is not None}
    if len(device_types) > 1:
        raise ParameterMismatchError(
            f"{caller}: the buffers' device type differs across ranks: "
            + ", ".join(
                f"rank {i}: {r.device_type}" for i, r in enumerate(reports) if r.device_type
            )
        )
    shapes: dict[str, tuple[int, ...]] = {}
    shape_rank: dict[str, int] = {}
    for rank, report in enumerate(reports):
        for name, shape in zip(report.names, report.shapes, strict=True):
            if shape is None:
                continue
            if name not in shapes:
                shapes[name], shape_rank[name] = shape, rank
            elif shapes[name] != shape:
                raise ParameterMismatchError(
                    f"{caller}: parameter {name!r} has shape {list(shape)} on rank {rank} but "
                    f"{list(shapes[name])} on rank {shape_rank[name]}"
                )
    try:
        weight = math.fsum(r.weight for r in reports)
    except OverflowError:
        # Weights are finite and >= 0: an overflowing partial sum means the exact sum rounds to inf.
        weight = math.inf
    return _GlobalLayout(
        dtype=WORK_DTYPES[dtypes.pop()] if dtypes else None,
        device_type=device_types.pop() if device_types else None,
        loss_scale=first.loss_scale,
        names=first.names,
        shapes=shapes,
        weight=weight,
        issued=sum(r.issued for r in reports),
        zero_weight=sum(r.zero_weight for r in reports),
    )


def _reduce_buffers(
    local: Mapping[str, torch.Tensor | None],
    *,
    layout: _GlobalLayout,
    group: ProcessGroup | None,
) -> dict[str, torch.Tensor]:
    """One SUM all_reduce of every buffer present on some rank, flattened in rank 0's name order;
    the same call (same numel, dtype) on every rank."""
    present = [name for name in layout.names if name in layout.shapes]
    if not present:
        return {}
    assert layout.dtype is not None and layout.device_type is not None
    device = _local_device(local, device_type=layout.device_type)
    pieces: list[torch.Tensor] = []
    for name in present:
        buffer = local[name]
        if buffer is None:
            # +0.0: adding it leaves every other rank's value unchanged (x + 0 = x, -0 + +0 = +0
            # as an accumulator's +0-started buffer would give).
            pieces.append(
                torch.zeros(math.prod(layout.shapes[name]), dtype=layout.dtype, device=device)
            )
        else:
            pieces.append(buffer.reshape(-1))
    # torch.cat copies: the caller's buffers are never written.
    flat = torch.cat(pieces)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    reduced: dict[str, torch.Tensor] = {}
    offset = 0
    for name in present:
        shape = layout.shapes[name]
        numel = math.prod(shape)
        reduced[name] = flat[offset : offset + numel].view(shape)
        offset += numel
    return reduced


def _local_device(local: Mapping[str, torch.Tensor | None], *, device_type: str) -> torch.device:
    """The device of this rank's buffers; for a rank without any, the agreed device type (for
    CUDA: this process's current device, as torch.distributed itself assumes)."""
    for buffer in local.values():
        if buffer is not None:
            return buffer.device
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _dtype_name(dtype: torch.dtype) -> str:
    # Also spells dtypes that are not work dtypes, for the message that refuses them.
    return str(dtype).removeprefix("torch.")
