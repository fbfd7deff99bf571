"""Lightning (``lightning.pytorch``), the two ways its documentation accumulates gradients, each
through ``Trainer.fit`` on a ``LightningModule`` that wraps the plain causal LM (whose forward
returns its own *mean* token loss: what a ``training_step`` usually returns):

* ``lightning``: automatic optimisation, ``Trainer(accumulate_grad_batches=K)``;
  ``training_step`` returns the microbatch's loss and Lightning's closure divides it by
  ``accumulate_grad_batches`` (``loops/optimization/automatic.py``,
  ``ClosureResult.from_training_step_output(training_step_output, normalize)``:
  ``closure_loss / normalize``) before ``backward``, stepping on the K-th batch: every
  microbatch weighs the same.
* ``lightning-manual``: manual optimisation (``self.automatic_optimization = False``), the
  recipe of the manual-optimisation guide ("Gradient Accumulation",
  ``docs/source-pytorch/model/manual_optimization.rst``): ``loss = self.compute_loss(batch) / N;
  self.manual_backward(loss); if (batch_idx + 1) % N == 0: opt.step(); opt.zero_grad()``.

Code path: ``Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=1, logger=False,
enable_checkpointing=False, default_root_dir=task.workdir, ...).fit(module,
DataLoader(task.dataset, batch_size=1))`` with ``configure_optimizers`` returning
``SGD(lr=task.learning_rate)``.  The gradient is read in ``Callback.on_before_optimizer_step``
(Lightning calls it after the closure's backward and before clipping, which is off, and the
step).  Lightning's warnings and its INFO lines are kept out of the caller's output.
Checkpoint: a callback's ``on_train_batch_end`` after ``c`` batches calls
``trainer.save_checkpoint(path)`` and stops the run (an exception: a crash); a fresh module and
``Trainer`` run ``fit(..., ckpt_path=path)``.  Lightning restores the step and batch counters but
not ``.grad``, and a plain ``DataLoader`` has no state to restore: the resumed epoch reads the
dataset from its start while the batch counter continues, so the step comes after the first
``K - c`` microbatches again (measured, see the ``mid-window resume`` column).  No fixed loss
scale: Lightning's only scaler is ``MixedPrecision``'s dynamic ``torch.amp.GradScaler`` for
``precision="16-mixed"``.  Float16 (``task.fp16``): ``Trainer(precision="16-mixed")``; on a CPU
accelerator Lightning's ``_AcceleratorConnector`` warns and switches to ``"bf16-mixed"``
(bfloat16 autocast, no ``GradScaler``): the run reports it.  Checked against lightning 2.6.6
(CPU, the version run here; the ``lightning`` extra).

Across ranks (``task.world_size > 1``, a torchrun world): ``Trainer(devices=N,
strategy=DDPStrategy(process_group_backend=task.backend), use_distributed_sampler=False)``.
Lightning finds the torchrun environment (``fabric/plugins/environments/torchelastic.py:59``,
``torch.distributed.is_torchelastic_launched()``) and runs in the launched processes (no spawn).
``use_distributed_sampler=False`` because its sampler would otherwise *shuffle* a training set
whatever the loader says (``pytorch/trainer/connectors/data_connector.py:491``: ``is_shuffled =
True`` for the training stage, then ``DistributedSampler(shuffle=True, seed=0)``): each rank
reads its own window in order, Lightning's documented switch for data a user shards itself.
What decides the weighting across ranks (lightning 2.6.6, run here): automatic,
``pytorch/loops/optimization/automatic.py:83`` (``closure_loss / normalize``, normalize =
``accumulate_grad_batches``) on each microbatch's *mean*, ``automatic.py:184``
(``_block_parallel_sync_behavior``: ``DistributedDataParallel.no_sync`` until the K-th batch,
``strategies/parallel.py:117-126``); manual, the recipe's ``loss / N`` and
``manual_backward`` (DDP syncs on every backward: the same sum); then DDP's all-reduce divided
by the world size.  Every microbatch of every rank weighs 1 / (N K).  Measured at N = 2 (ranks of
211 and 17 tokens, one with a zero-token microbatch), both paths: rel L2 4.726084520055488, the
prediction from the microbatch counts to 2e-16; a FAIL (ranks weighed alike alone would be
2.3145).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["AUTOMATIC", "MANUAL"]

_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


class _Stopped(Exception):
    """Raised by the checkpoint callback: the run ends there, as a crash would end it."""


@contextmanager
def _quiet(seen: list[str]) -> Iterator[None]:
    """Lightning's warnings recorded into ``seen`` (not raised, not shown) and its INFO lines
    (accelerator summary, tips) off, restored afterwards."""
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        seen.extend(str(w.message) for w in caught)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _module(task: LoopTask, pl: Any, *, manual: bool) -> Any:
    """A fresh ``LightningModule`` around ``task.build_model()``."""
    steps = task.num_microbatches

    class AuditModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = task.build_model()
            self.automatic_optimization = not manual

        def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
            loss: torch.Tensor = out["loss"]
            return loss

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            if not manual:
                return self.compute_loss(batch)
            # The manual-optimisation guide's "Gradient Accumulation" recipe, N = K.
            opt = self.optimizers()
            loss = self.compute_loss(batch) / steps
            self.manual_backward(loss)
            if (batch_idx + 1) % steps == 0:
                opt.step()
                opt.zero_grad()
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=task.learning_rate)

    return AuditModule()


def _trainer(task: LoopTask, pl: Any, *, manual: bool, callbacks: list[Any]) -> Any:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(task.workdir / "lightning"),
        precision="16-mixed" if task.fp16 else "32-true", callbacks=callbacks,
    )  # fmt: skip
    if not manual:  # manual optimisation refuses accumulate_grad_batches != 1
        options["accumulate_grad_batches"] = task.num_microbatches
    options.update(ddp_options(task, pl))
    return pl.Trainer(**options)


def ddp_options(task: LoopTask, pl: Any) -> dict[str, Any]:
    """The ``Trainer`` options of a run across ranks (none at world size 1): Lightning's DDP
    strategy in the torchrun world (module docstring)."""
    if task.world_size == 1:
        return {}
    # Under torchrun: TorchElasticEnvironment, no processes spawned.  Its DistributedSampler
    # would shuffle the training data (seed 0) whatever the loader says: each rank reads its own
    # window as given instead, Lightning's switch for that.
    return dict(
        devices=task.world_size,
        strategy=pl.strategies.DDPStrategy(process_group_backend=task.backend),
        use_distributed_sampler=False,
    )


def fit_window(
    task: LoopTask,
    pl: Any,
    seen: list[str],
    *,
    module: Callable[[], Any],
    trainer: Callable[[list[Any]], Any],
    loader: Callable[[], Any],
) -> tuple[Any, Any, Any, float | None]:
    """``trainer(callbacks).fit(module(), loader())`` over the window, Lightning's warnings
    into ``seen``; with ``task.checkpoint_after``, first a run stopped there by
    ``trainer.save_checkpoint`` and then the fit of fresh objects from it (``ckpt_path``).
    Returns the last trainer and module, the precision plugin's ``GradScaler`` (or None) and
    its scale before the fit."""
    path = task.workdir / "lightning_mid_window.ckpt"

    class Capture(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            task.record_gradients(module.model)

    class Checkpoint(pl.Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx + 1 == task.checkpoint_after:
                trainer.save_checkpoint(str(path))
                raise _Stopped

    with _quiet(seen):
        resume: dict[str, str] = {}
        if task.checkpoint_after is not None:
            try:
                trainer([Checkpoint()]).fit(module(), loader())
            except _Stopped:
                resume["ckpt_path"] = str(path)
            else:
                raise RuntimeError("the checkpoint callback never ran")
        last = trainer([Capture()])
        scaler = getattr(last.strategy.precision_plugin, "scaler", None)
        before = None if scaler is None else float(scaler.get_scale())
        fitted = module()
        last.fit(fitted, loader(), **resume)
    return last, fitted, scaler, before


def _run(task: LoopTask, *, manual: bool) -> LoopRun:
    pl: Any = importlib.import_module("lightning.pytorch")

    def loader() -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(task.dataset, batch_size=1, shuffle=False)

    seen: list[str] = []
    trainer, _, scaler, before = fit_window(
        task,
        pl,
        seen,
        module=lambda: _module(task, pl, manual=manual),
        trainer=lambda callbacks: _trainer(task, pl, manual=manual, callbacks=callbacks),
        loader=loader,
    )
    if not task.fp16:
        return LoopRun(counted_tokens=None)
    if scaler is None or before is None:
        precision = trainer.strategy.precision_plugin.precision
        switched = any("16-mixed" in message and "bf16-mixed" in message for message in seen)
        how = "Lightning runs 16-mixed as bf16-mixed on CPU" if switched else f"{precision}"
        return LoopRun(counted_tokens=None, note=f"no GradScaler: {how}")
    return LoopRun(counted_tokens=None, loss_scales=(before, float(scaler.get_scale())))


def run_automatic(task: LoopTask) -> LoopRun:
    """``Trainer(accumulate_grad_batches=K).fit`` (module docstring)."""
    return _run(task, manual=False)


def run_manual(task: LoopTask) -> LoopRun:
    """The manual-optimisation accumulation recipe (module docstring)."""
    return _run(task, manual=True)


_COMMON = dict(requires=("lightning", "lightning.pytorch"), model="plain", loss_scale=False,
               checked="lightning 2.6.6 (CPU, run here)", checkpoint=None,
               fp16=None, ranks=True)  # fmt: skip
AUTOMATIC = Adapter(
    name="lightning",
    title="Lightning Trainer(accumulate_grad_batches=K)",
    code_path="Trainer.fit: automatic.py ClosureResult.from_training_step_output: "
    "loss / accumulate_grad_batches",
    run=run_automatic,
    fixed_by="lightning+wacc",
    cause="lightning/pytorch/loops/optimization/automatic.py:83 (lightning 2.6.6) divides each "
    "training_step loss by accumulate_grad_batches (`closure_loss = closure_loss / normalize`): "
    "every microbatch weighs 1/K whatever its token count.",
    **_COMMON,  # type: ignore[arg-type]
)
MANUAL = Adapter(
    name="lightning-manual",
    title="Lightning manual optimisation (documented recipe)",
    code_path="Trainer.fit: training_step: manual_backward(loss / N); "
    "opt.step() if (batch_idx + 1) % N == 0",
    run=run_manual,
    fixed_by="lightning-manual+wacc",
    cause="the manual-optimisation guide's recipe (docs/source-pytorch/model/"
    'manual_optimization.rst, "Gradient Accumulation") backwards `loss / N`: every '
    "microbatch weighs 1/N whatever its token count.",
    **_COMMON,  # type: ignore[arg-type]
)
