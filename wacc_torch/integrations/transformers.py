"""``transformers.Trainer`` with token-weighted gradient accumulation (``wacc_torch``).

``Trainer`` with ``gradient_accumulation_steps = K`` hands the optimizer the right token mean only
when the model divides its loss *sum* by the window's ``num_items_in_batch`` and the Trainer
counted that number over the labels the loss reads. It does not for a GPT-2 (its ``loss_type`` is
unset, so ``Trainer._get_num_items_in_batch`` counts the unshifted labels: one token too many per
sequence), for a masked LM or a seq2seq model (their ``forward`` takes ``**kwargs`` but returns a
mean and never reads the count: the window gets ``Σ_k mean_k``), nor for a plain ``nn.Module``
(each microbatch's mean divided by K: equal weighting). :class:`WaccTrainer` replaces that
arithmetic, whatever the model: each microbatch's loss is the model's own *mean* over its
targets (``num_items_in_batch`` is never passed), its backward's gradients go into a
``wacc_torch`` accumulator with weight = that microbatch's target count (labels != -100, after
the shift for a causal LM), and the window's last microbatch writes the token-weighted mean into
``.grad`` before the Trainer clips and steps::

    from wacc_torch.integrations.transformers import WaccTrainer

    trainer = WaccTrainer(model=model, args=args, train_dataset=data)  # instead of Trainer(...)
    trainer.train()

Any ``Trainer`` subclass takes the same mixin (``class WaccSFTTrainer(WaccTrainerMixin,
SFTTrainer)``). ``shift_labels`` says which labels a model's loss reads; it is inferred for
Hugging Face models (causal LMs shift, masked LMs and seq2seq models do not) and must be given for
any other model. Float16 (``TrainingArguments(fp16=True)``): where accelerate has a
``GradScaler`` (a GPU) it scales each backward and decides once per window, at the step, as it
always does (the accumulator carries its scaled sums unchanged); where it has none (CPU: there
its fp16 switch does nothing), the forward runs under float16 autocast and a
:class:`~wacc_torch.WindowLossScaler` (``loss_scaler=``, default GradScaler's settings) scales
the losses and skips an overflowing window whole (every ``.grad`` stays None, the optimizer's
step changes nothing). Checkpoints: each ``checkpoint-N`` directory the Trainer writes also holds
``wacc_window.pt`` (the accumulator's record and the scaler's state), and
``train(resume_from_checkpoint=...)`` restores it. The Trainer checkpoints only at optimizer
steps, where the window is empty, and resumes at a window's start: a run stopped inside a window
recomputes that window from the last checkpoint (bit for bit the same gradient). Across ranks
(``torchrun``: the Trainer wraps the model in DDP): every microbatch's forward and backward run
under DDP's ``no_sync()``, the window's last one too, so DDP never averages a gradient; at the
window's end each rank's scaled sums and token count are SUM-reduced once
(:func:`wacc_torch.all_reduce_mean`: one metadata exchange, one all-reduce), divided by the loss
scale once and by the global count (semantics §7). Every rank hands its optimizer the same token
mean over every rank's targets, and the float16 scaler decides on those same reduced values: all
ranks step or skip together. :attr:`~WaccTrainerMixin.window_tokens` is then the global count.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

from wacc_torch.integrations._framework import require
from wacc_torch.integrations._token_window import TokenWindow, count_tokens
from wacc_torch.records import load_record, save_record
from wacc_torch.scaler import WindowLossScaler

# WaccTrainer is made by the module's __getattr__ on first use (transformers imported only then).
__all__ = ["WINDOW_FILE", "WaccTrainer", "WaccTrainerMixin", "shifts_labels"]  # noqa: F822

WINDOW_FILE = "wacc_window.pt"  # in each checkpoint-N directory
_BY = "wacc_torch.integrations.transformers"


def _transformers() -> Any:
    return require("transformers", extra="frameworks", integration=_BY)


def shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's own loss reads ``labels[..., 1:]`` (a causal LM) rather than the
    labels position by position (a masked LM, a seq2seq model), by the model's class (a PEFT
    model by its base model's); ``ValueError`` naming the class for any other model."""
    from transformers.models.auto import modeling_auto as auto

    base = model
    get_base = getattr(model, "get_base_model", None)  # a PEFT model: its base decides
    if callable(get_base):
        base = get_base()
    name = type(base).__name__
    if name in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return True
    unshifted = (
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    )
    if any(name in mapping.values() for mapping in unshifted):
        return False
    raise ValueError(
        f"WaccTrainer cannot tell which labels {name}'s loss reads: pass shift_labels=True if it "
        f"predicts labels[..., 1:] from the positions before (a causal LM), False if it compares "
        f"each position's logits with that position's label"
    )


class WaccTrainerMixin:
    """Token-weighted accumulation for ``Trainer`` and its subclasses (module docstring); put it
    first: ``class MyTrainer(WaccTrainerMixin, Trainer)``.

    Keyword arguments on top of the Trainer's: ``shift_labels`` (module docstring),
    ``accumulator_dtype`` (the work dtype; default float64 for a float64 model, else float32) and
    ``loss_scaler`` (a :class:`~wacc_torch.WindowLossScaler` for the CPU float16 path). After
    each optimizer step, :attr:`window_tokens` is the target count the window was divided by.
    """

    wacc: TokenWindow

    if TYPE_CHECKING:  # what the Trainer it is mixed into provides
        args: Any
        model: Any
        accelerator: Any
        loss_is_scaled_for_ga: bool | None

        def add_callback(self, callback: Any) -> None: ...

    def __init__(
        self,
        *args: Any,
        shift_labels: bool | None = None,
        accumulator_dtype: torch.dtype | None = None,
        loss_scaler: WindowLossScaler | None = None,
        **kwargs: Any,
    ) -> None:
        transformers = _transformers()
        if not hasattr(transformers.Trainer, "loss_is_scaled_for_ga"):
            # Without it Trainer.training_step divides every microbatch's loss by K itself.
            raise ImportError(
                f"{_BY} needs a transformers whose Trainer has loss_is_scaled_for_ga (5.x); "
                f"this is transformers {transformers.__version__}: pip install 'wacc[frameworks]'"
            )
        if shift_labels is not None and not isinstance(shift_labels, bool):
            raise TypeError(f"shift_labels must be True, False or None, got {shift_labels!r}")
        super().__init__(*args, **kwargs)
        if self.accelerator.distributed_type == "DEEPSPEED":
            raise NotImplementedError("WaccTrainer does not drive DeepSpeed's engine")
        if self.accelerator.distributed_type == "FSDP":
            raise NotImplementedError("WaccTrainer reduces across DDP ranks, not FSDP shards")
        own_scaler = self.args.fp16 and self.accelerator.scaler is None
        if loss_scaler is not None and not own_scaler:
            why = "accelerate's GradScaler decides" if self.args.fp16 else "fp16 is off"
            raise ValueError(f"loss_scaler is for the CPU float16 path only ({why} here)")
        self._wacc_shift = shifts_labels(self.model) if shift_labels is None else shift_labels
        self._wacc_ranks = int(self.args.world_size)
        self.wacc = TokenWindow(
            dtype=accumulator_dtype,
            loss_scaler=(loss_scaler or WindowLossScaler()) if own_scaler else None,
            across_ranks=self._wacc_ranks > 1,
        )
        self._wacc_autocast = own_scaler
        self._wacc_step = False  # inside training_step: compute_loss scales the loss
        self._wacc_loss = 0.0  # Σ tokens_k * mean_k of the window so far (logging)
        # Trainer must not divide the loss by K: each microbatch's mean is weighted by wacc.
        self.loss_is_scaled_for_ga = True
        self.add_callback(_save_window_callback(self, transformers.TrainerCallback))

    @property
    def window_tokens(self) -> float | None:
        """The target count the last finished window was divided by (None before the first)."""
        return self.wacc.window_tokens

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The Trainer's contexts, plus float16 autocast on the CPU float16 path."""
        stack: contextlib.ExitStack = super().compute_loss_context_manager()  # type: ignore[misc]
        if self._wacc_autocast and self._wacc_step:
            stack.enter_context(torch.autocast(self.args.device.type, dtype=torch.float16))
        return stack

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The model's own loss for this microbatch alone (a mean over its targets: the count is
        never handed over), times the window's loss scale inside a training step."""
        out = super().compute_loss(  # type: ignore[misc]
            model, inputs, return_outputs=return_outputs, num_items_in_batch=None
        )
        if not self._wacc_step or self.wacc.loss_scale == 1.0:
            return out
        if return_outputs:
            loss, outputs = out
            return loss * self.wacc.loss_scale, outputs
        return out * self.wacc.loss_scale

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One microbatch: the Trainer's own step (forward, backward), then its gradients into the
        window with weight = its targets; the window's last microbatch writes the mean into
        ``.grad``. Returns 0 until the window's last microbatch, then the window's token-mean
        loss, so that the Trainer's logged loss (its sum over the window) is that mean."""
        if "shift_labels" in inputs:  # a padding-free collator's own shifted labels
            tokens = count_tokens(inputs["shift_labels"], shift=False)
        elif "labels" in inputs:
            tokens = count_tokens(inputs["labels"], shift=self._wacc_shift)
        else:
            raise ValueError("WaccTrainer needs labels in every batch: its weight is their count")
        scale = self.wacc.loss_scale
        # Across ranks DDP must never average a microbatch's gradient (the window is reduced
        # once, in finish): its forward and backward run under no_sync, the last one's too.
        sync = getattr(model, "no_sync", None) if self._wacc_ranks > 1 else None
        self._wacc_step = True
        try:
            with sync() if callable(sync) else contextlib.nullcontext():
                loss = super().training_step(model, inputs, None)  # type: ignore[misc]
        finally:
            self._wacc_step = False
        self.wacc.add(model, tokens)
        mean = float(loss) / scale
        if tokens > 0:
            self._wacc_loss += mean * tokens
        if not self.accelerator.sync_gradients:  # not the window's last microbatch
            return torch.zeros_like(loss)
        self.wacc.finish(model)
        total = self.wacc.window_tokens or 0.0
        # Across ranks the Trainer logs the mean over ranks of what each returns: N * this
        # rank's loss sum / the global count makes that the window's token mean over all ranks.
        logged = self._wacc_ranks * self._wacc_loss / total if total > 0 else 0.0
        self._wacc_loss = 0.0
        return torch.full_like(loss, logged)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kw: Any) -> Any:
        """``Trainer.train``; resuming also restores the window saved with the checkpoint."""
        if resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                path = _transformers().trainer_utils.get_last_checkpoint(self.args.output_dir)
            if isinstance(path, str | os.PathLike):
                window = os.path.join(path, WINDOW_FILE)
                if os.path.exists(window):  # a plain Trainer's checkpoint: an empty window
                    self.wacc.load_state_dict(load_record(window), self.model)
        return super().train(resume_from_checkpoint, *args, **kw)  # type: ignore[misc]


def _save_window_callback(trainer: WaccTrainerMixin, base: type) -> Any:
    """A ``TrainerCallback`` (``base``) that writes the window into each checkpoint directory."""

    class SaveWindow(base):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not state.is_world_process_zero:
                # Checkpoints fall between windows: every rank's window is empty and its scaler
                # the same (one decision per window), so rank 0's file is every rank's.
                return
            directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(directory):
                save_record(trainer.wacc.state_dict(), os.path.join(directory, WINDOW_FILE))

    return SaveWindow()


def __getattr__(name: str) -> Any:
    if name == "WaccTrainer":  # built on first use: Trainer is imported only then
        transformers = _transformers()
        cls = type("WaccTrainer", (WaccTrainerMixin, transformers.Trainer), {
            "__doc__": "``transformers.Trainer`` with token-weighted accumulation "
            "(:class:`WaccTrainerMixin`).", "__module__": __name__,
        })  # fmt: skip
        globals()["WaccTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
