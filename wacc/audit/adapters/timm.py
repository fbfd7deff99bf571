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
importable").  The ``pixparse`` loop is its stand-in here: the same loop with
:class:`NativeScaler`, ``timm.utils.NativeScaler`` (``timm/utils/cuda.py``, timm 1.0.x) restated
on ``torch.amp.GradScaler`` without its gradient clipping (pixparse's ``clip_grad_value`` is off by
default), so that the loop the project started from runs without torchvision.  Float16
(``task.fp16``): pixparse's ``amp`` path — the forward under
``torch.autocast("cpu", dtype=torch.float16)``, the same ``NativeScaler`` call (its
``GradScaler.step`` skips the update on NaN/inf and backs off), ``SGD(lr=task.learning_rate)``;
the scale before/after is ``NativeScaler._scaler.get_scale()``.  Not run here either.

Across ranks (``pixparse``, ``task.world_size > 1``, a torchrun world): the task's DDP idiom —
``torch.distributed.init_process_group(task.backend)``, the model wrapped in
``DistributedDataParallel`` (``device_ids=None`` on a CPU), ``has_no_sync = hasattr(model,
"no_sync")`` and ``train_step``'s ``if self.has_no_sync and not need_update: with
self.model.no_sync(): ...`` (the seed's ``task_cruller_finetune_docvqa.py`` L342-376,
``task_cruller_finetune_xent.py`` L257-294): every microbatch but the window's last accumulates
locally, the last one's backward all-reduces.  What decides the weighting across ranks: ``loss
/= accum_steps`` on each microbatch's *mean* (the same lines) and DDP's reducer averaging the
ranks (``Reducer::mark_variable_ready_dense`` divides by the world size): every microbatch of
every rank weighs 1 / (N K), whatever its tokens.  No prediction from per-rank totals applies
(it weighs microbatches, not ranks, equally: ``weighs_ranks_equally`` is False); measured at
N = 2 (ranks of 211 and 17 tokens in the test's windows), the float64 gradient equals the
equal-microbatch one to rounding (``tests/wacc/audit/test_ranks_wacc.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from wacc.audit.models import logits_of
from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER", "PIXPARSE", "NativeScaler"]


class NativeScaler:
    """``timm.utils.NativeScaler`` as timm 1.0.x writes it, without the clipping branch: a
    ``torch.amp.GradScaler`` that scales each loss for its backward and, when ``need_update``,
    steps the optimizer (which unscales first, and skips the step on NaN/inf) and updates."""

    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda") -> None:
        self._scaler = torch.amp.GradScaler(device=device)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        parameters: object = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self) -> dict[str, object]:
        return self._scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self._scaler.load_state_dict(state_dict)


def _timm_scaler() -> NativeScaler:
    from timm.utils import NativeScaler as TimmScaler

    scaler: NativeScaler = TimmScaler(device="cpu")
    return scaler


def run(task: LoopTask, make_scaler: Callable[[], NativeScaler] = _timm_scaler) -> LoopRun:
    """The pixparse loop of the module docstring, with timm's ``NativeScaler`` (or the
    stand-in's, ``make_scaler``)."""

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, NativeScaler]:
        model = task.build_model()
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
        task.hook_optimizer(optimizer, model)
        return model, optimizer, make_scaler()

    ddp = task.world_size > 1
    if ddp:  # the task's distributed setup, as torchrun starts it
        torch.distributed.init_process_group(backend=task.backend)
    model, optimizer, scaler = fresh()
    # pixparse's task wraps its model in DDP and asks `has_no_sync` (module docstring).
    train_model: torch.nn.Module = DDP(model, device_ids=None) if ddp else model
    has_no_sync = hasattr(train_model, "no_sync")
    before = float(scaler._scaler.get_scale()) if task.fp16 else 0.0  # the wrapped GradScaler
    data = task.dataset
    accum_steps = task.num_microbatches
    for index in range(len(data)):
        if task.checkpoint_after == index:
            path = task.workdir / "pixparse_checkpoint.pt"
            torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, path)
            model, optimizer, scaler = fresh()
            train_model = DDP(model, device_ids=None) if ddp else model
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            scaler.load_state_dict(state["scaler"])
        batch = data[index]
        need_update = index + 1 == accum_steps
        # pixparse's train_step: `if self.has_no_sync and not need_update: with no_sync(): ...`
        sync: AbstractContextManager[object] = nullcontext()
        if has_no_sync and not need_update:
            assert isinstance(train_model, DDP)
            sync = train_model.no_sync()
        with sync:
            with torch.autocast("cpu", dtype=torch.float16, enabled=task.fp16):
                ids, labels = batch["input_ids"][None], batch["labels"][None]
                out = train_model(input_ids=ids, labels=labels)
            logits_of(out)  # the loop trains on the model's own loss
            loss = out["loss"]
            if accum_steps > 1:
                loss /= accum_steps
            scaler(loss, optimizer, parameters=train_model.parameters(), need_update=need_update)
    if task.fp16:
        return LoopRun(counted_tokens=None, loss_scales=(before, float(scaler._scaler.get_scale())))
    return LoopRun(counted_tokens=None)


_CAUSE = (
    "pixparse task_cruller_finetune_*.py train_step divides each microbatch's mean loss by "
    "accum_steps (`loss /= accum_steps`) before NativeScaler's backward: every microbatch weighs "
    "1/K whatever its token count (across ranks, DDP's average of the last microbatch's "
    "all-reduce makes it 1/(N K))."
)
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
    cause=_CAUSE,
)


def _pixparse(task: LoopTask) -> LoopRun:
    return run(task, lambda: NativeScaler(device="cpu"))


PIXPARSE = Adapter(
    name="pixparse",
    title="pixparse loss /= accum_steps + NativeScaler (timm's, restated: no torchvision)",
    requires=("torch",),
    model="plain",
    code_path="loss /= accum_steps; NativeScaler(..., need_update=last) as timm.utils writes it",
    checked="torch 2.13.0 (timm.utils.NativeScaler of timm 1.0.x restated)",
    loss_scale=False,
    checkpoint=None,
    run=_pixparse,
    fp16=None,
    ranks=True,
    fixed_by="pixparse+wacc",
    cause=_CAUSE,
)
