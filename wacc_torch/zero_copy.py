"""The zero-copy mode: autograd's backward accumulates straight into ``.grad`` (semantics §5, §6).

``WeightedGradientsAccumulator(..., zero_copy=True)`` keeps no second copy of the gradients: each
tracked parameter's ``.grad`` *is* its pending buffer. Inside ``with acc.microbatch(module,
weight=w, kind=...)`` a pre-hook on every tracked parameter's ``AccumulateGrad`` node receives the
microbatch's gradient ``g`` (autograd has already summed every use of the parameter in the graph)
and adds it into the buffer itself with the reproducible order — ``round_D(buf + g)`` for a sum,
``round_D(buf + round_D(g * w_D))`` for a mean (``buf.add_(g, alpha=w_D)`` when fused) — then hands
``AccumulateGrad`` nothing to add. The buffer starts at +0.0, as in the buffered mode, so the first
microbatch of a window gives the same bits (a stolen gradient would keep its -0.0).

Every rule of the mode is in this file. What it refuses:

* :class:`~wacc_torch.errors.ZeroCopyError` — what the mode cannot do, raised before anything
  changed (remove the cause and call again): a tracked parameter whose dtype is not D (autograd
  hands over gradients in the parameter's dtype, which could not be converted to D first); a
  ``.grad`` the window does not own on a parameter without a pending buffer (a stale gradient
  before the window's first block, another tool's tensor; found at entry and, mid-window, by
  ``finish_*`` and ``state_dict*``); a nested block; DDP outside ``no_sync()``; FSDP
  (``fully_shard``) anywhere in the module, also applied mid-window; the buffered calls on a
  zero-copy accumulator (``microbatch`` on a buffered one). Inside a block, from the backward: a
  second gradient for one parameter (a second backward, ``retain_graph``, or reentrant activation
  checkpointing — ``torch.utils.checkpoint(..., use_reentrant=True)`` — where the parameter is used
  both inside and outside the checkpointed segment: autograd then hands it two gradients instead of
  their sum), ``create_graph=True``, a sparse gradient, a parameter whose dtype became another.
* :class:`~wacc_torch.errors.BrokenWindowError` — the window no longer holds its sums in
  ``.grad``: a pending ``.grad`` changed in place (``zero_grad(set_to_none=False)``, gradient
  clipping, a plain backward), replaced by another tensor, or removed (``zero_grad()``), or its
  parameter re-registered in the module — outside a block (found by every call while it lasts:
  nothing is recorded, so putting the very same tensor back makes the window usable again) or
  inside one; and a backward that raised, or a refusal, after some gradient of the block was
  added. A backward cannot be undone: the window is then *broken*, its counters are not advanced,
  and only :meth:`~wacc_torch.WeightedGradientsAccumulator.discard` and ``load_state_dict`` are
  accepted.
* :class:`~wacc_torch.errors.ParameterMismatchError` — a tracked parameter that changed
  mid-window: frozen, removed or added (as in the buffered mode), or, since its ``.grad`` is the
  buffer, the shape or device of its ``.data`` (which the buffered mode never reads: semantics §3
  Reading) — at entry or, for a change made inside the block, from the parameter's hook (PyTorch's
  own "invalid gradient" ``RuntimeError`` may come first, for a shape its node cannot sum to). A
  set changed inside the block (semantics §6 Reading "a tracked set changed inside a block") is
  checked at the backward's first gradient, before anything is added, and on leaving, before the
  block is counted (then :class:`BrokenWindowError` if the block had added something); a
  parameter re-registered inside the block is refused the same way with :class:`ZeroCopyError`,
  and a trainable parameter outside the tracked set holding a ``.grad`` (an added parameter's raw
  gradient) makes ``finish_*`` and ``state_dict*`` raise :class:`ZeroCopyError` naming it.
* :class:`~wacc_torch.errors.UnsupportedEnvironmentError` — flush-to-zero in the thread that
  computes: the one entering the block (the weight and W, host arithmetic) and the one running
  the backward (each hook of a CPU buffer), which may differ.

A refusal inside the backward raises from it. An exception before any gradient of the block was
added (in the forward, say) changes nothing. A hook's refusal spoils its block even when the
caller catches it inside: leaving the block then raises (:class:`BrokenWindowError` if some
gradient was added, else the refusal's class again, nothing changed) instead of counting a
microbatch whose gradient is not (wholly) in the buffers. Any other exception of the backward that
the caller catches inside the block is invisible to it, and the block would count what was added:
let such exceptions leave the block.

The accumulator holds an ``AccumulateGrad`` node only while its block is open, and nothing of a
module after its window ended: between windows a parameter may be resized (an embedding grown for
new tokens), re-typed or moved, and every backward — in a block, plain, or of another
accumulator — gets a node of the parameter as it is now.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Literal

import torch
from torch import nn

from wacc_torch import _commit
from wacc_torch._binding import Binding, Parameters, check_bound
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._ownership import calibrate, hooked_gradient
from wacc_torch._structure import ModuleStructure
from wacc_torch._weights import read_weight
from wacc_torch._window import Window, WindowMode
from wacc_torch._work import Scratch, chunk_numel, pieces
from wacc_torch.buffered import add_into, needs_work
from wacc_torch.errors import (
    BrokenWindowError,
    ParameterMismatchError,
    WeightedAccumulationError,
    ZeroCopyError,
)
from wacc_torch.records import ValidatedRecord

__all__ = ["Kind", "Microbatch", "ZeroCopyMode"]

Kind = Literal["sum", "mean"]

_RECOVER = "call discard(), or load_state_dict() with an earlier record"


def refuse_ddp_outside_no_sync(module: nn.Module) -> None:
    """DDP reduces ``.grad`` buckets that it expects AccumulateGrad to fill; the hooks fill
    ``.grad`` themselves, so DDP is refused outside ``no_sync()`` (inside, nothing is sent)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel) and module.require_backward_grad_sync:
        raise ZeroCopyError(
            "zero-copy accumulation under DistributedDataParallel needs its no_sync() context: "
            "DDP would all-reduce a .grad the backward did not fill. Run every microbatch in "
            "`with ddp.no_sync(), acc.microbatch(...)` and reduce the finished sums with "
            "wacc_torch.all_reduce_sums"
        )


def refuse_fsdp(modules: list[nn.Module]) -> None:
    """FSDP (``fully_shard``) assigns sharded ``.grad`` itself and never sees the hooks' sums."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - FSDP2 is in every torch this package supports
        return
    if any(isinstance(sub, FSDPModule) for sub in modules):
        raise ZeroCopyError(
            "zero-copy accumulation does not support FSDP (fully_shard): FSDP writes sharded "
            ".grad itself; use the buffered accumulator with FSDPWeightedWindow"
        )


def accumulate_grad_node(parameter: nn.Parameter) -> torch.autograd.graph.Node:
    """The AccumulateGrad node of a leaf: the standard route (DDP's reducer takes it too). The
    tensor holds it only weakly: whoever needs the same node later keeps a reference."""
    with torch.enable_grad():
        grad_fn = parameter.view_as(parameter).grad_fn
    assert grad_fn is not None
    node = grad_fn.next_functions[0][0]
    assert node is not None
    return node


class ZeroCopyMode(WindowMode):
    """``microbatch`` blocks whose backward adds into ``.grad``, the window's pending buffers.

    Fields, all the mode's: ``block`` (the open block, or None); ``broken`` (why the window is
    broken, or None: set by a block that added part of a microbatch, cleared by ``discard`` and
    a load); ``owners`` and ``versions`` (each pending buffer's parameter, whose ``.grad`` it is,
    and the buffer's ``_version`` after wacc's last change to it); ``fsdp_checked`` (the module
    structure last found free of FSDP); these four live for one window. ``kept_work`` (the mean's
    work tensors, reused while large enough; a CPU memory cache that refers to no module) is kept
    across windows.
    """

    zero_copy = True

    def __init__(self, window: Window) -> None:
        super().__init__(window)
        self.block: Microbatch | None = None
        self.broken: str | None = None
        self.owners: dict[str, nn.Parameter] = {}
        self.versions: dict[str, int] = {}
        self.fsdp_checked: ModuleStructure | None = None
        self.kept_work: Scratch | None = None

    # ------------------------------------------------------------------- the window's .grad
    def damage(self) -> list[str]:
        """What happened to pending ``.grad`` behind the window's back (empty: nothing)."""
        removed: list[str] = []
        replaced: list[str] = []
        changed: list[str] = []
        for name, buffer in self.window.pending.items():
            grad = self.owners[name].grad
            if grad is None:
                removed.append(name)
            elif grad is not buffer:
                replaced.append(name)
            elif buffer._version != self.versions[name]:
                changed.append(name)
        found = []
        if changed:
            found.append(
                f"the .grad of {changed!r} was changed in place (zero_grad(set_to_none=False), "
                f"gradient clipping, an optimizer step or a backward outside a block, "
                f"mid-window?)"
            )
        if replaced:
            found.append(f"the .grad of {replaced!r} was replaced by another tensor")
        if removed:
            found.append(
                f"the .grad of {removed!r} was removed (set to None: model.zero_grad() or "
                f"optimizer.zero_grad() mid-window?)"
            )
        return found

    def check_readable(self) -> None:
        """Refuse to read a window inside a block, a broken one, one whose ``.grad`` changed
        behind its back, or one with a ``.grad`` it does not own (mid-window)."""
        if self.block is not None:
            raise ZeroCopyError(
                "the accumulator is inside a microbatch block; only the block's backward may "
                "run until it is left"
            )
        self.check_intact()
        window = self.window
        if window.issued and window.binding is not None:
            current = window.binder.current(window.binding)
            if current is not None:
                self.check_owned(current)
            self.check_untracked(window.binding)

    def check_untracked(self, binding: Binding) -> None:
        """:class:`ZeroCopyError` for a ``.grad`` on a trainable parameter the window does not
        track (one added mid-window, whose gradient went past the hooks into its own ``.grad``):
        handing the window over would leave it to the optimizer beside the means."""
        structure = self.window.binder.structure
        if structure is None or structure.unchanged(structure.module):
            return  # the module as last checked: no parameter outside the binding is trainable
        stray = [
            name
            for name, parameter in structure.module.named_parameters()
            if parameter.requires_grad
            and name not in binding.name_set
            and parameter.grad is not None
        ]
        if stray:
            raise ZeroCopyError(
                f"parameter(s) {stray!r} of the module are trainable but not tracked by this "
                f"window (added mid-window?) and have a .grad the window does not own: its "
                f"gradient is not in the window's sums, and an optimizer would step on it beside "
                f"them. Set it to None (or remove or freeze the parameter) and call again"
            )

    def check_intact(self) -> None:
        """:class:`BrokenWindowError` for a broken window or a damaged pending ``.grad``."""
        if self.broken is not None:
            raise BrokenWindowError(self.broken)
        damage = self.damage()
        if damage:
            # Nothing to record: the check finds the damage again at every call while it lasts.
            raise BrokenWindowError(
                f"{'; '.join(damage)}: the window's sums are no longer in .grad. {_RECOVER}"
            )

    def check_owned(self, parameters: Parameters) -> None:
        """Each of the module's tracked parameters holds its pending buffer as ``.grad``, or no
        ``.grad`` when it has none (:class:`BrokenWindowError` / :class:`ZeroCopyError`)."""
        pending = self.window.pending
        for name, parameter in parameters:
            grad = parameter.grad
            buffer = pending.get(name)
            if buffer is None:
                if grad is not None:
                    raise ZeroCopyError(
                        f"parameter {name!r} has a .grad this window does not own (a gradient "
                        f"of an earlier backward or window, or another tool's tensor): the "
                        f"zero-copy mode adds into .grad, so a parameter without a pending "
                        f"buffer must have none. Set it to None (optimizer.zero_grad("
                        f"set_to_none=True) before the window) and call again"
                    )
            elif parameter is not self.owners[name]:
                raise BrokenWindowError(
                    f"parameter {name!r} of the module is not the tensor whose .grad holds the "
                    f"window's sum (it was re-registered or its module replaced mid-window): "
                    f"put the original parameter back, or {_RECOVER}"
                )

    def check_outside_block(self, call: str) -> None:
        if self.block is not None:
            raise ZeroCopyError(f"{call}() inside a microbatch block; leave the block first")

    def check_loadable(self) -> None:
        if self.block is not None:
            raise ZeroCopyError(
                "discard() or load_state_dict() inside a microbatch block; leave the block first"
            )

    # ---------------------------------------------------------------------------- blocks
    def plan(self, module: nn.Module, weight: object, *, mean: bool) -> _Plan:
        """Validate a block (may raise; changes nothing) and prepare what it needs."""
        self.check_intact()
        window = self.window
        value = read_weight(weight)
        binding, parameters = window.bind(module)
        structure = window.binder.structure
        if structure is None or structure is not self.fsdp_checked:
            refuse_fsdp(list(module.modules()) if structure is None else structure.modules)
        for (name, parameter), shape, device in zip(
            parameters, binding.shapes, binding.devices, strict=True
        ):
            # The parameters themselves, at every block (semantics §3 Reading): autograd hands
            # the hooks gradients of the parameter's shape, device and dtype, and its .grad is
            # the buffer, so a .data changed mid-window cannot be accumulated here.
            if parameter.shape != shape or parameter.device != device:
                raise ParameterMismatchError(
                    f"parameter {name!r} has shape {list(parameter.shape)} on "
                    f"{parameter.device}, tracked shape is {list(shape)} on {device} (its .data "
                    f"changed mid-window; the tracked set can change only between windows)"
                )
            if parameter.dtype != window.dtype:
                raise ZeroCopyError(
                    f"parameter {name!r} has dtype {parameter.dtype} but the work dtype is "
                    f"{window.dtype}: autograd hands gradients over in the parameter's dtype, "
                    f"so they could not be converted to D first (semantics §5). Use "
                    f"zero_copy=False or dtype={parameter.dtype}"
                )
        self.check_owned(parameters)
        positive = value > 0
        counted, new_total = window.count_weight(weight, value, mean=mean, caller="microbatch")
        if positive and mean and not window.fused:
            calibrate()  # outside the backward: the ownership probe runs one of its own
        return _Plan(
            binding=binding,
            parameters=parameters,
            structure=structure,
            weight=float(counted) if positive else None,
            new_total=new_total,
        )

    def commit_block(self, plan: _Plan) -> None:
        """Leaving a block whose every gradient arrived intact: count it."""
        with _commit.COMMIT:
            self.fsdp_checked = plan.structure  # a cache of a check that passed
            positive = plan.weight is not None
            self.window.count(plan.binding, positive=positive, new_total=plan.new_total)

    def add_gradient(
        self,
        name: str,
        parameter: nn.Parameter,
        grad: torch.Tensor,
        *,
        weight: float,
        mean: bool,
        owned: bool,
    ) -> None:
        """Inside a block's backward: add one parameter's microbatch gradient into ``.grad``.
        ``owned``: autograd's gradient is the accumulator's to overwrite, so a reproducible mean
        multiplies it in place; otherwise the product goes through a piece-sized work tensor."""
        window = self.window
        buffer = window.pending.get(name)
        if buffer is None:
            self.first_gradient(name, parameter, grad, weight=weight, mean=mean)
            return
        work = None
        if needs_work(grad, dtype=window.dtype, mean=mean, fused=window.fused, owned=owned):
            need = [(buffer.device, window.dtype, chunk_numel(buffer.shape))]
            if buffer.device.type == "cpu":
                # Made when a gradient first needs it (an owned one never does) and kept.
                work = self.kept_work = Scratch.reusing(self.kept_work, need)
            else:
                # The hooks' kernels may run on different streams (one per producing op), where
                # one shared work tensor could be written by two at once: a fresh piece-sized one
                # each time, from the stream-ordered caching allocator.
                work = Scratch(need)
        add_into(buffer, grad, weight=weight, mean=mean, fused=window.fused, work=work, owned=owned)
        self.versions[name] = buffer._version

    def first_gradient(
        self, name: str, parameter: nn.Parameter, grad: torch.Tensor, *, weight: float, mean: bool
    ) -> None:
        """The window's first gradient of a parameter, into a new buffer that becomes its
        ``.grad``: ``round_D(+0 + t)`` as in the buffered mode (a stolen gradient would keep a
        -0.0 where that has +0.0)."""
        window = self.window
        with _commit.ordinary_tensors():
            buffer = torch.empty(parameter.shape, dtype=window.dtype, device=parameter.device)
        if window.fused and mean:
            buffer.zero_().add_(grad, alpha=weight)  # the opt-in order, as buffered
        else:
            # t (= g, or round_D(g * w_D) straight into the buffer), then + 0.0, piece by
            # piece while the piece is in cache: one pass fewer than zeros, t, add.
            for buffer_piece, grad_piece in pieces(buffer, grad):
                if mean:
                    torch.mul(grad_piece, weight, out=buffer_piece).add_(0.0)
                else:
                    torch.add(grad_piece, 0.0, out=buffer_piece)
        parameter.grad = buffer
        window.pending[name] = buffer
        self.owners[name] = parameter
        self.versions[name] = buffer._version

    # ------------------------------------------------------------------- WindowMode steps
    def prepare_restore(
        self, validated: ValidatedRecord, binding: Binding | None, parameters: Parameters
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        dtype = self.window.dtype
        for name, parameter in parameters:
            if parameter.dtype != dtype:
                raise ZeroCopyError(
                    f"parameter {name!r} has dtype {parameter.dtype} but the work dtype is "
                    f"{dtype}: its .grad cannot be a pending buffer of dtype D"
                )
        restored, _ = super().prepare_restore(validated, binding, parameters)

        def commit() -> None:
            # Each tracked .grad becomes its restored buffer, None without one, whatever it held.
            for name, parameter in parameters:
                buffer = restored.get(name)
                parameter.grad = buffer
                if buffer is not None:
                    self.owners[name] = parameter
                    self.versions[name] = buffer._version

        return restored, commit

    def end_window(self) -> None:
        self.broken = None
        self.owners = {}
        self.versions = {}
        self.fsdp_checked = None

    def release(self) -> None:
        # The window's buffers leave the parameters' .grad (a .grad replaced since is someone
        # else's and stays).
        for name, parameter in self.owners.items():
            if parameter.grad is not None and parameter.grad is self.window.pending.get(name):
                parameter.grad = None


class _Plan:
    """A validated block: its binding and parameters, the structure found free of FSDP, the
    weight its hooks apply (None: a zero-weight batch, nothing is added) and the new W."""

    __slots__ = ("binding", "new_total", "parameters", "structure", "weight")

    def __init__(
        self,
        *,
        binding: Binding,
        parameters: Parameters,
        structure: ModuleStructure | None,
        weight: float | None,
        new_total: float,
    ) -> None:
        self.binding = binding
        self.parameters = parameters
        self.structure = structure
        self.weight = weight
        self.new_total = new_total


class Microbatch:
    """``with acc.microbatch(module, weight=w, kind="mean"): loss.backward()`` (zero-copy mode).

    Entering validates everything (the window, the weight, the tracked set, every parameter's
    dtype and ``.grad``, data parallel) and installs the hooks; leaving removes them, releases
    the nodes and counts the microbatch (``issued``, ``zero_weight``, W) exactly as
    ``accumulate_sum`` / ``accumulate_mean`` would — if every gradient arrived intact. A block
    is used once.
    """

    def __init__(
        self, mode: ZeroCopyMode, module: nn.Module, *, weight: object, kind: Kind
    ) -> None:
        self._mode = mode
        self._module = module
        self._weight = weight
        self._kind = kind
        self._entered = False
        self._plan: _Plan | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._nodes: list[torch.autograd.graph.Node] = []  # alive while the hooks are
        self._arrived: set[str] = set()  # parameters whose gradient arrived
        self._set_checked = False  # whether a hook found the tracked set as at the entry
        self._added: list[str] = []  # those whose buffer it was added to
        self._refused: WeightedAccumulationError | None = None  # a hook's refusal spoils the block
        self._owns = False  # whether the hooks look for gradients they may overwrite

    def __enter__(self) -> Microbatch:
        if self._entered:
            raise ZeroCopyError("a microbatch block can be entered once; make a new one")
        if self._kind not in ("sum", "mean"):
            raise ValueError(f"kind must be 'sum' or 'mean', got {self._kind!r}")
        mode = self._mode
        if mode.block is not None:
            raise ZeroCopyError(
                "a microbatch block inside a microbatch block; only the outer block's backward "
                "may run until it is left"
            )
        refuse_ddp_outside_no_sync(self._module)
        plan = mode.plan(self._module, self._weight, mean=self._kind == "mean")
        nodes = [accumulate_grad_node(parameter) for _, parameter in plan.parameters]
        mode.window.snapshots.await_copies()  # the hooks change buffers a snapshot may copy
        binding = plan.binding
        # Register every hook before marking the block entered: a registration that fails part
        # way removes the ones before it, so the accumulator is never left "inside a block"
        # with hooks that no block owns. (The hooks read the block's state only when they fire.)
        handles: list[torch.utils.hooks.RemovableHandle] = []
        try:
            for (name, parameter), node, shape, device in zip(
                plan.parameters, nodes, binding.shapes, binding.devices, strict=True
            ):
                hook = self._hook_for(name, parameter, shape, device)
                handles.append(node.register_prehook(hook))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        self._entered = True
        self._owns = plan.weight is not None and self._kind == "mean" and not mode.window.fused
        self._plan = plan
        self._nodes = nodes
        self._handles = handles
        mode.block = self
        return self

    def _hook_for(
        self, name: str, parameter: nn.Parameter, shape: torch.Size, device: torch.device
    ) -> Callable[[tuple[torch.Tensor | None, ...]], tuple[None]]:
        dtype = self._mode.window.dtype

        def hook(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
            # Before this frame holds a reference of its own to the gradient.
            owned = self._owns and grads[0] is not None and hooked_gradient(grads, 0, dtype)
            grad = grads[0]
            if grad is not None:
                self._arrive(name, parameter, grad, shape, device, owned=owned)
            # Nothing for AccumulateGrad to add: the gradient is in the buffer already.
            return (None,)

        return hook

    def _arrive(
        self,
        name: str,
        parameter: nn.Parameter,
        grad: torch.Tensor,
        shape: torch.Size,
        device: torch.device,
        *,
        owned: bool,
    ) -> None:
        # Checks first: a refusal here has changed nothing for this parameter.
        plan = self._plan
        assert plan is not None
        refusal = self._refusal(name, parameter, grad, plan, shape, device)
        if refusal is not None:
            # Remembered: caught inside the block, the refusal must still not count the block.
            self._refused = refusal
            raise refusal
        self._arrived.add(name)
        if plan.weight is None:
            return  # a zero-weight microbatch: its gradient values are never read (semantics §5)
        self._mode.add_gradient(
            name,
            parameter,
            grad,
            weight=plan.weight,
            mean=self._kind == "mean",
            owned=owned,
        )
        self._added.append(name)

    def _refusal(
        self,
        name: str,
        parameter: nn.Parameter,
        grad: torch.Tensor,
        plan: _Plan,
        shape: torch.Size,
        device: torch.device,
    ) -> WeightedAccumulationError | None:
        mode = self._mode
        window = mode.window
        if not self._set_checked:
            # Once, at the backward's first gradient, before anything is added: a parameter
            # frozen, removed, added or re-registered inside the block (before its backward) is
            # refused with nothing changed. A change after this point is found on leaving.
            changed = self._changed_set(plan)
            if changed is not None:
                return changed
            self._set_checked = True
        if name in self._arrived:
            return ZeroCopyError(
                f"a second gradient for parameter {name!r} arrived in one microbatch block: a "
                f"second backward, retain_graph, or reentrant activation checkpointing "
                f"(torch.utils.checkpoint(..., use_reentrant=True)) with the parameter used both "
                f"inside and outside the checkpointed segment. The zero-copy mode multiplies each "
                f"gradient by the weight on its own, so it cannot give round_D(sum * w): call "
                f"backward once per block and use use_reentrant=False (or the buffered mode)"
            )
        if torch.is_grad_enabled():
            return ZeroCopyError(
                f"backward(create_graph=True) reached parameter {name!r}: the zero-copy "
                f"accumulation is not differentiable"
            )
        if grad.layout != torch.strided:
            return ZeroCopyError(
                f"parameter {name!r} received a {grad.layout} gradient: the zero-copy mode "
                f"accumulates dense gradients only"
            )
        if parameter.shape != shape or grad.shape != shape or parameter.device != device:
            return ParameterMismatchError(
                f"parameter {name!r} changed inside the microbatch block: it has shape "
                f"{list(parameter.shape)} on {parameter.device} and its gradient shape "
                f"{list(grad.shape)}, but the tracked shape is {list(shape)} on {device}"
            )
        if parameter.dtype != window.dtype or grad.dtype != window.dtype:
            return ZeroCopyError(
                f"parameter {name!r} has dtype {parameter.dtype} (its gradient {grad.dtype}) "
                f"inside the block, but the work dtype is {window.dtype}"
            )
        buffer = window.pending.get(name)
        current = parameter.grad
        if buffer is None:
            if current is not None:
                return ZeroCopyError(
                    f"parameter {name!r} got a .grad inside the microbatch block before its "
                    f"gradient arrived: the zero-copy mode adds into .grad, which this window "
                    f"does not own; set it to None"
                )
        elif current is not buffer or buffer._version != mode.versions[name]:
            what = (
                "removed"
                if current is None
                else "replaced"
                if current is not buffer
                else "changed in place"
            )
            return BrokenWindowError(
                f"the .grad of {name!r} was {what} inside the microbatch block before its "
                f"gradient arrived: the window's sum is no longer in .grad. {_RECOVER}"
            )
        if plan.weight is not None and parameter.device.type == "cpu":
            try:
                check_gradual_underflow("microbatch (in the backward's thread)")
            except WeightedAccumulationError as error:
                return error
        return None

    def _changed_set(self, plan: _Plan) -> WeightedAccumulationError | None:
        """What changed in the module's tracked set since the block's entry, or None (semantics
        §6 Reading "a tracked set changed inside a block"; asked at the backward's first gradient
        and on leaving; changes nothing). The hooks sit on
        the entry's parameters: a parameter frozen or removed inside the block may have had no
        gradient through them, an added one's went past them into its own ``.grad``
        (ParameterMismatchError, as the buffered mode's call would raise), and a parameter
        re-registered as another tensor got its gradient into that tensor's ``.grad``
        (ZeroCopyError)."""
        module = self._module
        structure = plan.structure
        if structure is not None and structure.unchanged(module):
            return None  # the same parameter objects, each as trainable as at the entry
        try:
            parameters = check_bound(
                module,
                plan.binding,
                issued=self._mode.window.issued,
                where="inside a zero-copy microbatch block (its hooks sit on the parameters of "
                "its entry: a gradient that reached none of them is not in the window)",
            )
        except ParameterMismatchError as error:
            return error
        replaced = [
            name
            for (name, now), (_, hooked) in zip(parameters, plan.parameters, strict=True)
            if now is not hooked
        ]
        if replaced:
            return ZeroCopyError(
                f"parameter(s) {replaced!r} were re-registered as other tensors inside the "
                f"zero-copy microbatch block: the hooks sit on the parameters of its entry, so "
                f"a gradient of the new tensors went past them into their own .grad, which is "
                f"not the window's"
            )
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._nodes = []
        mode = self._mode
        mode.block = None
        plan, self._plan = self._plan, None
        assert plan is not None
        damage = mode.damage()
        if kind is None and self._refused is None and not damage:
            changed = self._changed_set(plan)
            if changed is None:
                mode.commit_block(plan)
                return
            if not self._added:
                # Nothing was added, so nothing changed; but the microbatch is not counted.
                raise type(changed)(
                    f"{changed}. Nothing was added, so nothing changed; the microbatch was not "
                    f"counted"
                )
            mode.broken = (
                f"{changed}. The block had already added part of the microbatch (to "
                f"{self._added!r}), and the window cannot be completed: {_RECOVER} (taken "
                f"before the block)"
            )
            raise BrokenWindowError(mode.broken) from changed
        if self._added or damage or isinstance(self._refused, BrokenWindowError):
            if kind is not None:
                cause = f"an exception ({kind.__name__})"
            elif self._refused is not None:
                cause = f"a refused gradient ({self._refused})"
            else:
                cause = "; ".join(damage)
            mode.broken = (
                f"{cause} left a zero-copy microbatch block after part of the window's sums had "
                f"changed (added to {self._added!r}); the window cannot be completed: {_RECOVER} "
                f"(taken before the block)"
            )
            if kind is None:  # nothing else is raised: say so on leaving
                raise BrokenWindowError(mode.broken)
            return
        if kind is None:
            assert self._refused is not None
            # Nothing was added, so nothing changed; but the microbatch is not counted either.
            raise type(self._refused)(
                f"the block's backward was refused ({self._refused}); the refusal was caught "
                f"inside the block, and the microbatch was not counted"
            )
        # An exception before any gradient was added changed nothing: as if the block never ran.
