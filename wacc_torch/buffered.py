"""The buffered mode: ``accumulate_sum`` / ``accumulate_mean`` add handed-in gradients into
buffers of the accumulator's own (semantics §5, §6).

Gradients come from a ``grads`` mapping or from each tracked parameter's ``.grad``, which is then
taken out of the module. Each call prepares (validation, conversion, every buffer and work
tensor) and then commits with in-place kernels only. Small parameters' buffers are views into one
flat arena per device, so a complete set of their gradients is added as one tensor
(:mod:`wacc_torch._arena`, same bits); the module's structure and the gradients' layout are
checked in full once per window and then compared (:mod:`wacc_torch._binding`,
:mod:`wacc_torch._gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter

import torch
from torch import nn

from wacc_torch import _commit
from wacc_torch._arena import Arena, concatenated
from wacc_torch._binding import Binding, Parameters
from wacc_torch._gradients import GradientCheck, GradientMapping
from wacc_torch._ownership import disposable_gradients
from wacc_torch._weights import read_weight
from wacc_torch._window import Window, WindowMode
from wacc_torch._work import Scratch, chunk_numel, pieces
from wacc_torch.errors import ParameterMismatchError
from wacc_torch.normalize import check_writable
from wacc_torch.records import ValidatedRecord, check_counters

__all__ = ["BufferedMode", "add_into", "memory_span"]


@dataclass(frozen=True)
class _Steps:
    """A positive-weight batch, prepared: buffers and arenas to adopt, (buffer, gradient,
    owned) triples to add in order (owned: the gradient is the accumulator's to overwrite), and
    the work tensors the additions need."""

    new_buffers: dict[str, torch.Tensor]
    new_arenas: dict[torch.device, Arena]
    adds: list[tuple[torch.Tensor, torch.Tensor, bool]]
    work: Scratch


def needs_work(
    grad: torch.Tensor, *, dtype: torch.dtype, mean: bool, fused: bool, owned: bool = False
) -> bool:
    """Whether adding ``grad`` needs a work tensor: convert first (conv_D), then operate in D
    (``buffer.add_(grad of another dtype)`` would be one rounding in the promoted type); the
    reproducible mean's product ``round_D(c * w_D)`` is a tensor of its own too, unless the
    gradient is in D and ``owned`` (the accumulator's to overwrite: the product goes into it)."""
    if grad.dtype != dtype:
        return True
    return mean and not fused and not owned


def add_into(
    buffer: torch.Tensor,
    grad: torch.Tensor,
    *,
    weight: float,
    mean: bool,
    fused: bool,
    work: Scratch | None,
    owned: bool = False,
) -> None:
    """One §5/§6 step, ``buffer`` (D) += ``grad`` (times ``weight`` = w_D for a mean), with
    in-place kernels only (a commit step); ``work`` holds a piece-sized work tensor when
    :func:`needs_work` says so. ``owned``: ``grad`` is the accumulator's to overwrite
    (:mod:`wacc_torch._ownership`)."""
    dtype = buffer.dtype
    if not needs_work(grad, dtype=dtype, mean=mean, fused=fused, owned=owned):
        if mean and not fused:
            # Owned and in D: t = round_D(g * w_D) in place (the kernel of the pieces below,
            # so the same bits), then the add, piece by piece: each product is added while it
            # is still in cache (the whole tensor at once is two full passes, slower on large
            # tensors: the `shapes` suite's piece-size rows), and no work tensor is needed.
            for buffer_piece, grad_piece in pieces(buffer, grad):
                buffer_piece.add_(grad_piece.mul_(weight))
        elif mean:  # fused, gradient already in D
            buffer.add_(grad, alpha=weight)
        else:
            buffer.add_(grad)
        return
    assert work is not None
    # Piece by piece, so that the work tensor is still in cache when it is added.
    for buffer_piece, grad_piece in pieces(buffer, grad):
        piece = work.view(grad.device, dtype, grad_piece.shape)
        if mean and not fused:
            # weight is w_D, exactly representable in D, so the scalar multiply is exactly
            # round_D(c * w_D); then a separate add: never an FMA.
            if grad.dtype == dtype:
                torch.mul(grad_piece, weight, out=piece)
            else:
                piece.copy_(grad_piece).mul_(weight)  # copy_ converts exactly like .to(D)
            buffer_piece.add_(piece)
            continue
        piece.copy_(grad_piece)
        if mean:
            buffer_piece.add_(piece, alpha=weight)
        else:
            buffer_piece.add_(piece)


def _pick(indices: tuple[int, ...], items: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``[items[i] for i in indices]`` in one C call (small groups have at least two)."""
    return list(itemgetter(*indices)(items))


class BufferedMode(WindowMode):
    """``accumulate_sum`` / ``accumulate_mean`` into the window's own buffers.

    Fields, all the mode's: ``arenas`` (the window's flat buffer per device for small
    parameters; dropped with the window), ``gradients`` (the gradient-layout cache; dropped with
    the window), ``kept_work`` (the last call's work tensors, reused while large enough; a CPU
    memory cache that refers to no module, kept across windows).
    """

    def __init__(self, window: Window) -> None:
        super().__init__(window)
        self.arenas: dict[torch.device, Arena] = {}
        self.gradients = GradientCheck()
        self.kept_work: Scratch | None = None
        # from_pending's buffers (the caller's memory) and their byte ranges, while pending: a
        # gradient must not alias one (the window would read a buffer it is adding into).
        self.adopted: dict[str, tuple[torch.Tensor, tuple[int, int]]] = {}

    def accumulate(
        self,
        module: nn.Module,
        grads: GradientMapping | None,
        *,
        weight: object,
        mean: bool,
        caller: str,
        disposable: bool = False,
    ) -> None:
        """One microbatch (semantics §5 for sums, §6 for means). ``disposable``: the caller
        hands the gradients over (a reproducible mean may write its product into them)."""
        window = self.window
        # Prepare. Validation order (as the reference model's, semantics §5 Reading): the
        # weight's own validity, the module's tracked set, the gradients' structure, then (w > 0)
        # the floating-point environment, whether a mean weight survives D, the overflow of W.
        value = read_weight(weight)
        binding, parameters = window.bind(module)
        gradients = self.gradients.collect(binding, parameters, grads)
        self._refuse_aliases(parameters, gradients)
        positive = value > 0
        counted, new_total = window.count_weight(weight, value, mean=mean, caller=caller)
        # Memory a written gradient must not share: every parameter (frozen ones too) and
        # buffer of the module.
        module_tensors = [*module.parameters(), *module.buffers()] if disposable else None
        steps = (
            self._prepare_steps(
                binding, parameters, gradients, mean=mean, module_tensors=module_tensors
            )
            if positive
            else None
        )

        with _commit.COMMIT, torch.no_grad():
            window.snapshots.await_copies()
            if window.binding is not binding:
                self.arenas = {}  # a window binding anew: earlier arenas had other members
            if steps is not None:
                window.pending.update(steps.new_buffers)
                self.arenas.update(steps.new_arenas)
                self.kept_work = steps.work  # for the next call (CPU: see Scratch.reusing)
                scale = float(counted)
                for buffer, grad, owned in steps.adds:
                    add_into(
                        buffer,
                        grad,
                        weight=scale,
                        mean=mean,
                        fused=window.fused,
                        work=steps.work,
                        owned=owned,
                    )
            if grads is None:
                for _, parameter in parameters:
                    parameter.grad = None
            window.count(binding, positive=positive, new_total=new_total)

    def _refuse_aliases(self, parameters: Parameters, gradients: list[torch.Tensor | None]) -> None:
        """ParameterMismatchError for a gradient whose memory overlaps a buffer adopted by
        ``from_pending`` that is still pending: the arena's one-step add and the per-tensor adds
        would read it before or after adding into it, and disagree."""
        live = [
            (owner, tensor.device, span)
            for owner, (tensor, span) in self.adopted.items()
            if self.window.pending.get(owner) is tensor
        ]
        if not live:
            return
        for (name, _), grad in zip(parameters, gradients, strict=True):
            span = None if grad is None else memory_span(grad)
            if grad is None or span is None:
                continue
            for owner, device, other in live:
                if grad.device == device and span[0] < other[1] and other[0] < span[1]:
                    raise ParameterMismatchError(
                        f"gradient {name!r} shares the memory of pending buffer {owner!r} "
                        "(adopted by from_pending): the window would read a buffer it adds "
                        "into; pass a copy"
                    )

    def _prepare_steps(
        self,
        binding: Binding,
        parameters: Parameters,
        gradients: list[torch.Tensor | None],
        *,
        mean: bool,
        module_tensors: list[torch.Tensor] | None = None,
    ) -> _Steps:
        """Allocate the new buffers and the work tensors of a positive-weight batch and line up
        its additions (may raise; changes nothing).

        Small tensors are added as one: when every small parameter of a device has a gradient
        of one dtype, their gradients are concatenated (here, into a tensor of their own) and
        added to the device's arena in a single step; the per-element operations are the same,
        so are the bits, without a kernel launch per tensor. That concatenation is the
        accumulator's own: a reproducible mean multiplies it in place. Every other gradient, a
        ``.grad`` it takes included, is only read: its product goes through a cache-sized work
        piece, which measured faster on real layer sets than writing the product into the
        gradient (by 3-12 %: the ``shapes`` suite's ``(.grad, disposable)`` rows) — unless the
        caller hands the gradients over (``disposable``; ``module_tensors``: the module's
        parameters and buffers): then a reproducible mean writes its product into each one it
        may (:func:`wacc_torch._ownership.disposable_gradients`) and needs no work piece for it.
        """
        window = self.window
        new_buffers: dict[str, torch.Tensor] = {}
        new_arenas: dict[torch.device, Arena] = {}
        adds: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        covered: set[int] = set()
        pending = window.pending
        # Arenas belong to a binding: a window that binds anew (issued == 0) starts without.
        arenas = self.arenas if binding is window.binding else {}
        writable = (
            disposable_gradients(gradients, module_tensors, window.dtype)
            if module_tensors is not None and mean and not window.fused
            else None
        )
        with _commit.ordinary_tensors(), torch.no_grad():
            for device, indices in binding.small.items():
                arena = arenas.get(device)
                if arena is None:
                    if any(parameters[i][0] in pending for i in indices):
                        continue  # buffers of their own already (from_pending): no arena
                    arena = Arena(
                        [parameters[i] for i in indices], dtype=window.dtype, device=device
                    )
                    new_arenas[device] = arena
                small = _pick(indices, gradients)
                if not pending.keys() >= arena.name_set:
                    for name, grad in zip(arena.names, small, strict=True):
                        if grad is not None and name not in pending:
                            new_buffers[name] = arena.views[name]
                flat = concatenated(
                    small, arena=arena, dtype=self.gradients.common_dtype(indices, small)
                )
                if flat is not None:
                    adds.append((arena.storage, flat, True))
                    covered.update(indices)
            rest = (
                binding.large
                if len(covered) == binding.small_count
                else [i for i in range(len(parameters)) if i not in covered]
            )
            for index in rest:
                grad = gradients[index]
                if grad is None:
                    continue
                name, parameter = parameters[index]
                buffer = pending.get(name, new_buffers.get(name))
                if buffer is None:
                    buffer = torch.zeros(
                        parameter.shape, dtype=window.dtype, device=parameter.device
                    )
                    new_buffers[name] = buffer
                adds.append((buffer, grad, writable is not None and writable[index]))
            work = Scratch.reusing(
                self.kept_work,
                (
                    (grad.device, window.dtype, chunk_numel(grad.shape))
                    for _, grad, owned in adds
                    if needs_work(
                        grad, dtype=window.dtype, mean=mean, fused=window.fused, owned=owned
                    )
                ),
            )
        return _Steps(new_buffers=new_buffers, new_arenas=new_arenas, adds=adds, work=work)

    # ------------------------------------------------------------------- WindowMode steps
    def division_targets(self) -> dict[str, torch.Tensor | None]:
        # Each arena is divided as one tensor (elementwise, so the same bits; its unused parts
        # hold +0.0, which stays +0.0), every other buffer on its own.
        in_arena = {name for arena in self.arenas.values() for name in arena.names}
        targets: dict[str, torch.Tensor | None] = {
            f"<arena {device}>": arena.storage for device, arena in self.arenas.items()
        }
        targets.update(
            (name, buffer) for name, buffer in self.window.pending.items() if name not in in_arena
        )
        return targets

    def prepare_restore(
        self, validated: ValidatedRecord, binding: Binding | None, parameters: Parameters
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        # Small buffers into a new arena, as accumulation would have made them.
        by_name = dict(parameters)
        arenas: dict[torch.device, Arena] = {}
        restored: dict[str, torch.Tensor] = {}
        small = binding.small if binding is not None else {}
        names = binding.names if binding is not None else ()
        with _commit.ordinary_tensors(), torch.no_grad():
            for device, indices in small.items():
                members = [(names[i], by_name[names[i]]) for i in indices]
                if any(name in validated.pending for name, _ in members):
                    arenas[device] = Arena(members, dtype=self.window.dtype, device=device)
            in_arena = {
                name: arena.views[name] for arena in arenas.values() for name in arena.names
            }
            for name, buffer in validated.pending.items():
                view = in_arena.get(name)
                if view is not None:
                    restored[name] = view.copy_(buffer.detach())
                else:
                    restored[name] = buffer.detach().to(
                        by_name[name].device, memory_format=torch.contiguous_format, copy=True
                    )

        def commit() -> None:
            self.arenas = arenas

        return restored, commit

    def end_window(self) -> None:
        self.arenas = {}
        self.adopted = {}
        self.gradients.forget()

    # ---------------------------------------------------------------------- from_pending
    def adopt(
        self,
        module: nn.Module,
        pending: Mapping[str, torch.Tensor],
        *,
        issued: object,
        zero_weight: object,
        total_weight: object,
    ) -> None:
        """``from_pending``: bind this fresh window to ``module`` and adopt the caller's
        buffers with the saved counters."""
        window = self.window
        if not isinstance(pending, Mapping):
            raise TypeError(f"pending must be a mapping, got {type(pending).__name__}")
        binding, parameters = window.bind(module)
        by_name = dict(parameters)
        # Storages the adopted buffers must not share: the parameters' and their .grad's.
        foreign = [
            (span, f"the memory of parameter {name!r}{suffix}")
            for name, parameter in parameters
            for tensor, suffix in ((parameter, ""), (parameter.grad, "'s .grad"))
            if tensor is not None and (span := memory_span(tensor)) is not None
        ]
        for name, buffer in pending.items():
            parameter = by_name.get(name)
            if parameter is None:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} is not a tracked parameter of the module"
                )
            if not isinstance(buffer, torch.Tensor) or buffer.layout != torch.strided:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} must be a dense tensor, got "
                    f"{type(buffer).__name__} (layout {getattr(buffer, 'layout', None)})"
                )
            if buffer.dtype != window.dtype:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} has dtype {buffer.dtype}, expected {window.dtype}"
                )
            if buffer.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} has shape {list(buffer.shape)}, the parameter "
                    f"has shape {list(parameter.shape)}"
                )
            if buffer.device != parameter.device:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} is on {buffer.device}, the parameter is on "
                    f"{parameter.device}"
                )
            check_writable(buffer, what=f"pending buffer {name!r}")
            span = memory_span(buffer)
            if span is not None:
                for other, owner in foreign:
                    if span[0] < other[1] and other[0] < span[1]:
                        raise ParameterMismatchError(
                            f"pending buffer {name!r} shares {owner}: accumulating into it "
                            f"would change that tensor too"
                        )
                foreign.append((span, f"the memory of pending buffer {name!r}"))
        counted = check_counters(
            issued=issued,
            zero_weight=zero_weight,
            total_weight=total_weight,
            has_pending=bool(pending),
            bound=True,
        )
        adopted = {name: pending[name].detach() for name in binding.names if name in pending}
        spans = {
            name: (buffer, span)
            for name, buffer in adopted.items()
            if (span := memory_span(buffer)) is not None
        }
        with _commit.COMMIT:
            window.binding = binding
            window.pending = adopted
            self.adopted = spans
            window.issued, window.zero_weight, window.total_weight = counted


def memory_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The byte range ``[start, end)`` a tensor's elements lie in (None: no memory, as for a
    meta or empty tensor). Disjoint views of one storage (the arena's buffers) do not overlap;
    interleaved strided views are reported as overlapping, which is safe."""
    if tensor.numel() == 0 or tensor.untyped_storage().data_ptr() == 0:
        return None
    start = tensor.data_ptr()
    extents = zip(tensor.shape, tensor.stride(), strict=True)
    last = sum((size - 1) * stride for size, stride in extents)
    return start, start + (last + 1) * tensor.element_size()
