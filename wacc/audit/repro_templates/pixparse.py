"""The pixparse loop (``loss /= accum_steps``, then timm's ``NativeScaler`` with ``need_update``
on the window's last microbatch; see :mod:`wacc.audit.adapters.timm`), written out: timm's
``NativeScaler`` is a ``torch.amp.GradScaler`` that scales each loss for its backward and steps
(unscaling first) when ``need_update``; nothing to import but torch.  Its resume saves and loads
the model's and the scaler's ``state_dict`` (``.grad`` is in neither) after ``CHECKPOINT_AFTER``
microbatches, as the adapter does."""

from __future__ import annotations

__all__ = ["BODY", "RANKS", "RANKS_IMPORTS", "RESUME", "RESUME_IMPORTS"]

RESUME_IMPORTS = ("import os", "import tempfile")

_FRESH = """
captured = []


def fresh():
    model = build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # pixparse: AdamW; read before it steps
    optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
    scaler = torch.amp.GradScaler("cpu")  # what timm.utils.NativeScaler(device="cpu") wraps
    return model, optimizer, scaler


model, optimizer, scaler = fresh()
accum_steps = len(batches)
for index, batch in enumerate(batches):  # task_cruller_finetune_*.py: _forward, _backward
"""

_RESTART = """\
    if index == CHECKPOINT_AFTER:  # checkpoint mid-window, restart from it in fresh objects
        path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
        torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, path)
        model, optimizer, scaler = fresh()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        scaler.load_state_dict(state["scaler"])
"""

_STEP = """\
    loss = model(batch["input_ids"][None], batch["labels"][None])["loss"]  # the mean token loss
    if accum_steps > 1:
        loss /= accum_steps
    scaler.scale(loss).backward()  # NativeScaler(loss, optimizer, need_update=...)
    if index + 1 == accum_steps:  # need_update: unscale, step, update
        scaler.step(optimizer)
        scaler.update()
grads = captured[0]
counted = "each microbatch's own mean"
"""

BODY = _FRESH + _STEP
RESUME = _FRESH + _RESTART + _STEP

RANKS_IMPORTS = (
    "import contextlib",
    "from torch.nn.parallel import DistributedDataParallel as DDP",
)
# Across ranks: the task's DDP idiom (task_cruller_finetune_docvqa.py L342-376): the model in
# DDP, `has_no_sync`, every microbatch but the window's last under no_sync(), the last one's
# backward all-reducing (DDP averages the ranks), `loss /= accum_steps` on each mean.
RANKS = """
captured = []
raw_model = build_model()
raw_model.train()
optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.0)  # pixparse: AdamW; read before it steps
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(raw_model)))
scaler = torch.amp.GradScaler("cpu")  # what timm.utils.NativeScaler(device="cpu") wraps
model = DDP(raw_model, device_ids=None)  # the task's DDP wrapping (device_ids on a GPU)
has_no_sync = hasattr(model, "no_sync")
accum_steps = len(batches)
for index, batch in enumerate(batches):  # task_cruller_finetune_*.py: train_step
    need_update = index + 1 == accum_steps
    with model.no_sync() if has_no_sync and not need_update else contextlib.nullcontext():
        loss = model(batch["input_ids"][None], batch["labels"][None])["loss"]  # the mean loss
        if accum_steps > 1:
            loss /= accum_steps
        scaler.scale(loss).backward()  # NativeScaler(loss, optimizer, need_update=...)
    if need_update:  # unscale, step, update
        scaler.step(optimizer)
        scaler.update()
grads = captured[0]
counted = "each microbatch's own mean"
"""
