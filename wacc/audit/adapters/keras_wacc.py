"""``keras+wacc``: the ``keras`` row's ``model.fit`` (:mod:`wacc.audit.adapters.keras`: the plain
causal LM in a ``TorchModuleWrapper``, a masked-mean ``SparseCategoricalCrossentropy``) with the
model built as ``class AuditLM(TokenWeightedTrainStep, keras.Model)``
(:mod:`wacc_torch.integrations.keras`, ``steps=K``, ``tokens`` = the batch's targets
``labels[1:] != -100``) and its SGD compiled without ``gradient_accumulation_steps``: Keras's own
accumulation cannot be corrected (it never sees a token count; see the integration), so the
model's ``train_step`` accumulates the window and calls ``optimizer.apply`` once with its
token-weighted mean.  Checkpoint, fixed loss scale (``loss_scale_factor``) and float16
(``mixed_float16``: ``LossScaleOptimizer``, which now decides once per window) as the ``keras``
row; the accumulator's record is saved with the model (``model.save``, its own variables).
"""

from __future__ import annotations

from wacc.audit.adapters import keras
from wacc.audit.protocol import LoopRun, LoopTask

__all__ = ["ADAPTER"]


def run(task: LoopTask) -> LoopRun:
    """The ``keras`` row's loop with :class:`TokenWeightedTrainStep` (module docstring)."""
    return keras.run(task, wacc=True)


ADAPTER = keras.KerasAdapter(
    name="keras+wacc",
    title="Keras 3 (torch backend) with TokenWeightedTrainStep",
    requires=("keras",),
    model="plain",
    code_path="class LM(TokenWeightedTrainStep, keras.Model); model.fit: train_step: "
    "accumulate_mean(model, tokens(y)); every K-th batch: finish_mean().apply_to, "
    "optimizer.apply once",
    checked="keras 3.15.1 (torch backend, CPU, run here)",
    loss_scale=True,
    checkpoint=None,
    run=run,
    fp16=None,
    ranks=keras.KERAS_RANKS,
)
