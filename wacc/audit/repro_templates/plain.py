"""Plain PyTorch's correct loop (:mod:`wacc.audit.adapters.plain`): ``loss_sum / known_total``
per microbatch, one ``optimizer.step()``; its resume saves and loads the model's and the
optimizer's ``state_dict`` (``.grad`` is in neither) after ``CHECKPOINT_AFTER`` microbatches."""

from __future__ import annotations

__all__ = ["BODY", "RANKS", "RANKS_IMPORTS", "RESUME", "RESUME_IMPORTS"]

RESUME_IMPORTS = ("import os", "import tempfile")

_FRESH = """
captured = []


def fresh():
    model = build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
    return model, optimizer


model, optimizer = fresh()
known_total = sum(targets)
for index, batch in enumerate(batches):
"""

_RESTART = """\
    if index == CHECKPOINT_AFTER:  # checkpoint mid-window, restart from it in fresh objects
        path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        model, optimizer = fresh()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
"""

_STEP = """\
    (token_loss_sum(model, {k: v[None] for k, v in batch.items()}) / known_total).backward()
optimizer.step()
grads = captured[0]
counted = f"known total {known_total}"
"""

BODY = _FRESH + _STEP
RESUME = _FRESH + _RESTART + _STEP

RANKS_IMPORTS = (
    "import contextlib",
    "import torch.distributed as dist",
    "from torch.nn.parallel import DistributedDataParallel",
)
RANKS = """
model = build_model()
model.train()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
captured = []
optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
ddp = DistributedDataParallel(model)  # its reducer averages the ranks' gradients
known_total = sum(targets)  # this rank's window only
for index, batch in enumerate(batches):
    last = index == len(batches) - 1  # the last backward all-reduces, the others accumulate
    with contextlib.nullcontext() if last else ddp.no_sync():
        (token_loss_sum(ddp, {k: v[None] for k, v in batch.items()}) / known_total).backward()
optimizer.step()
grads = captured[0]
counted = f"its own known total {known_total}"
"""
