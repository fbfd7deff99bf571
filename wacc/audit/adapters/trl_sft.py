"""TRL's ``SFTTrainer`` on the audit's Llama (``LlamaForCausalLM``, tiny config), the window
converted to a ``datasets.Dataset`` of token ids (``input_ids`` + ``labels``: already tokenised,
so ``SFTTrainer._prepare_dataset`` skips tokenisation and keeps the labels), batch size 1,
``train_sampling_strategy="sequential"`` (``shuffle_dataset`` defaults to False), SGD at lr 0:

* ``trl-sft``: ``SFTConfig(packing=False, gradient_accumulation_steps=K)``, every other option at
  its default.  The rows are the window's exact microbatches (right padding included; the
  collator's attention mask is all ones, which changes nothing for a causal model).  With
  ``max_length`` set (default 1024) ``_prepare_dataset`` drops a row whose labels are all
  ``-100`` ("Drop examples left fully masked by truncation"): the zero-target microbatch is never
  run (its gradient is zero under a token-count weighting anyway).
* ``trl-sft-fp32``: the same with ``bf16=False``, to separate the weighting from the precision.
* ``trl-sft-packing``: ``SFTConfig(packing=True, max_length=L)``, ``L`` = the window's longest
  sequence (nothing truncated), each sequence given without its padding.  Packing changes what a
  microbatch is: ``pack_dataset(..., "bfd")`` puts the window's sequences into ``P`` rows of at
  most ``L`` tokens (``1 < P < K`` here), and ``gradient_accumulation_steps = P`` (counted with the
  same public ``trl.data_utils.pack_dataset``): one optimizer step over the packed window.  BFD
  packing makes the run padding-free: the collator concatenates, restarts ``position_ids`` per
  sequence and sets each sequence's first label to ``-100`` (``DataCollatorForLanguageModeling.
  torch_call``: ``output["labels"][output["position_ids"] == 0] = -100``; a causal LM's position 0
  is never a target, so every target of the window is kept), and transformers builds a
  block-diagonal mask from the restarted positions.  The truth is therefore the same window's
  token mean: what is measured is whether packing and accumulating the packed rows keep it.

The loss (``trl/trainer/sft_trainer.py``, ``SFTTrainer.compute_loss``): ``outputs = model(**inputs,
fused_lm_head=True)``; ``per_token_loss = -outputs.log_probs``; ``num_tokens = outputs.label_mask
.sum() if num_items_in_batch is None else num_items_in_batch``; ``loss = per_token_loss.sum() /
torch.as_tensor(num_tokens).clamp(min=1)``; then ``if self.args.average_tokens_across_devices and
num_items_in_batch is not None: loss = loss * (self.accelerator.num_processes // ...)`` (1 process
here).  ``num_items_in_batch`` is ``Trainer._get_num_items_in_batch`` over the window's batches
(shifted labels: Llama's ``loss_type`` maps to ``ForCausalLMLoss``), and because the model takes
``**kwargs``, ``Trainer.training_step`` skips its ``/ gradient_accumulation_steps``: a token sum
over the window divided by its true count.  Not completion-only: ``completion_only_loss`` is None
and the dataset has no prompt/completion columns, so every label given counts.  The count is read by
a subclass whose ``compute_loss`` notes the ``num_items_in_batch`` it is handed and calls
``SFTTrainer.compute_loss``.

Default precision: ``SFTConfig.bf16`` defaults to True (``trl/trainer/base_config.py``,
``__post_init__``: ``self.bf16 = not (self.fp16) if self.bf16 is None else self.bf16``), also on
CPU: accelerate runs the forward under bfloat16 autocast.  Autocast leaves float64 tensors alone,
but TRL's fused LM head (``add_fused_lm_head``, applied to the model in ``SFTTrainer.__init__``)
casts to the autocast dtype itself (``trl/kernels/chunked_logprob.py``,
``ChunkedLogProbFunction.forward``: ``compute_dtype = torch.get_autocast_dtype(device.type) if
torch.is_autocast_enabled(device.type) else hidden.dtype``; ``hidden_chunk = hidden[...]
.to(compute_dtype)``): even the float64 run's head matmul is bfloat16, so the default rows fail
the float32 bound by precision, with the right count (``trl-sft-fp32`` passes).  With bf16 off the
head's softmax statistics are still float32 (``running_max``/``sum_exp`` buffers): the float64 run
is float32-accurate.  Also default: ``gradient_checkpointing=True`` (recomputes the same forward).

``SFTTrainer`` maps the whole dataset in ``__init__``, and ``Trainer.get_batch_samples`` prefetches
the window: every microbatch is read before the first backward (the fetch log is filled when the
rows are built).  Checkpoint (padding only), as :mod:`wacc.audit.adapters.trainer`: two copies of
the window, ``save_steps=1``, a fresh ``SFTTrainer`` resumes from ``checkpoint-1`` and replays the
second (packing would mix the two copies in its packed rows).  Float16: ``SFTConfig(fp16=True)``;
off-GPU accelerate makes no ``GradScaler`` and no float16 autocast.  TRL's, transformers' and
datasets' log lines, warnings and progress bars are kept out of the caller's output.  Checked
against trl 1.16.0, transformers 5.24.0, accelerate 1.16.0, datasets 5.2.0 (CPU, run here; the
``hf-extras`` extra).

Across ranks: not run (``Adapter.ranks`` says why). ``SFTTrainer`` is a ``Trainer``: accelerate
shards the one global dataset (rank ``r`` reads rows ``r, r + N, ...``), but
``_prepare_dataset`` first drops every row whose labels are all ``-100``
(``trl/trainer/sft_trainer.py:1461-1463``), and the audit's rank windows hold a zero-target
microbatch: the rows after it move to another rank and the ranks get different batch counts, so no
global dataset gives each rank its own window (packing mixes all ranks' rows anyway). What would
decide the weighting across ranks is read from the source (trl 1.16.0, transformers 5.25.0):
``Trainer._get_num_items_in_batch`` gathers the count over the ranks
(``transformers/trainer.py:2384-2387``, ``average_tokens_across_devices`` default True), and
``SFTTrainer.compute_loss`` divides the token sum by it and multiplies by ``num_processes //
tp_size`` (``trl/trainer/sft_trainer.py:1623-1624``), undoing DDP's mean over ranks: the window's
token sum over every rank divided by the gathered count, as ``trainer-llama`` across ranks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from wacc.audit.models import PAD_TOKEN
from wacc.audit.protocol import Adapter, LoopRun, LoopTask
from wacc.audit.windows import VOCAB_SIZE

__all__ = ["PACKING", "PADDING", "PADDING_FP32"]

_LOGGERS = ("trl", "transformers", "datasets", "accelerate")


@contextmanager
def _quiet() -> Iterator[None]:
    """TRL's, transformers' and datasets' warnings, log lines and ``map`` progress bars kept out of
    the caller's output, everything restored afterwards."""
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging

    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    bars = [m for m in (datasets_logging, transformers_logging) if m.is_progress_bar_enabled()]
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in bars:  # map() and checkpoint-writing progress bars on stderr
        module.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for module in bars:
            module.enable_progress_bar()
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _tokenizer() -> Any:
    """A tokenizer over the window's ids built in memory (no download): ``SFTTrainer`` needs one
    for its pad token; the dataset is already token ids, so nothing is tokenised."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_TOKEN, **{f"t{i}": i for i in range(1, VOCAB_SIZE)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
    )


def _rows(task: LoopTask, *, packing: bool) -> dict[str, list[list[int]]]:
    """The window's microbatches as token-id rows in order (every fetch logged): as they are
    (right padding included: the exact microbatches), or, for packing, each sequence without its
    padding (packing makes the microbatches)."""
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for index in range(len(task.dataset)):
        microbatch = task.dataset[index]
        ids, labels = microbatch["input_ids"], microbatch["labels"]
        if packing:
            length = int((ids != PAD_TOKEN).sum())  # real tokens are >= 1; padding is at the end
            ids, labels = ids[:length], labels[:length]
        rows["input_ids"].append(ids.tolist())
        rows["labels"].append(labels.tolist())
    return rows


def _run(task: LoopTask, *, packing: bool, bf16: bool | None) -> LoopRun:
    from datasets import Dataset, concatenate_datasets
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer
    from trl.data_utils import pack_dataset

    counts: list[float] = []

    class Capture(TrainerCallback):
        def __init__(self, capture: bool) -> None:
            self.capture = capture

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.capture:
                task.record_gradients(kw["model"])

    class Observed(SFTTrainer):  # type: ignore[misc,unused-ignore]  # Any without trl
        """``SFTTrainer`` itself; only notes the count ``Trainer`` hands its ``compute_loss``."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            count = kwargs.get("num_items_in_batch")
            if count is not None:
                counts.append(float(count))
            return super().compute_loss(model, inputs, *args, **kwargs)

    def trainer(model: torch.nn.Module, *, max_steps: int, capture: bool, data: Any) -> Any:
        options: dict[str, Any] = dict(
            output_dir=str(task.workdir / "trl"), per_device_train_batch_size=1,
            gradient_accumulation_steps=steps, max_steps=max_steps, max_grad_norm=0.0,
            use_cpu=True, report_to="none", logging_strategy="no",
            save_strategy="steps" if task.checkpoint_after is not None else "no", save_steps=1,
            disable_tqdm=True, dataloader_num_workers=0, seed=0,
            train_sampling_strategy="sequential", packing=packing,
        )  # fmt: skip
        if packing:
            options["max_length"] = width  # the longest sequence: nothing truncated, >1 row
        if task.fp16:
            options["fp16"] = True
        elif bf16 is not None:
            options["bf16"] = bf16
        sft = Observed(
            model=cast(Any, model), args=SFTConfig(**options), train_dataset=data,
            processing_class=_tokenizer(), callbacks=[Capture(capture)],
            optimizers=(torch.optim.SGD(model.parameters(), lr=task.learning_rate), None),
        )  # fmt: skip
        sft.remove_callback(PrinterCallback)
        return sft

    with _quiet():
        rows = _rows(task, packing=packing)
        window = Dataset.from_dict(rows)
        width = max(len(ids) for ids in rows["input_ids"])
        steps = task.num_microbatches
        if packing:  # one optimizer step over the packed rows: as many as TRL's packing makes
            steps = len(pack_dataset(window.select_columns(["input_ids", "labels"]), width, "bfd"))
        model = task.build_model()
        if task.checkpoint_after is None:
            sft = trainer(model, max_steps=1, capture=True, data=window)
            scaler = sft.accelerator.scaler
            before = None if scaler is None else float(scaler.get_scale())
            sft.train()
            counted = counts[0] if counts else None
            if not task.fp16:
                return LoopRun(counted_tokens=counted)
            if scaler is None or before is None:
                return LoopRun(counted_tokens=counted, note="no GradScaler off-GPU")
            return LoopRun(counted_tokens=counted, loss_scales=(before, float(scaler.get_scale())))
        # As trainer.run: checkpoint-1 at the end of a first copy of the window, a fresh
        # SFTTrainer resumes from it and replays the second copy.
        twice = concatenate_datasets([window, window])
        trainer(model, max_steps=1, capture=False, data=twice).train()
        checkpoint = task.workdir / "trl" / "checkpoint-1"
        resumed = trainer(task.build_model(), max_steps=2, capture=True, data=twice)
        resumed.train(resume_from_checkpoint=str(checkpoint))
    return LoopRun(counted_tokens=counts[-1] if counts else None, resume="replay")


def run_padding(task: LoopTask) -> LoopRun:
    """``SFTTrainer`` with ``packing=False`` and SFTConfig's default precision."""
    return _run(task, packing=False, bf16=None)


def run_padding_fp32(task: LoopTask) -> LoopRun:
    """``SFTTrainer`` with ``packing=False`` and ``bf16=False``."""
    return _run(task, packing=False, bf16=False)


def run_packing(task: LoopTask) -> LoopRun:
    """``SFTTrainer`` with ``packing=True`` and SFTConfig's default precision."""
    return _run(task, packing=True, bf16=None)


_BF16 = (
    "SFTConfig.bf16 defaults to True, also on CPU (trl 1.16.0: trainer/base_config.py:108), and "
    "TRL's fused LM head computes in the autocast dtype (kernels/chunked_logprob.py:330): the head "
    "is bfloat16 even for a float64 model. Precision, not weighting: the count is right and "
    "bf16=False passes (trl-sft-fp32; packed too), so no wacc integration changes it."
)
# Why no rank window can be run (module docstring, "Across ranks").
_RANKS = (
    "SFTTrainer._prepare_dataset drops every row whose labels are all -100 (trl 1.16.0: "
    "trainer/sft_trainer.py:1461-1463) from the one global dataset before accelerate shards it "
    "(rank r reads rows r, r + N, ...): a rank window's zero-target microbatch moves every later "
    "row to another rank and leaves the ranks different batch counts, so no global dataset hands "
    "each rank its window (packing, sft_trainer.py:1466, mixes rows of all ranks too)"
)
_COMMON = dict(requires=("trl", "datasets", "transformers", "accelerate"), model="llama",
               loss_scale=False, checked="trl 1.16.0 with transformers 5.24.0, datasets 5.2.0",
               fp16=None, ranks=_RANKS)  # fmt: skip
PADDING = Adapter(
    name="trl-sft",
    title="TRL SFTTrainer, padding, default precision",
    code_path="SFTTrainer.train: compute_loss: -log_probs.sum() / num_items_in_batch",
    checkpoint=None,
    run=run_padding,
    cause=_BF16,
    **_COMMON,  # type: ignore[arg-type]
)
PADDING_FP32 = Adapter(
    name="trl-sft-fp32",
    title="TRL SFTTrainer, padding, bf16=False",
    code_path="SFTTrainer.train: compute_loss: -log_probs.sum() / num_items_in_batch",
    checkpoint=None,
    run=run_padding_fp32,
    **_COMMON,  # type: ignore[arg-type]
)
PACKING = Adapter(
    name="trl-sft-packing",
    title="TRL SFTTrainer, packing=True, default precision",
    code_path="SFTTrainer: pack_dataset(bfd) -> padding-free rows; compute_loss / num_items",
    checkpoint="packing two copies of the window mixes them in one packed row",
    run=run_packing,
    cause=_BF16,
    **_COMMON,  # type: ignore[arg-type]
)
