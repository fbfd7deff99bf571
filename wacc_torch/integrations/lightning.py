"""Token-weighted accumulation for Lightning's automatic optimization: a ``Callback``.

``Trainer(accumulate_grad_batches=K)`` divides each ``training_step`` loss by ``K`` before its
backward (``lightning/pytorch/loops/optimization/automatic.py``:
``closure_loss = closure_loss / normalize``), so every microbatch weighs the same whatever its
token count.  :class:`TokenWeightedAccumulation` keeps everything else of Lightning (the window
of ``K`` batches, the step, ``global_step``, schedulers, clipping, precision) and changes what
reaches the optimizer:

* ``on_train_batch_start``: the batch's token count, ``tokens(batch)`` (the count its mean loss
  divided by);
* ``on_before_backward``: a gradient hook on the loss multiplies the incoming gradient by ``K``,
  which the division's backward divides by again: the backward is exactly that of the
  ``training_step``'s own loss (``(g * K) / K == g`` for a power-of-two ``g``: 1, or a
  ``GradScaler``'s scale);
* ``on_after_backward``: ``accumulate_mean(module, tokens)`` takes the gradient out of ``.grad``;
  on the batch Lightning steps on, ``finish_window(accumulator).apply_to(module)`` writes the
  window's token-weighted mean into ``.grad`` (before a ``GradScaler`` unscales it and decides,
  once for the window, whether to step or to skip it whole);
* across ranks (the DDP strategy): ``on_train_batch_start`` also turns DDP's gradient all-reduce
  off (:func:`stop_gradient_sync`), since it would average the ranks' gradients, and
  :func:`finish_window` reduces every rank's sums and token counts once
  (:func:`wacc_torch.all_reduce_mean`, semantics §7): every rank writes the same mean over every
  rank's tokens, so a ``GradScaler`` skips an overflowing window on every rank alike;
* ``on_save_checkpoint`` / ``on_load_checkpoint``: the accumulator's record
  (:meth:`~wacc_torch.WeightedGradientsAccumulator.state_dict`) rides in Lightning's own
  checkpoint under :data:`RECORD_KEY`, so a mid-window resume keeps the pending gradient bit for
  bit (the data position is the loader's: a resumable one, ``state_dict``/``load_state_dict``,
  continues where it was).

Manual optimization needs no callback: use the accumulator directly in ``training_step`` with
:func:`finish_window` and :func:`stop_gradient_sync` (the recipe of
``docs/fix-your-framework/lightning.md``).  Importing this module does not import
Lightning; using :class:`TokenWeightedAccumulation` does, and raises
:class:`~wacc_torch.integrations._framework.MissingFrameworkError` (an ``ImportError``) naming
the ``lightning`` extra when it is missing.  Checked against lightning 2.6.6.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.integrations._framework import require
from wacc_torch.integrations._token_window import finish_window

__all__ = ["RECORD_KEY", "TokenWeightedAccumulation", "finish_window", "stop_gradient_sync"]

RECORD_KEY = "wacc_accumulator"
"""The key of the accumulator's record in a Lightning checkpoint."""

_BUILT: dict[str, Any] = {}

TokenWeightedAccumulation: Any  # declared only: built by __getattr__ on first use


def __getattr__(name: str) -> Any:
    """The Lightning classes, built (and Lightning imported) on first use."""
    if name == "TokenWeightedAccumulation":
        if name not in _BUILT:
            _BUILT[name] = _build_callback()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stop_gradient_sync(trainer: Any) -> None:
    """Turn off the gradient all-reduce of ``trainer``'s ``DistributedDataParallel`` model (DDP
    strategy; nothing under any other): call it before each batch's forward
    (``on_train_batch_start``), where DDP reads ``require_backward_grad_sync``.  The window is
    then reduced once, sums and weights, by :func:`finish_window`: DDP's average of the ranks
    must not act on top of it (semantics §7)."""
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # Lightning's no_sync() around the window's other batches restores this value.
        model.require_backward_grad_sync = False


def _build_callback() -> type:
    pl: Any = require(
        "lightning.pytorch", extra="lightning", integration="wacc_torch.integrations.lightning"
    )

    class TokenWeightedAccumulation(pl.Callback):
        """Hands the optimizer the token-weighted mean of the window's microbatch gradients
        (module docstring).  ``tokens(batch)`` is the batch's weight: the count its
        ``training_step`` loss (a mean) divided by (an int or a 0-d tensor; 0 for a batch
        without targets, whose gradient is then never read).  ``dtype`` is the accumulator's
        work dtype (default: the dtype of the module's first trainable parameter).
        ``window_tokens`` is the token count of the last window stepped on (what its mean
        divided by)."""

        def __init__(
            self, tokens: Callable[[Any], int | torch.Tensor], *, dtype: torch.dtype | None = None
        ) -> None:
            if not callable(tokens):
                raise TypeError(f"tokens must be a function of the batch, got {tokens!r}")
            self.tokens = tokens
            self.dtype = dtype
            self.accumulator: WeightedGradientsAccumulator | None = None
            self.window_tokens: float | None = None  # the last step's W (for logging)
            self._weight: int | torch.Tensor | None = None

        def _accumulator(self, module: torch.nn.Module) -> WeightedGradientsAccumulator:
            if self.accumulator is None:
                dtype = self.dtype
                if dtype is None:
                    trainable = [p for p in module.parameters() if p.requires_grad]
                    dtype = trainable[0].dtype if trainable else torch.float32
                self.accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
            return self.accumulator

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            if not pl_module.automatic_optimization:
                raise ValueError(
                    "TokenWeightedAccumulation is for automatic optimization; with "
                    "automatic_optimization=False use WeightedGradientsAccumulator in "
                    "training_step (the manual recipe)"
                )

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            self._weight = self.tokens(batch)
            stop_gradient_sync(trainer)  # the window is reduced once, in on_after_backward

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            steps = int(trainer.accumulate_grad_batches)
            if steps != 1:  # undo `loss / accumulate_grad_batches` in the backward, exactly
                loss.register_hook(lambda grad: grad * steps)

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if self._weight is None:
                raise RuntimeError("a backward without on_train_batch_start: no token count")
            accumulator = self._accumulator(pl_module)
            accumulator.accumulate_mean(pl_module, self._weight)
            self._weight = None
            # Lightning's own decision for this batch (epoch_loop._should_accumulate: the K-th
            # batch of the window, or the epoch's last), read where the step will follow.
            if not trainer.fit_loop._should_accumulate():
                result = finish_window(accumulator)  # across ranks: one all_reduce_mean
                result.apply_to(pl_module)
                self.window_tokens = result.weight

        def on_save_checkpoint(
            self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]
        ) -> None:
            checkpoint[RECORD_KEY] = self._accumulator(pl_module).state_dict()

        def on_load_checkpoint(
            self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]
        ) -> None:
            record = checkpoint.get(RECORD_KEY)
            if record is not None:
                self._accumulator(pl_module).load_state_dict(record, pl_module)

    TokenWeightedAccumulation.__module__ = __name__
    return TokenWeightedAccumulation
