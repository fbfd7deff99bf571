"""Every built-in loop adapter, by CLI name (one module per framework)."""

from __future__ import annotations

from wacc.audit.adapters import (
    accelerate,
    deepspeed,
    keras,
    lightning,
    nanogpt,
    peft_lora,
    plain,
    pytorch_native,
    timm,
    trainer,
    trl_sft,
    wacc_torch,
)
from wacc.audit.protocol import Adapter

__all__ = ["ADAPTERS"]

ADAPTERS: dict[str, Adapter] = {
    adapter.name: adapter
    for adapter in (
        trainer.HUB,
        trainer.LLAMA,
        trainer.QWEN2,
        trainer.GPT_NEOX,
        trainer.OPT,
        trainer.BERT,
        trainer.T5,
        trainer.PLAIN,
        accelerate.ACCUMULATE,
        accelerate.VARIABLE,
        lightning.AUTOMATIC,
        lightning.MANUAL,
        keras.ADAPTER,
        deepspeed.ADAPTER,
        peft_lora.LORA_GPT2,
        peft_lora.LORA_LLAMA,
        trl_sft.PADDING,
        trl_sft.PADDING_FP32,
        trl_sft.PACKING,
        pytorch_native.TORCHTUNE,
        pytorch_native.TORCHTITAN,
        timm.ADAPTER,
        timm.PIXPARSE,
        nanogpt.ADAPTER,
        plain.ADAPTER,
        wacc_torch.MEAN,
        wacc_torch.SUM,
        wacc_torch.FSDP,
    )
}
"""Built-in adapters in report order."""
