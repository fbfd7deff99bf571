"""Keras 3 on its torch backend: an optimizer built with ``gradient_accumulation_steps=K``, driven
by ``model.fit`` over the audit's plain causal LM wrapped in ``keras.layers.TorchModuleWrapper``.

Code path (Keras's documented use of a torch module, ``TorchModuleWrapper``'s docstring):
a ``keras.Model`` subclass whose ``call(input_ids)`` runs ``TorchModuleWrapper(task.build_model())``
and returns the logits of positions ``0 .. L-2``; ``model.compile(optimizer=SGD(learning_rate=
task.learning_rate, gradient_accumulation_steps=K), loss=SparseCategoricalCrossentropy(
from_logits=True, ignore_class=-100))``; ``model.fit(DataLoader(pairs, batch_size=1), epochs=1,
shuffle=False, verbose=0)`` where ``pairs[k] = (input_ids, labels[1:])`` (a Keras loss does not
shift: the targets are handed over shifted, as the torch model's own loss shifts them).  Every
variable of the wrapper *is* the torch ``nn.Parameter`` (``keras/src/backend/torch/core.py``,
``Variable._initialize``: "Reuse same parameter"), so the optimizer updates the module itself, in
the module's dtype (the variable takes the parameter's dtype; the accumulators follow it through
``add_variable_from_reference``).  The run is held on the CPU (``keras.device("cpu")``; Keras's
default torch device is CUDA where there is one).

What each microbatch weighs: Keras's loss is the masked mean of the microbatch
(``keras/src/losses/loss.py``, ``apply_mask``: the valid entries get ``total / valid``, then
``reduce_values`` divides the sum by ``total``; a microbatch with no target divides by nothing,
``divide_no_nan``, and contributes 0), and the torch trainer hands each microbatch's gradient to
``optimizer.apply`` (``keras/src/backend/torch/trainer.py``, ``train_step``).  The optimizer adds
it into its ``gradient_accumulator`` variables and on the K-th call averages
(``keras/src/optimizers/base_optimizer.py``, ``BaseOptimizer._backend_apply_gradients``,
``_update_step_fn``: ``grads = [(g + acc_g) / steps for g, acc_g in zip(grads, acc_grads)]``):
``Σ_k mean_k / K``, every microbatch weighing the same whatever its token count.  Keras never
divides by a window count (``counted_tokens=None``).  The float64 run gives the loss
``dtype="float64"`` (Keras's losses compute in ``floatx``, float32, by default), yet the mean's two
quotients stay float32: ``divide_no_nan`` (``keras/src/backend/torch/numpy.py``) takes its dtype
from ``dtypes.result_type``, which ends "Force to be 32-bit dtype when encountering 64-bit dtype"
(``out_dtype = BIT64_TO_BIT32_DTYPE.get(out_dtype, out_dtype)``), so microbatch k weighs
``f32(T_k / n_k) * f32(1 / T_k)`` (``T_k`` its label positions): about 2**-24 off ``1 / n_k``, far
below the weighting error, and said in the run's note.

The gradient is recorded where the optimizer applies it: a subclass of the backend's own SGD
class (``type(keras.optimizers.SGD())``: ``keras/src/backend/torch/optimizers/torch_sgd.py``
``SGD``) whose ``_backend_update_step(grads, trainable_variables, learning_rate)`` hands the
``grads`` it receives to ``task.record_gradients`` (under the torch module's parameter names) and
then calls the inherited method unchanged.  Keras calls that method only on the update step, with
the averaged gradient, after clipping and weight decay (both off) — the parameters' ``.grad`` at
that moment holds only the last microbatch's gradient (``train_step`` zeroes it every call), so the
``.grad`` of the module is not what Keras applies.

Checkpoint: a callback's ``on_train_batch_end`` after ``c`` microbatches calls
``model.save(path.keras)`` (Keras's own format: weights and optimizer state) and stops the run (an
exception: a crash); a fresh model around ``task.build_model()`` is compiled with a fresh optimizer,
built (``model.build``; the optimizer's variables with ``model.optimizer.build(
model.trainable_variables)``, what ``keras.saving.load_model`` does through
``Trainer.compile_from_config``), ``model.load_weights(path)`` restores it and ``fit`` runs the
remaining microbatches (the data position is the loop's).  The saved optimizer state holds the
``iteration`` counter and every ``gradient_accumulator`` (``model.save_weights`` writes the same
``optimizer/vars`` group): the pending window comes back and the resumed step is the
uninterrupted one (measured, see the ``mid-window resume`` column).  A fresh optimizer that is not
built first has no variables to load into: ``BaseOptimizer.load_own_variables`` warns "Skipping
variable loading for optimizer" and the pending window and the counter are gone (tested).

Fixed loss scale: ``SGD(loss_scale_factor=S)`` (the optimizer's documented fixed scale; the trainer
multiplies the loss by it in ``optimizer.scale_loss`` and ``BaseOptimizer.apply`` divides each
microbatch's gradient by it before accumulating).  Float16 (``task.fp16``):
``keras.mixed_precision.set_global_policy("mixed_float16")`` (restored afterwards), with which
``compile`` wraps the optimizer in ``LossScaleOptimizer`` (dynamic: initial scale 2**15; Keras 3
has no fixed-scale mode there, its constructor refuses ``dynamic=False`` and points to
``loss_scale_factor``).  Keras's mixed precision casts *Keras* variables when a layer reads them;
the wrapped module reads its own float32 parameters, so nothing computes in float16 (measured, see
the ``fp16 overflow`` column).  ``LossScaleOptimizer._common_apply`` checks each microbatch's
gradient for non-finite values and, on one, halves the scale and skips that ``apply`` (the inner
optimizer's accumulator and counter untouched), so an overflowing microbatch would be dropped and
the window would end one microbatch later; with float32 compute that branch is not reached here
(tested on the optimizer directly).

Keras reads ``KERAS_BACKEND`` once per process, at its import: the adapter imports it with
``KERAS_BACKEND=torch`` (the variable restored right after) and refuses to run, as a "not
importable" row, when Keras was already imported with another backend or ``KERAS_BACKEND`` names
another one (importing Keras here would fix that process's backend for the caller).  Keras's
import writes its config ``~/.keras/keras.json`` where none exists (``KERAS_HOME`` moves it): its
own doing, left alone.  Keras's warnings are kept out of the caller's output.  Checked against
keras 3.15.1 (CPU, torch 2.13.0, the version run here; the ``keras`` extra).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.windows import IGNORE_INDEX

__all__ = ["ADAPTER", "FLOAT32_WEIGHTS", "KERAS_RANKS", "import_keras", "resume"]

BACKEND = "torch"
FLOAT32_WEIGHTS = (
    "the loss's masked-mean weights (total/valid, 1/total) are float32 quotients in every dtype "
    "(keras/src/backend/common/dtypes.py result_type turns float64 into float32): the float64 "
    "run carries their rounding"
)


class WrongBackend(RuntimeError):
    """Keras is, or would be, on another backend in this process."""


def import_keras() -> Any:
    """``keras`` on the torch backend (module docstring); :class:`WrongBackend` when this process
    already has it, or asked for it, on another one."""
    config = sys.modules.get("keras.src.backend.config")
    if config is not None:  # imported (or half-imported) before: its backend is fixed
        backend = config.backend()
        if backend != BACKEND:
            raise WrongBackend(
                f"keras already imported with the {backend} backend (read once per process): "
                "run the audit in a new process"
            )
        return importlib.import_module("keras")
    asked = os.environ.get("KERAS_BACKEND")
    if asked not in (None, BACKEND):
        raise WrongBackend(f"KERAS_BACKEND={asked}: this loop needs the torch backend")
    os.environ["KERAS_BACKEND"] = BACKEND
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module("keras")
    finally:
        if asked is None:
            del os.environ["KERAS_BACKEND"]


KERAS_RANKS = (
    "Keras 3 has no multi-process data parallelism on the torch backend: keras/src/backend/"
    "__init__.py:43-47 (keras 3.15.1) sets `distribution_lib = None` for backend 'torch' (only "
    "jax/ and tensorflow/ ship a distribution_lib.py), so keras.distribution.initialize / "
    "DataParallel cannot run, and the torch trainer (src/backend/torch/trainer.py) never "
    "all-reduces gradients"
)


@dataclass(frozen=True)
class KerasAdapter(Adapter):
    """An :class:`Adapter` whose availability check imports Keras on the torch backend (a plain
    ``import keras`` would fix the process's backend to Keras's default)."""

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("keras") is None:
            return "not installed"
        try:
            import_keras()
        except WrongBackend as exc:
            return f"not importable: {exc}"
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"not importable: {type(exc).__name__}: {first}"[:160]
        return None


class _Stopped(Exception):
    """Raised by the checkpoint callback: the run ends there, as a crash would end it."""


class _Applied:
    """The gradients the optimizer applies, under the torch module's parameter names: what
    ``task.record_gradients`` reads (``named_parameters()`` of objects with ``.grad``)."""

    @dataclass
    class _Gradient:
        grad: torch.Tensor

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self._pairs = pairs

    def named_parameters(self) -> Iterator[tuple[str, _Applied._Gradient]]:
        return ((name, self._Gradient(grad)) for name, grad in self._pairs)


class _Pairs(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(input_ids, labels[1:])`` of the window's microbatches from ``start`` on."""

    def __init__(self, task: LoopTask, start: int) -> None:
        self._data = task.dataset
        self._start = start

    def __len__(self) -> int:
        return len(self._data) - self._start

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._data[self._start + index]
        return batch["input_ids"], batch["labels"][1:]


@contextmanager
def _quiet(policy: str | None) -> Iterator[None]:
    """Keras's warnings recorded (not shown) and, for ``policy``, the global dtype policy set and
    restored; everything on the CPU."""
    keras = import_keras()
    previous = keras.mixed_precision.global_policy()
    try:
        with warnings.catch_warnings(record=True), keras.device("cpu"):
            warnings.simplefilter("always")
            if policy is not None:
                keras.mixed_precision.set_global_policy(policy)
            yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def _model(task: LoopTask, keras: Any, *, built: bool = False, wacc: bool = False) -> Any:
    """A compiled Keras model around a fresh ``task.build_model()`` (module docstring); with
    ``wacc``, the ``keras+wacc`` model (:mod:`wacc.audit.adapters.keras_wacc`)."""
    module = task.build_model()
    names = {id(p): name for name, p in module.named_parameters()}
    steps = task.num_microbatches
    bases: tuple[type, ...] = (keras.Model,)
    options: dict[str, Any] = {}
    if wacc:
        from wacc_torch.integrations.keras import TokenWeightedTrainStep

        bases = (TokenWeightedTrainStep, keras.Model)
        options = {"steps": steps, "tokens": _target_tokens}

    class AuditLM(*bases):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(name="audit_lm", **options)
            self.lm = keras.layers.TorchModuleWrapper(module)

        def call(self, input_ids: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = self.lm(input_ids)["logits"]
            return logits[:, :-1, :]  # position t predicts t + 1: the targets are labels[1:]

    class RecordingSGD(type(keras.optimizers.SGD())):  # type: ignore[misc]
        """The backend's SGD; the update step first records the gradients it applies."""

        def _backend_update_step(
            self, grads: list[torch.Tensor], trainable_variables: list[Any], learning_rate: Any
        ) -> None:
            applied = [
                (names[id(v.value)], g) for g, v in zip(grads, trainable_variables, strict=True)
            ]
            task.record_gradients(_Applied(applied))  # type: ignore[arg-type]
            super()._backend_update_step(grads, trainable_variables, learning_rate)

    model = AuditLM()
    if built:
        model.build((1, task.window.microbatches[0]["input_ids"].shape[-1]))
    scale = None if task.loss_scale == 1.0 else task.loss_scale
    optimizer = RecordingSGD(
        learning_rate=task.learning_rate,
        gradient_accumulation_steps=steps if steps > 1 and not wacc else None,
        loss_scale_factor=scale,
    )
    # The float64 run keeps the loss in float64 (Keras's losses compute in floatx, float32).
    dtype = "float64" if task.dtype == torch.float64 else None
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=IGNORE_INDEX, dtype=dtype
    )
    model.compile(optimizer=optimizer, loss=loss)
    return model


def _target_tokens(y: torch.Tensor) -> torch.Tensor:
    """The targets a batch's masked-mean loss divides by (``labels[1:] != -100``)."""
    return (y != IGNORE_INDEX).sum()


def _fit(model: Any, task: LoopTask, start: int, callbacks: list[Any] | None = None) -> None:
    loader = torch.utils.data.DataLoader(_Pairs(task, start), batch_size=1, shuffle=False)
    model.fit(loader, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def resume(
    task: LoopTask, *, save_weights: bool = False, build_optimizer: bool = True, wacc: bool = False
) -> Any:
    """Run ``task.checkpoint_after`` microbatches, save with ``model.save`` (``.keras``) or
    ``model.save_weights`` (``.weights.h5``), then a fresh model loads it with ``load_weights``
    (its optimizer built first, unless ``build_optimizer`` is False); returns that fresh model."""
    keras: Any = import_keras()
    after = task.checkpoint_after
    assert after is not None
    suffix = ".weights.h5" if save_weights else ".keras"
    path = str(task.workdir / f"keras_mid_window{suffix}")

    class Checkpoint(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch + 1 == after:
                (self.model.save_weights if save_weights else self.model.save)(path)
                raise _Stopped

    try:
        _fit(_model(task, keras, wacc=wacc), task, 0, callbacks=[Checkpoint()])
    except _Stopped:
        pass
    else:
        raise RuntimeError("the checkpoint callback never ran")
    model = _model(task, keras, built=True, wacc=wacc)
    if build_optimizer:
        model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


def run(task: LoopTask, *, wacc: bool = False) -> LoopRun:
    """``model.fit`` with ``SGD(gradient_accumulation_steps=K)`` (module docstring); with
    ``wacc``, the ``keras+wacc`` loop."""
    keras = import_keras()
    with _quiet("mixed_float16" if task.fp16 else None):
        if task.checkpoint_after is not None:
            model = resume(task, wacc=wacc)
            _fit(model, task, task.checkpoint_after)
        else:
            model = _model(task, keras, wacc=wacc)
            _fit(model, task, 0)
        optimizer = model.optimizer
        scaler = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
    counted = model.window_tokens if wacc else None
    if not task.fp16:
        return LoopRun(counted_tokens=counted, note=FLOAT32_WEIGHTS)
    if scaler is None:
        return LoopRun(counted_tokens=counted, note="compile made no LossScaleOptimizer")
    after = float(scaler.dynamic_scale.value)
    return LoopRun(counted_tokens=counted, loss_scales=(float(scaler.initial_scale), after))


ADAPTER = KerasAdapter(
    name="keras",
    title="Keras 3 (torch backend) SGD(gradient_accumulation_steps=K)",
    requires=("keras",),
    model="plain",
    code_path="model.fit: base_optimizer.py BaseOptimizer._backend_apply_gradients: "
    "(g + acc_g) / steps",
    checked="keras 3.15.1 (torch backend, CPU, run here)",
    loss_scale=True,
    checkpoint=None,
    run=run,
    fp16=None,
    ranks=KERAS_RANKS,
    fixed_by="keras+wacc",
    cause="keras/src/optimizers/base_optimizer.py:567 (keras 3.15.1, "
    "BaseOptimizer._backend_apply_gradients) applies `(g + acc_g) / steps` on the K-th call: "
    "every microbatch's mean weighs 1/K whatever its token count.",
)
