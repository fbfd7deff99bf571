"""The text of the reproducer scripts (``wacc audit --repro``): the part every script shares
(:mod:`.common`) and, per framework, the loop part.

A :class:`LoopTemplate` is the source text that replays one adapter's code path (the adapter
module's docstring names it) outside wacc: torch, the framework and the standard library only.
It runs after the common part (put together by :mod:`wacc.audit.repro`), which defines
``build_model()`` (a fresh model in ``DTYPE``), ``batches`` (the window's microbatches, each a
dict of ``[L]`` tensors in the model family's format), ``targets`` (true target tokens per
microbatch),
``token_loss_sum(model, batch)`` (Σ of the token losses of a ``[B, L]`` batch) and
``gradient(model)`` (every parameter's ``.grad`` as one float64 vector, zeros where ``None``),
and it must leave ``grads`` (the gradient the framework hands its optimizer, from ``gradient``)
and ``counted`` (a short text: what the framework divided by).  A ``resume`` body does the same
with a checkpoint after ``CHECKPOINT_AFTER`` microbatches and a restart from it.

The loops with a template (:data:`LOOPS`): ``transformers.Trainer`` (:mod:`.trainer`: every
``trainer-*`` model family, and ``peft-lora-gpt2`` / ``peft-lora-llama``, whose LoRA model the
common part builds), ``accelerate`` and ``accelerate-variable`` (:mod:`.accelerate`), ``lightning``
and ``lightning-manual`` (:mod:`.lightning`), ``litgpt`` and ``litgpt-bf16-mixed``
(:mod:`.litgpt`: ``fit`` on Fabric), ``keras`` (:mod:`.keras`), ``deepspeed``
(:mod:`.deepspeed`), ``trl-sft`` and ``trl-sft-packing`` (:mod:`.trl`), ``torchtune``
(:mod:`.torchtune`), ``nanogpt``, ``pixparse`` and ``plain``; resume bodies for ``plain``,
``pixparse``, the two ``accelerate`` and the two ``lightning`` loops; across ranks (``ranks``: run
by ``torchrun``, gloo) for ``plain`` (DDP + ``no_sync()``), ``nanogpt`` (its DDP path), every
``trainer-*`` row (``ddp_backend="gloo"``, the global dataset Trainer shards; the two
``peft-lora-*`` rows too), the two ``accelerate`` loops, the two ``lightning`` paths
(``DDPStrategy``), the two ``litgpt`` rows (Fabric's ``DDPStrategy``), ``deepspeed`` /
``deepspeed-zero1``, ``pixparse`` (its task's DDP idiom), ``torchtune`` (its distributed recipe,
FSDP2) and ``olmo-core`` (:mod:`.olmo_core`, one process too; across ranks its FSDP,
``Transformer.apply_fsdp``). A row across ranks needs only its ``ranks`` text (importing
``ranks_imports``, by default ``imports``): :func:`wacc.audit.repro._rank_script` adds the common
part (``torch.distributed`` imported and its gloo group up, each rank's window, the exact gradient
over every rank's tokens, rank 0's result).
Without one (a failure of theirs gets a note): ``timm`` (``pixparse`` is its loop without
torchvision), ``torchtitan``, ``trl-sft-fp32`` and the ``wacc_torch`` loops; a
user's own loop gets its script from :mod:`.user` (:func:`wacc.audit.repro.write_reproducers`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from wacc.audit.repro_templates import (
    accelerate,
    deepspeed,
    keras,
    lightning,
    litgpt,
    nanogpt,
    olmo_core,
    pixparse,
    plain,
    torchtune,
    trainer,
    trl,
)

__all__ = ["LOOPS", "LoopTemplate"]


@dataclass(frozen=True)
class LoopTemplate:
    """One adapter's code path as script text (module docstring)."""

    framework: str  # what the script's result line names
    distributions: tuple[str, ...]  # installed distributions whose versions the header gives
    imports: tuple[str, ...]  # import lines beyond torch and torch.nn.functional
    body: str  # leaves ``grads`` and ``counted``
    resume: str | None = None  # the same with a mid-window checkpoint; None: not written
    resume_imports: tuple[str, ...] = ()  # what only ``resume`` needs
    # How the loop turns the window into its own microbatches, when not one per sequence (a
    # sentence the header adds after the window's K microbatches).
    window_note: str = ""
    # The loop across ranks (its data-parallel code path; the common part's rank variant has
    # defined ``rank``, ``batches``/``targets`` of this rank, and ``dist`` is up); None: none.
    ranks: str | None = None
    ranks_imports: tuple[str, ...] | None = None  # what ``ranks`` imports; None: ``imports``


_TRAINER = LoopTemplate(
    "transformers.Trainer",
    ("transformers", "accelerate"),
    trainer.IMPORTS,
    trainer.BODY,
    ranks=trainer.RANKS,
)
# average_tokens_across_devices=False: each rank divides by its own count.
_TRAINER_RANK_TOKENS = replace(
    _TRAINER,
    framework="transformers.Trainer (average_tokens_across_devices=False)",
    body=trainer.RANK_TOKENS_BODY,
    ranks=trainer.RANK_TOKENS_RANKS,
)
# PEFT's LoRA model (repro._model writes it) under Trainer's own loop: the Trainer body.
_LORA = LoopTemplate(
    "transformers.Trainer + PEFT LoRA",
    ("transformers", "accelerate", "peft"),
    trainer.IMPORTS,
    trainer.BODY,
    ranks=trainer.RANKS,
)
_LIGHTNING = ("lightning",)
_LITGPT = ("litgpt", "lightning")
_TRL = ("trl", "transformers", "accelerate", "datasets", "tokenizers")
LOOPS: dict[str, LoopTemplate] = {
    **{
        name: _TRAINER
        for name in (
            "trainer-hub",
            "trainer-llama",
            "trainer-qwen2",
            "trainer-gpt_neox",
            "trainer-opt",
            "trainer-bert",
            "trainer-t5",
            "trainer-plain",
        )
    },
    **{name: _TRAINER_RANK_TOKENS for name in ("trainer-hub-ranktok", "trainer-llama-ranktok")},
    "accelerate": LoopTemplate(
        "accelerate accumulate()",
        ("accelerate",),
        accelerate.IMPORTS,
        accelerate.ACCUMULATE,
        accelerate.ACCUMULATE_RESUME,
        ranks=accelerate.ACCUMULATE,
    ),
    "accelerate-variable": LoopTemplate(
        "accelerate (variable-size guide)",
        ("accelerate",),
        accelerate.IMPORTS,
        accelerate.VARIABLE,
        accelerate.VARIABLE_RESUME,
        ranks=accelerate.VARIABLE,
    ),
    "lightning": LoopTemplate(
        "Lightning accumulate_grad_batches",
        _LIGHTNING,
        lightning.IMPORTS,
        lightning.AUTOMATIC,
        lightning.AUTOMATIC_RESUME,
        lightning.RESUME_IMPORTS,
        ranks=lightning.AUTOMATIC_RANKS,
    ),
    "lightning-manual": LoopTemplate(
        "Lightning manual optimisation",
        _LIGHTNING,
        lightning.IMPORTS,
        lightning.MANUAL,
        lightning.MANUAL_RESUME,
        lightning.RESUME_IMPORTS,
        ranks=lightning.MANUAL_RANKS,
    ),
    "litgpt": LoopTemplate(
        "litgpt fit (Fabric, 32-true)",
        _LITGPT,
        litgpt.IMPORTS,
        litgpt.BODY,
        ranks=litgpt.RANKS,
    ),
    "litgpt-bf16-mixed": LoopTemplate(
        "litgpt fit (Fabric, bf16-mixed)",
        _LITGPT,
        litgpt.IMPORTS,
        litgpt.BF16_BODY,
        ranks=litgpt.BF16_RANKS,
    ),
    "keras": LoopTemplate(
        "Keras SGD(gradient_accumulation_steps=K)", ("keras",), keras.IMPORTS, keras.BODY
    ),
    "deepspeed": LoopTemplate(
        "DeepSpeed engine (ZeRO 0)",
        ("deepspeed",),
        deepspeed.IMPORTS,
        deepspeed.BODY,
        ranks=deepspeed.RANKS,
    ),
    "deepspeed-zero1": LoopTemplate(
        "DeepSpeed engine (ZeRO 1)",
        ("deepspeed",),
        deepspeed.IMPORTS,
        deepspeed.ZERO1,
        ranks=deepspeed.ZERO1_RANKS,
    ),
    **{name: _LORA for name in ("peft-lora-gpt2", "peft-lora-llama")},
    "torchtune": LoopTemplate(
        "torchtune full_finetune recipe",
        ("torchtune", "torchao", "torchdata"),
        torchtune.IMPORTS,
        torchtune.BODY,
        ranks=torchtune.RANKS,
        ranks_imports=torchtune.RANKS_IMPORTS,
    ),
    "trl-sft": LoopTemplate("TRL SFTTrainer", _TRL, trl.IMPORTS, trl.PADDING),
    "trl-sft-packing": LoopTemplate(
        "TRL SFTTrainer (packing)",
        _TRL,
        trl.PACKING_IMPORTS,
        trl.PACKING,
        window_note="Packing puts the window's sequences into fewer rows, and the loop "
        "accumulates over those rows (gradient_accumulation_steps = the row count: see the "
        "printed count).",
    ),
    "olmo-core": LoopTemplate(
        "OLMo-core TransformerTrainModule.train_batch",
        ("ai2-olmo-core",),
        olmo_core.IMPORTS,
        olmo_core.BODY,
        ranks=olmo_core.RANKS,
        ranks_imports=olmo_core.RANKS_IMPORTS,
    ),
    "nanogpt": LoopTemplate(
        "nanoGPT train.py",
        (),
        (),
        nanogpt.BODY,
        ranks=nanogpt.RANKS,
        ranks_imports=nanogpt.RANKS_IMPORTS,
    ),
    "pixparse": LoopTemplate(
        "pixparse loss /= accum_steps + NativeScaler",
        (),
        (),
        pixparse.BODY,
        pixparse.RESUME,
        pixparse.RESUME_IMPORTS,
        ranks=pixparse.RANKS,
        ranks_imports=pixparse.RANKS_IMPORTS,
    ),
    "plain": LoopTemplate(
        "plain PyTorch",
        (),
        (),
        plain.BODY,
        plain.RESUME,
        plain.RESUME_IMPORTS,
        ranks=plain.RANKS,
        ranks_imports=plain.RANKS_IMPORTS,
    ),
}
"""Templates by adapter name; an adapter without one gets no reproducer."""
