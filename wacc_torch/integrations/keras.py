"""Token-weighted accumulation for Keras 3 on its torch backend: :class:`TokenWeightedTrainStep`.

Keras's own accumulation cannot be corrected: an optimizer built with
``gradient_accumulation_steps=K`` adds the gradients ``optimizer.apply`` receives and on the
K-th call applies ``(g + acc_g) / steps`` (``keras/src/optimizers/base_optimizer.py``,
``BaseOptimizer._backend_apply_gradients``): it sees gradients only, never the batch, so it has
no token count to weigh a microbatch by, and dividing by the window's tokens instead of ``K``
would need every count of the window before its first backward.  ``sample_weight`` does not
help: a loss's reduction divides by the batch's element count, not by the weights' sum.

:class:`TokenWeightedTrainStep` is the Keras idiom for changing what ``fit`` does with the
torch backend, a ``train_step`` of the model's own ("Customizing what happens in fit() with
PyTorch"): mix it into the model (``class LM(TokenWeightedTrainStep, keras.Model)``), compile
with an optimizer *without* ``gradient_accumulation_steps``, and each ``train_step``

* runs the forward, the model's loss (a per-token mean) and its backward (through
  ``optimizer.scale_loss``: a ``loss_scale_factor`` or a ``LossScaleOptimizer``'s scale);
* ``accumulate_mean(model, tokens(y))`` takes the gradient out of ``.grad``;
* on the window's ``steps``-th batch, writes the token-weighted mean into ``.grad`` and calls
  ``optimizer.apply`` once for the window (a ``LossScaleOptimizer`` then unscales and skips the
  whole window on an overflow).  The window counts batches, not epochs: batches left at the end
  of an epoch stay pending and the next epoch's first ones complete their window.

The accumulator's record rides in Keras's own checkpoint (``model.save`` / ``save_weights``):
the model's ``save_own_variables`` / ``load_own_variables`` store it (``torch.save`` bytes as a
uint8 array under :data:`RECORD_KEY`; read back with ``torch.load(weights_only=True)``), so a
mid-window resume keeps the pending gradient bit for bit.  Using the mixin imports Keras;
:class:`~wacc_torch.integrations._framework.MissingFrameworkError` (an ``ImportError``) names
the ``keras`` extra when it is missing.  Checked against keras 3.15.1 (torch backend, CPU).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

from wacc_torch.accumulator import WeightedGradientsAccumulator
from wacc_torch.integrations._framework import require

__all__ = ["RECORD_KEY", "TokenWeightedTrainStep"]

RECORD_KEY = "wacc_accumulator"
"""The key of the accumulator's record among the model's own variables in a Keras file."""


def _keras() -> Any:
    return require("keras", extra="keras", integration="wacc_torch.integrations.keras")


class TokenWeightedTrainStep:
    """Mix into a ``keras.Model`` (first base) on the torch backend: ``fit`` then hands the
    optimizer the token-weighted mean of each window of ``steps`` batches (module docstring).
    ``tokens(y)`` is a batch's weight, the count its loss's mean divided by (an int or a 0-d
    tensor; 0: a batch without targets, whose gradient is never read); ``dtype`` the
    accumulator's work dtype (default: the first trainable parameter's).  ``window_tokens`` is
    the last applied window's token count."""

    def __init__(
        self,
        *args: Any,
        steps: int,
        tokens: Callable[[Any], int | torch.Tensor],
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        keras = _keras()
        if keras.backend.backend() != "torch":
            raise ValueError(f"TokenWeightedTrainStep needs the torch backend, not "
                             f"{keras.backend.backend()!r}")  # fmt: skip
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if not callable(tokens):
            raise TypeError(f"tokens must be a function of the targets, got {tokens!r}")
        super().__init__(*args, **kwargs)
        self.accumulation_steps = steps
        self.tokens = tokens
        self.accumulation_dtype = dtype
        self.window_tokens: float | None = None
        self._accumulator: WeightedGradientsAccumulator | None = None

    @property
    def accumulator(self) -> WeightedGradientsAccumulator:
        """The window's accumulator (made on first use, in ``dtype``)."""
        if self._accumulator is None:
            dtype = self.accumulation_dtype
            if dtype is None:
                trainable = [p for p in self._module().parameters() if p.requires_grad]
                dtype = trainable[0].dtype if trainable else torch.float32
            self._accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
        return self._accumulator

    def _module(self) -> torch.nn.Module:
        assert isinstance(self, torch.nn.Module)  # a Keras model on the torch backend is one
        return self

    def train_step(self, data: Any) -> dict[str, Any]:
        """One batch of the window (module docstring)."""
        keras = _keras()
        model: Any = self
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        model.zero_grad()
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        if model.optimizer.gradient_accumulation_steps:
            raise ValueError(
                "compile the optimizer without gradient_accumulation_steps: "
                "TokenWeightedTrainStep accumulates the window itself"
            )
        model.optimizer.scale_loss(loss).backward()
        accumulator = self.accumulator
        accumulator.accumulate_mean(self._module(), self.tokens(y))
        if accumulator.state.issued == self.accumulation_steps:
            result = accumulator.finish_mean()
            result.apply_to(self._module())
            self.window_tokens = result.weight
            variables = list(model.trainable_weights)
            with torch.no_grad():
                model.optimizer.apply([v.value.grad for v in variables], variables)
        for metric in model.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in model.metrics}

    def save_own_variables(self, store: Any) -> None:
        """The model's own variables, and the accumulator's record under :data:`RECORD_KEY`."""
        import numpy as np

        super().save_own_variables(store)  # type: ignore[misc]
        buffer = io.BytesIO()
        torch.save(self.accumulator.state_dict(), buffer)
        store[RECORD_KEY] = np.frombuffer(buffer.getvalue(), dtype=np.uint8)

    def load_own_variables(self, store: Any) -> None:
        """The model's own variables, then the accumulator from the record (when stored)."""
        import numpy as np

        own = {key: store[key] for key in store.keys() if key != RECORD_KEY}
        super().load_own_variables(own)  # type: ignore[misc]
        if RECORD_KEY in store.keys():
            raw = np.asarray(store[RECORD_KEY], dtype=np.uint8).tobytes()
            record = torch.load(io.BytesIO(raw), weights_only=True)
            self.accumulator.load_state_dict(record, self._module())
