"""DeepSpeed's engine (:mod:`wacc.audit.adapters.deepspeed`): ``deepspeed.initialize`` on the CPU
(gloo), the "Getting Started" loop ``engine(batch)``, ``engine.backward(loss)``,
``engine.step()``.  ``BODY``: ZeRO 0 in one process, the gradient read in a step pre-hook on the
client ``SGD`` (ZeRO 0 steps it itself, on the accumulation boundary); ``ZERO1``: ZeRO 1 in one
process, read as ``ZERO1_RANKS`` reads it.  Across ranks (the torchrun
world as torchrun set it): ``RANKS`` (ZeRO 0, the same hook) and ``ZERO1_RANKS`` (ZeRO 1 steps the
client ``SGD`` on its flat partition: the full gradient is read in the loop right after the
boundary backward, through ``deepspeed.utils.safe_get_full_grad``).  The float64 run needs an
accelerator whose all-reduce lets float64 gradients through, as the adapter's float64 copy has."""

from __future__ import annotations

__all__ = ["BODY", "IMPORTS", "RANKS", "ZERO1", "ZERO1_RANKS"]

IMPORTS = ("import os",)

_ALONE = """
# One CPU process: DeepSpeed's CPU accelerator (gloo) and the world init_distributed reads.
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")"""
_WORLD = """
os.environ["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's CPU accelerator (gloo); torchrun's world"""
_ENGINE = """
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
{hook}config = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": len(batches),
    "zero_optimization": {"stage": {stage}},{untested}
    "gradient_clipping": 0.0,  # DeepSpeed's default 1.0 would clip the gradient read here
}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
for batch in batches:
    loss = engine(**{k: v[None] for k, v in batch.items()})["loss"]  # the microbatch's mean
    engine.backward(loss){full}
    engine.step()
grads = captured[0]
counted = "each microbatch's own mean, / gradient_accumulation_steps"
"""
_HOOK = "optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))\n"
_UNTESTED = """
    "zero_allow_untested_optimizer": True,  # SGD is not on ZeRO's tested list"""
_FULL = """
    if engine.is_gradient_accumulation_boundary():  # reduced; step() consumes it next
        full = [deepspeed.utils.safe_get_full_grad(p) for p in model.parameters()]
        full = [torch.zeros_like(p) if g is None else g for g, p in zip(full, model.parameters())]
        captured.append(torch.cat([g.detach().double().flatten() for g in full]))"""


def _body(world: str, stage: int) -> str:
    return (
        (world + _ENGINE)
        .replace("{hook}", _HOOK if stage == 0 else "")
        .replace("{stage}", str(stage))
        .replace("{untested}", _UNTESTED if stage > 0 else "")
        .replace("{full}", _FULL if stage > 0 else "")
    )


BODY = _body(_ALONE, 0)
RANKS = _body(_WORLD, 0)
ZERO1 = _body(_ALONE, 1)
ZERO1_RANKS = _body(_WORLD, 1)
