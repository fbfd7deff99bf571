"""The window every integration shares: one optimizer step's microbatches, each added with its
token count as weight (``accumulate_mean``), finished once as the token-weighted mean (semantics
§6, §8), with an optional :class:`~wacc_torch.WindowLossScaler` deciding per window whether the
window is applied or skipped whole (§13), and a record for the framework's checkpoint (§9).
Across ranks (``across_ranks=True``) the window is finished once over every rank's microbatches:
each rank's scaled sums and weight are SUM-reduced once (:func:`wacc_torch.all_reduce_mean`, after
its one metadata exchange), then divided by the loss scale once and by the global weight (§7);
the framework's own data-parallel averaging must not touch the gradients (``no_sync`` on every
microbatch, or :func:`keep_local`'s DDP communication hook)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.distributed import all_reduce_mean
from wacc_torch.errors import RecordError, ZeroTotalWeightError
from wacc_torch.results import AccumulatedGradients
from wacc_torch.scaler import WindowLossScaler

__all__ = [
    "IGNORE_INDEX",
    "TokenWindow",
    "count_tokens",
    "finish_window",
    "keep_local",
    "local_module",
]

IGNORE_INDEX = -100  # the label every Hugging Face loss ignores
STATE_KEYS = ("format_version", "record", "scaler")
_FORMAT_VERSION = 1


def count_tokens(labels: torch.Tensor, *, shift: bool) -> int:
    """The targets a token-mean loss averages over: labels != -100, without each row's first
    position when the loss shifts the labels (a causal LM predicts ``t + 1`` from ``t``)."""
    counted = labels[..., 1:] if shift else labels
    return int((counted != IGNORE_INDEX).sum())


def finish_window(
    accumulator: WeightedGradientsAccumulator, *, group: Any = None
) -> AccumulatedGradients:
    """The window's token-weighted mean: ``finish_mean()`` in a single process; across the ranks
    of ``group`` (default: the whole world, when ``torch.distributed`` is initialized with more
    than one rank) every rank's ``finish_sums()`` reduced once, sums and weights together, by
    :func:`wacc_torch.all_reduce_mean` (semantics §7): every rank gets the same mean, divided by
    ``S`` once and then by the global weight, and the same ``found_inf``."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size(group) > 1:
        return all_reduce_mean(accumulator.finish_sums(), group=group)
    return accumulator.finish_mean()


def _work_dtype(module: nn.Module) -> torch.dtype:
    """float64 for a float64 model, else float32 (half-precision parameters still sum in
    float32: the window's sum is where rounding accumulates)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return torch.float64 if any(p.dtype == torch.float64 for p in trainable) else torch.float32


def local_module(module: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wraps (the same parameters, their plain names: a
    window's record then loads into the unwrapped model); any other module itself."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        inner: nn.Module = module.module
        return inner
    return module


def keep_local(model: nn.Module) -> None:
    """Make a ``DistributedDataParallel`` ``model``'s synchronized backward leave every rank's
    gradients as they are (a communication hook that sends nothing): the window is reduced once,
    by :meth:`TokenWindow.finish`, and never averaged by DDP on top. ``ValueError`` for a model
    that is not a ``DistributedDataParallel``; DDP's own ``RuntimeError`` when it has a hook."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"across ranks the model must be the prepared DistributedDataParallel, got "
            f"{type(model).__name__}"
        )
    from wacc_torch.ddp_hook import local_gradients_hook

    model.register_comm_hook(None, local_gradients_hook)


class TokenWindow:
    """One window of microbatches weighted by their token counts.

    ``add(module, tokens)`` after each microbatch's backward of ``loss_scale * mean_loss`` takes the
    gradients out of ``.grad``; ``finish(module)`` after the window's last one writes the
    token-weighted mean into ``.grad`` and answers whether the optimizer may step: False for a
    window without a single target (nothing to average: every ``.grad`` stays None) and for a
    window the scaler skips (an overflow: every ``.grad`` stays None, so a ``torch.optim``
    optimizer's ``step()`` changes nothing). ``dtype`` is the accumulator's work dtype (default:
    float64 for a float64 model, else float32). ``across_ranks``: ``finish`` is a collective of
    the default process group (module docstring): every rank calls it on the same window's end,
    the mean is over every rank's targets, every rank writes the same ``.grad`` and the scaler
    decides on the same reduced values (all ranks step or skip together); ``window_tokens`` is
    then the global count.
    """

    def __init__(
        self,
        *,
        dtype: torch.dtype | None = None,
        loss_scaler: WindowLossScaler | None = None,
        across_ranks: bool = False,
    ) -> None:
        if loss_scaler is not None and not isinstance(loss_scaler, WindowLossScaler):
            kind = type(loss_scaler).__name__
            raise TypeError(f"loss_scaler must be a wacc_torch.WindowLossScaler, got {kind}")
        self._dtype = dtype
        self.loss_scaler = loss_scaler
        self.across_ranks = across_ranks
        self._accumulator: WeightedGradientsAccumulator | None = None
        self.window_tokens: float | None = None  # W of the last finished window
        self.applied: bool | None = None  # whether the last finished window reached .grad

    @property
    def loss_scale(self) -> float:
        """The factor the current window's losses are multiplied by before backward."""
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    @property
    def pending(self) -> int:
        """Microbatches added to the current window so far."""
        return 0 if self._accumulator is None else self._accumulator.state.issued

    def _ready(self, module: nn.Module) -> WeightedGradientsAccumulator:
        if self._accumulator is None:
            dtype = self._dtype if self._dtype is not None else _work_dtype(module)
            self._accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
        accumulator = self._accumulator
        if accumulator.state.issued == 0 and accumulator.state.loss_scale != self.loss_scale:
            accumulator.set_loss_scale(self.loss_scale)  # only between windows (semantics §4)
        return accumulator

    def add(self, module: nn.Module, tokens: int | float | torch.Tensor) -> None:
        """Take the gradients of ``loss_scale * mean_loss`` of one microbatch out of ``.grad``,
        weighted by its ``tokens`` (a zero-target microbatch's NaN mean is never read)."""
        module = local_module(module)
        self._ready(module).accumulate_mean(module, tokens, disposable=True)

    def finish(self, module: nn.Module) -> bool:
        """Write the window's token-weighted mean into ``.grad``; whether to step (class doc)."""
        module = local_module(module)
        accumulator = self._ready(module)
        if self.across_ranks:
            # Sums and weights reduced once over every rank, divided by S once, then by the global
            # W (semantics §7); a zero global weight raises on every rank alike, before any
            # buffer is sent: every rank leaves .grad None together.
            try:
                result = all_reduce_mean(accumulator.finish_sums())
            except ZeroTotalWeightError:
                self.window_tokens, self.applied = 0.0, False
                return False
            weight = result.weight
        else:
            weight = accumulator.state.total_weight
            if weight == 0:  # no target in the whole window: there is no mean to step on
                accumulator.discard()
                self.window_tokens, self.applied = 0.0, False
                return False
            result = accumulator.finish_mean()
        self.window_tokens = weight
        # Across ranks found_inf is read from the reduced values every rank holds bit for bit:
        # every rank's scaler makes the same decision, without another collective.
        if self.loss_scaler is not None and not self.loss_scaler.update(result.found_inf):
            self.applied = False  # an overflow: the whole window is skipped, .grad stays None
            return False
        result.apply_to(module)
        self.applied = True
        return True

    def state_dict(self) -> dict[str, Any]:
        """The pending window (a ``wacc_torch`` record) and the scaler, for a checkpoint; loads
        with ``torch.load(..., weights_only=True)``."""
        record = None if self._accumulator is None else self._accumulator.state_dict()
        scaler = None if self.loss_scaler is None else self.loss_scaler.state_dict()
        return {"format_version": _FORMAT_VERSION, "record": record, "scaler": scaler}

    def load_state_dict(self, state: Mapping[str, Any], module: nn.Module) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) for ``module``, bit for bit; every
        field is checked before anything changes (:class:`~wacc_torch.RecordError` naming it)."""
        module = local_module(module)
        if not isinstance(state, Mapping) or set(state) != set(STATE_KEYS):
            keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
            raise RecordError(f"a window state has the keys {list(STATE_KEYS)}, got {keys}")
        if state["format_version"] != _FORMAT_VERSION:
            raise RecordError(f"window state format_version {state['format_version']!r} is not 1")
        if (state["scaler"] is None) != (self.loss_scaler is None):
            has = "has" if state["scaler"] is not None else "has no"
            want = "no loss scaler" if self.loss_scaler is None else "a loss scaler"
            raise RecordError(f"the saved window {has} loss scaler; this one has {want}")
        accumulator = None
        record = state["record"]
        if record is not None:
            if not isinstance(record, Mapping) or "dtype" not in record:
                raise RecordError("window state record is not a wacc_torch record")
            dtype = getattr(torch, str(record["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise RecordError(f"window state record dtype {record['dtype']!r} is unknown")
            scale = record.get("loss_scale")
            accumulator = WeightedGradientsAccumulator(
                dtype=dtype, loss_scale=scale if isinstance(scale, float) else 1.0
            )
            accumulator.load_state_dict(record, module)  # validates every field first
        if self.loss_scaler is not None:
            # Checks every field before it changes anything; the new accumulator is not in place
            # yet, so a raise here leaves this window exactly as it was.
            self.loss_scaler.load_state_dict(state["scaler"])
        self._accumulator = accumulator
