"""Keras 3 on its torch backend (:mod:`wacc.audit.adapters.keras`): ``model.fit`` with
``SGD(gradient_accumulation_steps=K)`` over the torch model wrapped in ``TorchModuleWrapper``; the
gradient is read where the optimizer applies it (the backend SGD's ``_backend_update_step``, the
averaged window: the module's ``.grad`` then holds only the last microbatch's)."""

from __future__ import annotations

__all__ = ["BODY", "IMPORTS"]

IMPORTS = ("import os",)

BODY = """
os.environ["KERAS_BACKEND"] = "torch"  # read once, when keras is imported
import keras

module = build_model()
captured = []


class LM(keras.Model):
    def __init__(self):
        super().__init__()
        self.lm = keras.layers.TorchModuleWrapper(module)

    def call(self, input_ids):
        return self.lm(input_ids)["logits"][:, :-1, :]  # position t predicts token t + 1


class SGD(type(keras.optimizers.SGD())):  # the torch backend's SGD; records what it applies
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Each variable's value is the module's own nn.Parameter: in the module's order.
        applied = {id(v.value): g for g, v in zip(grads, trainable_variables)}
        captured.append(torch.cat([applied[id(p)].double().flatten() for p in module.parameters()]))
        super()._backend_update_step(grads, trainable_variables, learning_rate)


pairs = [(b["input_ids"], b["labels"][1:]) for b in batches]  # a Keras loss does not shift
with keras.device("cpu"):
    model = LM()
    model.compile(
        optimizer=SGD(learning_rate=0.0, gradient_accumulation_steps=len(batches)),
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=-100,
            dtype="float64" if DTYPE == torch.float64 else None,  # Keras's default: float32
        ),
    )
    model.fit(torch.utils.data.DataLoader(pairs, batch_size=1), epochs=1, shuffle=False, verbose=0)
grads = captured[0]
counted = "each microbatch's own mean, the K means averaged"
"""
