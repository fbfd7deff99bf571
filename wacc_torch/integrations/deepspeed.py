"""Token-weighted accumulation for DeepSpeed's engine (ZeRO stages 0 and 1):
:class:`TokenWeightedEngine`.

``engine.backward(loss)`` divides every microbatch's loss by ``gradient_accumulation_steps``
(``deepspeed/runtime/engine.py``, ``DeepSpeedEngine.backward``: ``loss = loss /
self.gradient_accumulation_steps() if scale_wrt_gas else loss``), so every microbatch weighs the
same whatever its token count, and ``micro_steps`` (where the window's boundary is) is not in its
checkpoint.  :class:`TokenWeightedEngine` wraps an engine built with
``"managed_gradient_accumulation": false`` and ``"gradient_accumulation_steps": 1`` (DeepSpeed's
caller-owned boundary: ``backward`` only accumulates, every ``step()`` is a boundary; a larger
``gradient_accumulation_steps`` would still divide every gradient by it,
``_backward_prologue_per_tensor``) and:

* ``backward(loss, tokens)``: ``engine.backward(loss, scale_wrt_gas=False)`` (the microbatch's
  own mean loss, through the engine's loss scaler if it has one), then
  ``accumulate_mean(engine.module, tokens)``, which takes the gradient out of ``.grad``;
* ``step()``: the window's token-weighted mean (``finish_mean``; across ranks
  :func:`wacc_torch.all_reduce_mean` of ``finish_sums``: the sums and the weights reduced once,
  semantics §7) written into ``.grad``, then ``engine.step()``; the engine's own gradient
  all-reduce is off (``engine.enable_backward_allreduce = False``): it would average the ranks'
  means, not weigh them by their tokens.  A float16 ``torch_autocast`` engine's ``GradScaler``
  then unscales the mean and decides once for the window: an overflow skips it whole;
* ``save_checkpoint`` / ``load_checkpoint``: the accumulator's record rides in DeepSpeed's own
  checkpoint (``client_state[RECORD_KEY]``), so a mid-window resume keeps the pending gradient
  bit for bit.

ZeRO stage 1 keeps every microbatch's full gradient in ``.grad`` during an unmanaged backward
(``allreduce_gradients`` communicates only on the boundary, ``engine.py`` ``elif
self.is_gradient_accumulation_boundary()``) but hands the optimizer its gradient only through its
own reduce in ``step()`` (``reduce_gradients`` → ``averaged_gradients``, the flat fp32 partition
``stage_1_and_2.py`` steps): that reduce cannot be turned off, so it is made the window's one
reduction of the sums.  The engine must be built with ``"gradient_allreduce_op": "sum"``
(DeepSpeed's switch: ``gradient_average`` False, ``gradient_reduction_w_predivide`` then does a
plain SUM ``all_reduce``, no division by the world size).  ``step()`` exchanges every rank's
weight once (the metadata exchange of :func:`wacc_torch.all_reduce_mean`: the same checks and the
same error on every rank, the global weight the ``math.fsum`` of the ranks'), writes into ``.grad``
this rank's sums divided by ``S`` once and then by the *global* weight (a parameter without a
buffer here but with one on another rank as zeros, so every rank sends the same buckets), and
DeepSpeed's SUM reduce adds the ranks' shares: the token mean over every rank's tokens (semantics
§7, Reading "DeepSpeed ZeRO 1").  In one process the share is the mean itself.  Where ZeRO 1
accumulates in another dtype than the parameters' (``use_grad_accum_attribute``,
``stage_1_and_2.py:397-404``: its ``backward_epilogue`` moves ``.grad`` into ``.grad_accum``),
``backward`` takes the gradient from ``.grad_accum`` and ``step()`` writes the share there, in
that dtype, where the reduce reads it.  Float16 at ZeRO 1 (``torch_autocast``, the ZeRO
optimizer's own ``GradScaler``): DeepSpeed skips an overflowing window whole but returns before
the scaler's ``update()`` (``stage_1_and_2.py:3043-3050``, ``:2978``), so on its own the scale
never backs off and every later window overflows again; ``step()`` then backs the scaler off as
its ``update()`` would (scale times the backoff factor, growth tracker restarted).  ZeRO
stages 2 and 3 reduce or partition gradients inside every backward (``partition_gradients``),
where the accumulator cannot take them: refused (``ValueError`` naming the stage).
Constructing one imports DeepSpeed (to check the engine's type);
:class:`~wacc_torch.integrations._framework.MissingFrameworkError` (an ``ImportError``) names
the ``deepspeed`` extra when it is missing.  Checked against deepspeed
0.19.8 (CPU: ZeRO 0 and 1 in float32 and ``torch_autocast`` float16; both across two ranks in
float32).
"""

from __future__ import annotations

from typing import Any

import torch

from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.distributed import _agreed_layout
from wacc_torch.integrations._framework import require
from wacc_torch.integrations._token_window import finish_window
from wacc_torch.normalize import divide_sums
from wacc_torch.results import AccumulatedGradients

__all__ = ["RECORD_KEY", "TokenWeightedEngine"]

RECORD_KEY = "wacc_accumulator"
"""The key of the accumulator's record in a DeepSpeed checkpoint's ``client_state``."""


class TokenWeightedEngine:
    """A DeepSpeed engine whose optimizer gets the token-weighted mean of the window (module
    docstring).  ``dtype`` is the accumulator's work dtype (default: the dtype of the module's
    first trainable parameter); ``group`` the process group the window spans (default: the
    whole world, when ``torch.distributed`` is initialized with more than one rank)."""

    def __init__(self, engine: Any, *, dtype: torch.dtype | None = None, group: Any = None) -> None:
        deepspeed: Any = require(
            "deepspeed", extra="deepspeed", integration="wacc_torch.integrations.deepspeed"
        )
        if not isinstance(engine, deepspeed.DeepSpeedEngine):
            raise TypeError(f"engine must be a deepspeed.DeepSpeedEngine, got {type(engine)!r}")
        if engine.managed_gradient_accumulation():
            raise ValueError(
                "TokenWeightedEngine needs an engine built with "
                '"managed_gradient_accumulation": false (the window is the caller\'s: every '
                "step() is its boundary); this one counts micro-steps itself"
            )
        steps = engine.gradient_accumulation_steps()
        if steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps is {steps}: with a caller-owned window set it to 1 "
                "(DeepSpeed still divides each gradient by it, engine.py "
                "_backward_prologue_per_tensor)"
            )
        stage = engine.zero_optimization_stage()
        if stage not in (0, 1):
            raise ValueError(
                f"ZeRO stage {stage} reduces or partitions gradients inside the backward, where "
                "the accumulator cannot take them: TokenWeightedEngine needs ZeRO stage 0 or 1"
            )
        if stage == 1 and engine.gradient_average:
            raise ValueError(
                "ZeRO stage 1 averages the ranks' gradients in step(): build the engine with "
                '"gradient_allreduce_op": "sum" (each rank sends its sums over the global token '
                "count; DeepSpeed's sum is then the token mean)"
            )
        if dtype is None:
            trainable = [p for p in engine.module.parameters() if p.requires_grad]
            dtype = trainable[0].dtype if trainable else torch.float32
        if stage == 0:
            engine.enable_backward_allreduce = False  # one reduction of sums and weights: step()
        self.stage = stage
        self.engine = engine
        self.group = group
        self.accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)

    def backward(self, loss: torch.Tensor, tokens: int | torch.Tensor) -> None:
        """Backward of the microbatch's mean ``loss`` (not divided by anything), weighted by
        ``tokens``, the count that mean divided by (0: a microbatch without targets)."""
        self.engine.backward(loss, scale_wrt_gas=False)
        module = self.engine.module
        if not self._grad_accum:
            self.accumulator.accumulate_mean(module, tokens)
            return
        # ZeRO 1 with a gradient accumulation dtype other than the parameters' has moved the
        # gradient from .grad into .grad_accum (module docstring): take it from there.
        held = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        grads = {name: getattr(p, "grad_accum", None) for name, p in held}
        self.accumulator.accumulate_mean(module, tokens, grads=grads)
        for _, parameter in held:
            parameter.grad_accum = None

    def step(self) -> AccumulatedGradients:
        """End the window: its token-weighted mean into ``.grad``, then ``engine.step()``
        (which may skip it whole on an overflow); returns the mean (``weight``: its tokens).
        ZeRO 1 across ranks: this rank's share of the mean (its sums over every rank's tokens),
        which ``engine.step()``'s SUM reduce adds to the others' (module docstring)."""
        if self.stage == 0 or not _distributed(self.group):
            result = finish_window(self.accumulator, group=self.group)
        else:
            result = _share_of_mean(self.accumulator.finish_sums(), group=self.group)
        if self._grad_accum:
            self._write_grad_accum(result)
        else:
            result.apply_to(self.engine.module)
        scaler = getattr(self.engine.optimizer, "torch_autocast_gradscaler", None)
        scale = None if scaler is None else scaler.get_scale()
        self.engine.step()
        if scaler is not None and self.stage == 1:
            _back_off_skipped_window(self.engine.optimizer, scaler, scale)
        return result

    @property
    def _grad_accum(self) -> bool:
        """Whether ZeRO 1 reads ``.grad_accum`` (its "mode 2": the gradient accumulation dtype
        differs from the parameters', ``stage_1_and_2.py`` ``use_grad_accum_attribute``), not
        ``.grad``."""
        return self.stage == 1 and bool(
            getattr(self.engine.optimizer, "use_grad_accum_attribute", False)
        )

    def _write_grad_accum(self, result: AccumulatedGradients) -> None:
        """``result`` into ``.grad_accum`` in ZeRO's accumulation dtype, where its reduce reads
        it; every conversion made before anything is written."""
        dtype = self.engine.optimizer.gradient_accumulation_dtype
        named = dict(self.engine.module.named_parameters())
        values = {
            name: None if grad is None else grad.to(dtype=dtype, device=named[name].device)
            for name, grad in result.grads.items()
        }
        for name, value in values.items():
            named[name].grad_accum = value
            named[name].grad = None

    def save_checkpoint(
        self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        """``engine.save_checkpoint`` with the accumulator's record in ``client_state``."""
        state = {**(client_state or {}), RECORD_KEY: self.accumulator.state_dict()}
        return self.engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
        """``engine.load_checkpoint``, then the accumulator from the record it carried (the
        record is removed from the ``client_state`` returned)."""
        path, client_state = self.engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        if client_state and RECORD_KEY in client_state:
            record = client_state.pop(RECORD_KEY)
            self.accumulator.load_state_dict(record, self.engine.module)
        return path, client_state


def _back_off_skipped_window(zero: Any, scaler: Any, scale: float | None) -> None:
    """After a ZeRO 1 ``step()`` that found an overflow, back off its ``torch_autocast``
    ``scaler`` as its ``update()`` would have: DeepSpeed skips the window whole but returns
    before the scaler's ``update()`` (``stage_1_and_2.py:3043-3050``, ``:2978``), so without this
    the scale never falls and every later window overflows again.  The state goes through the
    scaler's public ``state_dict`` / ``load_state_dict``: the scale times its backoff factor, the
    growth tracker restarted (torch's ``_amp_update_scale_`` on an inf).  ``overflow`` is the
    flag ZeRO all-reduces over the data-parallel group, so every rank backs off alike.  A step
    that moved the scale itself (``scale``: before it; a DeepSpeed that updates on an overflow)
    is left alone: the window is backed off once."""
    if not getattr(zero, "overflow", False) or scaler.get_scale() != scale:
        return
    state = scaler.state_dict()
    state["scale"] = state["scale"] * state["backoff_factor"]
    state["_growth_tracker"] = 0
    scaler.load_state_dict(state)


def _distributed(group: Any) -> bool:
    """Whether ``group`` (default: the world) spans more than one rank."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return initialized and torch.distributed.get_world_size(group) > 1


def _share_of_mean(sums: AccumulatedGradients, *, group: Any) -> AccumulatedGradients:
    """This rank's share of the window's mean over every rank of ``group``: its sums divided by
    ``S`` once and then by the global weight, so that a SUM of the shares over the ranks is the
    token mean (ZeRO 1's reduce, module docstring).  The weights come from the one metadata
    exchange of :func:`wacc_torch.all_reduce_mean` (the same checks, and the same exception on
    every rank, before any buffer moves; a global weight of 0 raises
    :class:`~wacc_torch.ZeroTotalWeightError` on every rank).  A parameter with a buffer on some
    rank but not here is zeros here (every rank hands DeepSpeed the same parameters); one with
    a buffer nowhere stays None on every rank.  ``found_inf`` is this rank's share's."""
    layout = _agreed_layout(sums, group=group, caller="TokenWeightedEngine.step", normalize=True)
    local = {name: grad for name, grad in sums.grads.items() if grad is not None}
    shares, check = divide_sums(
        local, loss_scale=layout.loss_scale, total_weight=layout.weight, in_place=True,
        find_inf=True,
    )  # fmt: skip
    grads: dict[str, torch.Tensor | None] = {}
    for name in sums.grads:
        share = shares.get(name)
        if share is None and name in layout.shapes:
            assert layout.dtype is not None  # a shape is known: some rank has a buffer
            share = torch.zeros(layout.shapes[name], dtype=layout.dtype)
        grads[name] = share
    return AccumulatedGradients(
        grads=grads,
        weight=layout.weight,
        loss_scale=layout.loss_scale,
        issued=layout.issued,
        zero_weight=layout.zero_weight,
        normalized=True,
        found_inf=check is not None and check.found(),
    )
