"""PEFT LoRA under ``transformers.Trainer``: ``peft.get_peft_model(model, LoraConfig(...))`` on two
of the audit's causal LMs (:mod:`wacc.audit.models`: ``lora-gpt2``, ``lora-llama``; rank 4, PEFT's
default target modules, every base weight frozen), trained by exactly the ``Trainer`` code path of
:mod:`wacc.audit.adapters.trainer` (its ``run``: ``Trainer(gradient_accumulation_steps=K,
max_steps=1, ...)``, the gradient read in ``on_pre_optimizer_step``, the count by a forward
pre-hook on ``num_items_in_batch``, the replayed-window resume, ``fp16=True`` for float16).

What is audited is the gradient of the adapters only: the truth differentiates the trainable
parameters (:func:`wacc.audit.truth.compute_truth`), and both LoRA factors start nonzero
(``init_lora_weights=False``; PEFT's default zero ``B`` would make every ``A`` gradient exactly
zero at the audited point).

What decides the count is the *base* model: ``Trainer.__init__`` inspects
``unwrap_peft_model(self.model)`` (``transformers/trainer.py``, "Model introspection"): its
``forward`` takes ``**kwargs`` (``model_accepts_loss_kwargs``, so ``num_items_in_batch`` is counted
and handed over: ``PeftModelForCausalLM.forward`` passes ``**kwargs`` on to the base model), and
``self._loss_shifts_labels = LOSS_MAPPING.get(getattr(model_to_inspect, "loss_type", None)) is
ForCausalLMLoss and ...``:

* ``peft-lora-llama``: ``LlamaForCausalLM``'s ``loss_type`` maps to ``ForCausalLMLoss``, so
  ``Trainer._get_num_items_in_batch`` counts ``batch["labels"][..., 1:]`` — the true count.
* ``peft-lora-gpt2``: ``GPT2LMHeadModel``'s ``loss_type`` is unset, so ``_get_num_items_in_batch``
  counts the *unshifted* ``batch["labels"]`` (one token too many per sequence with a target),
  while the model's loss (``ForCausalLMLoss``) shifts them: the window's gradient times
  ``N / N_unshifted``, the ``trainer-hub`` finding, unchanged by LoRA.

Across ranks (``task.world_size > 1``, a torchrun world): the Trainer rows' own path
(:func:`wacc.audit.adapters.trainer.run_with`: ``ddp_backend``, the sharded global dataset), the
Trainer wrapping the ``PeftModel`` in DDP (only the adapters require grad: DDP reduces those).
What decides the weighting across ranks is the Trainer's, as for ``trainer-hub`` (transformers
5.25.0, accelerate 1.16.0): ``trainer.py:2384-2387`` (``_get_num_items_in_batch``: with
``average_tokens_across_devices``, default True, the count is ``accelerator.gather(...).sum()``
over every rank), ``trainer.py:2244-2252`` (``compute_loss``: ``loss *= num_processes //
tp_size``, undoing DDP's mean over ranks), ``trainer.py:1941-1952`` (``no_sync`` on every batch
but the window's last), the count's labels still decided by the base model's ``loss_type``
(``trainer.py:543``): ``peft-lora-gpt2`` hands every rank Σ_r Σ_k g_rk / C, C the gathered
*unshifted* count (one token too many per sequence), ``peft-lora-llama`` the gathered shifted one.

Checked against peft 0.21.2 with transformers 5.24.0 and accelerate 1.16.0 (CPU, the versions run
here; the ``hf-extras`` extra).
"""

from __future__ import annotations

from wacc.audit.adapters import trainer
from wacc.audit.protocol import Adapter

__all__ = ["LORA_GPT2", "LORA_LLAMA"]

_PATH = (
    "get_peft_model(model, LoraConfig(r=4, init_lora_weights=False)); "
    "Trainer.train: get_batch_samples -> num_items_in_batch -> PeftModel(**inputs)"
)
_COMMON = dict(requires=("peft", "transformers", "accelerate"), loss_scale=False,
               checked="peft 0.21.2 with transformers 5.24.0, accelerate 1.16.0",
               checkpoint=None, run=trainer.run, fp16=None, ranks=True)  # fmt: skip
LORA_GPT2 = Adapter(
    name="peft-lora-gpt2",
    title="PEFT LoRA on GPT2LMHeadModel + Trainer",
    model="lora-gpt2",
    code_path=_PATH + " -> GPT2LMHeadModel: count over unshifted labels",
    fixed_by="peft-lora-gpt2+wacc",
    cause="Trainer inspects the base GPT2LMHeadModel, which sets no loss_type, and counts "
    "num_items_in_batch over the unshifted labels (transformers 5.25.0: trainer.py:543, :2377) "
    "while its ForCausalLMLoss shifts them: one token too many per sequence.",
    **_COMMON,  # type: ignore[arg-type]
)
LORA_LLAMA = Adapter(
    name="peft-lora-llama",
    title="PEFT LoRA on LlamaForCausalLM + Trainer",
    model="lora-llama",
    code_path=_PATH + " -> ForCausalLMLoss",
    **_COMMON,  # type: ignore[arg-type]
)
