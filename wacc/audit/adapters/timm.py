"""The pixparse/timm loop (the common ``loss /= accum_steps`` loop of pixparse's
``task_cruller_finetune_*.py``): per microbatch ``loss = model(...)`` mean loss, ``loss /=
accum_steps``, then ``timm.utils.NativeScaler()(loss, optimizer, parameters=model.parameters(),
need_update=need_update)`` with ``need_update`` true on the window's last microbatch
(``NativeScaler`` = ``torch.amp.GradScaler``: ``scale(loss).backward()``, and on update
``step(optimizer)`` which unscales first).  ``NativeScaler`` is built for ``device="cpu"`` on a
CPU run.  No fixed loss scale can be set: ``NativeScaler`` builds a dynamic ``GradScaler`` with its
defaults (initial scale 2**16) and takes no scale argument.  Checkpoint: the model's and
``NativeScaler.state_dict()``.  Written against timm 1.0.31 but NOT run here: timm imports
torchvision, which must be a build matching the installed torch (the registry's torchvision for
torch 2.13 is CUDA-only and fails to import on a CPU torch: the audit then reports timm "not
importable").  Float16 (``task.fp16``): pixparse's ``amp`` path — the forward under
``torch.autocast("cpu", dtype=torch.float16)``, the same ``NativeScaler`` call (its
``GradScaler.step`` skips the update on NaN/inf and backs off), ``SGD(lr=task.learning_rate)``;
the scale before/after is ``NativeScaler._scaler.get_scale()``.  Not run here either.
"""

from __future__ import annotations

import torch

from wacc.audit.models import logits_of
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER"]


def run(task: LoopTask) -> LoopRun:
    """The pixparse loop of the module docstring."""
    from timm.utils import NativeScaler

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, NativeScaler]:
        model = task.build_model()
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
        task.hook_optimizer(optimizer, model)
        scaler = NativeScaler(device="cpu")
        return model, optimizer, scaler

    model, optimizer, scaler = fresh()
    before = float(scaler._scaler.get_scale()) if task.fp16 else 0.0  # the wrapped GradScaler
    data = task.dataset
    accum_steps = task.num_microbatches
    for index in range(len(data)):
        if task.checkpoint_after == index:
            path = task.workdir / "timm_checkpoint.pt"
            torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, path)
            model, optimizer, scaler = fresh()
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            scaler.load_state_dict(state["scaler"])
        batch = data[index]
        need_update = index + 1 == accum_steps
        with torch.autocast("cpu", dtype=torch.float16, enabled=task.fp16):
            out = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])
        logits_of(out)  # the loop trains on the model's own loss
        loss = out["loss"]
        if accum_steps > 1:
            loss /= accum_steps
        scaler(loss, optimizer, parameters=model.parameters(), need_update=need_update)
    if task.fp16:
        return LoopRun(counted_tokens=None, loss_scales=(before, float(scaler._scaler.get_scale())))
    return LoopRun(counted_tokens=None)


ADAPTER = Adapter(
    name="timm",
    title="pixparse/timm loss /= accum_steps + NativeScaler",
    requires=("timm", "timm.utils"),
    model="plain",
    code_path="loss /= accum_steps; timm.utils.NativeScaler(..., need_update=last)",
    checked="timm 1.0.31 (not importable here: not run)",
    loss_scale=False,
    checkpoint=None,
    run=run,
    fp16=None,
)
