"""The loop-adapter protocol: how the audit drives one training loop on one window.

An adapter is an :class:`Adapter`: metadata plus ``run(task) -> LoopRun``.  ``run`` must, using
only the framework's public code path:

1. build its model with ``task.build_model()`` (fresh, identical weights every call, in
   ``task.dtype``) and read the microbatches from ``task.dataset`` in order (a map-style
   ``torch.utils.data.Dataset`` of dicts ``input_ids``/``labels``, shape ``[L]``; batch size 1;
   a masked-LM or seq2seq model's microbatches also hold ``attention_mask`` and use that family's
   labels: :class:`wacc.audit.models.Family`);
2. run one optimizer step over the whole window, the loss multiplied by ``task.loss_scale`` when
   the loop can be given a fixed loss scale (``Adapter.loss_scale``), which it must divide out;
3. call ``task.record_gradients(model)`` right before the optimizer changes anything (a framework
   callback, or ``task.hook_optimizer(optimizer, model)``: a ``torch.optim`` step pre-hook);
4. when ``task.checkpoint_after`` is an int ``c``: after ``c`` microbatches, checkpoint with the
   framework's own call into ``task.workdir``, drop every object, rebuild them from scratch
   (``task.build_model()`` again), restore the checkpoint and run the remaining microbatches
   (``task.dataset`` from index ``c``: the data position is the loop's).  A framework that can
   only checkpoint at optimizer steps may instead resume from its last step checkpoint and
   recompute the window, and say so with ``LoopRun(resume="replay")``;
5. return :class:`LoopRun`: the token count it divided by (None when it never divides by one);
6. when ``task.fp16`` (only if ``Adapter.fp16`` is None): run the loop's own float16
   mixed-precision code path instead — float32 parameters (``task.dtype``), the forward under
   float16 autocast (or whatever the framework's fp16 switch does) and the loop's dynamic loss
   scaler, if it has one, stepping or skipping as that scaler decides; build the optimizer with
   ``lr=task.learning_rate`` (> 0 then, so that an applied step shows in the parameters); and
   return ``LoopRun(loss_scales=(before, after))``, the scaler's scale around the window, or
   ``None`` with a ``note`` saying why there is none.  The audit reads the outcome from the
   parameters of the last model ``task.build_model()`` returned (compared with a fresh one) after
   ``run`` returns; ``task.record_gradients`` is then optional (a skipped step never calls it).

A user loop is ``module:function`` with ``function(task: LoopTask) -> LoopRun``; optional function
attributes ``loss_scale`` / ``checkpoint`` / ``fp16`` (bool) and ``model`` (a name of
:data:`wacc.audit.models.MODEL_KINDS`, default ``"plain"``) say what it supports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wacc.audit.models import ModelSpec, SpikeProbe, add_spike
from wacc.audit.windows import Window

__all__ = ["FP16_LEARNING_RATE", "Adapter", "LoopRun", "LoopTask", "WindowDataset", "user_adapter"]

FP16_LEARNING_RATE = 1.0  # SGD's lr in a float16 run: an applied step changes the parameters


class WindowDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The window's microbatches as a map-style dataset that logs every fetch (in order); each in
    the format of the model's family (``prepare``; default: as the window holds it)."""

    def __init__(
        self,
        window: Window,
        log: list[int],
        prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self._window = window
        self._log = log
        self._prepare = prepare

    def __len__(self) -> int:
        return len(self._window.microbatches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self._log.append(index)
        microbatch = self._window.microbatches[index]
        if self._prepare is not None:
            return self._prepare(microbatch)
        return {k: v.clone() for k, v in microbatch.items()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self[i] for i in range(len(self)))


@dataclass
class LoopTask:
    """One run of one loop on one window (built by the runner; see the module docstring)."""

    model_spec: ModelSpec
    dtype: torch.dtype
    window: Window
    workdir: Path
    loss_scale: float = 1.0
    checkpoint_after: int | None = None
    weights_dtype: torch.dtype | None = None  # the audited dtype when ``dtype`` is its float64 run
    fetch_log: list[int] = field(default_factory=list)
    fetched_at_first_backward: int | None = None
    captured: dict[str, torch.Tensor] | None = None
    steps_seen: int = 0
    fp16: bool = False  # run the loop's own float16 mixed-precision path (step 6 of the docstring)
    models: list[nn.Module] = field(default_factory=list)  # every model build_model() returned
    spikes: list[SpikeProbe] = field(default_factory=list)  # their float16 spike probes (fp16)
    world_size: int = 1  # ranks of the data-parallel world this run is one rank of
    rank: int = 0  # this process's rank (its window is ``window``)
    backend: str = "gloo"  # the torch.distributed backend the loop brings its group up with

    @property
    def learning_rate(self) -> float:
        """The loop's SGD learning rate: 0 (the audit reads gradients), or
        :data:`FP16_LEARNING_RATE` in a float16 run (the outcome is read from the parameters)."""
        return FP16_LEARNING_RATE if self.fp16 else 0.0

    @property
    def dataset(self) -> WindowDataset:
        """The window's microbatches in the model family's format (each fetch is logged)."""
        return WindowDataset(self.window, self.fetch_log, self.model_spec.prepare)

    @property
    def num_microbatches(self) -> int:
        """K, the window's microbatches (one optimizer step)."""
        return len(self.window.microbatches)

    def build_model(self) -> nn.Module:
        """A fresh model in ``dtype`` (with the weights rounded to ``weights_dtype`` first, when
        given); a gradient hook notes how much data was read by then.  In a float16 run the model
        carries the overflow spike (:func:`wacc.audit.models.add_spike`)."""
        model = self.model_spec.build(self.weights_dtype or self.dtype).to(self.dtype)
        self.models.append(model)
        if self.fp16:
            self.spikes.append(add_spike(model))

        def note(grad: torch.Tensor) -> None:
            if self.fetched_at_first_backward is None:
                self.fetched_at_first_backward = len(set(self.fetch_log))

        for parameter in model.parameters():
            if parameter.requires_grad:  # a frozen one (a LoRA model's base) takes no hook
                parameter.register_hook(note)  # observes only: returns None, unchanged gradient
        return model

    def record_gradients(self, model: nn.Module) -> None:
        """Copy every parameter's ``.grad`` now (the first optimizer step of the window only)."""
        self.steps_seen += 1
        if self.captured is not None:
            return
        self.captured = {
            name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in model.named_parameters()
        }

    def hook_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Register a ``torch.optim`` step pre-hook that records the gradients."""
        optimizer.register_step_pre_hook(lambda *_: self.record_gradients(model))


@dataclass(frozen=True)
class LoopRun:
    """What a loop reports about its own run."""

    counted_tokens: float | None  # the window count it divided by; None: it never divides by one
    note: str = ""  # anything the loop wants in the report
    resume: str = "restore"  # "restore": resumes the pending window; "replay": recomputes it
    loss_scales: tuple[float, float] | None = None  # fp16 run: the scaler's scale before, after


@dataclass(frozen=True)
class Adapter:
    """A loop the audit can run (see the module docstring)."""

    name: str  # CLI name
    title: str  # one line for the table
    requires: tuple[str, ...]  # importable modules it needs (distribution name first: its version)
    model: str  # a name of MODEL_KINDS
    code_path: str  # the exact public code path it drives
    checked: str  # the version range it was checked against
    loss_scale: bool  # a fixed loss scale can be set
    checkpoint: str | None  # None: offers a mid-window checkpoint call; else why not
    run: Callable[[LoopTask], LoopRun]
    fp16: str | None = "no float16 mode"  # None: runs its float16 path when task.fp16; else why not
    unsupported: str | None = None  # why this loop is never run here (its rows say so)
    ranks: bool | str = False  # True: runs with task.world_size > 1; a string: why it cannot

    def unavailable(self) -> str | None:
        """None when every required module imports; else "not run: …" (``unsupported``), "not
        installed" or "not importable: …"."""
        if self.unsupported is not None:
            return f"not run: {self.unsupported}"
        for module in self.requires:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name is not None and module.split(".")[0] == exc.name.split(".")[0]:
                    return "not installed"
                return f"not importable: ModuleNotFoundError: {exc.name}"
            except Exception as exc:  # a broken install (e.g. timm with a CUDA-only torchvision)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                return f"not importable: {type(exc).__name__}: {first}"[:160]
        return None

    def version(self) -> str:
        """The installed version of the first required distribution ('' when not installed)."""
        from importlib import metadata

        if not self.requires:
            return ""
        top = self.requires[0].split(".")[0]
        # wacc_torch ships in the wacc distribution: map the module to whatever installed it.
        distribution = metadata.packages_distributions().get(top, [top])[0]
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return ""


def user_adapter(spec: str) -> Adapter:
    """An :class:`Adapter` for ``module:function`` or ``path/file.py:function``, imported by the
    one rule of :mod:`wacc.spec` (``ValueError`` naming what is wrong)."""
    from wacc.errors import UsageError
    from wacc.spec import import_target

    try:
        function: Any = import_target(spec, what="user loop")
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    if not callable(function):
        raise ValueError(f"user loop {spec!r} is not callable (a function(task) -> LoopRun)")
    from wacc.audit.models import MODEL_KINDS

    model = getattr(function, "model", "plain")
    if not isinstance(model, str) or model not in MODEL_KINDS:  # a list is not even hashable
        raise ValueError(f"user loop {spec!r}: model {model!r} is not one of {sorted(MODEL_KINDS)}")
    flags = {name: getattr(function, name, False) for name in ("loss_scale", "checkpoint", "fp16")}
    for name, value in flags.items():
        if not isinstance(value, bool):  # "no" or a 0-d tensor would be read as something else
            raise ValueError(f"user loop {spec!r}: {name} {value!r} is not True or False")
    checkpoint, fp16 = flags["checkpoint"], flags["fp16"]
    doc = function.__doc__ if isinstance(function.__doc__, str) else ""
    return Adapter(
        name=spec,
        title=doc.strip().splitlines()[0][:60] if doc.strip() else spec,
        requires=(),
        model=model,
        code_path=spec,
        checked="",
        loss_scale=flags["loss_scale"],
        checkpoint=None if checkpoint else "not declared by the loop",
        run=function,
        fp16=None if fp16 else "not settable",
    )
