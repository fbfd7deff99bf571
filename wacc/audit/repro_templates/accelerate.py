"""``accelerate``'s two documented accumulation loops (:mod:`wacc.audit.adapters.accelerate`):
``accumulate()`` and the variable-size guide's ``num_items_in_batch``, each also with
``save_state`` / ``load_state`` into fresh objects after ``CHECKPOINT_AFTER`` microbatches.  The
same text runs across ranks (``Accelerator(cpu=True)`` reads the torchrun world and ``prepare``
wraps the model in DDP; each rank reads its own window); the guide's skeleton runs every batch
but the window's last under ``no_sync`` there."""

from __future__ import annotations

__all__ = ["ACCUMULATE", "ACCUMULATE_RESUME", "IMPORTS", "VARIABLE", "VARIABLE_RESUME"]

IMPORTS = ("import contextlib", "import tempfile", "from accelerate import Accelerator")

_FRESH = """
captured = []


def fresh():
    accelerator = Accelerator(gradient_accumulation_steps=len(batches), cpu=True)
    model = build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    # Runs only when accelerate really steps: the window's gradient.
    optimizer.register_step_pre_hook(lambda *_: captured.append(gradient(model)))
    return (accelerator, *accelerator.prepare(model, optimizer))


accelerator, model, optimizer = fresh()
"""

_RESTART = """\
    if index == CHECKPOINT_AFTER:  # checkpoint mid-window, restart from it in fresh objects
        state = tempfile.mkdtemp()
        accelerator.save_state(state)
        accelerator, model, optimizer = fresh()
        accelerator.load_state(state)
"""


def _accumulate(restart: str) -> str:
    return (
        _FRESH
        + """for index, batch in enumerate(batches):
"""
        + restart
        + """    with accelerator.accumulate(model):
        loss = model(**{k: v[None] for k, v in batch.items()}).loss  # the microbatch's mean
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
grads = captured[0]
counted = "each microbatch's own mean"
"""
    )


def _variable(restart: str) -> str:
    return (
        _FRESH
        + """# The guide's fix for "training samples of variable size".
num_items = sum(batch["labels"].ne(-100).sum() for batch in batches)
num_items_in_batch = accelerator.gather(num_items).sum().item()
steps = len(batches)  # gradient_accumulation_steps
for index, batch in enumerate(batches):
"""
        + restart
        + """    # Across ranks the guide's skeleton all-reduces (DDP) on the last batch only.
    alone = index == len(batches) - 1 or accelerator.num_processes == 1
    with contextlib.nullcontext() if alone else model.no_sync():
        loss = token_loss_sum(model, {k: v[None] for k, v in batch.items()})
        accelerator.backward(loss * steps * accelerator.num_processes / num_items_in_batch)
optimizer.step()
optimizer.zero_grad()
grads = captured[0]
counted = f"num_items_in_batch {num_items_in_batch}"
"""
    )


ACCUMULATE = _accumulate("")
ACCUMULATE_RESUME = _accumulate(_RESTART)
VARIABLE = _variable("")
VARIABLE_RESUME = _variable(_RESTART)
