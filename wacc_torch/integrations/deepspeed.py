"""Token-weighted accumulation for DeepSpeed's engine (ZeRO stage 0): :class:`TokenWeightedEngine`.

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

ZeRO stages 1-3 partition or reduce gradients inside the backward, where the accumulator cannot
take them: refused (``ValueError`` naming the stage).  Constructing one imports DeepSpeed (to
check the engine's type); :class:`~wacc_torch.integrations._framework.MissingFrameworkError`
(an ``ImportError``) names the ``deepspeed`` extra when it is missing.  Checked against
deepspeed 0.19.8 (CPU, ZeRO 0, float32 and ``torch_autocast`` float16).
"""

from __future__ import annotations

from typing import Any

import torch

from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.integrations._framework import require
from wacc_torch.integrations._token_window import finish_window
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
        if stage != 0:
            raise ValueError(
                f"ZeRO stage {stage} reduces or partitions gradients inside the backward, where "
                "the accumulator cannot take them: TokenWeightedEngine needs ZeRO stage 0"
            )
        if dtype is None:
            trainable = [p for p in engine.module.parameters() if p.requires_grad]
            dtype = trainable[0].dtype if trainable else torch.float32
        engine.enable_backward_allreduce = False  # one reduction of sums and weights: step()
        self.engine = engine
        self.group = group
        self.accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)

    def backward(self, loss: torch.Tensor, tokens: int | torch.Tensor) -> None:
        """Backward of the microbatch's mean ``loss`` (not divided by anything), weighted by
        ``tokens``, the count that mean divided by (0: a microbatch without targets)."""
        self.engine.backward(loss, scale_wrt_gas=False)
        self.accumulator.accumulate_mean(self.engine.module, tokens)

    def step(self) -> AccumulatedGradients:
        """End the window: its token-weighted mean into ``.grad``, then ``engine.step()``
        (which may skip it whole on an overflow); returns the mean (``weight``: its tokens)."""
        result = finish_window(self.accumulator, group=self.group)
        result.apply_to(self.engine.module)
        self.engine.step()
        return result

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
