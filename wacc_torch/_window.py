"""The accumulation window: the core both modes feed (semantics §3, §7-§9).

:class:`Window` owns what the semantics calls the accumulator's state: the options (D, S, fused),
the binding (the tracked parameter set), the counters (``issued``, ``zero_weight``, ``W``) and the
pending buffers, plus the snapshots in flight and the binder's cache of the module. It does no
feeding: each way of adding gradients is a *mode* over it, :class:`WindowMode`'s subclasses —
:class:`wacc_torch.buffered.BufferedMode` (``accumulate_*``) and
:class:`wacc_torch.zero_copy.ZeroCopyMode` (``microbatch`` blocks) — and what every mode shares
(finishing, records, ``discard``) is :class:`WindowMode`'s, with the few points where the modes
differ as overridable steps: whether the window may be read now, where a restored buffer lives,
what ending a window releases.

Ownership at a glance: the window's fields are the window's; a mode's fields (arenas and caches
of the buffered mode; the open block, the broken flag and the ``.grad`` bookkeeping of the
zero-copy mode) are that mode's, and live for one window unless said otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from wacc_torch import _commit
from wacc_torch._binding import Binder, Binding, Parameters, tracked_parameters
from wacc_torch._dtypes import check_loss_scale, dtype_name
from wacc_torch._finite import found_inf, narrower
from wacc_torch._snapshots import Snapshots, StateDictHandle
from wacc_torch._weights import count_weight
from wacc_torch.errors import InvalidLossScaleError, ParameterMismatchError, ZeroTotalWeightError
from wacc_torch.normalize import divide_sums
from wacc_torch.records import FORMAT_VERSION, ValidatedRecord, validate_record
from wacc_torch.results import AccumulatedGradients

__all__ = ["Window", "WindowMode"]


def _nothing() -> None:
    return None


class Window:
    """One accumulator's window: options, binding, counters and pending buffers (semantics §3).

    ``binding`` outlives the window (finishing does not unbind); everything else that refers to
    a module or its parameters is dropped when the window ends (:meth:`reset`).
    """

    def __init__(self, *, dtype: torch.dtype, loss_scale: float, fused: bool) -> None:
        self.dtype = dtype
        self.loss_scale = loss_scale
        self.fused = fused
        self.binding: Binding | None = None
        self.pending: dict[str, torch.Tensor] = {}
        self.issued = 0
        self.zero_weight = 0
        self.total_weight = 0.0
        self.binder = Binder()
        self.snapshots = Snapshots()

    def bind(self, module: nn.Module) -> tuple[Binding, Parameters]:
        """The binding a call with ``module`` uses, and its tracked parameters in binding order
        (a new binding when the window is empty; mid-window a change raises)."""
        return self.binder.check(module, self.binding, issued=self.issued)

    def count_weight(
        self, weight: object, value: int | float, *, mean: bool, caller: str
    ) -> tuple[int | float, float]:
        """What a batch of weight ``value`` counts and the new W (:func:`count_weight`)."""
        return count_weight(
            self.total_weight, weight, value, dtype=self.dtype, mean=mean, caller=caller
        )

    def count(self, binding: Binding, *, positive: bool, new_total: float) -> None:
        """Commit: one more batch of the window, bound to ``binding``."""
        self.binding = binding
        self.issued += 1
        if positive:
            self.total_weight = new_total
        else:
            self.zero_weight += 1

    def handover(self) -> dict[str, torch.Tensor | None]:
        """Every tracked name with its pending buffer or None (semantics §7)."""
        names = () if self.binding is None else self.binding.names
        return {name: self.pending.get(name) for name in names}

    def result(self, *, normalized: bool, found_inf: bool) -> AccumulatedGradients:
        """The finished window (its buffers handed over, not copied)."""
        return AccumulatedGradients(
            grads=self.handover(),
            weight=self.total_weight,
            loss_scale=self.loss_scale,
            issued=self.issued,
            zero_weight=self.zero_weight,
            normalized=normalized,
            found_inf=found_inf,
        )

    def reset(self) -> None:
        """Commit: a new, empty window; nothing of the module is held any more."""
        self.pending = {}
        self.issued = 0
        self.zero_weight = 0
        self.total_weight = 0.0
        self.binder.forget()

    def header(self) -> dict[str, Any]:
        """The record's fields but ``pending`` (semantics §9)."""
        binding = self.binding
        return {
            "format_version": FORMAT_VERSION,
            "dtype": dtype_name(self.dtype),
            "loss_scale": self.loss_scale,
            "fused": self.fused,
            "issued": self.issued,
            "zero_weight": self.zero_weight,
            "total_weight": self.total_weight,
            "param_names": [] if binding is None else list(binding.names),
            "param_shapes": [] if binding is None else [list(s) for s in binding.shapes],
        }


class WindowMode:
    """What both modes share over a :class:`Window`: finishing, records, ``discard``.

    A subclass feeds the window and overrides the steps where it differs: :meth:`check_readable`
    (may the window be read or handed over now), :meth:`check_intact` (does it still hold its
    sums), :meth:`check_loadable` (may it be replaced),
    :meth:`division_targets` (what ``finish_mean`` divides), :meth:`prepare_restore` (where
    restored buffers live), :meth:`end_window` (what the mode drops with the window) and
    :meth:`release` (what ``discard`` gives back).
    """

    zero_copy = False

    def __init__(self, window: Window) -> None:
        self.window = window

    # ------------------------------------------------------------------ steps to override
    def check_readable(self) -> None:
        """Raise if the window cannot be read or handed over now (default: it always can)."""

    def check_loadable(self) -> None:
        """Raise if the window cannot be replaced (a load, ``discard``) now (default: it can)."""

    def check_outside_block(self, call: str) -> None:
        """Raise if ``call`` cannot run now because a block is open (default: never)."""

    def check_intact(self) -> None:
        """Raise if the window no longer holds its sums (default: it always does)."""

    def division_targets(self) -> dict[str, torch.Tensor | None]:
        """The tensors ``finish_mean`` divides in place (default: each pending buffer)."""
        return dict(self.window.pending)

    def prepare_restore(
        self, validated: ValidatedRecord, binding: Binding | None, parameters: Parameters
    ) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
        """New buffers holding the record's pending values and the mode's own commit step of
        the load, run after the window took the restored state (may raise; changes nothing)."""
        device_of = {name: parameter.device for name, parameter in parameters}
        with _commit.ordinary_tensors(), torch.no_grad():
            # Fresh dense copies that the window owns (an expanded or strided buffer in the
            # record could not be accumulated into element by element).
            restored = {
                name: buffer.detach().to(
                    device_of[name], memory_format=torch.contiguous_format, copy=True
                )
                for name, buffer in validated.pending.items()
            }
        return restored, _nothing

    def end_window(self) -> None:
        """Commit step when a window ends (finish, discard, load): drop the mode's fields."""

    def release(self) -> None:
        """Commit step of ``discard``, before the window is reset (default: nothing)."""

    # ----------------------------------------------------------------------- shared calls
    def finish_sums(self) -> AccumulatedGradients:
        """semantics §7; see ``WeightedGradientsAccumulator.finish_sums``."""
        self.check_readable()
        window = self.window
        window.snapshots.await_copies()
        overflowed = found_inf(window.pending.values())  # reads the buffers once
        with _commit.COMMIT:
            result = window.result(normalized=False, found_inf=overflowed)
            self._end()
        return result

    def finish_mean(self) -> AccumulatedGradients:
        """semantics §8; see ``WeightedGradientsAccumulator.finish_mean``."""
        self.check_readable()
        window = self.window
        if window.total_weight == 0.0:
            raise ZeroTotalWeightError(
                f"finish_mean on a window with total weight 0.0 (issued={window.issued}, "
                f"zero_weight={window.zero_weight}); nothing was cleared"
            )
        window.snapshots.await_copies()  # the in-place division must wait for snapshot copies
        # What apply_to will write: found_inf also of the means in the parameters' dtypes
        # (a finite float32 mean above 65504 is inf in a float16 .grad), semantics §8.
        binding = window.binding
        dtype_of = {} if binding is None else dict(zip(binding.names, binding.dtypes, strict=True))
        division = self.division_targets()
        _, check = divide_sums(
            division,
            loss_scale=window.loss_scale,
            total_weight=window.total_weight,
            in_place=True,
            find_inf=True,
            targets=dtype_of,
        )
        overflowed = check is not None and check.found()
        # The small buffers divided as one arena (of mixed parameters): their narrower dtypes
        # are judged on their own, a read of small tensors only.
        narrow = [
            (buffer, dtype_of[name])
            for name, buffer in window.pending.items()
            if name not in division and narrower(buffer.dtype, dtype_of[name]) != buffer.dtype
        ]
        if narrow and not overflowed:
            overflowed = found_inf([b for b, _ in narrow], [aim for _, aim in narrow])
        with _commit.COMMIT:
            result = window.result(normalized=True, found_inf=overflowed)
            self._end()
        return result

    def set_loss_scale(self, loss_scale: object) -> None:
        """semantics §4 Reading; see ``WeightedGradientsAccumulator.set_loss_scale``."""
        self.check_outside_block("set_loss_scale")
        # A broken window is not empty, even with issued == 0: part of a microbatch is in it.
        self.check_intact()
        window = self.window
        if window.issued:
            raise InvalidLossScaleError(
                f"set_loss_scale({loss_scale!r}): the window has issued {window.issued} "
                f"microbatch(es) under loss scale {window.loss_scale!r}, and every backward of a "
                "window has one loss scale; finish or discard the window first"
            )
        scale = check_loss_scale(loss_scale, window.dtype)
        with _commit.COMMIT:
            window.loss_scale = scale

    def state_dict(self, *, checksum: bool) -> dict[str, Any]:
        """semantics §9; see ``WeightedGradientsAccumulator.state_dict``."""
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {checksum!r}")
        self.check_readable()
        window = self.window
        return window.snapshots.take(window.header(), window.pending, checksum=checksum)

    def state_dict_async(self, *, checksum: bool) -> StateDictHandle:
        """semantics §9; see ``WeightedGradientsAccumulator.state_dict_async``."""
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {checksum!r}")
        self.check_readable()
        window = self.window
        return window.snapshots.take_async(window.header(), window.pending, checksum=checksum)

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        """semantics §9; see ``WeightedGradientsAccumulator.load_state_dict``."""
        self.check_loadable()
        window = self.window
        parameters = tracked_parameters(module)
        validated = validate_record(
            record,
            dtype=window.dtype,
            loss_scale=window.loss_scale,
            fused=window.fused,
            tracked=[(name, parameter.shape) for name, parameter in parameters],
        )
        binding: Binding | None = None
        if validated.param_names:
            device_of = {name: parameter.device for name, parameter in parameters}
            for name in validated.pending:
                if device_of[name].type == "meta":
                    # Restored "on the parameter's device" would drop the values (semantics §9).
                    raise ParameterMismatchError(
                        f"parameter {name!r} is on the {device_of[name]} device, which holds no "
                        f"values, and the record holds a pending buffer for it: loading it "
                        f"there would drop the window's sums. Materialize the module "
                        f"(module.to_empty(device=...)) before loading the record"
                    )
            dtype_of = {name: parameter.dtype for name, parameter in parameters}
            binding = Binding(
                names=validated.param_names,
                shapes=tuple(torch.Size(shape) for shape in validated.param_shapes),
                devices=tuple(device_of[name] for name in validated.param_names),
                dtypes=tuple(dtype_of[name] for name in validated.param_names),
            )
        restored, commit = self.prepare_restore(validated, binding, parameters)
        # The module as checked here, so that the window's next calls compare rather than walk
        # it again (and the zero-copy mode can tell its .grad owners from the module's).
        checked = None
        if binding is not None:
            by_name = dict(parameters)
            ordered = [(name, by_name[name]) for name in binding.names]
            checked = window.binder.snapshot(module, binding, ordered)
        with _commit.COMMIT:
            window.snapshots.await_copies()
            self.release()
            window.reset()
            window.binder.prime(checked)
            window.binding = binding
            window.pending = restored
            window.issued = validated.issued
            window.zero_weight = validated.zero_weight
            window.total_weight = validated.total_weight
            self.end_window()
            commit()

    def discard(self) -> None:
        """Drop the window: counters to 0, buffers released (see the accumulator's method)."""
        self.check_loadable()
        with _commit.COMMIT:
            self.window.snapshots.await_copies()
            self.release()
            self._end()

    def _end(self) -> None:
        self.window.reset()
        self.end_window()
