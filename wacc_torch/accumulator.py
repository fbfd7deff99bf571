"""Weighted gradient accumulation over unequal microbatches (semantics §3-§9): the public face.

:class:`WeightedGradientsAccumulator` is one class with two modes over one core:

* the window (:mod:`wacc_torch._window`): options, binding, counters, pending buffers, records;
* the buffered mode (:mod:`wacc_torch.buffered`): ``accumulate_sum`` / ``accumulate_mean``;
* the zero-copy mode (:mod:`wacc_torch.zero_copy`): ``microbatch`` blocks into ``.grad``.

The default evaluation order is the reproducible one of the semantics: convert then add (sums),
multiply then add (means), and a sequential division by the loss scale and then by the total
weight, each step rounded on its own. ``fused=True`` is an opt-in one-pass mode for means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from wacc_torch._dtypes import check_loss_scale, check_work_dtype
from wacc_torch._gradients import GradientMapping
from wacc_torch._snapshots import StateDictHandle
from wacc_torch._window import Window, WindowMode
from wacc_torch.buffered import BufferedMode
from wacc_torch.errors import ZeroCopyError
from wacc_torch.normalize import normalize_sums
from wacc_torch.results import AccumulatedGradients, AccumulatorState
from wacc_torch.zero_copy import Kind, Microbatch, ZeroCopyMode

__all__ = [
    "AccumulatedGradients",
    "AccumulatorState",
    "StateDictHandle",
    "WeightedGradientsAccumulator",
    "normalize_sums",
]

Weight = float | torch.Tensor


class WeightedGradientsAccumulator:
    """Accumulates gradients of unequal microbatches and normalizes them once (semantics §3-§9).

    Options are keyword-only: ``dtype`` is the work dtype D of the pending buffers (float64,
    float32, float16 or bfloat16), ``loss_scale`` the fixed loss scale S every backward of the
    window used (a finite float > 0 exactly representable in D), ``fused`` selects the opt-in
    one-pass mode for means (``buf.add_(c, alpha=w_D)``, not reproducible across devices),
    ``zero_copy`` the mode in which the pending buffers are the parameters' ``.grad``, filled by
    ``microbatch`` blocks (:mod:`wacc_torch.zero_copy`) instead of ``accumulate_*`` calls.

    Gradients come either from a ``grads`` mapping (name -> tensor or None; a name left out is
    None, i.e. a zero contribution; an unknown name raises) or, when ``grads`` is None, from each
    tracked parameter's ``.grad``, which is then taken out of the module (set to None), also for
    a zero-weight batch, so a stale ``.grad`` can never leak into the next microbatch.

    The tracked set is the module's ``requires_grad`` parameters (names, shapes, devices),
    matched by name, bound by the first accumulate of a window (a zero-weight one too) or by a
    load. A window with nothing in it yet (``issued == 0``: new, or just finished) binds to the
    module's current trainable parameters, so unfreezing, adapters switched on or off, a resized
    embedding or a move to another device need no new accumulator, and nothing of the previous
    window's module is held; inside a window a change raises :class:`ParameterMismatchError`
    (a parameter that became frozen is named as frozen). A parameter's buffer (D, on the
    parameter's device, starting at +0.0) exists from its first non-None gradient in a
    positive-weight batch of the window; buffers are ordinary tensors even under
    ``torch.inference_mode()``. Small parameters (at most
    :data:`wacc_torch._arena.SMALL_ELEMENTS` elements) have their buffers in one flat arena
    per device, allocated whole at the first positive-weight batch, so that a complete set of
    their gradients is added as one tensor (same bits; :mod:`wacc_torch._arena`). The module's
    structure is walked once per window; later calls compare it (:mod:`wacc_torch._structure`).

    Weights and the loss scale follow one rule (:mod:`wacc_torch._scalars`): a Python int or
    float, or a numpy scalar / 0-d array / 0-d tensor of an integer or one of six float
    formats, read exactly (``Fraction``, ``longdouble``, bools, complex are refused). Gradients
    must be one of float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2. Wherever
    wacc computes on the CPU (the weights and W on the host; the buffers of CPU parameters),
    flush-to-zero (``torch.set_flush_denormal(True)``) in the computing thread is refused with
    :class:`~wacc_torch.errors.UnsupportedEnvironmentError`: results would differ from
    semantics §2.

    Every mutating call prepares first (validation, conversion, allocation of every buffer and
    temporary: anything that may raise) and then commits with in-place kernels and assignments
    only, so a call that raises, out of memory included, leaves the counters, the buffers and
    the module's ``.grad`` exactly as they were (the zero-copy mode's broken window is the one
    documented exception: a backward cannot be undone).
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
        window = Window(dtype=work_dtype, loss_scale=scale, fused=fused)
        self._mode: WindowMode = ZeroCopyMode(window) if zero_copy else BufferedMode(window)

    # ----------------------------------------------------------------------------- reading
    @property
    def state(self) -> AccumulatorState:
        """A frozen copy of the options and counters; reading it changes nothing."""
        window = self._mode.window
        return AccumulatorState(
            dtype=window.dtype,
            loss_scale=window.loss_scale,
            issued=window.issued,
            zero_weight=window.zero_weight,
            total_weight=window.total_weight,
            fused=window.fused,
            zero_copy=self._mode.zero_copy,
        )

    def __repr__(self) -> str:
        state = self.state
        return (
            f"{type(self).__name__}(dtype={state.dtype}, loss_scale={state.loss_scale!r}, "
            f"fused={state.fused}, zero_copy={state.zero_copy}, issued={state.issued}, "
            f"zero_weight={state.zero_weight}, total_weight={state.total_weight!r})"
        )

    # ------------------------------------------------------------------------- the modes
    def _buffered(self, call: str) -> BufferedMode:
        mode = self._mode
        if not isinstance(mode, BufferedMode):
            raise ZeroCopyError(
                f"{call}() on a zero-copy accumulator: its buffers are the parameters' .grad, "
                f"so gradients are added by `with acc.microbatch(module, weight=w, kind=...)`"
            )
        return mode

    def _zero_copy(self, call: str) -> ZeroCopyMode:
        mode = self._mode
        if not isinstance(mode, ZeroCopyMode):
            raise ZeroCopyError(
                f"{call}() needs an accumulator made with zero_copy=True; this one buffers "
                f"(use accumulate_sum / accumulate_mean)"
            )
        return mode

    # ---------------------------------------------------------------------- accumulation
    def accumulate_sum(
        self, module: nn.Module, weight: Weight, *, grads: GradientMapping | None = None
    ) -> None:
        """Add the gradients of ``S * sum_t loss_t`` of one microbatch (semantics §5).

        ``weight`` is the microbatch's effective token/sample count w (a real number or 0-d
        tensor, finite, >= 0). For w > 0 each buffer becomes ``round_D(buf + conv_D(g))`` and W
        becomes ``round_64(W + w)``. For w == 0 no gradient value is read (NaN or inf ones
        included); only ``issued`` and ``zero_weight`` count it. Buffered mode only.
        """
        mode = self._buffered("accumulate_sum")
        mode.accumulate(module, grads, weight=weight, mean=False, caller="accumulate_sum")

    def accumulate_mean(
        self,
        module: nn.Module,
        weight: Weight,
        *,
        grads: GradientMapping | None = None,
        disposable: bool = False,
    ) -> None:
        """Add the gradients of ``S * mean_t loss_t`` of one microbatch, times its weight (§6).

        The weight counted is ``w_D = conv_D(w)``, what the work dtype makes of w (bfloat16:
        1001 -> 1000). For w > 0, ``t = round_D(conv_D(g) * w_D)`` then
        ``buf = round_D(buf + t)`` (two roundings), and W becomes ``round_64(W + w_D)``; with
        ``fused=True`` the one-pass ``buf.add_(conv_D(g), alpha=w_D)`` is used instead. A w > 0
        whose w_D is 0 or not finite raises :class:`InvalidWeightError`. Buffered mode only.

        ``disposable=True`` hands the gradients over: the caller will not read them again (the
        ``grads`` tensors, or the ``.grad`` tensors taken). The reproducible product is then
        written into each gradient in D that is a plain tensor sharing its memory with no other
        gradient of the call and no parameter or buffer of the module, instead of a work
        tensor: the same bits, no work tensor for it, and measured 3-12 % slower on large
        tensors on a CPU (the work piece stays in cache, the written gradient goes back to
        memory). Without it no tensor of the caller's is ever written.
        """
        if not isinstance(disposable, bool):
            raise TypeError(f"disposable must be True or False, got {disposable!r}")
        mode = self._buffered("accumulate_mean")
        mode.accumulate(
            module,
            grads,
            weight=weight,
            mean=True,
            caller="accumulate_mean",
            disposable=disposable,
        )

    def microbatch(self, module: nn.Module, *, weight: Weight, kind: Kind = "mean") -> Microbatch:
        """A block in which one backward adds one microbatch straight into ``.grad``.

        Zero-copy mode only (``zero_copy=True``)::

            with acc.microbatch(model, weight=tokens, kind="mean"):
                (loss_scale * loss_mean).backward()

        is ``accumulate_mean(model, tokens)`` (``kind="sum"``: ``accumulate_sum``) with the same
        bits, counters and errors, but the pending buffer is the parameter's ``.grad`` itself:
        no second copy of the gradients and no extra pass. Entering validates and raises
        before anything changes; see :mod:`wacc_torch.zero_copy` for every rule of the mode.
        """
        return Microbatch(self._zero_copy("microbatch"), module, weight=weight, kind=kind)

    def discard(self) -> None:
        """Drop the window: counters to 0, buffers released, a broken window usable again.

        In zero-copy mode each tracked ``.grad`` that is one of the window's buffers is set to
        None. Nothing else is touched; the next accumulate or block starts a new window.
        """
        self._mode.discard()

    def set_loss_scale(self, loss_scale: float) -> None:
        """Make ``loss_scale`` the loss scale S of the window about to start (semantics §4).

        Only between windows: the window must be empty (``issued == 0``: just constructed,
        finished, discarded, or loaded from a record of an empty window), because every backward
        of a window has one S; otherwise :class:`InvalidLossScaleError`, naming both scales. The
        value is checked like the constructor's (finite, > 0, exactly representable in D:
        :class:`InvalidLossScaleError` naming it); a broken zero-copy window is not empty, even with
        ``issued == 0``: :class:`BrokenWindowError`. Nothing changes on a raise. This is how a
        dynamic loss scale (:class:`wacc_torch.WindowLossScaler`) reaches the accumulator; it is
        never changed otherwise, and never inferred from gradient values.
        """
        self._mode.set_loss_scale(loss_scale)

    # ---------------------------------------------------------------------------- finish
    def finish_sums(self) -> AccumulatedGradients:
        """Hand over the scaled sums and the window's weight W, and start a new window (§7).

        Nothing is divided and nothing is communicated: reduce the sums and the weights across
        ranks yourself, then divide by ``loss_scale`` exactly once and by the reduced weight
        (:func:`normalize_sums` does both). Works on an empty window too (W == 0). In zero-copy
        mode the sums are the parameters' ``.grad``, which keep them.
        """
        return self._mode.finish_sums()

    def finish_mean(self) -> AccumulatedGradients:
        """Divide the sums by S, then by W (:func:`normalize_sums`), and start a new window (§8).

        Raises :class:`ZeroTotalWeightError` when W == 0 (an empty window or only zero-weight
        batches), clearing nothing. The buffers are divided in place and handed over; every
        divisor and temporary is made first, so a failure (out of memory, flush-to-zero) leaves
        the window as it was and the call can be repeated. In zero-copy mode the means are left
        in the parameters' ``.grad`` (``apply_to`` is not needed).
        """
        return self._mode.finish_mean()

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
        return self._mode.state_dict(checksum=checksum)

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
        return self._mode.state_dict_async(checksum=checksum)

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
        self._mode.load_state_dict(record, module)

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
        memory) and :class:`RecordError` for inconsistent counters. Buffered mode only (a
        zero-copy accumulator is restored with :meth:`load_state_dict`, which puts the buffers
        into ``.grad``).
        """
        if not isinstance(state, AccumulatorState):
            raise TypeError(f"state must be an AccumulatorState, got {type(state).__name__}")
        if state.zero_copy:
            raise ZeroCopyError(
                "from_pending() adopts buffers for the buffered mode; restore a zero-copy "
                "accumulator with load_state_dict() (it puts the buffers into .grad)"
            )
        accumulator = cls(dtype=state.dtype, loss_scale=state.loss_scale, fused=state.fused)
        accumulator._buffered("from_pending").adopt(
            module,
            pending,
            issued=state.issued,
            zero_weight=state.zero_weight,
            total_weight=state.total_weight,
        )
        return accumulator
