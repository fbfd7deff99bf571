"""Weighted accumulation of loss sums for FSDP2 (``torch.distributed.fsdp.fully_shard``) models.

FSDP2 keeps each rank's accumulated gradient unsharded while gradient sync is off, and
reduce-scatters it on the synchronized backward, AVERAGING over the ranks by default.
:class:`FSDPWeightedWindow` turns that into semantics' weighted mean for a window of microbatches
whose losses are loss SUMS (``S × Σ_t loss_t``, any token counts, any number of microbatches per
rank):

1. ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` on every
   FSDP unit of the model (neither recurses): the reduce-scatter SUMS across ranks instead of
   averaging.  The divide factor alone is not enough: for float32 and bfloat16 FSDP2 then asks
   for ``ReduceOp.PREMUL_SUM(1 / factor)``, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM
   with Gloo", torch 2.13); forced SUM divides by the factor afterwards, and skips a factor of 1;
2. every microbatch but the last runs with ``set_requires_gradient_sync(False)`` and
   ``set_reshard_after_backward(False)`` (:meth:`FSDPWeightedWindow.microbatch`): FSDP adds its
   gradient into the unsharded accumulation, ``round(acc + g)`` in the parameter dtype (§5's
   sum with ``D`` = the parameters' dtype), and the parameters stay unsharded, so ranks with
   different numbers of microbatches issue the same collectives;
3. the last microbatch's backward reduce-scatters the window's sums: each rank's shard of
   ``Σ_ranks Σ_k S g_k``;
4. :meth:`FSDPWeightedWindow.finish_mean` exchanges the weights and counters once
   (``all_gather_object``, every rank reaching the same verdict; a global weight of 0 raises
   :class:`ZeroTotalWeightError` on every rank and leaves the summed shards in ``.grad``) and
   divides each local shard by ``S``, then by the global weight, in place (semantics §8,
   :func:`wacc_torch.accumulator.normalize_sums`).

Collectives per window: FSDP's own (parameter all-gathers, one reduce-scatter per FSDP unit in
the last backward, in the parameter dtype) plus one small metadata exchange.  With two ranks
every element of the reduce-scatter is one rounding ``round(a + b)``, so the result equals the
DDP path's (``no_sync`` + ``accumulate_sum`` with ``D`` = the parameter dtype +
:func:`wacc_torch.all_reduce_mean`) bit for bit.

Bit for bit, except for signed zeros: FSDP's accumulation starts from the first gradient, the
accumulator's buffers from +0, so an element that is -0 in every contribution stays -0 here.

Readings and limits: the work dtype is the parameters' dtype (FSDP owns the unsharded
accumulation buffer; a ``MixedPrecisionPolicy`` with another ``reduce_dtype`` is not covered and
raises in :meth:`FSDPWeightedWindow.finish_mean` if the gradients differ), so only loss SUMS
are supported (a mean loss times its weight would round inside autograd, not as
§6 orders it).  A zero-weight microbatch must contribute exact zeros: skip its backward, or,
if it is a rank's last one, run the backward of its loss sum over no tokens (exactly 0).

Reading: a parameter that ``fully_shard`` leaves out (``ignored_params``) is not FSDP's: its
plain-tensor ``.grad`` holds this rank's sum only, and :meth:`FSDPWeightedWindow.finish_mean`
divides it by ``S`` and the global weight like the shards.  On more than one rank, sum it over
the group (``all_reduce``) before ``finish_mean``, as whatever replicates that parameter must.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from wacc_torch._dtypes import WORK_DTYPES, check_loss_scale, dtype_name
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._finite import flag_of
from wacc_torch._weights import count_weight, read_weight
from wacc_torch.distributed import (
    _exchange,
    _membership,
    _problem_report,
    _RankReport,
)
from wacc_torch.errors import (
    InvalidLossScaleError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
)
from wacc_torch.normalize import divide_sums
from wacc_torch.results import AccumulatedGradients

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FSDPWeightedWindow"]


class FSDPWeightedWindow:
    """A window of loss-sum microbatches on an FSDP2 root module ``model``.

    Per microbatch: ``window.microbatch(last=...)`` before its forward, the backward of
    ``S × loss sum``, then ``window.add_weight(tokens)``; after the last one,
    ``window.finish_mean()``: every local ``.grad`` shard then holds the global weighted mean.
    ``group`` is the group FSDP reduces over (default: the default group).
    """

    def __init__(
        self, model: FSDPModule, *, loss_scale: float, group: ProcessGroup | None = None
    ) -> None:
        if not (isinstance(model, FSDPModule) and isinstance(model, nn.Module)):
            raise TypeError(
                f"model must be a module wrapped by fully_shard, got {type(model).__name__}"
            )
        parameters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dtypes = {p.dtype for _, p in parameters}
        if len(dtypes) != 1 or next(iter(dtypes)) not in WORK_DTYPES.values():
            raise WeightedAccumulationError(
                f"the parameters must share one work dtype, got {sorted(map(str, dtypes))}"
            )
        self._dtype = dtypes.pop()
        self._loss_scale = check_loss_scale(loss_scale, self._dtype)
        self._model = model
        self._parameters = parameters
        self._group = group
        self._issued = 0
        self._zero_weight = 0
        self._total_weight = 0.0
        # Unlike set_requires_gradient_sync, these two act on one FSDP unit: set them on each.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def set_loss_scale(self, loss_scale: float) -> None:
        """The loss scale S of the window about to start; only between windows (no weight added
        since the last ``finish_mean``), checked like the constructor's. Local: call it with the
        same S on every rank (``finish_mean``'s exchange refuses differing scales). Raises
        :class:`InvalidLossScaleError` naming the value; nothing changes on a raise."""
        if self._issued:
            raise InvalidLossScaleError(
                f"set_loss_scale({loss_scale!r}): the window has {self._issued} microbatch(es) "
                f"under loss scale {self._loss_scale!r}, and every backward of a window has one "
                "loss scale; finish_mean first"
            )
        self._loss_scale = check_loss_scale(loss_scale, self._dtype)

    @property
    def loss_scale(self) -> float:
        """The loss scale S of the current window."""
        return self._loss_scale

    def microbatch(self, *, last: bool) -> None:
        """Call before each microbatch's forward: ``last=True`` for the window's last one (its
        backward reduce-scatters), False otherwise (accumulate locally, stay unsharded)."""
        self._model.set_requires_gradient_sync(last)
        self._model.set_reshard_after_backward(last)

    def add_weight(self, weight: float) -> None:
        """Count a microbatch of ``weight`` tokens (after its backward); local, no communication."""
        # One rule for numbers and one rounding of W + w (wacc_torch._weights).
        value = read_weight(weight)
        _, total = count_weight(
            self._total_weight,
            weight,
            value,
            dtype=self._dtype,
            mean=False,
            caller="FSDPWeightedWindow.add_weight",
        )
        self._issued += 1
        self._zero_weight += value == 0
        self._total_weight = total

    def finish_mean(self) -> AccumulatedGradients:
        """Normalize the reduce-scattered sums in place: ``.grad`` shard / S / global W.

        Collective.  Returns the local shards (``normalized=True``), the global weight and
        counters, and starts a new window.  Raises on every rank alike; on a raise the ``.grad``
        shards keep the summed, loss-scaled values.
        """
        caller = "FSDPWeightedWindow.finish_mean"
        world_size = _membership(self._group, caller=caller)
        shards: dict[str, torch.Tensor | None] = {}
        problem: _RankReport | None = None
        try:
            # The division runs in this thread (and the weights on the host): a rank that
            # flushes subnormals is reported, so that every rank raises together.
            check_gradual_underflow(caller)
        except UnsupportedEnvironmentError as error:
            problem = _problem_report(UnsupportedEnvironmentError, str(error))
        for name, parameter in self._parameters:
            grad = parameter.grad
            local = None if grad is None else getattr(grad, "_local_tensor", grad)
            if problem is None and local is not None and local.dtype != self._dtype:
                problem = _problem_report(  # the first problem is the one reported
                    WeightedAccumulationError,
                    f"{caller}: the gradient of {name!r} has dtype {local.dtype}, the "
                    f"parameters {self._dtype}",
                )
            shards[name] = local
        report = problem or _RankReport(
            problem=None,
            dtype=dtype_name(self._dtype),
            loss_scale=self._loss_scale,
            names=tuple(name for name, _ in self._parameters),
            shapes=tuple(tuple(p.shape) for _, p in self._parameters),
            device_type=self._parameters[0][1].device.type,
            weight=self._total_weight,
            issued=self._issued,
            zero_weight=self._zero_weight,
        )
        layout = _exchange(
            report, group=self._group, world_size=world_size, caller=caller, normalize=True
        )
        normalized, check = divide_sums(
            shards,
            loss_scale=self._loss_scale,
            total_weight=layout.weight,
            in_place=True,
            find_inf=True,
        )
        assert check is not None
        self._issued, self._zero_weight, self._total_weight = 0, 0, 0.0
        # Each rank checked its own shards: one MAX all_reduce of a flag makes found_inf the
        # global answer, the same on every rank, so that every rank skips the window together.
        # After the window is finished: should the collective fail, the means are in .grad and
        # the window is not divided twice by a retry.
        flag = flag_of([check], _flag_device(self._parameters[0][1], shards))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return AccumulatedGradients(
            grads=normalized,
            weight=layout.weight,
            loss_scale=self._loss_scale,
            issued=layout.issued,
            zero_weight=layout.zero_weight,
            normalized=True,
            found_inf=bool(flag.item()),
        )


def _flag_device(parameter: nn.Parameter, shards: dict[str, torch.Tensor | None]) -> torch.device:
    """Where the found_inf flag is reduced: the shards' device (a CUDA device under NCCL)."""
    for shard in shards.values():
        if shard is not None:
            return shard.device
    local = getattr(parameter, "_local_tensor", parameter)
    return local.device
