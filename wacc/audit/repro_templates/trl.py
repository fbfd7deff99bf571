"""TRL's ``SFTTrainer`` (:mod:`wacc.audit.adapters.trl_sft`) at SFTConfig's defaults (bf16=True,
the fused LM head, gradient checkpointing) on the window as a ``datasets.Dataset`` of token ids:
``PADDING`` the exact microbatches (right padding included), ``PACKING`` each sequence without
its padding, ``packing=True`` with ``max_length`` the longest and K = the rows
``pack_dataset(..., "bfd")`` makes.  The gradient is read in ``on_pre_optimizer_step``, the count
``SFTTrainer.compute_loss`` is handed by a subclass that notes it."""

from __future__ import annotations

from wacc.audit.models import PAD_TOKEN
from wacc.audit.windows import VOCAB_SIZE

__all__ = ["IMPORTS", "PACKING", "PACKING_IMPORTS", "PADDING"]

IMPORTS = (
    "import tempfile",
    "from datasets import Dataset, disable_progress_bars",
    "from tokenizers import Tokenizer",
    "from tokenizers.models import WordLevel",
    "from transformers import PreTrainedTokenizerFast, PrinterCallback, TrainerCallback",
    "from trl import SFTConfig, SFTTrainer",
)
PACKING_IMPORTS = (*IMPORTS, "from trl.data_utils import pack_dataset")

_PADDING_ROWS = """
window = Dataset.from_dict({  # the window's microbatches as they are, right padding included
    "input_ids": [b["input_ids"].tolist() for b in batches],
    "labels": [b["labels"].tolist() for b in batches],
})
steps = len(batches)
"""

_PACKING_ROWS = """
window = Dataset.from_dict({  # each sequence without its padding: packing makes the rows
    "input_ids": TOKENS,
    "labels": [t if labelled else [-100] * len(t) for t, labelled in zip(TOKENS, LABELLED)],
})
steps = len(pack_dataset(window, width, "bfd"))  # one optimizer step over the packed rows
"""

_BODY = """
disable_progress_bars()  # SFTTrainer's dataset map()s draw them on stderr
captured, counts = [], []


class Capture(TrainerCallback):  # the gradient right before optimizer.step()
    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        captured.append(gradient(model))


class Observed(SFTTrainer):  # SFTTrainer itself; notes the count Trainer hands compute_loss
    def compute_loss(self, model, inputs, *args, **kwargs):
        counts.append(kwargs.get("num_items_in_batch"))
        return super().compute_loss(model, inputs, *args, **kwargs)


# SFTTrainer wants a tokenizer for its pad token (the rows are token ids already): built here.
vocab = {"<pad>": {pad}, **{f"t{i}": i for i in range(1, {vocab})}}
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>"
)
{rows}
model = build_model()
args = SFTConfig(  # every other option at its default: bf16=True among them
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=1,
    gradient_accumulation_steps=steps, max_grad_norm=0.0, use_cpu=True, report_to="none",
    logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=0,
    train_sampling_strategy="sequential", {packing}
)
trainer = Observed(
    model=model, args=args, train_dataset=window, processing_class=tokenizer,
    callbacks=[Capture()], optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None),
)
trainer.remove_callback(PrinterCallback)  # it prints the run's metrics
trainer.train()
grads = captured[0]
counted = f"num_items_in_batch {int(counts[0])} (over {steps} rows)"
"""


def _body(rows: str, packing: str) -> str:
    text = _BODY.replace("{pad}", str(PAD_TOKEN)).replace("{vocab}", str(VOCAB_SIZE))
    return text.replace("{rows}", rows.strip("\n")).replace("{packing}", packing)


PADDING = _body(_PADDING_ROWS, "packing=False,")
PACKING = _body(_PACKING_ROWS, "packing=True, max_length=width,  # nothing truncated")
