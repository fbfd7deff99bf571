"""Weighted gradient accumulation over unequal microbatches (semantics §3-§9).

The default evaluation order is the reproducible one of the semantics: convert then add (sums),
multiply then add (means), and a sequential division by the loss scale and then by the total
weight, each step rounded on its own. ``fused=True`` is an opt-in one-pass mode for means.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter, itemgetter
from types import TracebackType
from typing import Any

import torch
from torch import nn

from wacc_torch._arena import Arena, concatenated, small_groups
from wacc_torch._dtypes import (
    GRADIENT_DTYPES,
    check_loss_scale,
    check_work_dtype,
    dtype_name,
    op_dtype,
    to_work_dtype,
)
from wacc_torch._environment import check_gradual_underflow
from wacc_torch._scalars import add_to_total, as_float64, read_real
from wacc_torch._structure import ModuleStructure
from wacc_torch._work import Scratch as _Scratch
from wacc_torch._work import chunk_numel as _chunk_numel
from wacc_torch._work import pieces as _pieces
from wacc_torch.errors import (
    BrokenWindowError,
    InvalidWeightError,
    ParameterMismatchError,
    ZeroCopyError,
    ZeroTotalWeightError,
)
from wacc_torch.records import (
    CHECKSUM_KEY,
    FORMAT_VERSION,
    check_counters,
    record_checksum_of,
    validate_record,
)
from wacc_torch.zero_copy import Kind, Microbatch, _accumulate_grad_node, refuse_fsdp

__all__ = [
    "AccumulatedGradients",
    "AccumulatorState",
    "StateDictHandle",
    "WeightedGradientsAccumulator",
    "normalize_sums",
]

Weight = float | torch.Tensor

_GRAD = attrgetter("grad")
_SECOND = itemgetter(1)
_IS_NONE = partial(operator.is_, None)
_SIGNATURE = attrgetter("shape", "dtype", "device", "layout")
GradientMapping = Mapping[str, torch.Tensor | None]


class _CommitPhase:
    """Marks a commit phase: from here on only operations that cannot fail on validated,
    prepared inputs (in-place kernels on our own dense buffers, attribute assignments).

    Every public mutating call first prepares (validation, conversion, allocation, every
    temporary: anything that may raise) and then commits inside ``with _COMMIT:``. It does
    nothing at run time; the fault-injection tests replace it to tell the phases apart.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


_COMMIT = _CommitPhase()


def _ordinary_tensors() -> AbstractContextManager[object]:
    # Buffers, temporaries and handed-over tensors must be ordinary tensors even when the caller
    # is in torch.inference_mode(): an inference tensor cannot be updated in place outside it.
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return nullcontext()


@dataclass(frozen=True)
class AccumulatorState:
    """A copy of an accumulator's options and window counters (semantics §3).

    ``total_weight`` is W, the float64 sum of the counted weights in issue order; ``fused``
    says whether means are accumulated in the opt-in one-pass mode; ``zero_copy`` whether the
    pending buffers are the parameters' ``.grad`` (:mod:`wacc_torch.zero_copy`).
    """

    dtype: torch.dtype
    loss_scale: float
    issued: int
    zero_weight: int
    total_weight: float
    fused: bool
    zero_copy: bool = False


@dataclass(frozen=True)
class AccumulatedGradients:
    """What ``finish_sums`` / ``finish_mean`` hand over.

    ``grads`` maps every tracked parameter name to its tensor in the work dtype (the pending
    buffer itself for sums, not a copy), or None when the parameter received no gradient in any
    positive-weight batch of the window. ``normalized`` is False for sums (still scaled by
    ``loss_scale`` and not divided by ``weight``) and True for means.
    """

    grads: dict[str, torch.Tensor | None]
    weight: float
    loss_scale: float
    issued: int
    zero_weight: int
    normalized: bool

    def apply_to(self, module: nn.Module) -> None:
        """Write each gradient into the matching parameter's ``.grad``.

        Each tensor is converted to that parameter's dtype (and device); a None gradient sets
        ``.grad`` to None. Parameters not named in ``grads`` are left alone. When no conversion
        is needed the ``.grad`` is the tensor held here, not a copy. Every name and shape is
        checked and every conversion made before any ``.grad`` is written
        (:class:`ParameterMismatchError`; a failed conversion writes nothing either).
        """
        parameters = dict(module.named_parameters())
        for name, grad in self.grads.items():
            parameter = parameters.get(name)
            if parameter is None:
                raise ParameterMismatchError(f"the module has no parameter named {name!r}")
            if grad is not None and grad.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"gradient {name!r} has shape {list(grad.shape)} but the parameter has "
                    f"shape {list(parameter.shape)}"
                )
        with _ordinary_tensors():
            converted = {
                name: None
                if grad is None
                else grad.to(dtype=parameters[name].dtype, device=parameters[name].device)
                for name, grad in self.grads.items()
            }
        with _COMMIT:
            for name, grad in converted.items():
                parameters[name].grad = grad


class StateDictHandle:
    """A pending ``state_dict_async()`` snapshot; :meth:`result` waits for it.

    The device-to-host copies were issued on each buffer's current CUDA stream when the
    snapshot was taken; ``result`` waits on the CUDA events recorded right after them. The
    handle keeps the source buffers alive until then, and each source was marked as used on
    the copy's stream (``record_stream``), so freeing or reusing a buffer (after
    ``finish_sums`` hands it over, on any stream) cannot overwrite it under the copy.
    """

    def __init__(
        self,
        record: dict[str, Any],
        events: list[torch.cuda.Event],
        sources: list[torch.Tensor],
        *,
        checksum: bool = True,
    ) -> None:
        self._record = record
        self._checksum = checksum
        self._events = events
        self._sources: list[torch.Tensor] | None = sources

    def done(self) -> bool:
        """Whether every device-to-host copy of the snapshot has completed."""
        return all(event.query() for event in self._events)

    def result(self) -> dict[str, Any]:
        """Wait for the copies and return the record (same content as ``state_dict()``)."""
        for event in self._events:
            event.synchronize()
        self._sources = None  # the copies are complete: the sources may go
        if self._checksum and CHECKSUM_KEY not in self._record:
            # Only now are the host copies complete, so only now can their bytes be hashed.
            self._record[CHECKSUM_KEY] = record_checksum_of(self._record)
        return self._record


def _coerce_weight(weight: object) -> int | float:
    """A microbatch weight, read exactly (an int or a float); refuse anything but a finite
    real >= 0 (which types count as real: :func:`wacc_torch._scalars.read_real`)."""
    value = read_real(weight, what="weight", error=InvalidWeightError)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidWeightError(f"weight must be finite and >= 0, got {weight!r}")
    if value < 0:
        raise InvalidWeightError(f"weight must be finite and >= 0, got {weight!r}")
    return value


def _scalar_tensor(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # A 0-d tensor ON the buffers' device: CUDA true division by a CPU scalar would multiply by
    # the reciprocal instead of dividing (semantics §8).
    return torch.tensor(value, dtype=dtype, device=device)


def _read_total_weight(total_weight: object) -> float:
    """semantics §8's W for :func:`normalize_sums`: same number rule as a weight, finite, > 0."""
    value = read_real(total_weight, what="total_weight", error=InvalidWeightError)
    if value == 0:
        raise ZeroTotalWeightError(
            f"cannot normalize by total weight {total_weight!r}: no positive weight was counted"
        )
    weight = as_float64(value)
    if weight != value and math.isfinite(weight):
        raise InvalidWeightError(
            f"total_weight {total_weight!r} is not exactly a float64 (W is a float64 sum)"
        )
    if not (math.isfinite(weight) and weight > 0.0):
        raise InvalidWeightError(f"total_weight must be finite and > 0, got {total_weight!r}")
    return weight


def normalize_sums(
    grads: Mapping[str, torch.Tensor | None],
    *,
    loss_scale: float,
    total_weight: float | torch.Tensor,
    in_place: bool = False,
) -> dict[str, torch.Tensor | None]:
    """Divide scaled gradient sums by the loss scale, then by the total weight (semantics §8).

    Per element, in each tensor's own dtype D: ``y = round_D(g / S)``, then
    ``round_D(round_op(y / round_op(W)))`` with op = float64 for float64 and float32 otherwise.
    The product ``S * W`` is never formed. Both divisors are 0-d tensors on the gradient's
    device. None entries stay None. ``total_weight`` may be a number or a 0-d tensor (what a
    manual ``dist.all_reduce`` of the weight gives), read like a weight; it must be exactly a
    float64. With ``in_place=True`` the result overwrites the given tensors (and the returned
    dict holds them), all or nothing: every divisor and temporary is made before the first
    tensor is written. Otherwise they are left untouched.

    Raises :class:`ZeroTotalWeightError` when ``total_weight == 0``, :class:`InvalidWeightError`
    for a negative, non-finite or non-real one, :class:`InvalidLossScaleError` for a loss scale
    that is not finite, > 0 and exactly representable in every gradient's dtype (float64 when
    every entry is None), and :class:`ParameterMismatchError` for a value that is not a dense
    tensor of a work dtype (or, with ``in_place=True``, one that is not safe to write in place).
    """
    if not isinstance(grads, Mapping):
        raise TypeError(
            f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
        )
    weight = _read_total_weight(total_weight)
    checked_dtypes: set[torch.dtype] = set()
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, grad in grads.items():
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor) or grad.layout != torch.strided:
            raise ParameterMismatchError(
                f"gradient {name!r} must be a dense tensor or None, got {type(grad).__name__}"
            )
        try:
            check_work_dtype(grad.dtype)
        except ValueError:
            raise ParameterMismatchError(
                f"gradient {name!r} has dtype {grad.dtype}, not a work dtype"
            ) from None
        if in_place:
            _check_writable(grad, what=f"gradient {name!r}")
        if grad.dtype not in checked_dtypes:
            check_loss_scale(loss_scale, grad.dtype)
            checked_dtypes.add(grad.dtype)
        tensors.append((name, grad))
    if not checked_dtypes:
        # No tensor, so no work dtype to check S against; S itself must still be valid (finite,
        # > 0, a float64), which the check in float64 covers.
        check_loss_scale(loss_scale, torch.float64)
    scale = float(loss_scale)
    if any(grad.device.type == "cpu" for _, grad in tensors):
        check_gradual_underflow("normalize_sums")

    # Prepare: every divisor and temporary; then the in-place commit cannot fail half-way.
    with _ordinary_tensors():
        divisors: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        for _, grad in tensors:
            key = (grad.device, grad.dtype)
            if key not in divisors:
                divisors[key] = (
                    _scalar_tensor(scale, grad.dtype, grad.device),
                    _scalar_tensor(weight, op_dtype(grad.dtype), grad.device),
                )
        # Narrow D divides in op(D) = float32 (so a W beyond D's range, e.g. fp16 with
        # W = 70000, stays finite), then rounds once more into D: a float32 work tensor.
        scratch = _Scratch(
            (grad.device, op_dtype(grad.dtype), _chunk_numel(grad.shape))
            for _, grad in tensors
            if op_dtype(grad.dtype) != grad.dtype
        )
        outputs = {
            name: grad
            if in_place
            else torch.empty_like(grad, memory_format=torch.contiguous_format)
            for name, grad in tensors
        }
        with _COMMIT:
            for name, grad in tensors:
                scale_tensor, weight_tensor = divisors[(grad.device, grad.dtype)]
                out = outputs[name]
                # Both divisions piece by piece, so that the second finds the first's result in
                # cache (a tensor of at most CHUNK_ELEMENTS is one piece).
                for out_piece, grad_piece in _pieces(out, grad):
                    # y = round_D(g / S): same-dtype 0-d divisor, so no type promotion. g / 1
                    # is g bit for bit (NaN payloads aside, which no oracle compares): skipped.
                    if scale != 1.0:
                        torch.div(grad_piece, scale_tensor, out=out_piece)
                    elif out is not grad:
                        out_piece.copy_(grad_piece)
                    if out.dtype == weight_tensor.dtype:
                        out_piece.div_(weight_tensor)
                        continue
                    quotient = scratch.view(out.device, weight_tensor.dtype, out_piece.shape)
                    quotient.copy_(out_piece).div_(weight_tensor)
                    out_piece.copy_(quotient)
    return {name: None if grad is None else outputs[name] for name, grad in grads.items()}


def _may_overlap(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory (an expanded, stride-0 view, ...).

    Sufficient test for "no overlap": with the dims of size > 1 sorted by stride, each stride
    is at least the extent of the previous ones. Exotic non-overlapping layouts that fail it
    are reported as overlapping: refusing them is safe.
    """
    dims = sorted(
        (stride, size)
        for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
        if size > 1
    )
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def _check_writable(tensor: torch.Tensor, *, what: str) -> None:
    """Refuse a tensor that an in-place update could not write element by element: overlapping
    memory (an expanded, stride-0 view) or an inference tensor outside inference mode."""
    if _may_overlap(tensor):
        raise ParameterMismatchError(
            f"{what} has overlapping memory (shape {list(tensor.shape)}, strides "
            f"{list(tensor.stride())}): it cannot be updated in place element by element"
        )
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise ParameterMismatchError(
            f"{what} is an inference tensor (made under torch.inference_mode()): it cannot be "
            f"updated in place outside inference mode"
        )


@dataclass(frozen=True)
class _Steps:
    """A positive-weight batch, prepared: buffers and arenas to adopt, (buffer, gradient) pairs
    to add in order, and the work tensors the additions need."""

    new_buffers: dict[str, torch.Tensor]
    new_arenas: dict[torch.device, Arena]
    adds: list[tuple[torch.Tensor, torch.Tensor]]
    work: _Scratch


@dataclass(frozen=True)
class _BlockPlan:
    """A validated zero-copy block: its parameters in binding order, the weight its hooks apply
    (None: a zero-weight batch, nothing is added), its work tensors and what leaving it commits."""

    parameters: list[tuple[str, nn.Parameter]]
    weight: float | None
    work: _Scratch | None
    commit: Callable[[], None]


@dataclass(frozen=True)
class _Binding:
    """The tracked parameter set: names in registration order, shapes, devices; derived from
    them: the name set, the small parameters per device (:func:`small_groups`), whether any
    is on the CPU, the largest piece per device (:func:`wacc_torch._work.chunk_numel`)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    devices: tuple[torch.device, ...]
    name_set: frozenset[str] = field(init=False)
    small: dict[torch.device, tuple[int, ...]] = field(init=False)
    small_count: int = field(init=False)
    large: tuple[int, ...] = field(init=False)
    on_cpu: bool = field(init=False)
    pieces: dict[torch.device, int] = field(init=False)

    def __post_init__(self) -> None:
        small = small_groups(self.shapes, self.devices)
        in_arena = {index for indices in small.values() for index in indices}
        object.__setattr__(self, "name_set", frozenset(self.names))
        object.__setattr__(self, "small", small)
        object.__setattr__(self, "small_count", len(in_arena))
        object.__setattr__(
            self, "large", tuple(i for i in range(len(self.names)) if i not in in_arena)
        )
        object.__setattr__(self, "on_cpu", any(d.type == "cpu" for d in self.devices))
        pieces: dict[torch.device, int] = {}
        for shape, device in zip(self.shapes, self.devices, strict=True):
            pieces[device] = max(pieces.get(device, 0), _chunk_numel(shape))
        object.__setattr__(self, "pieces", pieces)


def _pick(indices: tuple[int, ...], items: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``[items[i] for i in indices]`` in one C call (small groups have at least two)."""
    return list(itemgetter(*indices)(items))


def _tracked_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's requires_grad parameters in registration order, checked to be accumulable."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    parameters = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not parameters:
        raise ParameterMismatchError(
            f"the module ({type(module).__name__}) has no requires_grad parameter to accumulate"
        )
    for name, parameter in parameters:
        if not parameter.is_floating_point():
            raise ParameterMismatchError(
                f"parameter {name!r} has dtype {parameter.dtype}: only floating-point "
                f"parameters can be accumulated"
            )
    return parameters


def _binding_of(parameters: list[tuple[str, nn.Parameter]]) -> _Binding:
    return _Binding(
        names=tuple(name for name, _ in parameters),
        shapes=tuple(parameter.shape for _, parameter in parameters),
        devices=tuple(parameter.device for _, parameter in parameters),
    )


class WeightedGradientsAccumulator:
    """Accumulates gradients of unequal microbatches and normalizes them once (semantics §3-§9).

    Options are keyword-only: ``dtype`` is the work dtype D of the pending buffers (float64,
    float32, float16 or bfloat16), ``loss_scale`` the fixed loss scale S every backward of the
    window used (a finite float > 0 exactly representable in D), ``fused`` selects the opt-in
    one-pass mode for means (``buf.add_(c, alpha=w_D)``, not reproducible across devices).

    Gradients come either from a ``grads`` mapping (name -> tensor or None; a name left out is
    None, i.e. a zero contribution; an unknown name raises) or, when ``grads`` is None, from each
    tracked parameter's ``.grad``, which is then taken out of the module (set to None), also for
    a zero-weight batch, so a stale ``.grad`` can never leak into the next microbatch.

    The tracked set is the module's ``requires_grad`` parameters (names, shapes, devices),
    matched by name, bound by the first accumulate of a window (a zero-weight one too) or by a
    load. A window with nothing in it yet (``issued == 0``: new, or just finished) binds to the
    module's current trainable parameters, so unfreezing, adapters switched on or off, or a
    move to another device need no new accumulator; inside a window a change raises
    :class:`ParameterMismatchError` (a parameter that became frozen is named as frozen). A
    parameter's buffer (D, on the parameter's device, starting at +0.0) exists from its first
    non-None gradient in a positive-weight batch of the window; buffers are ordinary tensors
    even under ``torch.inference_mode()``. Small parameters (at most
    :data:`wacc_torch._arena.SMALL_ELEMENTS` elements) have their buffers in one flat arena
    per device, allocated whole at the first positive-weight batch, so that a complete set of
    their gradients is added as one tensor (same bits; :mod:`wacc_torch._arena`). The module's
    structure is walked once per window; later calls compare it (:mod:`wacc_torch._structure`).

    Weights and the loss scale follow one rule (:mod:`wacc_torch._scalars`): a Python int or
    float, or a numpy scalar / 0-d array / 0-d tensor of an integer or one of six float
    formats, read exactly (``Fraction``, ``longdouble``, bools, complex are refused). Gradients
    must be one of float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2. On the CPU,
    flush-to-zero (``torch.set_flush_denormal(True)``) is refused with
    :class:`~wacc_torch.errors.UnsupportedEnvironmentError`: results would differ from semantics §2.

    Every mutating call prepares first (validation, conversion, allocation of every buffer and
    temporary: anything that may raise) and then commits with in-place kernels and assignments
    only, so a call that raises, out of memory included, leaves the counters, the buffers and
    the module's ``.grad`` exactly as they were.
    """

    def __init__(
        self,
        *,
        dtype: torch.dtype,
        loss_scale: float,
        fused: bool = False,
        zero_copy: bool = False,
    ) -> None:
        work_dtype = check_work_dtype(dtype)
        scale = check_loss_scale(loss_scale, work_dtype)
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        if not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be a bool, got {zero_copy!r}")
        self._dtype = work_dtype
        self._loss_scale = scale
        self._fused = fused
        self._zero_copy = zero_copy
        self._binding: _Binding | None = None
        self._pending: dict[str, torch.Tensor] = {}
        # The window's flat buffer per device for small parameters (wacc_torch._arena).
        self._arenas: dict[torch.device, Arena] = {}
        # What the last check found for a binding: the module's parameter structure and the
        # layout of a complete set of gradients; later calls compare instead of re-checking.
        self._structure_cache: (
            tuple[_Binding, ModuleStructure, list[tuple[str, nn.Parameter]]] | None
        ) = None
        self._signature_cache: tuple[_Binding, tuple[object, ...]] | None = None
        self._issued = 0
        self._zero_weight = 0
        self._total_weight = 0.0
        # Work tensors of the accumulate call being committed (None outside one).
        self._work: _Scratch | None = None
        # Events of state_dict_async copies not yet known to be complete (_await_snapshots).
        self._snapshot_events: list[tuple[torch.device, torch.cuda.Event]] = []
        # Zero-copy mode (wacc_torch.zero_copy): the open block, why the window is broken (None:
        # it is not), each pending buffer's parameter and its ._version when the last block
        # ended, the AccumulateGrad nodes (kept alive: they hold the hooks), the mean's scratch.
        self._block: Microbatch | None = None
        self._broken: str | None = None
        self._grad_owners: dict[str, nn.Parameter] = {}
        self._grad_versions: dict[str, int] = {}
        self._nodes: dict[str, tuple[nn.Parameter, torch.autograd.graph.Node]] = {}
        # The last call's or block's work tensors, reused while large enough (at most a piece,
        # CHUNK_ELEMENTS, per device and dtype; CPU only: Scratch.reusing).
        self._kept_work: _Scratch | None = None
        self._fsdp_checked: ModuleStructure | None = None

    # ----------------------------------------------------------------------------- reading
    @property
    def state(self) -> AccumulatorState:
        """A frozen copy of the options and counters; reading it changes nothing."""
        return AccumulatorState(
            dtype=self._dtype,
            loss_scale=self._loss_scale,
            issued=self._issued,
            zero_weight=self._zero_weight,
            total_weight=self._total_weight,
            fused=self._fused,
            zero_copy=self._zero_copy,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dtype={self._dtype}, loss_scale={self._loss_scale!r}, "
            f"fused={self._fused}, zero_copy={self._zero_copy}, issued={self._issued}, "
            f"zero_weight={self._zero_weight}, "
            f"total_weight={self._total_weight!r})"
        )

    # ---------------------------------------------------------------------- accumulation
    def accumulate_sum(
        self, module: nn.Module, weight: Weight, *, grads: GradientMapping | None = None
    ) -> None:
        """Add the gradients of ``S * sum_t loss_t`` of one microbatch (semantics §5).

        ``weight`` is the microbatch's effective token/sample count w (a real number or 0-d
        tensor, finite, >= 0). For w > 0 each buffer becomes ``round_D(buf + conv_D(g))`` and W
        becomes ``round_64(W + w)``. For w == 0 no gradient value is read (NaN or inf ones
        included); only ``issued`` and ``zero_weight`` count it.
        """
        self._accumulate(module, grads, weight=weight, mean=False)

    def accumulate_mean(
        self, module: nn.Module, weight: Weight, *, grads: GradientMapping | None = None
    ) -> None:
        """Add the gradients of ``S * mean_t loss_t`` of one microbatch, times its weight (§6).

        The weight counted is ``w_D = conv_D(w)``, what the work dtype makes of w (bfloat16:
        1001 -> 1000). For w > 0, ``t = round_D(conv_D(g) * w_D)`` then
        ``buf = round_D(buf + t)`` (two roundings), and W becomes ``round_64(W + w_D)``; with
        ``fused=True`` the one-pass ``buf.add_(conv_D(g), alpha=w_D)`` is used instead. A w > 0
        whose w_D is 0 or not finite raises :class:`InvalidWeightError`.
        """
        self._accumulate(module, grads, weight=weight, mean=True)

    def _accumulate(
        self,
        module: nn.Module,
        grads: GradientMapping | None,
        *,
        weight: Weight,
        mean: bool,
    ) -> None:
        # Prepare. Validation order (as the reference model's): the weight's own validity, the
        # module's tracked set, the gradients' structure, then whether a mean weight survives D.
        self._check_mode(zero_copy=False, call="accumulate_sum/accumulate_mean")
        weight_value = _coerce_weight(weight)
        binding, parameters = self._check_module(module)
        gradients = self._collect_gradients(binding, parameters, grads)
        positive = weight_value > 0
        counted_weight, new_total = self._counted_weight(weight, weight_value, mean=mean)
        steps = self._prepare_steps(binding, parameters, gradients, mean=mean) if positive else None

        with _COMMIT, torch.no_grad():
            self._await_snapshots()
            if self._binding is not binding:
                self._arenas = {}  # a window binding anew: earlier arenas had other members
            self._binding = binding
            if steps is not None:
                self._pending.update(steps.new_buffers)
                self._arenas.update(steps.new_arenas)
                self._work = steps.work
                self._kept_work = steps.work  # for the next call (CPU: see Scratch.reusing)
                scale = float(counted_weight)
                for buffer, grad in steps.adds:
                    self._add(buffer, grad, weight=scale, mean=mean)
                self._work = None  # the work tensors live for one call only
            if grads is None:
                for _, parameter in parameters:
                    parameter.grad = None
            self._issued += 1
            if positive:
                self._total_weight = new_total
            else:
                self._zero_weight += 1

    def _counted_weight(
        self, weight: object, weight_value: int | float, *, mean: bool
    ) -> tuple[int | float, float]:
        """The weight a batch counts (w, or w_D for a mean) and the new W; raises for a mean
        weight that does not survive D or a W that overflows."""
        counted_weight: int | float = weight_value
        if mean and weight_value > 0:
            # conv_D as PyTorch does it: an int is read through float64 first.
            counted_weight = to_work_dtype(as_float64(weight_value), self._dtype)
            if counted_weight == 0.0 or not math.isfinite(counted_weight):
                raise InvalidWeightError(
                    f"weight {weight!r} does not survive the work dtype {self._dtype}: it "
                    f"converts to {counted_weight!r}"
                )
        new_total = add_to_total(self._total_weight, counted_weight)  # round_64(W + w), exact w
        if not math.isfinite(new_total):
            raise InvalidWeightError(
                f"weight {weight_value!r} makes the total weight overflow "
                f"({self._total_weight!r} + {counted_weight!r})"
            )
        return counted_weight, new_total

    def _needs_work(self, grad: torch.Tensor, *, mean: bool) -> bool:
        # Convert first (conv_D), then operate in D: buffer.add_(grad of another dtype) would
        # be a single rounding in the promoted type instead. The reproducible mean also needs
        # its product round_D(c * w_D) in a tensor of its own.
        return grad.dtype != self._dtype or (mean and not self._fused)

    def _prepare_steps(
        self,
        binding: _Binding,
        parameters: list[tuple[str, nn.Parameter]],
        gradients: list[torch.Tensor | None],
        *,
        mean: bool,
    ) -> _Steps:
        """Allocate the new buffers and the work tensors of a positive-weight batch and line up
        its additions (may raise; changes nothing).

        Small tensors are added as one: when every small parameter of a device has a gradient
        of one dtype, their gradients are concatenated (here, into a tensor of their own) and
        added to the device's arena in a single ``_add``; the per-element operations are the
        same, so are the bits, without a kernel launch per tensor.
        """
        if binding.on_cpu:  # checked per call, not per tensor: the flag is per thread
            check_gradual_underflow("accumulate")
        new_buffers: dict[str, torch.Tensor] = {}
        new_arenas: dict[torch.device, Arena] = {}
        adds: list[tuple[torch.Tensor, torch.Tensor]] = []
        covered: set[int] = set()
        # Arenas belong to a binding: a window that binds anew (issued == 0) starts without.
        arenas = self._arenas if binding is self._binding else {}
        with _ordinary_tensors(), torch.no_grad():
            for device, indices in binding.small.items():
                arena = arenas.get(device)
                if arena is None:
                    if any(parameters[i][0] in self._pending for i in indices):
                        continue  # buffers of their own already (from_pending): no arena
                    arena = Arena(
                        [parameters[i] for i in indices], dtype=self._dtype, device=device
                    )
                    new_arenas[device] = arena
                small = _pick(indices, gradients)
                if not self._pending.keys() >= arena.name_set:
                    for name, grad in zip(arena.names, small, strict=True):
                        if grad is not None and name not in self._pending:
                            new_buffers[name] = arena.views[name]
                flat = concatenated(small, arena=arena)
                if flat is not None:
                    adds.append((arena.storage, flat))
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
                buffer = self._pending.get(name, new_buffers.get(name))
                if buffer is None:
                    buffer = torch.zeros(
                        parameter.shape, dtype=self._dtype, device=parameter.device
                    )
                    new_buffers[name] = buffer
                adds.append((buffer, grad))
            work = _Scratch.reusing(
                self._kept_work,
                (
                    (grad.device, self._dtype, _chunk_numel(grad.shape))
                    for _, grad in adds
                    if self._needs_work(grad, mean=mean)
                ),
            )
        return _Steps(new_buffers=new_buffers, new_arenas=new_arenas, adds=adds, work=work)

    def _add(self, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool) -> None:
        # Commit phase: in-place kernels only, on validated same-shape same-device tensors; the
        # work tensor was allocated in the prepare phase (self._work).
        if not self._needs_work(grad, mean=mean):
            if mean:  # fused, gradient already in D
                buffer.add_(grad, alpha=weight)
            else:
                buffer.add_(grad)
            return
        assert self._work is not None
        # Piece by piece, so that the work tensor is still in cache when it is added.
        for buffer_piece, grad_piece in _pieces(buffer, grad):
            work = self._work.view(grad.device, self._dtype, grad_piece.shape)
            if mean and not self._fused:
                # weight is w_D, exactly representable in D, so the scalar multiply is exactly
                # round_D(c * w_D); then a separate add: never an FMA.
                if grad.dtype == self._dtype:
                    torch.mul(grad_piece, weight, out=work)
                else:
                    work.copy_(grad_piece).mul_(weight)  # copy_ converts exactly like .to(D)
                buffer_piece.add_(work)
                continue
            work.copy_(grad_piece)
            if mean:
                buffer_piece.add_(work, alpha=weight)
            else:
                buffer_piece.add_(work)

    def _check_module(self, module: nn.Module) -> tuple[_Binding, list[tuple[str, nn.Parameter]]]:
        """Return the (possibly new) binding and the module's tracked parameters in its order.

        A window with nothing in it (``issued == 0``: a new accumulator, or right after a
        finish) binds to the module's current ``requires_grad`` parameters, so gradual
        unfreezing, LoRA toggles or a move to another device need no new accumulator; inside a
        window the set is fixed and a change raises :class:`ParameterMismatchError`.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        binding = self._binding
        if binding is None or self._issued == 0:
            parameters = _tracked_parameters(module)
            binding = _binding_of(parameters)
            self._structure_cache = (binding, ModuleStructure(module), parameters)
            return binding, parameters
        cached = self._structure_cache
        if cached is not None and cached[0] is binding and cached[1].unchanged(module):
            return binding, cached[2]
        every = dict(module.named_parameters())
        by_name = {name: p for name, p in every.items() if p.requires_grad}
        tracked = set(binding.names)
        if by_name.keys() != tracked:
            frozen = [n for n in binding.names if n in every and n not in by_name]
            missing = [n for n in binding.names if n not in every]
            extra = [n for n in by_name if n not in tracked]
            problems = []
            if frozen:
                problems.append(f"frozen (requires_grad=False) since it was bound: {frozen!r}")
            if missing:
                problems.append(f"missing from the module: {missing!r}")
            if extra:
                problems.append(f"trainable but not tracked: {extra!r}")
            raise ParameterMismatchError(
                f"the module's requires_grad parameters changed in the middle of a window "
                f"(issued={self._issued}); parameter(s) {'; '.join(problems)}. The tracked set "
                f"can change only between windows (after finish_sums/finish_mean)"
            )
        ordered = [(name, by_name[name]) for name in binding.names]
        for (name, parameter), shape, device in zip(
            ordered, binding.shapes, binding.devices, strict=True
        ):
            if not parameter.is_floating_point():
                raise ParameterMismatchError(
                    f"parameter {name!r} has dtype {parameter.dtype}: only floating-point "
                    f"parameters can be accumulated"
                )
            if parameter.shape != shape:
                raise ParameterMismatchError(
                    f"parameter {name!r} has shape {list(parameter.shape)}, tracked shape is "
                    f"{list(shape)} (mid-window)"
                )
            if parameter.device != device:
                raise ParameterMismatchError(
                    f"parameter {name!r} is on {parameter.device}, tracked device is {device} "
                    f"(mid-window)"
                )
        self._structure_cache = (binding, ModuleStructure(module), ordered)
        return binding, ordered

    def _collect_gradients(
        self,
        binding: _Binding,
        parameters: list[tuple[str, nn.Parameter]],
        grads: GradientMapping | None,
    ) -> list[torch.Tensor | None]:
        """The gradient of each tracked parameter (None = zero), checked, in binding order.

        A complete set whose shapes, dtypes, devices and layouts are those of the last one
        accepted for this binding is accepted on that comparison alone (one pass in C).
        """
        if grads is None:
            candidates = list(map(_GRAD, map(_SECOND, parameters)))
        else:
            if not isinstance(grads, Mapping):
                raise TypeError(
                    f"grads must be a mapping name -> tensor or None, got {type(grads).__name__}"
                )
            if not binding.name_set.issuperset(grads):
                unknown = [name for name in grads if name not in binding.name_set]
                raise ParameterMismatchError(
                    f"grads names parameter(s) {unknown!r} that are not tracked "
                    f"(tracked: {list(binding.names)!r})"
                )
            candidates = list(map(grads.get, binding.names))
        complete = not any(map(_IS_NONE, candidates))
        signature: tuple[object, ...] | None = None
        if complete:
            try:
                signature = tuple(map(_SIGNATURE, candidates))
            except AttributeError:
                signature = None  # not a tensor: the checks below name it
            cached = self._signature_cache
            if signature is not None and cached is not None and cached[0] is binding:
                if signature == cached[1]:
                    return candidates
        self._check_gradients(binding, parameters, candidates)
        if signature is not None:
            self._signature_cache = (binding, signature)
        return candidates

    @staticmethod
    def _check_gradients(
        binding: _Binding,
        parameters: list[tuple[str, nn.Parameter]],
        candidates: list[torch.Tensor | None],
    ) -> None:
        for (name, parameter), grad in zip(parameters, candidates, strict=True):
            if grad is None:
                continue
            if not isinstance(grad, torch.Tensor):
                raise ParameterMismatchError(
                    f"gradient of {name!r} must be a tensor or None, got {type(grad).__name__}"
                )
            if grad.dtype not in GRADIENT_DTYPES:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has dtype {grad.dtype}: one of "
                    f"{sorted(str(dtype) for dtype in GRADIENT_DTYPES)} is required"
                )
            if grad.layout != torch.strided:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has layout {grad.layout}: only dense (strided) "
                    f"gradients are accepted"
                )
            if grad.shape != parameter.shape:
                raise ParameterMismatchError(
                    f"gradient of {name!r} has shape {list(grad.shape)}, the parameter has "
                    f"shape {list(parameter.shape)}"
                )
            if grad.device != parameter.device:
                raise ParameterMismatchError(
                    f"gradient of {name!r} is on {grad.device}, the parameter is on "
                    f"{parameter.device}"
                )
        # The buffers have the tracked shapes and devices, whatever became of the parameters'
        # .data since the window bound (not re-checked per call: wacc_torch._structure).
        for name, grad, shape, device in zip(
            binding.names, candidates, binding.shapes, binding.devices, strict=True
        ):
            if grad is not None and (grad.shape != shape or grad.device != device):
                raise ParameterMismatchError(
                    f"gradient of {name!r} has shape {list(grad.shape)} on {grad.device}; the "
                    f"tracked shape is {list(shape)} on {device} (the parameter changed "
                    f"mid-window; the tracked set can change only between windows)"
                )

    # ------------------------------------------------------------------------- zero-copy
    def microbatch(self, module: nn.Module, *, weight: Weight, kind: Kind = "mean") -> Microbatch:
        """A block in which one backward adds one microbatch straight into ``.grad``.

        Zero-copy mode only (``zero_copy=True``)::

            with acc.microbatch(model, weight=tokens, kind="mean"):
                (loss_scale * loss_mean).backward()

        is ``accumulate_mean(model, tokens)`` (``kind="sum"``: ``accumulate_sum``) with the same
        bits, counters and errors, but the pending buffer is the parameter's ``.grad`` itself:
        no second copy of the gradients and no extra pass. Entering validates and raises
        before anything changes; see :mod:`wacc_torch.zero_copy` for what is refused and for a
        backward that raises inside the block (the window is then broken).
        """
        return Microbatch(self, module, weight=weight, kind=kind)

    def discard(self) -> None:
        """Drop the window: counters to 0, buffers released, a broken window usable again.

        In zero-copy mode each tracked ``.grad`` that is one of the window's buffers is set to
        None. Nothing else is touched; the next accumulate or block starts a new window.
        """
        if self._block is not None:
            raise ZeroCopyError("discard() inside a microbatch block; leave the block first")
        with _COMMIT:
            self._await_snapshots()
            self._release_grads()
            self._reset_window()
            self._broken = None

    def _check_mode(self, *, zero_copy: bool, call: str) -> None:
        if self._zero_copy != zero_copy:
            if zero_copy:
                raise ZeroCopyError(
                    f"{call}() needs an accumulator made with zero_copy=True; this one buffers "
                    f"(use accumulate_sum / accumulate_mean)"
                )
            raise ZeroCopyError(
                f"{call}() on a zero-copy accumulator: its buffers are the parameters' .grad, "
                f"so gradients are added by `with acc.microbatch(module, weight=w, kind=...)`"
            )
        self._check_usable()

    def _check_usable(self) -> None:
        """Refuse to use a broken window, or one whose ``.grad`` buffers changed outside it."""
        if self._block is not None:
            raise ZeroCopyError(
                "the accumulator is inside a microbatch block; only the block's backward may "
                "run until it is left"
            )
        if self._broken is None and self._zero_copy:
            changed = [
                name
                for name, buffer in self._pending.items()
                if buffer._version != self._grad_versions.get(name)
            ]
            if changed:
                # Nothing to record: the changed version is found again by every later call
                # until discard() or load_state_dict() replaces the buffers.
                raise BrokenWindowError(
                    f"the .grad of {changed!r} was changed in place outside a microbatch block "
                    f"(a backward outside a block, zero_grad(set_to_none=False), gradient "
                    f"clipping mid-window?): the window no longer holds its sums. Call "
                    f"discard(), or load_state_dict() with an earlier record"
                )
        if self._broken is not None:
            raise BrokenWindowError(self._broken)

    def _plan_microbatch(self, module: nn.Module, weight: object, *, mean: bool) -> _BlockPlan:
        """Validate a zero-copy block (may raise; changes nothing) and prepare its commit."""
        self._check_mode(zero_copy=True, call="microbatch")
        weight_value = _coerce_weight(weight)
        binding, parameters = self._check_module(module)
        structure = self._structure_cache[1] if self._structure_cache is not None else None
        if structure is None or structure is not self._fsdp_checked:
            refuse_fsdp(list(module.modules()) if structure is None else structure.modules)
            self._fsdp_checked = structure  # a cache of a check that passed, not state
        for name, parameter in parameters:
            if parameter.dtype != self._dtype:
                raise ZeroCopyError(
                    f"parameter {name!r} has dtype {parameter.dtype} but the work dtype is "
                    f"{self._dtype}: autograd hands gradients over in the parameter's dtype, so "
                    f"they could not be converted to D first (semantics §5). Use zero_copy=False "
                    f"or dtype={parameter.dtype}"
                )
            grad = parameter.grad
            buffer = self._pending.get(name)
            if buffer is None and grad is not None:
                raise ZeroCopyError(
                    f"parameter {name!r} already has a .grad this window does not own (a "
                    f"gradient of an earlier backward or window): the zero-copy mode adds into "
                    f".grad, so it must start empty. Call optimizer.zero_grad(set_to_none=True) "
                    f"before the window"
                )
            if buffer is not None and grad is not buffer:
                raise ZeroCopyError(
                    f"the .grad of parameter {name!r} was replaced since the window's last "
                    f"microbatch block: it must stay the window's pending buffer until finish"
                )
        positive = weight_value > 0
        counted_weight, new_total = self._counted_weight(weight, weight_value, mean=mean)
        if positive and binding.on_cpu:
            check_gradual_underflow("microbatch")
        work = None
        if positive and mean and not self._fused:
            with _ordinary_tensors():
                work = _Scratch.reusing(
                    self._kept_work,
                    ((device, self._dtype, numel) for device, numel in binding.pieces.items()),
                )

        def commit() -> None:
            with _COMMIT:
                self._work = None
                if work is not None:
                    self._kept_work = work
                self._binding = binding
                self._grad_versions = {
                    name: buffer._version for name, buffer in self._pending.items()
                }
                self._issued += 1
                if positive:
                    self._total_weight = new_total
                else:
                    self._zero_weight += 1

        return _BlockPlan(
            parameters=parameters,
            weight=float(counted_weight) if positive else None,
            work=work,
            commit=commit,
        )

    def _zero_copy_node(self, name: str, parameter: nn.Parameter) -> torch.autograd.graph.Node:
        node = _accumulate_grad_node(parameter)
        self._nodes[name] = (parameter, node)  # alive while its hook is (see zero_copy.py)
        return node

    def _add_into_grad(
        self, name: str, parameter: nn.Parameter, grad: torch.Tensor, *, weight: float, mean: bool
    ) -> None:
        """Inside a block's backward: add one parameter's microbatch gradient into ``.grad``."""
        buffer = self._pending.get(name)
        if buffer is None:
            # The first gradient of the window, into a new buffer: round_D(+0 + t) as in the
            # buffered mode (a stolen gradient would keep a -0.0 where that has +0.0).
            with _ordinary_tensors():
                buffer = torch.empty(parameter.shape, dtype=self._dtype, device=parameter.device)
            if self._fused and mean:
                buffer.zero_().add_(grad, alpha=weight)  # the opt-in order, as buffered
            else:
                # t (= g, or round_D(g * w_D) straight into the buffer), then + 0.0, piece by
                # piece while the piece is in cache: one pass fewer than zeros, t, add.
                for buffer_piece, grad_piece in _pieces(buffer, grad):
                    if mean:
                        torch.mul(grad_piece, weight, out=buffer_piece).add_(0.0)
                    else:
                        torch.add(grad_piece, 0.0, out=buffer_piece)
            parameter.grad = buffer
            self._pending[name] = buffer
            self._grad_owners[name] = parameter
            return
        shared = self._work
        if shared is not None and buffer.device.type != "cpu":
            # The hooks' kernels may run on different streams (one per producing op), where one
            # shared work tensor could be written by two at once: a fresh piece-sized one each
            # time, from the stream-ordered caching allocator.
            self._work = _Scratch([(buffer.device, self._dtype, _chunk_numel(buffer.shape))])
        try:
            self._add(buffer, grad, weight=weight, mean=mean)
        finally:
            self._work = shared

    def _release_grads(self) -> None:
        # Zero-copy: the window's buffers leave the parameters' .grad (a .grad replaced since is
        # someone else's and stays).
        for name, parameter in self._grad_owners.items():
            if parameter.grad is not None and parameter.grad is self._pending.get(name):
                parameter.grad = None

    # ---------------------------------------------------------------------------- finish
    def finish_sums(self) -> AccumulatedGradients:
        """Hand over the scaled sums and the window's weight W, and start a new window (§7).

        Nothing is divided and nothing is communicated: reduce the sums and the weights across
        ranks yourself, then divide by ``loss_scale`` exactly once and by the reduced weight
        (:func:`normalize_sums` does both). Works on an empty window too (W == 0). In zero-copy
        mode the sums are the parameters' ``.grad``, which keep them.
        """
        self._check_usable()
        with _COMMIT:
            self._await_snapshots()
            result = AccumulatedGradients(
                grads=self._handover(),
                weight=self._total_weight,
                loss_scale=self._loss_scale,
                issued=self._issued,
                zero_weight=self._zero_weight,
                normalized=False,
            )
            self._reset_window()
        return result

    def finish_mean(self) -> AccumulatedGradients:
        """Divide the sums by S, then by W (:func:`normalize_sums`), and start a new window (§8).

        Raises :class:`ZeroTotalWeightError` when W == 0 (an empty window or only zero-weight
        batches), clearing nothing. The buffers are divided in place and handed over; every
        divisor and temporary is made first, so a failure (out of memory, flush-to-zero) leaves
        the window as it was and the call can be repeated. In zero-copy mode the means are left
        in the parameters' ``.grad`` (``apply_to`` is not needed).
        """
        self._check_usable()
        if self._total_weight == 0.0:
            raise ZeroTotalWeightError(
                f"finish_mean on a window with total weight 0.0 (issued={self._issued}, "
                f"zero_weight={self._zero_weight}); nothing was cleared"
            )
        self._await_snapshots()  # the in-place division must wait for snapshot copies
        # Each arena is divided as one tensor (elementwise, so the same bits; its unused parts
        # hold +0.0, which stays +0.0), every other buffer on its own.
        in_arena = {name for arena in self._arenas.values() for name in arena.names}
        targets: dict[str, torch.Tensor | None] = {
            f"<arena {device}>": arena.storage for device, arena in self._arenas.items()
        }
        targets.update(
            (name, buffer) for name, buffer in self._pending.items() if name not in in_arena
        )
        normalize_sums(
            targets,
            loss_scale=self._loss_scale,
            total_weight=self._total_weight,
            in_place=True,
        )
        with _COMMIT:
            result = AccumulatedGradients(
                grads=self._handover(),
                weight=self._total_weight,
                loss_scale=self._loss_scale,
                issued=self._issued,
                zero_weight=self._zero_weight,
                normalized=True,
            )
            self._reset_window()
        return result

    def _handover(self) -> dict[str, torch.Tensor | None]:
        names = () if self._binding is None else self._binding.names
        return {name: self._pending.get(name) for name in names}

    def _reset_window(self) -> None:
        self._pending = {}
        self._arenas = {}
        self._issued = 0
        self._zero_weight = 0
        self._total_weight = 0.0
        self._grad_owners = {}
        self._grad_versions = {}

    # --------------------------------------------------------------------------- records
    def state_dict(self, *, checksum: bool = True) -> dict[str, Any]:
        """A record of the accumulator: plain Python values and CPU tensor copies (semantics §9).

        Keys:

        * ``format_version`` (int): record layout version, currently 1.
        * ``dtype`` (str): the work dtype D, torch spelling without ``torch.``
          (``"float32"``, ``"bfloat16"``, ...).
        * ``loss_scale`` (float): S.
        * ``fused`` (bool): whether means use the opt-in one-pass mode.
        * ``issued`` (int): microbatches accumulated in this window, zero-weight ones included.
        * ``zero_weight`` (int): how many of them had weight exactly 0.
        * ``total_weight`` (float): W, the float64 sum of the counted weights.
        * ``param_names`` (list[str]): tracked parameters in registration order; ``[]`` when no
          parameter set is bound yet (such a record loads into any module).
        * ``param_shapes`` (list[list[int]]): their shapes, same order.
        * ``pending`` (dict[str, Tensor]): the buffers allocated so far in this window, as CPU
          tensors of dtype D (copies: later accumulation does not change them). A buffer may
          hold inf or NaN (an overflow in D, a NaN gradient); the record keeps them as they are.
        * ``checksum`` (str): ``"sha256:"`` and the SHA-256 of the record's canonical bytes
          (every field above and every buffer's bits; :mod:`wacc_torch.records`), verified by
          ``load_state_dict`` after the field checks. A record without it loads unverified.
          ``checksum=False`` leaves it out: hashing runs at about 1 GB/s on one core, several
          times slower than the copy itself, which matters for a checkpoint of a large model
          taken often (``benchmarks``' large suite measures both).

        The record survives ``torch.save`` and ``torch.load(..., weights_only=True)``. A
        zero-copy accumulator's record is the same (its buffers are the ``.grad``), so records
        move freely between the modes.
        """
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {checksum!r}")
        self._check_usable()
        record = self._record_header()
        with _ordinary_tensors():
            record["pending"] = {
                name: buffer.detach().to("cpu", copy=True) for name, buffer in self._pending.items()
            }
        if checksum:
            record[CHECKSUM_KEY] = record_checksum_of(record)
        return record

    def state_dict_async(self, *, checksum: bool = True) -> StateDictHandle:
        """Start a snapshot like :meth:`state_dict` whose device-to-host copies run async.

        CUDA buffers are copied with ``non_blocking=True`` into pinned host memory on their
        device's current stream and a CUDA event is recorded after the copies; ``.result()``
        waits for it (and only then computes the checksum, over the completed copies). Later
        accumulation (on any stream) waits for that event first, so the snapshot holds the
        values of this call's moment; the handle keeps each source buffer alive and marked in
        use on the copy's stream until the copy is done, so handing it over (``finish_sums``)
        and freeing or reusing its memory cannot corrupt the snapshot. CPU buffers are copied
        synchronously. ``checksum`` as for :meth:`state_dict`.
        """
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {checksum!r}")
        self._check_usable()
        record = self._record_header()
        pending: dict[str, torch.Tensor] = {}
        cuda_devices: list[torch.device] = []
        sources: list[torch.Tensor] = []
        with _ordinary_tensors():
            for name, buffer in self._pending.items():
                if buffer.device.type == "cuda":
                    stream = torch.cuda.current_stream(buffer.device)
                    host = torch.empty(
                        buffer.shape, dtype=buffer.dtype, device="cpu", pin_memory=True
                    )
                    host.copy_(buffer.detach(), non_blocking=True)
                    # The caching allocator must not hand this memory to another stream before
                    # the copy ran, even if the buffer is freed right after this call.
                    buffer.record_stream(stream)
                    sources.append(buffer)
                    pending[name] = host
                    if buffer.device not in cuda_devices:
                        cuda_devices.append(buffer.device)
                else:
                    pending[name] = buffer.detach().to("cpu", copy=True)
        record["pending"] = pending
        events: list[torch.cuda.Event] = []
        for device in cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
            self._snapshot_events.append((device, event))
        return StateDictHandle(record, events, sources, checksum=checksum)

    def _record_header(self) -> dict[str, Any]:
        binding = self._binding
        return {
            "format_version": FORMAT_VERSION,
            "dtype": dtype_name(self._dtype),
            "loss_scale": self._loss_scale,
            "fused": self._fused,
            "issued": self._issued,
            "zero_weight": self._zero_weight,
            "total_weight": self._total_weight,
            "param_names": [] if binding is None else list(binding.names),
            "param_shapes": [] if binding is None else [list(s) for s in binding.shapes],
        }

    def _await_snapshots(self) -> None:
        # Make the current stream of each device wait for pending snapshot copies before a
        # buffer is changed or handed over, even if the caller switched streams since.
        for device, event in self._snapshot_events:
            torch.cuda.current_stream(device).wait_event(event)
        self._snapshot_events.clear()

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        """Restore counters and pending buffers from ``record`` for ``module`` (semantics §9).

        Every field is validated first (see :meth:`state_dict` for the keys; ``dtype``,
        ``loss_scale`` and ``fused`` must equal this accumulator's; names and shapes must match
        the module's ``requires_grad`` parameters unless the record binds none; pending buffers
        must be tensors of dtype D for recorded names; counters must be consistent). Any problem
        raises :class:`RecordError` naming the field, leaving the accumulator as it was. The
        module is checked first: one without requires_grad parameters, or with a non-floating
        one, raises :class:`ParameterMismatchError`. A record that binds no parameters leaves
        the accumulator unbound (the next accumulate binds).
        Buffers are copied onto the module's parameters' devices; the record is not aliased.
        In zero-copy mode each tracked parameter's ``.grad`` becomes its restored buffer (None
        without one), whatever it held, and a broken window is replaced; every tracked
        parameter must then have dtype D (:class:`ZeroCopyError`).
        """
        if self._block is not None:
            raise ZeroCopyError("load_state_dict() inside a microbatch block; leave it first")
        parameters = _tracked_parameters(module)
        validated = validate_record(
            record,
            dtype=self._dtype,
            loss_scale=self._loss_scale,
            fused=self._fused,
            tracked=[(name, parameter.shape) for name, parameter in parameters],
        )
        binding: _Binding | None = None
        restored: dict[str, torch.Tensor] = {}
        arenas: dict[torch.device, Arena] = {}
        if validated.param_names:
            device_of = {name: parameter.device for name, parameter in parameters}
            binding = _Binding(
                names=validated.param_names,
                shapes=tuple(torch.Size(shape) for shape in validated.param_shapes),
                devices=tuple(device_of[name] for name in validated.param_names),
            )
            with _ordinary_tensors(), torch.no_grad():
                # Fresh dense copies that this accumulator owns (an expanded or strided buffer
                # in the record could not be accumulated into element by element); small ones
                # into a new arena, as accumulation would have made them (buffered mode).
                if not self._zero_copy:
                    by_name = dict(parameters)
                    for device, indices in binding.small.items():
                        members = [(binding.names[i], by_name[binding.names[i]]) for i in indices]
                        if any(name in validated.pending for name, _ in members):
                            arenas[device] = Arena(members, dtype=self._dtype, device=device)
                in_arena = {
                    name: arena.views[name] for arena in arenas.values() for name in arena.names
                }
                for name, buffer in validated.pending.items():
                    view = in_arena.get(name)
                    if view is not None:
                        restored[name] = view.copy_(buffer.detach())
                    else:
                        restored[name] = buffer.detach().to(
                            device_of[name], memory_format=torch.contiguous_format, copy=True
                        )
        if self._zero_copy:
            for name, parameter in parameters:
                if parameter.dtype != self._dtype:
                    raise ZeroCopyError(
                        f"parameter {name!r} has dtype {parameter.dtype} but the work dtype is "
                        f"{self._dtype}: its .grad cannot be a pending buffer of dtype D"
                    )
        with _COMMIT:
            self._await_snapshots()
            if self._zero_copy:
                self._release_grads()
            self._binding = binding
            self._pending = restored
            self._arenas = arenas
            self._issued = validated.issued
            self._zero_weight = validated.zero_weight
            self._total_weight = validated.total_weight
            self._grad_owners = {}
            self._grad_versions = {}
            self._broken = None
            if self._zero_copy:
                for name, parameter in parameters:
                    parameter.grad = restored.get(name)
                    if name in restored:
                        self._grad_owners[name] = parameter
                self._grad_versions = {name: b._version for name, b in restored.items()}

    @classmethod
    def from_pending(
        cls,
        module: nn.Module,
        pending: Mapping[str, torch.Tensor],
        state: AccumulatorState,
    ) -> WeightedGradientsAccumulator:
        """Re-attach saved counters ``state`` to pending buffers the caller already restored.

        ``pending`` maps tracked parameter names to buffers of dtype ``state.dtype`` with the
        parameters' shapes, on the parameters' devices; they are adopted (detached), not copied,
        so each must be memory that accumulation can own: dense and non-overlapping (not an
        expanded, stride-0 view), not an inference tensor, and sharing its storage with no other
        pending buffer, tracked parameter or ``.grad`` (else an update of one would change the
        other). The new accumulator is bound to the module's ``requires_grad`` parameters.
        Raises :class:`ParameterMismatchError` for a bad buffer (name, shape, dtype, device,
        memory) and :class:`RecordError` for inconsistent counters.
        """
        if not isinstance(state, AccumulatorState):
            raise TypeError(f"state must be an AccumulatorState, got {type(state).__name__}")
        if state.zero_copy:
            raise ZeroCopyError(
                "from_pending() adopts buffers for the buffered mode; restore a zero-copy "
                "accumulator with load_state_dict() (it puts the buffers into .grad)"
            )
        accumulator = cls(dtype=state.dtype, loss_scale=state.loss_scale, fused=state.fused)
        if not isinstance(pending, Mapping):
            raise TypeError(f"pending must be a mapping, got {type(pending).__name__}")
        binding, parameters = accumulator._check_module(module)
        by_name = dict(parameters)
        # Storages the adopted buffers must not share: the parameters' and their .grad's.
        foreign = [
            (span, f"the memory of parameter {name!r}{suffix}")
            for name, parameter in parameters
            for tensor, suffix in ((parameter, ""), (parameter.grad, "'s .grad"))
            if tensor is not None and (span := _memory_span(tensor)) is not None
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
            if buffer.dtype != state.dtype:
                raise ParameterMismatchError(
                    f"pending buffer {name!r} has dtype {buffer.dtype}, expected {state.dtype}"
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
            _check_writable(buffer, what=f"pending buffer {name!r}")
            span = _memory_span(buffer)
            if span is not None:
                for other, owner in foreign:
                    if span[0] < other[1] and other[0] < span[1]:
                        raise ParameterMismatchError(
                            f"pending buffer {name!r} shares {owner}: accumulating into it "
                            f"would change that tensor too"
                        )
                foreign.append((span, f"the memory of pending buffer {name!r}"))
        issued, zero_weight, total_weight = check_counters(
            issued=state.issued,
            zero_weight=state.zero_weight,
            total_weight=state.total_weight,
            has_pending=bool(pending),
            bound=True,
        )
        adopted = {name: pending[name].detach() for name in binding.names if name in pending}
        with _COMMIT:
            accumulator._binding = binding
            accumulator._pending = adopted
            accumulator._issued = issued
            accumulator._zero_weight = zero_weight
            accumulator._total_weight = total_weight
        return accumulator


def _memory_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The byte range ``[start, end)`` a tensor's elements lie in (None: no memory, as for a
    meta or empty tensor). Disjoint views of one storage (the arena's buffers) do not overlap;
    interleaved strided views are reported as overlapping, which is safe."""
    if tensor.numel() == 0 or tensor.untyped_storage().data_ptr() == 0:
        return None
    start = tensor.data_ptr()
    extents = zip(tensor.shape, tensor.stride(), strict=True)
    last = sum((size - 1) * stride for size, stride in extents)
    return start, start + (last + 1) * tensor.element_size()
