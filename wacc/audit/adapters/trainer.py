"""Hugging Face ``transformers.Trainer`` with ``gradient_accumulation_steps = K``, over model
families built from tiny configs (:mod:`wacc.audit.models`):

* ``trainer-hub``: ``GPT2LMHeadModel`` built from a tiny ``GPT2Config``.  Its ``forward`` takes
  ``**kwargs``, so ``Trainer`` prefetches the window (``get_batch_samples``), counts
  ``num_items_in_batch`` and the model divides its loss *sum* by it.
* ``trainer-llama``: the same with ``LlamaForCausalLM`` (its class name maps to
  ``ForCausalLMLoss`` in ``LOSS_MAPPING``, GPT-2's ``GPT2LMHeadModel`` does not: ``Trainer`` then
  counts *unshifted* labels while the model's loss, defaulting to ``ForCausalLMLoss``, shifts them).
* ``trainer-qwen2``, ``trainer-gpt_neox``, ``trainer-opt``: three more causal LMs
  (``Qwen2ForCausalLM``, ``GPTNeoXForCausalLM``, ``OPTForCausalLM``): each forward takes
  ``**kwargs`` and hands ``num_items_in_batch`` to ``self.loss_function`` (``ForCausalLMLoss``, by
  ``LOSS_MAPPING["ForCausalLM"]``), which divides the shifted loss sum by it.
* ``trainer-bert``: ``BertForMaskedLM`` on the masked-LM family's microbatches (``input_ids``
  with ``[MASK]``, ``attention_mask``, unshifted ``labels``).  Its forward takes ``**kwargs``, so
  ``Trainer.__init__`` sets ``model_accepts_loss_kwargs``, counts ``num_items_in_batch`` (over the
  unshifted labels: right for this family) and hands it over, and ``Trainer.training_step`` then
  skips its ``loss / current_gradient_accumulation_steps``; but
  ``BertForMaskedLM.forward`` computes ``CrossEntropyLoss()(prediction_scores, labels)``, the
  microbatch's *mean*, and never reads ``num_items_in_batch``: the window gets ``Σ_k mean_k``.
* ``trainer-t5``: ``T5ForConditionalGeneration`` on the seq2seq family's microbatches (encoder
  ``input_ids`` + ``attention_mask``, decoder ``labels``; the model builds ``decoder_input_ids``
  with ``_shift_right``).  The same path as BERT: ``**kwargs`` in ``forward``, the count handed
  over, and ``T5ForConditionalGeneration.forward`` returns ``CrossEntropyLoss(ignore_index=-100)``
  (a mean) without reading it.
* ``trainer-plain``: a plain ``nn.Module`` whose ``forward(input_ids, labels)`` returns its own
  mean loss and takes no ``**kwargs``: ``Trainer`` then divides each microbatch's mean by
  ``current_gradient_accumulation_steps`` (equal weighting), silently.

Code path: ``Trainer(model, TrainingArguments(gradient_accumulation_steps=K, max_steps=1,
per_device_train_batch_size=1, train_sampling_strategy="sequential", max_grad_norm=0,
use_cpu=True), train_dataset, optimizers=(SGD(lr=0), None)).train()``.  The gradient is read in
``TrainerCallback.on_pre_optimizer_step`` (after clipping, which is off, right before
``optimizer.step()``); the count the model received is read by a forward pre-hook on the
``num_items_in_batch`` keyword.  No mid-window checkpoint exists: ``save_steps`` counts optimizer
steps.  What is tried instead: two copies of the window, ``save_steps=1`` writes ``checkpoint-1``
after the first, the run is dropped inside the second, and a fresh ``Trainer`` runs
``train(resume_from_checkpoint=checkpoint-1)``: it skips the first window's batches and replays
the whole second window (the pending gradient is recomputed, not restored).  No fixed loss
scale: ``fp16`` uses a dynamic scaler on an accelerator device.  Float16 (``task.fp16``): the
same with ``TrainingArguments(fp16=True)`` and ``SGD(lr=task.learning_rate)``; the scaler is
``trainer.accelerator.scaler`` — on CPU accelerate makes none (and no autocast: its fp16 switch
does nothing off-GPU), which the run reports.  Checked against transformers
5.24.0 with accelerate 1.15.0 (the versions run here; ``train_sampling_strategy`` is a 5.x
argument, without it the order is random).

Across ranks (``task.world_size > 1``, a torchrun world): ``TrainingArguments(ddp_backend=
task.backend)`` (gloo on a CPU) and nothing else; ``Trainer`` reads the torchrun environment
(accelerate's ``PartialState``: ``MULTI_CPU``) and wraps the model in DDP.  Its dataloader is
sharded by accelerate (``BatchSamplerShard``: rank ``r`` reads global batches ``r, r + N, ...``), so
each rank is given the global dataset its window is the shard of
(:class:`wacc.audit.adapters.sharded.RankShard`, which refuses any other rank's index).  What
decides the weighting across ranks (transformers 5.25.0, accelerate 1.16.0, the versions run):

* ``transformers/trainer.py:2384-2387`` (``_get_num_items_in_batch``): with
  ``average_tokens_across_devices`` (default True, ``training_args.py:858``) and ``world_size >
  1``, ``num_items_in_batch = self.accelerator.gather(num_items_in_batch).sum()``: every rank
  divides its loss sum by the count over all ranks;
* ``trainer.py:2244-2252`` (``compute_loss``): with that flag, ``loss *= num_processes //
  tp_size``, undoing DDP's mean over ranks (its reducer divides the all-reduced bucket by the
  world size);
* ``trainer.py:2147-2155`` (``training_step``): the loss is then not divided by
  ``current_gradient_accumulation_steps``; ``trainer.py:1941-1952``: ``accelerator.no_sync`` on
  every batch but the window's last.

So ``trainer-hub`` (the flag at its default) hands the optimizer Σ_r Σ_k g_rk / C, C the gathered
count (measured: exactly, to float32 rounding of transformers' loss); for GPT-2 C counts unshifted
labels (``trainer.py:543``: ``_loss_shifts_labels`` only for a ``loss_type`` mapped to
``ForCausalLMLoss``), one per sequence too many: on the windows (211;17 tokens, counted 235) rel
L2 0.0298 = 7/235.  ``trainer-hub-ranktok`` and ``trainer-llama-ranktok``
(``average_tokens_across_devices=False``) divide by each rank's own count and DDP averages the
ranks: mean_r Σ_k g_rk / T_r, the ranks weighing alike.  Measured at N = 2: Llama (shifted count,
the true totals 211;17) 1.6442034490 against 1.6442034514 predicted from the per-rank totals
(agreement 1.5e-9 relative: Llama's float32 RMSNorm); GPT-2 1.2621 (counted 215;20, the
unshifted counts; 1.4982 predicted from the true totals, 1.2621 from the counted ones).
``trainer-plain`` (no ``num_items_in_batch``: ``loss / current_gradient_accumulation_steps`` on
each microbatch's mean, then DDP's mean) weighs every microbatch of every rank 1 / (N K):
measured 4.726084520055488, the prediction from the microbatch counts to 2e-16.  The other
families take the same code path (``ranks=True``) and were not run across ranks here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from wacc.audit.adapters.sharded import sharded_dataset
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = [
    "BERT",
    "GPT_NEOX",
    "HUB",
    "HUB_RANK_TOKENS",
    "LLAMA",
    "LLAMA_RANK_TOKENS",
    "OPT",
    "PLAIN",
    "QWEN2",
    "T5",
]


def _trainer(
    task: LoopTask,
    model: torch.nn.Module,
    *,
    steps: int,
    capture: bool,
    kind: Any = None,
    average: bool | None = None,
) -> Any:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if capture:
                task.record_gradients(kw["model"])

    options: dict[str, Any] = dict(
        output_dir=str(task.workdir / "trainer"), per_device_train_batch_size=1,
        gradient_accumulation_steps=task.num_microbatches, max_steps=steps, learning_rate=0.0,
        max_grad_norm=0.0, use_cpu=True, report_to="none", logging_strategy="no",
        save_strategy="steps" if task.checkpoint_after is not None else "no", save_steps=1,
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    if task.fp16:
        options["fp16"] = True
    if task.world_size > 1:  # the torchrun environment makes it a DDP run; on a CPU, gloo
        options["ddp_backend"] = task.backend
    if average is not None:  # None: the library's default (True in 5.x)
        options["average_tokens_across_devices"] = average
    if "train_sampling_strategy" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        options["train_sampling_strategy"] = "sequential"
    dataset: Any = sharded_dataset(task)  # Trainer shards it across ranks itself
    if task.checkpoint_after is not None:  # two windows: the second is the one interrupted
        dataset = torch.utils.data.ConcatDataset([dataset, sharded_dataset(task)])
    trainer = (kind or Trainer)(
        model=model,
        args=TrainingArguments(**options),
        train_dataset=dataset,
        optimizers=(torch.optim.SGD(model.parameters(), lr=task.learning_rate), None),
        callbacks=[Capture()],
    )
    trainer.remove_callback(PrinterCallback)  # it prints the run's metrics on stdout
    return trainer


def _no_scaler(accelerator: Any) -> str:
    """Why an fp16 run has no scaler: accelerate makes a GradScaler only on an accelerator."""
    where = "off-GPU" if accelerator.device.type == "cpu" else f"on {accelerator.device.type}"
    return f"no GradScaler {where}"


def run(task: LoopTask) -> LoopRun:
    """One ``Trainer.train()`` over the window (module docstring), every option its default."""
    return run_with(task, None)


def run_rank_tokens(task: LoopTask) -> LoopRun:
    """:func:`run` with ``average_tokens_across_devices=False``: each rank's own token count."""
    return run_with(task, None, average=False)


def _scaler_scale(trainer: Any) -> float | None:
    """The scale of the loss scaler that decides the window (None: there is none): accelerate's
    ``GradScaler``, or the ``WindowLossScaler`` of a ``WaccTrainer`` on its CPU float16 path."""
    window = getattr(trainer, "wacc", None)
    if window is not None and window.loss_scaler is not None:
        return float(window.loss_scaler.scale)
    scaler = trainer.accelerator.scaler
    return None if scaler is None else float(scaler.get_scale())


def _counted(trainer: Any, counts: list[float]) -> float | None:
    """What the window was divided by: a ``WaccTrainer``'s own count, else the Trainer's
    ``num_items_in_batch`` as the model received it (None: never handed over)."""
    if hasattr(trainer, "window_tokens"):
        return trainer.window_tokens
    return counts[-1] if counts else None


def run_with(task: LoopTask, kind: Any, *, average: bool | None = None) -> LoopRun:
    """:func:`run` with the Trainer class ``kind`` (None: ``transformers.Trainer``) and
    ``average_tokens_across_devices`` ``average`` (None: the library's default)."""
    model = task.build_model()
    counts: list[float] = []

    def note_count(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if "num_items_in_batch" in kwargs:
            counts.append(float(kwargs["num_items_in_batch"]))

    model.register_forward_pre_hook(note_count, with_kwargs=True)
    if task.fp16:
        trainer = _trainer(task, model, steps=1, capture=True, kind=kind, average=average)
        before = _scaler_scale(trainer)
        trainer.train()
        counted, after = _counted(trainer, counts), _scaler_scale(trainer)
        if before is None or after is None:
            return LoopRun(counted_tokens=counted, note=_no_scaler(trainer.accelerator))
        return LoopRun(counted_tokens=counted, loss_scales=(before, after))
    if task.checkpoint_after is None:
        trainer = _trainer(task, model, steps=1, capture=True, kind=kind, average=average)
        trainer.train()
        return LoopRun(counted_tokens=_counted(trainer, counts))
    # The first window ends with checkpoint-1 (Trainer saves only at optimizer steps); the run
    # "stops" inside the second window, and a fresh Trainer resumes from checkpoint-1.
    _trainer(task, model, steps=1, capture=False, kind=kind, average=average).train()
    resumed = task.build_model()
    resumed.register_forward_pre_hook(note_count, with_kwargs=True)
    checkpoint = task.workdir / "trainer" / "checkpoint-1"
    trainer = _trainer(task, resumed, steps=2, capture=True, kind=kind, average=average)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return LoopRun(counted_tokens=_counted(trainer, counts), resume="replay")


_COMMON = dict(requires=("transformers", "accelerate"), loss_scale=False,
               checked="transformers 5.24.0 with accelerate 1.15.0", checkpoint=None,
               run=run, fp16=None, ranks=True)  # fmt: skip
HUB = Adapter(
    name="trainer-hub",
    title="Trainer + GPT2LMHeadModel (num_items_in_batch)",
    model="gpt2",
    code_path="Trainer.train: get_batch_samples -> num_items_in_batch -> model(**inputs)",
    fixed_by="trainer-hub+wacc",
    cause="GPT2LMHeadModel sets no loss_type, so Trainer counts num_items_in_batch over the "
    "unshifted labels (transformers 5.25.0: trainer.py:543, :2377) while the model's "
    "ForCausalLMLoss shifts them: one token too many per sequence.",
    **_COMMON,  # type: ignore[arg-type]
)
HUB_RANK_TOKENS = Adapter(
    name="trainer-hub-ranktok",
    title="Trainer + GPT2LMHeadModel, average_tokens_across_devices=False",
    model="gpt2",
    code_path="Trainer.train: num_items_in_batch of this rank only -> model(**inputs); DDP mean",
    cause="GPT2LMHeadModel sets no loss_type, so Trainer counts the unshifted labels "
    "(transformers 5.25.0: trainer.py:543), and average_tokens_across_devices=False "
    "(training_args.py:858) divides each rank by its own count while DDP averages the ranks "
    "alike (trainer.py:2244-2252).",
    fixed_by="trainer-hub-ranktok+wacc",
    **{**_COMMON, "run": run_rank_tokens},  # type: ignore[arg-type]
)
LLAMA = Adapter(
    name="trainer-llama",
    title="Trainer + LlamaForCausalLM (num_items_in_batch)",
    model="llama",
    code_path="Trainer.train: get_batch_samples -> num_items_in_batch -> model(**inputs)",
    **_COMMON,  # type: ignore[arg-type]
)
_NUM_ITEMS = "Trainer.train: get_batch_samples -> num_items_in_batch -> model(**inputs)"
LLAMA_RANK_TOKENS = Adapter(
    name="trainer-llama-ranktok",
    title="Trainer + LlamaForCausalLM, average_tokens_across_devices=False",
    model="llama",
    code_path="Trainer.train: num_items_in_batch of this rank only -> model(**inputs); DDP mean",
    # Llama's loss shifts the labels and the Trainer counts them shifted: each rank's token mean
    # is right, and the DDP mean over ranks weighs the ranks alike (the prediction applies; the
    # GPT-2 row also counts one token too many per sequence, so it does not).
    weighs_ranks_equally=True,
    cause="average_tokens_across_devices=False (transformers 5.25.0: training_args.py:858) divides "
    "each rank's loss sum by its own num_items_in_batch (trainer.py:2384-2387 skips the gather) "
    "while DDP averages the ranks (trainer.py:2244-2252 no longer multiplies by num_processes): "
    "every rank weighs 1/N whatever its token count.",
    fixed_by="trainer-llama-ranktok+wacc",
    **{**_COMMON, "run": run_rank_tokens},  # type: ignore[arg-type]
)
QWEN2 = Adapter(
    name="trainer-qwen2",
    title="Trainer + Qwen2ForCausalLM (num_items_in_batch)",
    model="qwen2",
    code_path=_NUM_ITEMS + " -> ForCausalLMLoss",
    **_COMMON,  # type: ignore[arg-type]
)
GPT_NEOX = Adapter(
    name="trainer-gpt_neox",
    title="Trainer + GPTNeoXForCausalLM (num_items_in_batch)",
    model="gpt_neox",
    code_path=_NUM_ITEMS + " -> ForCausalLMLoss",
    **_COMMON,  # type: ignore[arg-type]
)
OPT = Adapter(
    name="trainer-opt",
    title="Trainer + OPTForCausalLM (num_items_in_batch)",
    model="opt",
    code_path=_NUM_ITEMS + " -> ForCausalLMLoss",
    **_COMMON,  # type: ignore[arg-type]
)
BERT = Adapter(
    name="trainer-bert",
    title="Trainer + BertForMaskedLM (masked LM)",
    model="bert",
    code_path=_NUM_ITEMS + "; BertForMaskedLM.forward: CrossEntropyLoss() mean, count unread",
    fixed_by="trainer-bert+wacc",
    cause="BertForMaskedLM.forward returns CrossEntropyLoss()'s microbatch mean and never reads "
    "num_items_in_batch (transformers 5.25.0: models/bert/modeling_bert.py:813), while Trainer "
    "skips its division by K because the forward takes **kwargs (trainer.py:2151): the window "
    "gets the sum of the K means.",
    **_COMMON,  # type: ignore[arg-type]
)
T5 = Adapter(
    name="trainer-t5",
    title="Trainer + T5ForConditionalGeneration (seq2seq)",
    model="t5",
    code_path=_NUM_ITEMS
    + "; T5ForConditionalGeneration.forward: CrossEntropyLoss(ignore_index=-100) mean, unread",
    fixed_by="trainer-t5+wacc",
    cause="T5ForConditionalGeneration.forward returns CrossEntropyLoss(ignore_index=-100)'s "
    "microbatch mean and never reads num_items_in_batch (transformers 5.25.0: models/t5/"
    "modeling_t5.py:1054), while Trainer skips its division by K (trainer.py:2151): the window "
    "gets the sum of the K means.",
    **_COMMON,  # type: ignore[arg-type]
)
PLAIN = Adapter(
    name="trainer-plain",
    title="Trainer + plain nn.Module (own mean loss)",
    model="plain",
    code_path="Trainer.train: training_step -> loss / current_gradient_accumulation_steps",
    fixed_by="trainer-plain+wacc",
    cause="Trainer.training_step divides each microbatch's own mean loss by the number of "
    "microbatches (transformers 5.25.0: trainer.py:2156): every microbatch weighs the same, "
    "whatever its tokens.",
    **_COMMON,  # type: ignore[arg-type]
)
