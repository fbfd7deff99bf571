"""The zero-copy mode: autograd's backward accumulates straight into ``.grad`` (semantics §5, §6).

``WeightedGradientsAccumulator(..., zero_copy=True)`` keeps no second copy of the gradients: each
tracked parameter's ``.grad`` *is* its pending buffer. Inside ``with acc.microbatch(module,
weight=w, kind=...)`` a pre-hook on every tracked parameter's ``AccumulateGrad`` node receives the
microbatch's gradient ``g`` (autograd has already summed every use of the parameter in the graph)
and adds it into the buffer itself with the reproducible order — ``round_D(buf + g)`` for a sum,
``round_D(buf + round_D(g * w_D))`` for a mean (``buf.add_(g, alpha=w_D)`` when fused) — then hands
``AccumulateGrad`` nothing to add. The buffer starts at +0.0, as in the buffered mode, so the first
microbatch of a window gives the same bits (a stolen gradient would keep its -0.0).

What cannot be exact is refused before anything changes (:class:`ZeroCopyError`): a parameter whose
dtype is not D (autograd hands over gradients in the parameter's dtype), a ``.grad`` this window
does not own (a stale gradient, another tool's tensor) or one changed in place outside a block, a
nested block, DDP outside ``no_sync()``, FSDP, and inside a block a second backward reaching the
same parameter, a sparse gradient or ``create_graph=True``.

A backward cannot be undone: when the block exits with an exception after some gradient was already
added, the window holds part of a microbatch. It is then *broken*: counters are not advanced, and
every call but :meth:`~WeightedGradientsAccumulator.discard` and ``load_state_dict`` raises
:class:`BrokenWindowError` naming the parameters that received part of the microbatch. An
exception before any gradient arrived (in the forward, say) changes nothing. A hook's refusal
spoils its block even when the caller catches it inside: leaving the block then raises
(:class:`BrokenWindowError` if some gradient was added, else :class:`ZeroCopyError`, nothing
changed) instead of counting a microbatch whose gradient is not (wholly) in the buffers. Any
other exception of the backward that the caller catches inside the block is invisible to it, and
the block would count what was added: let such exceptions leave the block.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from wacc_torch.errors import BrokenWindowError, ZeroCopyError

if TYPE_CHECKING:
    from wacc_torch.accumulator import WeightedGradientsAccumulator

__all__ = ["Microbatch"]

Kind = Literal["sum", "mean"]


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


def _accumulate_grad_node(parameter: nn.Parameter) -> torch.autograd.graph.Node:
    # The AccumulateGrad node of a leaf: the standard route (DDP's reducer takes it too). The
    # tensor holds it only weakly, so the caller keeps a reference for as long as its hook lives.
    with torch.enable_grad():
        grad_fn = parameter.view_as(parameter).grad_fn
    assert grad_fn is not None
    node = grad_fn.next_functions[0][0]
    assert node is not None
    return node


class Microbatch:
    """``with acc.microbatch(module, weight=w, kind="mean"): loss.backward()`` (zero-copy mode).

    Entering validates everything (the weight, the tracked set, every parameter's dtype and
    ``.grad``, data parallel) and installs the hooks; leaving removes them and counts the
    microbatch (``issued``, ``zero_weight``, W) exactly as ``accumulate_sum`` /
    ``accumulate_mean`` would. A block is used once.
    """

    def __init__(
        self,
        accumulator: WeightedGradientsAccumulator,
        module: nn.Module,
        *,
        weight: object,
        kind: Kind,
    ) -> None:
        self._accumulator = accumulator
        self._module = module
        self._weight = weight
        self._kind = kind
        self._entered = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._arrived: set[str] = set()  # parameters whose gradient arrived
        self._added: list[str] = []  # those whose buffer it was added to
        self._refused: str | None = None  # why a hook refused a gradient (the block is spoilt)
        self._commit: Callable[[], None] | None = None

    def __enter__(self) -> Microbatch:
        if self._entered:
            raise ZeroCopyError("a microbatch block can be entered once; make a new one")
        if self._kind not in ("sum", "mean"):
            raise ValueError(f"kind must be 'sum' or 'mean', got {self._kind!r}")
        acc = self._accumulator
        refuse_ddp_outside_no_sync(self._module)
        plan = acc._plan_microbatch(self._module, self._weight, mean=self._kind == "mean")
        nodes = [
            (name, parameter, acc._zero_copy_node(name, parameter))
            for name, parameter in plan.parameters
        ]
        acc._await_snapshots()  # the hooks will change buffers a snapshot may still be copying
        self._entered = True
        self._commit = plan.commit
        acc._work = plan.work
        acc._block = self
        self._handles = [
            node.register_prehook(self._hook_for(name, parameter, plan.weight))
            for name, parameter, node in nodes
        ]
        return self

    def _hook_for(
        self, name: str, parameter: nn.Parameter, weight: float | None
    ) -> Callable[[tuple[torch.Tensor | None, ...]], tuple[None]]:
        mean = self._kind == "mean"

        def hook(grads: tuple[torch.Tensor | None, ...]) -> tuple[None]:
            grad = grads[0]
            if grad is not None:
                self._arrive(name, parameter, grad, weight=weight, mean=mean)
            # Nothing for AccumulateGrad to add: the gradient is in the buffer already.
            return (None,)

        return hook

    def _arrive(
        self,
        name: str,
        parameter: nn.Parameter,
        grad: torch.Tensor,
        *,
        weight: float | None,
        mean: bool,
    ) -> None:
        # Checks first: a refusal here has changed nothing for this parameter.
        refusal = None
        if name in self._arrived:
            refusal = (
                f"a second gradient for parameter {name!r} arrived in one microbatch block (a "
                f"second backward, or retain_graph): the zero-copy mode multiplies each backward "
                f"by the weight on its own, so it cannot give round_D(sum * w). Call backward "
                f"once per block"
            )
        elif torch.is_grad_enabled():
            refusal = (
                f"backward(create_graph=True) reached parameter {name!r}: the zero-copy "
                f"accumulation is not differentiable"
            )
        elif grad.layout != torch.strided:
            refusal = (
                f"parameter {name!r} received a {grad.layout} gradient: the zero-copy mode "
                f"accumulates dense gradients only"
            )
        if refusal is not None:
            # Remembered: caught inside the block, the refusal must still not count the block.
            self._refused = refusal
            raise ZeroCopyError(refusal)
        self._arrived.add(name)
        if weight is None:
            return  # a zero-weight microbatch: its gradient values are never read (semantics §4)
        self._accumulator._add_into_grad(name, parameter, grad, weight=weight, mean=mean)
        self._added.append(name)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        acc = self._accumulator
        acc._block = None
        acc._work = None
        commit, self._commit = self._commit, None
        if kind is None and self._refused is None:
            assert commit is not None
            commit()
            return
        cause = "a refused gradient" if kind is None else f"an exception ({kind.__name__})"
        if self._added:
            acc._broken = (
                f"{cause} left a zero-copy microbatch block after part of its gradient was "
                f"added to {self._added!r}; the window cannot be completed: call discard(), or "
                f"load_state_dict() with a record taken before the block"
            )
            if kind is None:  # the refusal was caught inside the block: say so on leaving
                raise BrokenWindowError(acc._broken)
        elif kind is None:
            # Nothing was added, so nothing changed; but the microbatch is not counted either.
            raise ZeroCopyError(
                f"the block's backward was refused ({self._refused}); the refusal was caught "
                f"inside the block, and the microbatch was not counted"
            )
        # An exception before any gradient was added changed nothing: as if the block never ran.
