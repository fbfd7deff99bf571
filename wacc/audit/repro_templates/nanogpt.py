"""nanoGPT's ``train.py`` accumulation loop (karpathy/nanoGPT ``3adf61e``, lines 292-314; see
:mod:`wacc.audit.adapters.nanogpt`), written out as the script has it with the window's
microbatches in place of ``get_batch``; nothing to import but torch."""

from __future__ import annotations

__all__ = ["BODY", "RANKS", "RANKS_IMPORTS"]

BODY = """
model = build_model()
model.train()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # train.py: AdamW; read before it steps
captured = []
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
scaler = torch.amp.GradScaler("cpu", enabled=False)  # train.py: enabled=(dtype == 'float16')
gradient_accumulation_steps = len(batches)
for micro_step in range(gradient_accumulation_steps):  # train.py L292-314, grad_clip = 0.0
    X, Y = batches[micro_step]["input_ids"][None], batches[micro_step]["labels"][None]
    loss = model(X, Y)["loss"]  # the microbatch's mean token loss, as GPT.forward returns it
    loss = loss / gradient_accumulation_steps
    scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
grads = captured[0]
counted = "each microbatch's own mean"
"""

RANKS_IMPORTS = (
    "import torch.distributed as dist",
    "from torch.nn.parallel import DistributedDataParallel as DDP",
)
RANKS = """
raw_model = build_model()
raw_model.train()
optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.0)  # train.py: AdamW
captured = []
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(raw_model)))
scaler = torch.amp.GradScaler("cpu", enabled=False)  # train.py: enabled=(dtype == 'float16')
gradient_accumulation_steps = len(batches) * dist.get_world_size()  # the global setting
gradient_accumulation_steps //= dist.get_world_size()  # train.py's DDP setup
model = DDP(raw_model, device_ids=None)  # train.py: device_ids=[ddp_local_rank] (a GPU's)
for micro_step in range(gradient_accumulation_steps):  # train.py L292-314, grad_clip = 0.0
    model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
    X, Y = batches[micro_step]["input_ids"][None], batches[micro_step]["labels"][None]
    loss = model(X, Y)["loss"]  # the microbatch's mean token loss, as GPT.forward returns it
    loss = loss / gradient_accumulation_steps
    scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
grads = captured[0]
counted = "each microbatch's own mean"
"""
