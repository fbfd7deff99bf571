"""A DDP communication hook that reduces a whole accumulation window on the last microbatch.

With :func:`wacc_torch.all_reduce_mean` the reduction runs after the last backward, so nothing of
it overlaps the backward.  :class:`WeightedAllReduceHook` instead lets DDP's own bucketed,
overlapped all-reduce of the window's LAST microbatch carry the whole window: for each bucket,
on every rank, the pending sums of the earlier microbatches plus this microbatch's gradient
(§5 or §6, in the work dtype ``D``), summed across ranks (SUM, never averaged), then divided
by the loss scale and the global weight (semantics §8).  DDP writes the result into ``.grad``,
converted to each parameter's dtype, exactly as ``AccumulatedGradients.apply_to`` does.

Use::

    hook = WeightedAllReduceHook(ddp_model, accumulator)
    with ddp_model.no_sync():
        for batch in window[:-1]:
            ...backward...; accumulator.accumulate_sum(ddp_model.module, tokens)
    loss = ...last forward...               # outside no_sync()
    hook.last_microbatch_sum(last_tokens)   # one small metadata exchange, before the backward
    loss.backward()                         # buckets reduce as their gradients become ready
    optimizer.step()

Call ``last_microbatch_*`` AFTER the last microbatch's forward: the first forward after DDP's
first synchronized backward rebuilds its buckets with a collective, and ranks with different
numbers of earlier microbatches reach that forward at different points; arming after the forward
keeps every rank's collectives in the same order.

Collectives per window: one metadata ``all_gather_object`` (in ``last_microbatch_*``: weights,
counters, dtype, loss scale, parameter names; every rank reaches the same verdict, so a bad input
on one rank raises the same error on all of them before any gradient moves) and DDP's one
all-reduce per bucket, of the buffers in ``D`` (``D``'s bytes per parameter element).

Reading of semantics: the hook performs the last microbatch's conversion, multiply and add itself,
with the semantics §5/§6 rounding order (the accumulator's public API has no way to add a gradient
that lives in a DDP bucket without also counting it), and takes the earlier microbatches' buffers
with ``finish_sums()`` when the first bucket is ready.  Every element goes through the same
operations as ``accumulate_*`` + ``finish_sums`` + :func:`all_reduce_mean` + ``apply_to``; with
two ranks (one rounding per element in the SUM) the ``.grad`` is bit-identical to that path.
With more ranks the association order of the SUM is the backend's and may depend on the bucket
layout, so it can differ from the helper's within the same error bound.

Differences from the helper: every parameter DDP reduces gets a gradient (zeros where no rank
contributed anything, where the helper gives ``None``), and the buffers must all be on one device
(DDP's single-device-per-rank layout).

Module without ``from __future__ import annotations``: DDP checks the hook's annotations
against the real ``dist.GradBucket`` and ``Future[Tensor]`` objects.
"""

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel

from wacc_torch._dtypes import dtype_name
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._finite import FiniteCheck, found_in
from wacc_torch._weights import count_weight, read_weight
from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.distributed import (
    _exchange,
    _GlobalLayout,
    _membership,
    _problem_report,
    _RankReport,
)
from wacc_torch.errors import (
    InvalidWeightError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroCopyError,
)
from wacc_torch.normalize import divide_sums
from wacc_torch.results import AccumulatedGradients

__all__ = ["WeightedAllReduceHook", "local_gradients_hook"]


@dataclass
class _ArmedWindow:
    """The window whose last backward is about to run (set by ``last_microbatch_*``)."""

    mean: bool
    weight: float  # w for sums, w_D for means; 0.0 means "do not read this gradient"
    layout: _GlobalLayout
    pending: AccumulatedGradients | None = None  # taken from the accumulator at the first bucket
    reduced: dict[str, torch.Tensor] = field(default_factory=dict)
    checks: list[FiniteCheck] = field(default_factory=list)  # found_inf, one per bucket


class WeightedAllReduceHook:
    """Registers itself as ``model``'s DDP communication hook (``register_comm_hook``).

    ``accumulator`` is the window's accumulator, fed with ``accumulate_*(model.module, ...)``
    under ``model.no_sync()``.  Call :meth:`last_microbatch_sum` (or ``_mean``) between the
    window's last forward and its backward, both WITHOUT ``no_sync()``; after the backward,
    every ``.grad`` holds the global mean and :attr:`result` the reduced window
    (``normalized=True``, the global weight and counters, the normalized buffers in ``D``).
    A backward outside ``no_sync()`` without a preceding ``last_microbatch_*`` raises
    :class:`WeightedAccumulationError` inside the backward rather than silently averaging.
    ``group`` defaults to the DDP model's process group.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        accumulator: WeightedGradientsAccumulator,
        *,
        group: ProcessGroup | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"model must be a DistributedDataParallel, got {type(model).__name__}")
        if not isinstance(accumulator, WeightedGradientsAccumulator):
            raise TypeError(
                "accumulator must be a WeightedGradientsAccumulator, got "
                f"{type(accumulator).__name__}"
            )
        if accumulator.state.zero_copy:
            raise ZeroCopyError(
                "WeightedAllReduceHook needs a buffered accumulator: its last microbatch is a "
                "plain DDP backward, which would add into the zero-copy window's .grad. With "
                "zero_copy=True run every microbatch in `with ddp.no_sync(), acc.microbatch(...)` "
                "and reduce with wacc_torch.all_reduce_mean"
            )
        self._module = model.module
        self._accumulator = accumulator
        self._group = group if group is not None else model.process_group
        tracked = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self._names = {id(p): n for n, p in tracked}
        self._shapes = {n: tuple(p.shape) for n, p in tracked}
        self._armed: _ArmedWindow | None = None
        self.result: AccumulatedGradients | None = None
        model.register_comm_hook(self, _weighted_all_reduce_hook)

    def last_microbatch_sum(self, weight: float) -> None:
        """The next backward (outside ``no_sync()``) is the window's last microbatch, a loss SUM
        over ``weight`` tokens (semantics §5).  Collective: exchanges the window's metadata; raises
        the same error on every rank (e.g. :class:`ZeroTotalWeightError` when the global weight
        is 0), leaving the accumulator unchanged."""
        self._arm(weight, mean=False, caller="last_microbatch_sum")

    def last_microbatch_mean(self, weight: float) -> None:
        """As :meth:`last_microbatch_sum` for a loss MEAN over ``weight`` tokens (semantics §6)."""
        self._arm(weight, mean=True, caller="last_microbatch_mean")

    def _arm(self, weight: object, *, mean: bool, caller: str) -> None:
        world_size = _membership(self._group, caller=caller)
        self.result = None
        report, counted = self._report(weight, mean=mean, caller=caller)
        layout = _exchange(
            report, group=self._group, world_size=world_size, caller=caller, normalize=True
        )
        self._armed = _ArmedWindow(mean=mean, weight=counted, layout=layout)

    def _report(self, weight: object, *, mean: bool, caller: str) -> tuple[_RankReport, float]:
        """This rank's view of the whole window, the last microbatch included; a bad weight
        becomes a problem report so that every rank raises together."""
        state = self._accumulator.state
        try:
            # One rule for numbers, one rounding of W + w (wacc_torch._weights), and the
            # host arithmetic checked for flush-to-zero in this thread.
            value = read_weight(weight)
            counted, total = count_weight(
                state.total_weight, weight, value, dtype=state.dtype, mean=mean, caller=caller
            )
        except (InvalidWeightError, UnsupportedEnvironmentError) as error:
            # Named once: count_weight's and the flush-to-zero check's messages start with it.
            message = str(error)
            if not message.startswith(f"{caller}: "):
                message = f"{caller}: {message}"
            return _problem_report(type(error), message), 0.0
        devices = {p.device.type for p in self._module.parameters() if p.requires_grad}
        if len(devices) != 1:
            return _problem_report(
                WeightedAccumulationError,
                f"{caller}: the parameters must be on one device type, got {sorted(devices)}",
            ), 0.0
        report = _RankReport(
            problem=None,
            dtype=dtype_name(state.dtype),
            loss_scale=state.loss_scale,
            names=tuple(self._shapes),
            shapes=tuple(self._shapes.values()),
            device_type=devices.pop(),
            weight=total,
            issued=state.issued + 1,
            zero_weight=state.zero_weight + (value == 0),
        )
        return report, float(counted)

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        armed = self._armed
        if armed is None:
            raise WeightedAccumulationError(
                "WeightedAllReduceHook: a backward synchronized gradients (outside no_sync()) "
                "without last_microbatch_sum/_mean() first; DDP would average it by the world "
                "size, which is the error this hook exists to avoid"
            )
        buffer = bucket.buffer()
        if buffer.device.type == "cpu":
            # The arithmetic below runs in autograd's thread, which last_microbatch_* (checked
            # with the others, collectively) need not be: a last, local refusal.
            check_gradual_underflow("WeightedAllReduceHook (in the backward's thread)")
        if armed.pending is None:
            # The first ready bucket of the last backward takes over the window's buffers.
            armed.pending = self._accumulator.finish_sums()
        dtype = self._accumulator.state.dtype
        parameters = bucket.parameters()
        names = [self._names[id(p)] for p in parameters]
        pieces = []
        for name in names:
            pending = armed.pending.grads.get(name)
            numel = math.prod(self._shapes[name])
            pieces.append(
                torch.zeros(numel, dtype=dtype, device=buffer.device)
                if pending is None
                else pending.reshape(-1)
            )
        flat = torch.cat(pieces)  # a copy: the accumulator's buffers are never written
        if armed.weight > 0.0:
            gradient = _bucket_gradient(bucket, buffer)
            converted = gradient.to(dtype)  # conv_D first, then operate in D (semantics §5/§6)
            if not armed.mean:
                flat.add_(converted)
            elif self._accumulator.state.fused:
                flat.add_(converted, alpha=armed.weight)
            else:
                # w_D is exact in D: the scalar multiply is round_D(c * w_D); then a separate add.
                product = (
                    converted.mul(armed.weight)
                    if converted is gradient
                    else converted.mul_(armed.weight)
                )
                flat.add_(product)
        layout = armed.layout
        loss_scale = self._accumulator.state.loss_scale
        shapes = self._shapes
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        assert work is not None
        # The callback runs, and is released, in the process group's worker thread: holding the
        # hook strongly there (and through it the group) would let the group's last reference die
        # in its own thread, whose destructor then joins itself and aborts the process.
        hook = weakref.ref(self)

        def normalize(_: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            __, check = divide_sums(
                {"bucket": flat},
                loss_scale=loss_scale,
                total_weight=layout.weight,
                in_place=True,
                find_inf=True,
                # The bucket holds the parameters' dtype: found_inf of what it will hold.
                targets={"bucket": buffer.dtype},
            )
            assert check is not None
            armed.checks.append(check)  # asked once, when the last bucket is in
            buffer.copy_(flat)  # into the parameters' dtype, as apply_to's .to(dtype)
            offset = 0
            for name in names:
                shape = shapes[name]
                numel = math.prod(shape)
                armed.reduced[name] = flat[offset : offset + numel].view(shape)
                offset += numel
            owner = hook()
            if owner is not None and len(armed.reduced) == len(shapes):
                owner.result = AccumulatedGradients(
                    grads={name: armed.reduced[name] for name in shapes},
                    weight=layout.weight,
                    loss_scale=loss_scale,
                    issued=layout.issued,
                    zero_weight=layout.zero_weight,
                    normalized=True,
                    # Every rank divides the same all-reduced bits: the same answer everywhere.
                    found_inf=found_in(armed.checks),
                )
                owner._armed = None
            return buffer

        return work.get_future().then(normalize)


def _bucket_gradient(bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.Tensor:
    """This microbatch's gradients of the bucket, flat in the bucket's parameter order: the
    bucket's own buffer when its gradient views tile it in that order (DDP's layout), else a
    concatenated copy."""
    offset = 0
    element = buffer.element_size()
    for gradient in bucket.gradients():
        if gradient.data_ptr() != buffer.data_ptr() + offset * element:
            return torch.cat([g.reshape(-1) for g in bucket.gradients()])
        offset += gradient.numel()
    if offset != buffer.numel():
        return torch.cat([g.reshape(-1) for g in bucket.gradients()])
    return buffer


def _weighted_all_reduce_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The function DDP calls per bucket; ``state`` is the :class:`WeightedAllReduceHook`."""
    assert isinstance(state, WeightedAllReduceHook)
    return state._reduce_bucket(bucket)


def local_gradients_hook(
    state: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that sends nothing: the bucket comes back as it is, so every rank
    keeps its own gradients (no all-reduce, no division by the world size). For a loop that
    reduces the window itself after its last backward (:func:`wacc_torch.all_reduce_mean`, as the
    framework integrations do across ranks) where the last microbatch's forward ran outside
    ``no_sync()``."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
