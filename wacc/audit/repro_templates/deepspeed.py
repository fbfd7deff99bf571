"""DeepSpeed's engine (:mod:`wacc.audit.adapters.deepspeed`): ``deepspeed.initialize`` at ZeRO 0
on the CPU (one gloo process), the "Getting Started" loop ``engine(batch)``,
``engine.backward(loss)``, ``engine.step()``; the gradient read in a step pre-hook on the client
``SGD`` (ZeRO 0 steps it itself, on the accumulation boundary).  The float64 run needs an
accelerator whose all-reduce lets float64 gradients through, as the adapter's float64 copy has."""

from __future__ import annotations

__all__ = ["BODY", "IMPORTS"]

IMPORTS = ("import os",)

BODY = """
# One CPU process: DeepSpeed's CPU accelerator (gloo) and the world init_distributed reads.
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from deepspeed.accelerator import set_accelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator


class Float64CPU(CPU_Accelerator):  # else the all-reduce refuses float64 gradients
    def supported_dtypes(self):
        return [*super().supported_dtypes(), torch.float64]


if DTYPE == torch.float64:
    set_accelerator(Float64CPU())
model = build_model()
model.train()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
captured = []
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
config = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": len(batches),
    "zero_optimization": {"stage": 0},
    "gradient_clipping": 0.0,  # DeepSpeed's default 1.0 would clip the gradient read here
}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
for batch in batches:
    loss = engine(**{k: v[None] for k, v in batch.items()})["loss"]  # the microbatch's mean
    engine.backward(loss)
    engine.step()
grads = captured[0]
counted = "each microbatch's own mean, / gradient_accumulation_steps"
"""
