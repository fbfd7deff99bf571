"""Lightning with ``wacc_torch``: the two rows that fix :mod:`wacc.audit.adapters.lightning`.

* ``lightning+wacc``: automatic optimization, ``Trainer(accumulate_grad_batches=K,
  callbacks=[TokenWeightedAccumulation(tokens=...)])``
  (:mod:`wacc_torch.integrations.lightning`) around the same ``LightningModule`` as the
  ``lightning`` row (``training_step`` returns the microbatch's mean loss, unchanged);
* ``lightning-manual+wacc``: manual optimization, the recipe of
  ``docs/fix-your-framework/lightning.md``: ``self.manual_backward(loss)`` (no ``/ N``),
  ``self.accumulator.accumulate_mean(self, tokens)``, and on the window's last batch
  ``finish_window(self.accumulator).apply_to(self); opt.step(); opt.zero_grad()``
  (``finish_mean()`` in one process), ``stop_gradient_sync(self.trainer)`` in the module's
  ``on_train_batch_start``, the record in its ``on_save_checkpoint`` / ``on_load_checkpoint``.

``tokens`` is the audit's :func:`~wacc.audit.windows.target_count` of the batch's labels.
Checkpoint: as the ``lightning`` row (``trainer.save_checkpoint`` after ``c`` batches, a fresh
module and ``Trainer``, ``fit(ckpt_path=...)``), with a resumable loader: a ``DataLoader`` whose
``state_dict`` is the number of batches it served and whose ``load_state_dict`` starts the next
epoch there (what torchdata's ``StatefulDataLoader`` does; Lightning saves and restores such a
loader's state with its checkpoint, ``fit_loop.py``'s ``combined_loader``), so the resumed run
reads microbatches ``c ..``; the accumulator's record rides in the checkpoint.  Float16
(``task.fp16``): Lightning's ``16-mixed`` on a CPU accelerator becomes ``bf16-mixed`` (no
``GradScaler``: the ``lightning`` row); these rows pass the plugin Lightning builds for
``16-mixed`` on a GPU, ``MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))``,
so that the forward runs under float16 autocast and Lightning's ``GradScaler`` decides once per
window (the token-weighted mean is written into ``.grad`` before it unscales): an overflow
anywhere in the window skips it whole.  Checked against lightning 2.6.6 (CPU, run here).

Across ranks (``task.world_size > 1``): the ``lightning`` rows' DDP strategy in the torchrun
world (:func:`wacc.audit.adapters.lightning.ddp_options`).  Both rows turn DDP's gradient
all-reduce off before every batch's forward (``stop_gradient_sync``:
``require_backward_grad_sync = False`` on Lightning's ``DistributedDataParallel``; Lightning's
``no_sync()`` on the window's other batches restores that value) and end the window with
``finish_window``: one :func:`wacc_torch.all_reduce_mean` of every rank's ``finish_sums()``
(semantics §7), the same token-weighted mean over every rank's tokens written into every rank's
``.grad``, so a ``GradScaler`` finds the same overflow on every rank.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from wacc.audit.adapters.lightning import ddp_options, fit_window
from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.windows import target_count

__all__ = ["AUTOMATIC", "MANUAL"]


class _Sampler(torch.utils.data.Sampler[int]):
    """Indices ``start .. n - 1`` in order; counts what it served (the loader's state)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0
        self.served = 0

    def __len__(self) -> int:
        return self.n - self.start

    def __iter__(self) -> Any:
        start, self.start = self.start, 0
        self.served = start
        for index in range(start, self.n):
            self.served = index + 1
            yield index


class _ResumableLoader(torch.utils.data.DataLoader[Any]):
    """A ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (Lightning's ``_Stateful``)."""

    def state_dict(self) -> dict[str, int]:
        assert isinstance(self.sampler, _Sampler)
        return {"served": self.sampler.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        assert isinstance(self.sampler, _Sampler)
        self.sampler.start = int(state["served"])


def _tokens(batch: dict[str, torch.Tensor]) -> int:
    return target_count(batch["labels"])


def _module(task: LoopTask, pl: Any, *, manual: bool) -> Any:
    """The ``lightning`` row's module (automatic), or the manual recipe with the accumulator."""
    from wacc_torch import WeightedGradientsAccumulator
    from wacc_torch.integrations.lightning import finish_window, stop_gradient_sync

    steps = task.num_microbatches

    class AuditModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = task.build_model()
            self.automatic_optimization = not manual
            if manual:  # the recipe's own accumulator (automatic: the callback's)
                self.accumulator = WeightedGradientsAccumulator(dtype=task.dtype, loss_scale=1.0)
            self.window_tokens: float | None = None

        def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
            loss: torch.Tensor = out["loss"]
            return loss

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            if not manual:
                return self.compute_loss(batch)
            # The manual recipe: the mean loss as it is, weighted by its tokens.
            opt = self.optimizers()
            self.manual_backward(self.compute_loss(batch))
            self.accumulator.accumulate_mean(self, _tokens(batch))
            if self.accumulator.state.issued == steps or self.trainer.is_last_batch:
                result = finish_window(self.accumulator)  # across ranks: reduced once
                result.apply_to(self)
                self.window_tokens = result.weight
                opt.step()
                opt.zero_grad()
            return None

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if manual:  # before the forward: DDP must not average what finish_window reduces
                stop_gradient_sync(self.trainer)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if manual:
                checkpoint["wacc_accumulator"] = self.accumulator.state_dict()

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            if manual:
                self.accumulator.load_state_dict(checkpoint["wacc_accumulator"], self)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=task.learning_rate)

    return AuditModule()


def _trainer(task: LoopTask, pl: Any, *, manual: bool, callbacks: list[Any]) -> Any:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=str(task.workdir / "lightning"),
        callbacks=callbacks,
    )  # fmt: skip
    if task.fp16:  # what Lightning builds for "16-mixed" on a GPU (module docstring)
        scaler = torch.amp.GradScaler("cpu")
        options["plugins"] = [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler)]
    if not manual:
        from wacc_torch.integrations.lightning import TokenWeightedAccumulation

        options["accumulate_grad_batches"] = task.num_microbatches
        options["callbacks"] = [TokenWeightedAccumulation(tokens=_tokens), *callbacks]
    options.update(ddp_options(task, pl))
    return pl.Trainer(**options)


def _run(task: LoopTask, *, manual: bool) -> LoopRun:
    pl: Any = importlib.import_module("lightning.pytorch")

    def loader() -> _ResumableLoader:
        data = task.dataset
        return _ResumableLoader(data, batch_size=1, sampler=_Sampler(len(data)))

    trainer, module, scaler, before = fit_window(
        task,
        pl,
        [],
        module=lambda: _module(task, pl, manual=manual),
        trainer=lambda callbacks: _trainer(task, pl, manual=manual, callbacks=callbacks),
        loader=loader,
    )
    # What finish_mean divided by (the callback's or the manual module's last window).
    holder = module if manual else next(c for c in trainer.callbacks if hasattr(c, "window_tokens"))
    counted = holder.window_tokens
    if not task.fp16:
        return LoopRun(counted_tokens=counted)
    if scaler is None or before is None:
        return LoopRun(counted_tokens=counted, note="no GradScaler")
    return LoopRun(counted_tokens=counted, loss_scales=(before, float(scaler.get_scale())))


def run_automatic(task: LoopTask) -> LoopRun:
    """``Trainer(accumulate_grad_batches=K, callbacks=[TokenWeightedAccumulation(...)])``."""
    return _run(task, manual=False)


def run_manual(task: LoopTask) -> LoopRun:
    """The manual-optimization recipe with the accumulator (module docstring)."""
    return _run(task, manual=True)


_COMMON = dict(requires=("lightning", "lightning.pytorch"), model="plain", loss_scale=False,
               checked="lightning 2.6.6 (CPU, run here)", checkpoint=None,
               fp16=None, ranks=True)  # fmt: skip
AUTOMATIC = Adapter(
    name="lightning+wacc",
    title="Lightning accumulate_grad_batches=K + TokenWeightedAccumulation",
    code_path="Trainer(accumulate_grad_batches=K, callbacks=[wacc_torch.integrations.lightning."
    "TokenWeightedAccumulation(tokens)]).fit",
    run=run_automatic,
    **_COMMON,  # type: ignore[arg-type]
)
MANUAL = Adapter(
    name="lightning-manual+wacc",
    title="Lightning manual optimisation with WeightedGradientsAccumulator",
    code_path="training_step: manual_backward(loss); accumulator.accumulate_mean(self, tokens); "
    "on the last batch: finish_window(accumulator).apply_to(self); opt.step() "
    "(on_train_batch_start: stop_gradient_sync(trainer))",
    run=run_manual,
    **_COMMON,  # type: ignore[arg-type]
)
