"""Every built-in loop adapter, by CLI name (one module per framework)."""

from __future__ import annotations

from wacc.audit.adapters import (
    accelerate,
    accelerate_wacc,
    deepspeed,
    deepspeed_wacc,
    keras,
    keras_wacc,
    lightning,
    lightning_wacc,
    litgpt,
    litgpt_wacc,
    nanogpt,
    nanogpt_wacc,
    olmo_core,
    olmo_core_wacc,
    peft_lora,
    pixparse_wacc,
    plain,
    timm,
    torchtitan,
    torchtune,
    torchtune_wacc,
    trainer,
    trainer_wacc,
    trl_sft,
    wacc_torch,
)
from wacc.audit.protocol import Adapter, user_adapter

__all__ = ["ADAPTERS", "resolve"]

ADAPTERS: dict[str, Adapter] = {
    adapter.name: adapter
    for adapter in (
        trainer.HUB,
        trainer_wacc.HUB,
        trainer.HUB_RANK_TOKENS,
        trainer_wacc.HUB_RANK_TOKENS,
        trainer.LLAMA,
        trainer.LLAMA_RANK_TOKENS,
        trainer_wacc.LLAMA_RANK_TOKENS,
        trainer.QWEN2,
        trainer.GPT_NEOX,
        trainer.OPT,
        trainer.BERT,
        trainer_wacc.BERT,
        trainer.T5,
        trainer_wacc.T5,
        trainer.PLAIN,
        trainer_wacc.PLAIN,
        accelerate.ACCUMULATE,
        accelerate_wacc.ACCUMULATE,
        accelerate.VARIABLE,
        accelerate_wacc.VARIABLE,
        lightning.AUTOMATIC,
        lightning_wacc.AUTOMATIC,
        lightning.MANUAL,
        lightning_wacc.MANUAL,
        keras.ADAPTER,
        keras_wacc.ADAPTER,
        deepspeed.ADAPTER,
        deepspeed_wacc.ADAPTER,
        deepspeed.ZERO1,
        deepspeed_wacc.ZERO1,
        peft_lora.LORA_GPT2,
        trainer_wacc.LORA_GPT2,
        peft_lora.LORA_LLAMA,
        trl_sft.PADDING,
        trl_sft.PADDING_FP32,
        trl_sft.PACKING,
        torchtune.ADAPTER,
        torchtune_wacc.ADAPTER,
        torchtitan.ADAPTER,
        litgpt.TRUE_32,
        litgpt_wacc.TRUE_32,
        litgpt.BF16_MIXED,
        litgpt_wacc.BF16_MIXED,
        olmo_core.ADAPTER,
        olmo_core_wacc.ADAPTER,
        timm.ADAPTER,
        timm.PIXPARSE,
        pixparse_wacc.ADAPTER,
        nanogpt.ADAPTER,
        nanogpt_wacc.ADAPTER,
        plain.ADAPTER,
        wacc_torch.MEAN,
        wacc_torch.SUM,
        wacc_torch.FSDP,
    )
}
"""Built-in adapters in report order."""


def resolve(name: str) -> Adapter:
    """The adapter a loop's name means: a built-in one by name, else a user loop spec
    (``module:function`` or ``path/file.py:function``, imported by the rule of
    :func:`wacc.audit.protocol.user_adapter`)."""
    if name in ADAPTERS:
        return ADAPTERS[name]
    return user_adapter(name)
