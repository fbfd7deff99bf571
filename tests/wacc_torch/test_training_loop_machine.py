"""A stateful differential machine over what real training loops do (issue 15).

Two identical small real models (``Net``: a Linear, a parameter used twice per forward, an optional
branch, an embedding that can be resized, a replaceable submodule, a frozen parameter that can be
unfrozen, an optional extra parameter) are trained side by side with real ``backward()`` calls:
one through the zero-copy mode (Z: ``acc.microbatch(...)``, ``.grad`` IS the pending buffer), one
through the buffered mode (B: a plain backward, then ``accumulate_sum`` / ``accumulate_mean``).
The reference model (``wacc_ref``'s :class:`ReferenceAccumulator`) is fed exactly the gradients B
took. The oracle is ``docs/semantics.md`` — §3's Readings on the tracked set, §6's on the
zero-copy mode and its ``.grad``, §11 — and the rules listed in :mod:`wacc_torch.zero_copy`.

After every step (the invariant ``modes_agree``): the three hold the same counters; B's record and
the reference's have the same checksum and pending values; Z's record equals B's field by field,
with the same checksum, and every pending buffer of Z is the parameter's ``.grad``, bit for bit
(or Z refuses ``state_dict`` with exactly the error the semantics give for its condition);
both models hold the same parameters, bit for bit. Each rule also checks its own outcome: the
same error class in B and the reference; in Z the documented error, and a refused call changed
nothing (counters, record, every ``.grad``'s identity and bits); a broken window refuses every
call with ``BrokenWindowError`` until ``discard()`` or a load. Where the modes legitimately
differ (B takes an edited or stale ``.grad`` as the microbatch's gradient, Z refuses), each
mode's documented behaviour is checked and Z is then resynchronised: B's record, through
``torch.save`` / ``torch.load(weights_only=True)``, is loaded into Z (records are mode-free), or
all three discard their window.

Rules
-----
``microbatch`` (plain) and ``microbatch_with_a_twist``: one microbatch in both modes. Weights: 0,
small ints, floats, ints above 2**53, numpy scalars, 0-d tensors, and a few invalid ones (negative,
NaN, inf, a bool, 1e308 that overflows W or D). Kinds sum and mean; the branch on or off;
activation checkpointing (none, non-reentrant, reentrant); the backward in another thread
(``threading.Thread``, joined inside the block). Twists: a custom ``autograd.Function`` whose
backward raises, early (nothing added yet) or late (after some parameters got their gradient); a
second backward (``retain_graph``); a parameter used inside and outside a reentrant checkpoint;
flush-to-zero in the backward's thread or in the main thread (always restored in a ``finally``);
an in-block ``.grad`` edit before or after the backward (``zero_grad(set_to_none=True/False)``,
``mul_(2)``, ``clip_grad_norm_``, a clone, a foreign tensor, ``None``); a nested block, the
accumulator's calls inside a block, and the other mode's calls (``accumulate_*`` on Z,
``microbatch`` on B).
``end_window``: ``finish_sums`` / ``finish_mean`` (optionally under flush-to-zero), compared bit
for bit (Z's result is ``.grad`` itself), or ``discard()`` (the reference finishes its window:
READING 2); then an optimizer step and ``zero_grad``, ``zero_grad`` alone, the results left in
``.grad`` (stale for the next window), ``zero_grad(set_to_none=False)``, or new models: the old
ones must die (weakrefs), the accumulators holding nothing of a past binding.
``checkpoint_restore``: ``state_dict`` (or ``state_dict_async``) -> ``torch.save`` ->
``torch.load(weights_only=True)`` -> ``load_state_dict`` into a FRESH accumulator of the role's
mode or into the same one, the record taken from either mode (records move between modes); a
corrupted record first (refused with ``RecordError`` by both, nothing changed, a broken window
stays broken).
``edit_grads``: out-of-block ``.grad`` edits (the ops above); Z's refusals are then probed
(``state_dict``, ``state_dict_async``, ``finish_*``, a block's entry), each changing nothing.
``change_model``: ``.data`` resize (embedding rows), reshape keeping the element count, dtype
change; ``requires_grad`` flips; an extra parameter added or removed; mid-window (refused by both,
then reverted or the window discarded; a dtype change: Z refuses, also a load, B converts) and
between windows (both bind anew; a plain backward after a resize works).
``reregister``: a parameter re-registered or a submodule replaced by an identical copy, mid-window
(B accepts, Z refuses while the old parameter holds its buffer) or between windows; the old one
put back, left (Z refuses until resynchronised), or Z restored from B's record.
``resize_inside_block``: ``.data`` resized or reshaped between a block's entry and its backward.

Readings (choices where the semantics are silent; each marked ``READING n`` where it is used)
--------------------------------------------------------------------------------------------
1. A zero-weight block under flush-to-zero in the backward's thread is accepted, like B's
   zero-weight accumulate and Z's zero-weight entry: its gradients are never read, so no CPU
   arithmetic runs ("Z's block entry (w > 0) and each hook").
2. ``discard()`` keeps the tracked binding (names and shapes), as ``finish_*`` does (semantics §3:
   "it outlives the window"); the reference, which has no ``discard``, finishes its window.
3. ``.data`` resized between a block's entry and its backward: the hook raises
   ``ParameterMismatchError``. When the new shape cannot be expanded from the old one, PyTorch's
   engine itself refuses first (``RuntimeError``: "returned an invalid gradient", checked against
   the AccumulateGrad node that the block holds since its entry, before the hook runs), so both
   classes are accepted; the block must not be counted either way, and the window is either
   unchanged or broken.
4. A ``.grad`` that the window does not own, on a parameter without a buffer: ``state_dict`` and
   ``finish_*`` refuse it (``ZeroCopyError``) only when ``issued > 0``; the parameters looked at
   there are those of the module the window last bound, under the bound names, as the module
   holds them now (the accumulator has no module argument then): a parameter re-registered as a
   new tensor is looked at as that tensor, and when the module's trainable names changed nothing
   is looked at (the next block's entry names the change).
5. Where two conditions hold at once (say a broken window and an invalid weight), either class is
   accepted: the semantics order the checks of one call, not Z's own conditions against them.
6. The accumulator's calls inside a block (``state_dict``, ``finish_sums``, ``discard``, a nested
   ``microbatch``) raise ``ZeroCopyError`` and change nothing (the existing suite's contract).
7. A record that binds parameters whose shapes no longer match the module (a window finished, the
   model then resized) is refused by ``load_state_dict`` with ``RecordError`` in both modes
   (semantics §9: ``param_shapes`` must equal the module's).
8. "A plain backward after resizing works" and "the old module and parameters die after
   ``finish_*``/``discard()`` and ``del``" hold once PyTorch itself lets go: after a backward that
   raised in one branch, the engine keeps the other branches' ready tasks (each holds its
   AccumulateGrad node, which holds the parameter and its old shape) in the thread's ready queue
   until the next backward in that thread (pure PyTorch, no accumulator involved: a resized
   parameter then meets its old node, "returned an invalid gradient"). The machine drains the
   queue with a throwaway backward right after every backward that raised (``_drain_engine``).

Not expressed: devices (the CPU only here), DDP and FSDP, sparse gradients, ``create_graph=True``
(PyTorch warns about a reference cycle, and warnings are errors in this suite), ``fused=True``
(the buffered mode adds small gradients as one concatenated tensor, so the vectorized/tail split
of ``add_(alpha=w)`` may differ per element from Z's per-parameter adds: both are in semantics
§6's set, but not bit-identical).

Budget
------
Examples and steps scale with the active Hypothesis profile: ``max_examples`` is the profile's
divided by ``EXAMPLES_DIVISOR`` (2), each example runs up to ``STEPS`` (60) steps (rules are
drawn with Hypothesis' swarm testing). Under ``HYPOTHESIS_PROFILE=ci`` that is 50 examples, about
3000 steps in all (about 600 microbatches, 190 of them with a twist, 540 window ends, 900 model
changes, 220 checkpoint round trips). On the final code it took 47 s within the full suite on
a 2-core machine that ran ``wacc gate`` in 137 s that day (40 s on the machines of earlier
issues). ``nightly`` runs 20 times as many examples. Against the pre-rewrite code it fails within
about 30 s (shrinking included).
"""

from __future__ import annotations

import copy
import gc
import io
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from wacc_ref.accumulator import ReferenceAccumulator
from wacc_torch import (
    AccumulatorState,
    BrokenWindowError,
    WeightedGradientsAccumulator,
    ZeroCopyError,
    denormals_flushed,
)
from wacc_torch.records import CHECKSUM_KEY

IN, HIDDEN, OUT, ROWS = 3, 4, 2, 3
MAX_ROWS = ROWS + 2
LEARNING_RATE = 2.0**-6
WORK_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
LOSS_SCALES = (2.0**4, 1.0, 2.0**-2)  # powers of two: exact in every D
STEPS = 60  # steps per example at most
EXAMPLES_DIVISOR = 2  # examples per run: the profile's max_examples // this

# ------------------------------------------------------------------------------------- model


class _Raise(torch.autograd.Function):
    """Identity forward; its backward raises (after what is behind it got its gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the machine's backward that raises")


def _as(parameter: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # A parameter whose dtype was changed still takes part (its gradient arrives in its dtype).
    return parameter if parameter.dtype == dtype else parameter.to(dtype)


class Net(nn.Module):
    """A Linear; ``shared`` used twice (and optionally once more outside a checkpoint); an
    optional ``branch``; an embedding ``emb`` whose rows may change; a replaceable submodule
    ``sub``; ``frozen`` (not trainable until unfrozen); an optional ``extra`` parameter."""

    def __init__(self, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)

        def values(*shape: int) -> torch.Tensor:
            drawn = torch.randn(*shape, generator=generator, dtype=torch.float64) * 0.5
            return drawn.to(dtype)

        self.lin = nn.Linear(IN, HIDDEN, dtype=dtype)
        self.sub = nn.Linear(HIDDEN, OUT, dtype=dtype)
        with torch.no_grad():
            for linear in (self.lin, self.sub):
                linear.weight.copy_(values(*linear.weight.shape))
                linear.bias.copy_(values(*linear.bias.shape))
        self.shared = nn.Parameter(values(HIDDEN))
        self.branch = nn.Parameter(values(HIDDEN))
        self.emb = nn.Parameter(values(ROWS, HIDDEN))
        self.frozen = nn.Parameter(values(HIDDEN), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        idx: torch.Tensor,
        *,
        branch: bool,
        ckpt: str | None,
        shared_outside: bool,
        raise_at: str | None,
    ) -> torch.Tensor:
        dtype = x.dtype
        hidden = F.linear(x, _as(self.lin.weight, dtype), _as(self.lin.bias, dtype))
        if raise_at == "late":
            hidden = _Raise.apply(hidden)
        embedded = F.embedding(idx, _as(self.emb, dtype))

        def segment(hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
            shared = _as(self.shared, dtype)  # used twice: autograd sums both uses
            z = torch.tanh(hidden * shared + embedded + _as(self.frozen, dtype))
            if branch:
                z = z * _as(self.branch, dtype)
            extra = self._parameters.get("extra")
            if extra is not None:
                z = z + _as(extra, dtype)
            return z * shared

        if ckpt is None:
            z = segment(hidden, embedded)
        else:
            z = checkpoint(segment, hidden, embedded, use_reentrant=ckpt == "reentrant")
        out = F.linear(z, _as(self.sub.weight, dtype), _as(self.sub.bias, dtype))
        if shared_outside:
            out = out + (z * _as(self.shared, dtype)).sum(-1, keepdim=True)
        if raise_at == "early":
            out = _Raise.apply(out)
        return out


def _trainable(net: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in net.named_parameters() if p.requires_grad}


def _owner(net: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (net.get_submodule(path) if path else net), attr


# ------------------------------------------------------------------------------ microbatches

_PLAIN_WEIGHTS = st.one_of(
    st.sampled_from([0, 0.0, 1, 2, 3, 7, 0.5, 3.25, 1001, 1e-3, 2.0**-20]),
    st.integers(1, 300),
    st.integers(2**53 + 1, 2**62),  # not exactly a float64: W + w is one rounding of the sum
    st.builds(np.int64, st.integers(0, 1000)),
    st.builds(np.float32, st.sampled_from([0.0, 0.75, 5.0, 300.5])),
    st.builds(np.float16, st.sampled_from([1.0, 2.5])),
    st.builds(torch.tensor, st.integers(0, 50)),
    st.builds(
        lambda value, dtype: torch.tensor(value, dtype=dtype),
        st.sampled_from([0.0, 1.5, 6.0, 1000.0]),
        st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    ),
)
_BAD_WEIGHTS = st.sampled_from([-1, -0.5, math.nan, math.inf, True, 1e308, 1e-300])
WEIGHTS = st.one_of(_PLAIN_WEIGHTS, _PLAIN_WEIGHTS, _PLAIN_WEIGHTS, _BAD_WEIGHTS)

TWISTS = (
    "raise_early",
    "raise_late",
    "double",
    "reentrant_shared",
    "ftz_thread",
    "ftz_main",
    "edit_before",
    "edit_after",
    "nested",
)
EDIT_OPS = ("zero_none", "zero_inplace", "clip", "mul2", "clone", "foreign", "none")
EDIT_TARGETS = ("lin.weight", "lin.bias", "shared", "branch", "emb", "sub.weight", "sub.bias")


@dataclass(frozen=True)
class Micro:
    """One microbatch: its weight and kind, inputs (tokens, seed), the forward's options, the
    thread that runs the backward, and at most one twist (with the edit it makes, if any)."""

    weight: Any  # a number, numpy scalar or 0-d tensor, valid or not
    kind: str
    tokens: int
    seed: int
    branch: bool
    ckpt: str | None
    shared_outside: bool
    thread: bool
    twist: str | None = None
    edit_op: str | None = None
    edit_target: str | None = None


@st.composite
def micros(draw: st.DrawFn, *, twisted: bool = False) -> Micro:
    twist = draw(st.sampled_from(TWISTS)) if twisted else None
    if twist == "reentrant_shared":
        ckpt: str | None = "reentrant"
    elif twist == "double":
        ckpt = draw(st.sampled_from([None, "nonreentrant"]))
    else:
        ckpt = draw(st.sampled_from([None, None, None, "nonreentrant", "reentrant"]))
    if twist == "reentrant_shared":
        shared_outside = True
    elif ckpt == "reentrant":
        shared_outside = False  # used inside and outside: that is the reentrant_shared twist
    else:
        shared_outside = draw(st.booleans())
    edit_op = edit_target = None
    if twist in ("edit_before", "edit_after"):
        edit_op = draw(st.sampled_from(EDIT_OPS))
        edit_target = draw(st.sampled_from(EDIT_TARGETS))
    return Micro(
        weight=draw(WEIGHTS),
        kind=draw(st.sampled_from(["sum", "mean"])),
        tokens=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**16)),
        branch=draw(st.booleans()),
        ckpt=ckpt,
        shared_outside=shared_outside,
        thread=twist == "ftz_thread" or draw(st.sampled_from([False, False, True])),
        twist=twist,
        edit_op=edit_op,
        edit_target=edit_target,
    )


def _weight_value(weight: object) -> float:
    """The weight as a float (only called on weights a block accepted)."""
    if isinstance(weight, torch.Tensor | np.generic):
        return float(weight.item())
    return float(weight)  # type: ignore[arg-type]


def _reference_weight(weight: object) -> Any:
    # The reference reads numpy scalars and Python numbers; a 0-d tensor is its .item() (exact).
    return weight.item() if isinstance(weight, torch.Tensor) else weight


# ---------------------------------------------------------------------------------- helpers


class _Probe(Exception):
    """Leaves a probing block before anything happened in it."""


def _detached(error: Exception) -> Exception:
    """``error`` without its traceback (and context): a traceback holds the frames that held
    the loss, so the autograd graph, its AccumulateGrad nodes and their shapes would outlive
    the step until the next garbage collection (then a resized parameter would meet an old
    node, and whether it does would depend on the collector's timing)."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error


def _outcome(call: Callable[[], object]) -> Exception | None:
    try:
        call()
    except AssertionError:
        raise
    except Exception as error:  # the class is compared by the caller
        return _detached(error)
    return None


def _name(error: BaseException | None) -> str | None:
    return None if error is None else type(error).__name__


def _names(classes: set[type[BaseException]]) -> set[str]:
    return {cls.__name__ for cls in classes}


@contextmanager
def _flush_denormal(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _drain_engine() -> None:
    """READING 8: after a backward that raised, PyTorch's engine keeps the other branches'
    ready tasks (each holds its AccumulateGrad node, which holds the parameter and its shape)
    in this thread's ready queue until the next backward in this thread drains them; until
    then a resized parameter meets its old node, and the old parameter stays alive. That is
    the engine's doing, not the accumulator's: a throwaway backward drains it."""
    drain = torch.ones((), requires_grad=True)
    (drain * 1).backward()


def _run_backward(
    loss: torch.Tensor,
    *,
    thread: bool,
    ftz: bool,
    double: bool,
    after: Callable[[], None] | None = None,
) -> Exception | None:
    """``loss.backward()`` (twice with ``double``) in this thread or another one (joined), with
    flush-to-zero on in that thread if ``ftz``; then ``after()`` in the same thread. Returns the
    exception the backward raised (``after`` must not raise)."""
    box: dict[str, BaseException] = {}

    def work() -> None:
        if ftz:
            torch.set_flush_denormal(True)
        try:
            try:
                loss.backward(retain_graph=double)
                if double:
                    loss.backward()
            except Exception as error:
                box["backward"] = _detached(error)
                _drain_engine()
                return
            if after is not None:
                after()
        except BaseException as error:  # an AssertionError of `after`: re-raised below
            box["after"] = error
        finally:
            if ftz:
                torch.set_flush_denormal(False)

    if thread:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    else:
        work()
    if "after" in box:
        raise box["after"]
    error = box.get("backward")
    assert error is None or isinstance(error, Exception)
    return error


def _roundtrip(record: Mapping[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(dict(record), buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _values_differ(actual: torch.Tensor | None, expected: torch.Tensor | None) -> str | None:
    """None when both are None or hold the same bits (±0 distinct; NaN payloads not compared,
    semantics §12); else what differs."""
    if actual is None or expected is None:
        if actual is None and expected is None:
            return None
        which = (
            "None" if actual is None else "a tensor",
            "None" if expected is None else "a tensor",
        )
        return f"{which[0]} vs {which[1]}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} vs {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)} vs {list(expected.shape)}"
    a = actual.detach().cpu().to(torch.float64).reshape(-1)
    b = expected.detach().cpu().to(torch.float64).reshape(-1)
    a_nan, b_nan = torch.isnan(a), torch.isnan(b)
    same = (a_nan & b_nan) | (~a_nan & ~b_nan & (a.view(torch.int64) == b.view(torch.int64)))
    if bool(same.all()):
        return None
    index = int((~same).nonzero()[0])
    return (
        f"{int((~same).sum())} element(s) differ, first at flat index {index}: "
        f"{float(a[index]).hex()} vs {float(b[index]).hex()}"
    )


def _array_differs(actual: torch.Tensor | None, expected: object) -> str | None:
    """A tensor against a reference float64 array (None kept), as :func:`_values_differ`."""
    if expected is None or actual is None:
        return _values_differ(actual, None if expected is None else torch.zeros(()))
    want = torch.from_numpy(np.asarray(expected, dtype=np.float64).copy())
    return _values_differ(actual.detach().cpu().to(torch.float64), want)


def _records_differ(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """Field by field (pending bit for bit as :func:`_values_differ`), checksum included."""
    if set(actual) != set(expected):
        return f"keys {sorted(actual)} vs {sorted(expected)}"
    for key in expected:
        if key == "pending":
            if set(actual[key]) != set(expected[key]):
                return f"pending names {sorted(actual[key])} vs {sorted(expected[key])}"
            for name, buffer in expected[key].items():
                problem = _values_differ(actual[key][name], buffer)
                if problem is not None:
                    return f"pending[{name!r}]: {problem}"
        elif type(actual[key]) is not type(expected[key]) or actual[key] != expected[key]:
            return f"{key}: {actual[key]!r} vs {expected[key]!r}"
    return None


def _record_fits(record: Mapping[str, Any], net: nn.Module) -> bool:
    """Whether ``load_state_dict`` can bind ``record`` to ``net`` (READING 7)."""
    if not record["param_names"]:
        return True
    shapes = {name: list(p.shape) for name, p in _trainable(net).items()}
    recorded = dict(zip(record["param_names"], record["param_shapes"], strict=True))
    return recorded == shapes


def _apply_edit(net: nn.Module, op: str, target: str | None) -> bool:
    """A ``.grad`` edit a training loop makes; returns whether it touched the ``.grad`` of a
    trainable parameter. A frozen parameter's ``.grad`` (a foreign tensor put there) is edited
    too, but it is nothing a window tracks (semantics §3): editing it is no touch."""
    parameter = dict(net.named_parameters()).get(target) if target else None
    tracked = [p for p in net.parameters() if p.requires_grad]
    if op in ("zero_none", "zero_inplace"):
        touched = any(p.grad is not None for p in tracked)
        net.zero_grad(set_to_none=op == "zero_none")
        return touched
    if op == "clip":
        with_grad = [p for p in net.parameters() if p.grad is not None]
        if with_grad:
            torch.nn.utils.clip_grad_norm_(with_grad, max_norm=1.0)
        return any(p.grad is not None for p in tracked)
    if parameter is None:
        return False
    if op == "foreign":
        parameter.grad = torch.full_like(parameter, 0.25)
        return parameter.requires_grad
    if parameter.grad is None:
        return False
    if op == "mul2":
        parameter.grad.mul_(2)
    elif op == "clone":
        parameter.grad = parameter.grad.clone()
    else:
        assert op == "none", op
        parameter.grad = None
    return parameter.requires_grad


@dataclass
class _ZSnapshot:
    """What a refused Z call must leave as it was."""

    state: AccumulatorState
    record: dict[str, Any] | None
    parameters: dict[str, nn.Parameter]
    grads: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]


@dataclass
class _BSide:
    """What the buffered side of a microbatch did."""

    backward: Exception | None = None  # the backward raised: no accumulate call
    accumulate: Exception | None = None
    reference: Exception | None = None
    stale: tuple[str, ...] = ()  # .grad present before the backward (added to its gradient)
    touched: bool = False  # an edit changed B's .grad

    @property
    def counted(self) -> bool:
        return self.backward is None and self.accumulate is None


# ---------------------------------------------------------------------------------- machine


class TrainingLoopMachine(RuleBasedStateMachine):
    """Z and B side by side on identical models, the reference in step with B."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.step = "initialize"

    # ------------------------------------------------------------------------ set-up
    @initialize(
        dtype=st.sampled_from(WORK_DTYPES),
        scale=st.sampled_from(LOSS_SCALES),
        seed=st.integers(0, 2**16),
    )
    def start(self, dtype: torch.dtype, scale: float, seed: int) -> None:
        self.dtype, self.scale = dtype, scale
        self.net_z = Net(dtype, seed)
        self.net_b = copy.deepcopy(self.net_z)
        self.acc_z = self._new(zero_copy=True)
        self.acc_b = self._new(zero_copy=False)
        self.ref = ReferenceAccumulator(dtype=str(dtype).removeprefix("torch."), loss_scale=scale)
        # Z's window as the semantics describe it: each pending buffer's parameter, tensor and
        # version (the buffer IS .grad), whether a block broke the window, and the parameters
        # the window last bound.
        self.zbuf: dict[str, tuple[nn.Parameter, torch.Tensor, int]] = {}
        self.z_broken = False
        self.z_bound: dict[str, nn.Parameter] = {}
        self.ftz_ok = bool(torch.set_flush_denormal(True))
        torch.set_flush_denormal(False)
        self.ready = True

    def _new(self, *, zero_copy: bool) -> WeightedGradientsAccumulator:
        return WeightedGradientsAccumulator(
            dtype=self.dtype, loss_scale=self.scale, zero_copy=zero_copy
        )

    def fail(self, mode: str, message: str) -> AssertionError:
        return AssertionError(f"[{self.step}] {mode}: {message}")

    def check(self, condition: bool, mode: str, message: str) -> None:
        if not condition:
            raise self.fail(mode, message)

    # ------------------------------------------------------------------ the model of Z
    def z_faults(self, call: str) -> set[type[BaseException]]:
        """The errors Z must raise for ``call`` (``"entry"``, ``"finish"``, ``"state_dict"``)
        from its own conditions (BrokenWindowError, ZeroCopyError); empty: none."""
        faults: set[type[BaseException]] = set()
        if self.z_broken:
            faults.add(BrokenWindowError)
        parameters = dict(self.net_z.named_parameters())
        for name, (parameter, buffer, version) in self.zbuf.items():
            if (
                parameters.get(name) is not parameter
                or parameter.grad is not buffer
                or buffer._version != version
            ):
                faults.add(BrokenWindowError)  # replaced, removed, changed in place, unbound
        if call == "entry":
            trainable = _trainable(self.net_z)
            if any(p.dtype != self.dtype for p in trainable.values()):
                faults.add(ZeroCopyError)
            if any(p.grad is not None and n not in self.zbuf for n, p in trainable.items()):
                faults.add(ZeroCopyError)  # a stale or foreign .grad
        elif self.acc_z.state.issued > 0:  # READING 4
            looked_at = self.z_bound_now()
            if any(p.grad is not None and n not in self.zbuf for n, p in looked_at.items()):
                faults.add(ZeroCopyError)
        return faults

    def z_bound_now(self) -> dict[str, nn.Parameter]:
        """READING 4: the bound names' parameters as the module holds them now (a re-registered
        parameter is looked at as its new tensor); none when the trainable names changed."""
        if not self.z_bound:
            return {}
        trainable = _trainable(self.net_z)
        return trainable if trainable.keys() == self.z_bound.keys() else {}

    def z_snapshot(self) -> _ZSnapshot:
        parameters = dict(self.net_z.named_parameters())
        return _ZSnapshot(
            state=self.acc_z.state,
            record=None if self.z_faults("state_dict") else self.acc_z.state_dict(),
            parameters=parameters,
            grads={
                name: (p.grad, None if p.grad is None else p.grad.detach().clone())
                for name, p in parameters.items()
            },
        )

    def assert_z_unchanged(self, snapshot: _ZSnapshot, what: str) -> None:
        mode = f"Z ({what})"
        self.check(
            self.acc_z.state == snapshot.state,
            mode,
            f"counters changed: {snapshot.state} -> {self.acc_z.state}",
        )
        parameters = dict(self.net_z.named_parameters())
        self.check(parameters.keys() == snapshot.parameters.keys(), mode, "parameters changed")
        for name, parameter in parameters.items():
            self.check(parameter is snapshot.parameters[name], mode, f"{name} was replaced")
            grad, copied = snapshot.grads[name]
            self.check(parameter.grad is grad, mode, f"{name}.grad was replaced")
            problem = _values_differ(parameter.grad, copied)
            self.check(problem is None, mode, f"{name}.grad changed: {problem}")
        if snapshot.record is not None:
            problem = _records_differ(self.acc_z.state_dict(), snapshot.record)
            self.check(problem is None, mode, f"record changed: {problem}")

    def probe_entry(self) -> Exception | None:
        """Enter a Z block and leave it at once (nothing happened in it): the entry's error."""
        try:
            with self.acc_z.microbatch(self.net_z, weight=1, kind="sum"):
                raise _Probe
        except _Probe:
            return None
        except AssertionError:
            raise
        except Exception as error:
            return _detached(error)

    def check_broken(self, before: AccumulatorState, what: str) -> None:
        """Every call but discard()/load_state_dict() raises BrokenWindowError; counters kept."""
        for call_name, call in (
            ("state_dict", self.acc_z.state_dict),
            ("state_dict_async", lambda: self.acc_z.state_dict_async().result()),
            ("finish_sums", self.acc_z.finish_sums),
            ("finish_mean", self.acc_z.finish_mean),
            ("microbatch entry", self.probe_entry),
        ):
            error = self.probe_entry() if call_name == "microbatch entry" else _outcome(call)
            self.check(
                isinstance(error, BrokenWindowError),
                f"Z ({what})",
                f"the window is broken, so {call_name} must raise BrokenWindowError, got "
                f"{_name(error)}: {error}",
            )
        self.check(
            self.acc_z.state == before,
            f"Z ({what})",
            f"a broken window's counters advanced: {before} -> {self.acc_z.state}",
        )

    def note_window_buffers(self) -> None:
        """After a block that broke the window: .grad it created are window buffers too (they
        must be released by discard() and replaced by a load)."""
        for name, parameter in _trainable(self.net_z).items():
            if name not in self.zbuf and parameter.grad is not None:
                self.zbuf[name] = (parameter, parameter.grad, parameter.grad._version)

    def capture_z_window(self, pending_names: set[str], what: str) -> None:
        """After a counted block or a load: the pending buffers ARE .grad."""
        parameters = _trainable(self.net_z)
        self.zbuf = {}
        for name in pending_names:
            parameter = parameters.get(name)
            self.check(
                parameter is not None and parameter.grad is not None,
                f"Z ({what})",
                f"{name} has a pending buffer but no .grad",
            )
            assert parameter is not None and parameter.grad is not None
            self.zbuf[name] = (parameter, parameter.grad, parameter.grad._version)
        self.z_bound = dict(parameters)

    def recover(self, how: str) -> None:
        """Resynchronise Z with B: load B's record into Z, or discard all three windows (then
        the user's zero_grad). After it, neither model holds a stale .grad."""
        record = _roundtrip(self.acc_b.state_dict())
        if how == "load" and _record_fits(record, self.net_z):
            error = _outcome(lambda: self.acc_z.load_state_dict(record, self.net_z))
            self.check(error is None, "Z (recovery load)", f"loading B's record raised {error!r}")
            self.after_z_load(record, "recovery load")
            for parameter in _trainable(self.net_b).values():
                parameter.grad = None
            return
        for mode, acc in (("Z", self.acc_z), ("B", self.acc_b)):
            error = _outcome(acc.discard)
            self.check(error is None, f"{mode} (recovery discard)", f"discard raised {error!r}")
        self.ref.finish_sums()
        self.net_z.zero_grad(set_to_none=True)
        self.net_b.zero_grad(set_to_none=True)
        self.zbuf, self.z_bound, self.z_broken = {}, {}, False
        # B bound the current model with the microbatch Z refused (a refused block changes
        # nothing, so Z kept its last binding): B's empty record gives Z the same one.
        record = _roundtrip(self.acc_b.state_dict())
        binding = (record["param_names"], record["param_shapes"])
        ours = self.acc_z.state_dict()
        if (ours["param_names"], ours["param_shapes"]) != binding:
            self.check(
                _record_fits(record, self.net_z),
                "machine",
                "after a discard, B's binding is not the model's: cannot align Z's",
            )
            error = _outcome(lambda: self.acc_z.load_state_dict(record, self.net_z))
            self.check(error is None, "Z (recovery load)", f"loading B's record raised {error!r}")
            self.after_z_load(record, "recovery load")

    def after_z_load(self, record: Mapping[str, Any], what: str) -> None:
        """A load puts each restored buffer into .grad (None without one) and heals Z."""
        for name, parameter in _trainable(self.net_z).items():
            expected = record["pending"].get(name)
            problem = _values_differ(parameter.grad, expected)
            self.check(problem is None, f"Z ({what})", f"{name}.grad after the load: {problem}")
        self.z_broken = False
        self.capture_z_window(set(record["pending"]), what)

    def heal(self, how: str) -> None:
        """The user's loop is healthy before it changes the model: Z refusing nothing."""
        if (
            self.z_faults("entry")
            or self.z_faults("state_dict")
            or any(p.grad is not None for p in _trainable(self.net_b).values())
        ):
            self.recover(how)

    def plain_parameters(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in _trainable(self.net_b).items()}

    # ---------------------------------------------------------------- one microbatch
    def loss(self, net: Net, micro: Micro) -> torch.Tensor:
        generator = torch.Generator().manual_seed(micro.seed)
        x = torch.randn(micro.tokens, IN, generator=generator, dtype=torch.float64)
        y = torch.randn(micro.tokens, OUT, generator=generator, dtype=torch.float64)
        idx = torch.randint(0, ROWS, (micro.tokens,), generator=generator)
        twist = micro.twist
        out = net(
            x.to(self.dtype),
            idx,
            branch=micro.branch,
            ckpt=micro.ckpt,
            shared_outside=micro.shared_outside,
            raise_at={"raise_early": "early", "raise_late": "late"}.get(twist or ""),
        )
        error = (out - y.to(self.dtype)) ** 2
        return (error.sum() if micro.kind == "sum" else error.mean()) * self.scale

    def reference_dry_run(self, micro: Micro) -> str | None:
        """What a block's entry must refuse for reasons common to both modes (weight, tracked
        set, mean weight in D, W overflow, flush-to-zero): the reference's call without
        gradients, on a copy."""
        reference = copy.deepcopy(self.ref)
        method = reference.accumulate_sum if micro.kind == "sum" else reference.accumulate_mean
        return _name(
            _outcome(
                lambda: method(self.plain_parameters(), _reference_weight(micro.weight), grads={})
            )
        )

    def run_b(self, micro: Micro, edit: tuple[str, str | None, str] | None) -> _BSide:
        net, acc = self.net_b, self.acc_b
        side = _BSide(stale=tuple(n for n, p in _trainable(net).items() if p.grad is not None))
        if edit is not None and edit[2] == "before":
            side.touched = _apply_edit(net, edit[0], edit[1])
        loss = self.loss(net, micro)
        results: dict[str, Any] = {}

        def after() -> None:  # in the thread that ran the backward
            if edit is not None and edit[2] == "after":
                results["touched"] = _apply_edit(net, edit[0], edit[1])
            parameters = _trainable(net)
            grads = {
                n: p.grad.detach().to(torch.float64).numpy()
                for n, p in parameters.items()
                if p.grad is not None
            }
            results["grads_before"] = {n: p.grad for n, p in parameters.items()}
            results["record_before"] = acc.state_dict()
            method = acc.accumulate_sum if micro.kind == "sum" else acc.accumulate_mean
            results["accumulate"] = _outcome(lambda: method(net, micro.weight))
            reference = self.ref.accumulate_sum if micro.kind == "sum" else self.ref.accumulate_mean
            shapes = {n: tuple(p.shape) for n, p in parameters.items()}
            results["reference"] = _outcome(
                lambda: reference(shapes, _reference_weight(micro.weight), grads=grads)
            )

        side.backward = _run_backward(
            loss,
            thread=micro.thread,
            ftz=micro.twist == "ftz_thread",
            double=micro.twist == "double",
            after=after,
        )
        side.touched = side.touched or bool(results.get("touched"))
        if side.backward is not None:
            # The backward raised: the user drops the microbatch (no accumulate) and its .grad.
            net.zero_grad(set_to_none=True)
            return side
        side.accumulate, side.reference = results["accumulate"], results["reference"]
        self.check(
            _name(side.accumulate) == _name(side.reference),
            "B vs reference",
            f"accumulate raised {side.accumulate!r}, the reference {side.reference!r}",
        )
        if side.accumulate is not None:
            problem = _records_differ(acc.state_dict(), results["record_before"])
            self.check(problem is None, "B (refused accumulate)", f"record changed: {problem}")
            for name, parameter in _trainable(net).items():
                self.check(
                    parameter.grad is results["grads_before"].get(name),
                    "B (refused accumulate)",
                    f"{name}.grad changed",
                )
            net.zero_grad(set_to_none=True)  # the user drops the refused microbatch
        else:
            for name, parameter in _trainable(net).items():
                self.check(parameter.grad is None, "B", f"accumulate left {name}.grad")
        return side

    def nested_checks(self, record: Mapping[str, Any]) -> None:
        """Inside a block (READING 6): a nested block and the accumulator's calls are refused."""
        acc, net = self.acc_z, self.net_z
        inner = acc.microbatch(net, weight=1, kind="sum")
        error = _outcome(inner.__enter__)
        if error is None:
            inner.__exit__(None, None, None)
        calls: list[tuple[str, Exception | None]] = [("a nested microbatch", error)]
        for call_name, call in (
            ("state_dict", acc.state_dict),
            ("finish_sums", acc.finish_sums),
            ("discard", acc.discard),
            ("load_state_dict", lambda: acc.load_state_dict(record, net)),
        ):
            calls.append((call_name, _outcome(call)))
        for call_name, error in calls:
            self.check(
                isinstance(error, ZeroCopyError),
                "Z (inside a block)",
                f"{call_name} inside a block must raise ZeroCopyError, got {error!r}",
            )

    def wrong_mode_checks(self, snapshot: _ZSnapshot) -> None:
        """The other mode's calls: accumulate_* on Z, microbatch on B (ZeroCopyError, nothing
        changed; Z may name its own present condition instead: READING 5)."""
        allowed = {"ZeroCopyError"} | _names(self.z_faults("entry"))
        for call_name in ("accumulate_sum", "accumulate_mean"):
            error = _outcome(lambda: getattr(self.acc_z, call_name)(self.net_z, 1))  # noqa: B023
            self.check(
                _name(error) in allowed,
                "Z",
                f"{call_name} on a zero-copy accumulator must raise ZeroCopyError, got {error!r}",
            )
        self.assert_z_unchanged(snapshot, "accumulate_* on Z")
        record = self.acc_b.state_dict()
        # Refused by microbatch() itself or by entering its block: `with` meets either.
        blocks: list[Any] = []
        error = _outcome(
            lambda: blocks.append(self.acc_b.microbatch(self.net_b, weight=1, kind="sum"))
        ) or _outcome(lambda: blocks[0].__enter__())
        if error is None:
            blocks[0].__exit__(None, None, None)
        self.check(
            isinstance(error, ZeroCopyError),
            "B",
            f"microbatch on a buffered accumulator must raise ZeroCopyError, got {error!r}",
        )
        problem = _records_differ(self.acc_b.state_dict(), record)
        self.check(problem is None, "B (refused microbatch)", f"record changed: {problem}")

    def run_z(
        self, micro: Micro, edit: tuple[str, str | None, str] | None, record: Mapping[str, Any]
    ) -> tuple[Exception | None, bool, bool]:
        """Run the block; returns (its exception, whether it was entered, whether an edit
        touched a .grad of Z)."""
        acc, net = self.acc_z, self.net_z
        entered = False
        box: dict[str, bool] = {}
        try:
            with acc.microbatch(net, weight=micro.weight, kind=micro.kind):  # type: ignore[arg-type]
                entered = True
                if micro.twist == "nested":
                    self.nested_checks(record)
                if edit is not None and edit[2] == "before":
                    box["touched"] = _apply_edit(net, edit[0], edit[1])
                loss = self.loss(net, micro)

                def after() -> None:
                    if edit is not None and edit[2] == "after":
                        box["touched"] = _apply_edit(net, edit[0], edit[1])

                error = _run_backward(
                    loss,
                    thread=micro.thread,
                    ftz=micro.twist == "ftz_thread",
                    double=micro.twist == "double",
                    after=after,
                )
                if error is not None:
                    raise error
        except AssertionError:
            raise
        except Exception as error:
            return _detached(error), entered, bool(box.get("touched"))
        return None, entered, bool(box.get("touched"))

    def resolve_edit(self, micro: Micro) -> tuple[str, str | None, str] | None:
        """The edit both loops make: (op, target, "before"/"after" the backward). A foreign
        tensor is put on a parameter whose Z .grad is a buffer (READING: a foreign .grad on a
        parameter without one is the out-of-block rule's)."""
        if micro.edit_op is None:
            return None
        when = "before" if micro.twist == "edit_before" else "after"
        target = micro.edit_target
        if micro.edit_op == "foreign":
            if when == "after":
                return ("mul2", target, when)
            owned = [n for n in self.zbuf if n in _trainable(self.net_z)]
            if not owned:
                return None
            if target not in owned:
                target = owned[0]
        return (micro.edit_op, target, when)

    def microbatch_step(self, micro: Micro, recover: str, *, defer: bool = False) -> bool:
        """One microbatch in both modes and the reference; returns whether Z must still be
        resynchronised (only with ``defer``: the caller recovers later)."""
        if not self.ftz_ok and micro.twist in ("ftz_main", "ftz_thread"):
            micro = replace(micro, twist=None)
        edit = self.resolve_edit(micro)
        record = _roundtrip(self.acc_b.state_dict()) if micro.twist == "nested" else {}
        ftz_main = micro.twist == "ftz_main"
        snapshot = self.z_snapshot()
        z_faults = self.z_faults("entry")
        z_stale = tuple(
            n
            for n, p in _trainable(self.net_z).items()
            if p.grad is not None and n not in self.zbuf
        )
        if micro.twist == "nested":
            self.wrong_mode_checks(snapshot)
        with _flush_denormal(ftz_main):
            common = self.reference_dry_run(micro)
        with _flush_denormal(ftz_main):
            b = self.run_b(micro, edit)
        with _flush_denormal(ftz_main):
            z_error, entered, z_touched = self.run_z(micro, edit, record)
        broken = False
        if common is not None or z_faults:
            allowed = _names(z_faults) | ({common} if common else set())
            self.check(
                not entered and _name(z_error) in allowed,
                "Z",
                f"the block's entry must raise one of {sorted(allowed)}, got "
                f"{'an entered block and ' if entered else ''}{z_error!r}",
            )
            self.assert_z_unchanged(snapshot, "refused entry")
            z_counted = False
        else:
            self.check(entered, "Z", f"the block's entry raised {z_error!r}")
            positive = _weight_value(micro.weight) > 0
            expected, broken, z_counted = self.expected_block(micro, positive, z_touched)
            self.check(
                _name(z_error) == expected,
                "Z",
                f"the block must {'raise ' + expected if expected else 'be counted'}, "
                f"got {z_error!r}",
            )
            if micro.twist == "reentrant_shared":
                self.check(
                    "reentrant" in str(z_error).lower(),
                    "Z",
                    f"the refusal must name reentrant checkpointing: {z_error}",
                )
            if broken:
                self.note_window_buffers()
                self.check_broken(snapshot.state, "after the block")
                self.z_broken = True
            elif not z_counted:
                self.assert_z_unchanged(snapshot, "a block that was not counted")
        if z_counted and not b.counted and not (b.stale or b.touched):
            raise self.fail("Z vs B", f"Z counted the microbatch, B refused it: {b!r}")
        in_step = (
            z_counted == b.counted
            and not broken
            and not (b.stale or b.touched or z_touched or z_stale)
        )
        if in_step:
            if z_counted:
                self.capture_z_window(set(self.acc_b.state_dict()["pending"]), "counted block")
            return False
        if defer:
            return True
        self.recover(recover)
        return False

    def expected_block(
        self, micro: Micro, positive: bool, touched: bool
    ) -> tuple[str | None, bool, bool]:
        """(the error leaving an entered block, whether the window is then broken, whether the
        block is counted), as wacc_torch.zero_copy's docstring says."""
        twist = micro.twist
        if twist == "raise_early":
            return "RuntimeError", False, False  # nothing added yet: unchanged
        if twist == "raise_late":
            return "RuntimeError", positive, False  # a zero-weight block stays intact
        if twist in ("double", "reentrant_shared"):
            return "ZeroCopyError", positive, False  # a second gradient for one parameter
        if twist == "ftz_thread" and positive:
            return "UnsupportedEnvironmentError", False, False  # the first hook refuses
        if twist in ("edit_before", "edit_after") and touched:
            return "BrokenWindowError", True, False
        return None, False, True  # READING 1 for a zero-weight ftz_thread block

    # ------------------------------------------------------------------------- rules
    @precondition(lambda self: self.ready)
    @rule(micro=micros(), recover=st.sampled_from(["load", "load", "discard"]))
    def microbatch(self, micro: Micro, recover: str) -> None:
        self.step = f"microbatch({micro!r})"
        self.microbatch_step(micro, recover)

    @precondition(lambda self: self.ready)
    @rule(micro=micros(twisted=True), recover=st.sampled_from(["load", "load", "discard"]))
    def microbatch_with_a_twist(self, micro: Micro, recover: str) -> None:
        self.step = f"microbatch_with_a_twist({micro!r})"
        self.microbatch_step(micro, recover)

    @precondition(lambda self: self.ready)
    @rule(
        kind=st.sampled_from(["sums", "mean", "mean", "discard"]),
        ftz=st.sampled_from([False, False, False, True]),
        then=st.sampled_from(["step", "step", "zero_none", "leave", "zero_inplace", "swap"]),
        recover=st.sampled_from(["load", "discard"]),
    )
    def end_window(self, kind: str, ftz: bool, then: str, recover: str) -> None:
        """finish_sums / finish_mean (or discard()), then what the loop does with .grad: an
        optimizer step and zero_grad, zero_grad alone, nothing (stale for the next window),
        zero_grad(set_to_none=False), or new models (the old ones must die)."""
        self.step = f"end_window({kind=}, {ftz=}, {then=})"
        if kind == "discard":
            self.discard()
            ended = True
        else:
            ended = self.finish(kind, ftz and self.ftz_ok, then, recover)
        if ended and then == "swap":
            self.swap_models()

    def finish(self, kind: str, ftz: bool, then: str, recover: str) -> bool:
        """Returns whether the window ended (False: the finish was refused by all three)."""
        call = "finish_sums" if kind == "sums" else "finish_mean"
        with _flush_denormal(ftz):
            common = _name(_outcome(getattr(copy.deepcopy(self.ref), call)))
        faults = self.z_faults("finish")
        if faults:
            snapshot = self.z_snapshot()
            with _flush_denormal(ftz):
                error = _outcome(getattr(self.acc_z, call))
            allowed = _names(faults) | ({common} if common else set())
            self.check(
                _name(error) in allowed,
                "Z",
                f"{call} must raise one of {sorted(allowed)}, got {error!r}",
            )
            self.assert_z_unchanged(snapshot, f"refused {call}")
            self.recover(recover)
        # Stale .grad of an earlier window (issued == 0, so Z accepts them): the user clears
        # them, else B's apply_to (None -> .grad = None) and Z (no buffer, .grad left alone)
        # would leave different .grad for the optimizer.
        for name, parameter in _trainable(self.net_z).items():
            if name not in self.zbuf:
                parameter.grad = None
        for parameter in _trainable(self.net_b).values():
            parameter.grad = None
        with _flush_denormal(ftz):
            common = _name(_outcome(getattr(copy.deepcopy(self.ref), call)))
        b_record = self.acc_b.state_dict()
        snapshot = self.z_snapshot()
        results: dict[str, Any] = {}

        def run(mode: str, target: Any) -> Exception | None:
            return _outcome(lambda: results.__setitem__(mode, getattr(target, call)()))

        with _flush_denormal(ftz):
            errors = {
                "B": run("B", self.acc_b),
                "reference": run("reference", self.ref),
                "Z": run("Z", self.acc_z),
            }
        self.check(
            _name(errors["B"]) == _name(errors["reference"]) == _name(errors["Z"]) == common,
            "Z, B, reference",
            f"{call} outcomes differ: {errors!r} (expected {common})",
        )
        if errors["B"] is not None:
            self.assert_z_unchanged(snapshot, f"refused {call}")
            problem = _records_differ(self.acc_b.state_dict(), b_record)
            self.check(problem is None, f"B (refused {call})", f"record changed: {problem}")
            return False
        res_z, res_b, res_r = results["Z"], results["B"], results["reference"]
        for field in ("weight", "issued", "zero_weight", "normalized"):
            values = (getattr(res_z, field), getattr(res_b, field), getattr(res_r, field))
            self.check(
                values[0] == values[1] == values[2],
                "Z, B, reference",
                f"{call}().{field}: {values}",
            )
        self.check(res_z.grads.keys() == res_b.grads.keys(), "Z vs B", f"{call}() names differ")
        parameters = dict(self.net_z.named_parameters())
        for name, grad_b in res_b.grads.items():
            problem = _values_differ(res_z.grads[name], grad_b)
            self.check(problem is None, "Z vs B", f"{call}() result {name}: {problem}")
            problem = _array_differs(grad_b, res_r.grads[name])
            self.check(problem is None, "B vs reference", f"{call}() result {name}: {problem}")
            holder = parameters.get(name)
            if res_z.grads[name] is not None:
                self.check(
                    holder is not None and holder.grad is res_z.grads[name],
                    "Z",
                    f"the result {name} must be the parameter's .grad itself",
                )
            else:
                self.check(
                    holder is None or holder.grad is None,
                    "Z",
                    f"{name} finished as None, but its .grad holds a tensor",
                )
        self.zbuf, self.z_bound = {}, {}
        if then in ("zero_none", "swap"):
            self.net_z.zero_grad(set_to_none=True)
            self.net_b.zero_grad(set_to_none=True)
            return True
        if any(name not in dict(self.net_b.named_parameters()) for name in res_b.grads):
            # The window bound an older model (changed after a discard): apply_to refuses the
            # names (semantics §8), and there is nothing to apply anyway (all None).
            return True
        res_b.apply_to(self.net_b)
        for (name, p_z), p_b in zip(
            self.net_z.named_parameters(), self.net_b.parameters(), strict=True
        ):
            problem = _values_differ(p_z.grad, p_b.grad)
            self.check(problem is None, "Z vs B", f"{name}.grad after {call}: {problem}")
        if then == "step":
            for net in (self.net_z, self.net_b):
                torch.optim.SGD(net.parameters(), lr=LEARNING_RATE).step()
                net.zero_grad(set_to_none=True)
        elif then == "zero_inplace":
            self.net_z.zero_grad(set_to_none=False)
            self.net_b.zero_grad(set_to_none=False)
        return True

    @precondition(lambda self: self.ready)
    @rule(
        z_from=st.sampled_from(["z", "b"]),
        b_from=st.sampled_from(["z", "b"]),
        z_fresh=st.booleans(),
        b_fresh=st.booleans(),
        use_async=st.booleans(),
        corrupt=st.sampled_from(
            [None, None, "issued", "dtype", "unknown_key", "pending", "checksum"]
        ),
    )
    def checkpoint_restore(
        self,
        z_from: str,
        b_from: str,
        z_fresh: bool,
        b_fresh: bool,
        use_async: bool,
        corrupt: str | None,
    ) -> None:
        self.step = (
            f"checkpoint_restore({z_from=}, {b_from=}, {z_fresh=}, {b_fresh=}, {use_async=}, "
            f"{corrupt=})"
        )
        record_b = _roundtrip(self.acc_b.state_dict())
        faults = self.z_faults("state_dict")
        record_z = None
        if faults:
            self.expect_records_refused(faults)
        else:
            raw = self.acc_z.state_dict_async().result() if use_async else self.acc_z.state_dict()
            record_z = _roundtrip(raw)
            problem = _records_differ(record_z, record_b)
            self.check(problem is None, "Z vs B", f"records differ: {problem}")
        if corrupt is not None:
            bad = self.corrupted(record_b, corrupt)
            snapshot = self.z_snapshot()
            error = _outcome(lambda: self.acc_z.load_state_dict(bad, self.net_z))
            self.check(
                _name(error) == "RecordError",
                "Z",
                f"a corrupted record ({corrupt}) must raise RecordError, got {error!r}",
            )
            self.assert_z_unchanged(snapshot, "refused load")
            error = _outcome(lambda: self.acc_b.load_state_dict(bad, self.net_b))
            self.check(
                _name(error) == "RecordError",
                "B",
                f"a corrupted record ({corrupt}) must raise RecordError, got {error!r}",
            )
            problem = _records_differ(self.acc_b.state_dict(), record_b)
            self.check(problem is None, "B (refused load)", f"record changed: {problem}")
        sources = {"z": record_z if record_z is not None else record_b, "b": record_b}
        if not _record_fits(record_b, self.net_b):
            # READING 7: the record binds an older model (finished window, model changed since).
            for mode, acc, net in (("Z", self.acc_z, self.net_z), ("B", self.acc_b, self.net_b)):
                error = _outcome(lambda: acc.load_state_dict(record_b, net))  # noqa: B023
                self.check(
                    _name(error) == "RecordError",
                    mode,
                    f"a record of another model must raise RecordError, got {error!r}",
                )
            return
        target_z = self._new(zero_copy=True) if z_fresh else self.acc_z
        target_b = self._new(zero_copy=False) if b_fresh else self.acc_b
        source_z, source_b = sources[z_from], sources[b_from]
        error = _outcome(lambda: target_z.load_state_dict(source_z, self.net_z))
        self.check(
            error is None, "Z", f"load_state_dict of {z_from.upper()}'s record raised {error!r}"
        )
        error = _outcome(lambda: target_b.load_state_dict(source_b, self.net_b))
        self.check(
            error is None, "B", f"load_state_dict of {b_from.upper()}'s record raised {error!r}"
        )
        self.acc_z, self.acc_b = target_z, target_b
        self.after_z_load(source_z, "load_state_dict")
        for parameter in _trainable(self.net_b).values():
            parameter.grad = None  # the user's restore: B's loop starts the microbatch empty

    def corrupted(self, record: Mapping[str, Any], kind: str) -> dict[str, Any]:
        bad = dict(record)
        bad["pending"] = dict(record["pending"])
        if kind == "issued":
            bad["issued"] = -1
        elif kind == "dtype":
            bad["dtype"] = "float64" if self.dtype != torch.float64 else "float32"
        elif kind == "unknown_key":
            bad["unexpected"] = 1
        elif kind == "pending" and bad["pending"]:
            name = next(iter(bad["pending"]))
            bad["pending"][name] = torch.zeros(bad["pending"][name].numel() + 1, dtype=self.dtype)
        elif kind == "checksum" and CHECKSUM_KEY in bad:
            bad[CHECKSUM_KEY] = "sha256:" + "0" * 64
        else:
            del bad["total_weight"]
        return bad

    def discard(self) -> None:
        """discard() in both modes (the reference finishes its window: READING 2)."""
        owned = {
            name: parameter
            for name, (parameter, buffer, _) in self.zbuf.items()
            if parameter.grad is buffer
        }
        for mode, acc in (("Z", self.acc_z), ("B", self.acc_b)):
            error = _outcome(acc.discard)
            self.check(error is None, mode, f"discard() raised {error!r}")
        self.ref.finish_sums()  # READING 2
        for name, parameter in owned.items():
            self.check(
                parameter.grad is None, "Z", f"discard() left the window's buffer in {name}.grad"
            )
        self.zbuf, self.z_bound, self.z_broken = {}, {}, False

    def expect_records_refused(self, faults: set[type[BaseException]]) -> None:
        """Z's state_dict and state_dict_async both raise one of ``faults``' classes."""
        for call_name, call in (
            ("state_dict", self.acc_z.state_dict),
            ("state_dict_async", lambda: self.acc_z.state_dict_async().result()),
        ):
            error = _outcome(call)
            self.check(
                _name(error) in _names(faults),
                "Z",
                f"{call_name} must raise one of {sorted(_names(faults))}, got {error!r}",
            )

    @precondition(lambda self: self.ready)
    @rule(op=st.sampled_from(EDIT_OPS), param=st.sampled_from((*EDIT_TARGETS, "frozen", "extra")))
    def edit_grads(self, op: str, param: str) -> None:
        """Out of any block: both loops edit .grad. B takes what it finds at its next accumulate;
        Z refuses what the semantics say from the next call on."""
        self.step = f"edit_grads({op=}, {param=})"
        for net in (self.net_z, self.net_b):
            _apply_edit(net, op, param)
        snapshot = self.z_snapshot()
        faults = self.z_faults("state_dict")
        if faults:
            self.expect_records_refused(faults)
        faults = self.z_faults("finish")
        if faults:
            for call_name in ("finish_sums", "finish_mean"):
                error = _outcome(getattr(self.acc_z, call_name))
                allowed = (
                    _names(faults) | {"ZeroTotalWeightError"}
                    if call_name == "finish_mean" and not self.acc_z.state.total_weight
                    else _names(faults)
                )
                self.check(
                    _name(error) in allowed,
                    "Z",
                    f"{call_name} must raise one of {sorted(allowed)}, got {error!r}",
                )
        faults = self.z_faults("entry")
        if faults:
            error = self.probe_entry()
            self.check(
                _name(error) in _names(faults),
                "Z",
                f"the block's entry must raise one of {sorted(_names(faults))}, got {error!r}",
            )
        self.assert_z_unchanged(snapshot, "refused calls")

    def change(self, net: Net, kind: str, target: str) -> Callable[[], None] | None:
        """Apply one model change to ``net``; returns its undo (None: nothing to change)."""
        if kind in ("rows_up", "rows_down"):
            emb = net.emb
            rows = emb.shape[0]
            if (kind == "rows_up" and rows >= MAX_ROWS) or (kind == "rows_down" and rows <= ROWS):
                return None
            old = emb.data
            if kind == "rows_up":
                emb.data = torch.cat([old, torch.full((1, HIDDEN), 0.5, dtype=old.dtype)])
            else:
                emb.data = old[:-1].clone()
        elif kind == "reshape_shared":
            shared = net.shared
            old = shared.data
            shape = (1, HIDDEN) if old.dim() == 1 else (HIDDEN,)
            shared.data = old.reshape(shape).clone()
            emb = shared
        elif kind == "dtype":
            emb = net.get_parameter(target)
            old = emb.data
            emb.data = old.to(torch.float32 if self.dtype != torch.float32 else torch.float64)
        elif kind == "requires_grad":
            parameter = net.get_parameter(target)
            parameter.requires_grad_(not parameter.requires_grad)

            def flip_back() -> None:
                parameter.requires_grad_(not parameter.requires_grad)

            return flip_back
        else:
            assert kind == "extra", kind
            extra = net._parameters.get("extra")
            if extra is not None:
                del net.extra

                def put_back() -> None:
                    net.extra = extra

                return put_back
            net.extra = nn.Parameter(torch.full((HIDDEN,), 0.125, dtype=self.dtype))
            return lambda: delattr(net, "extra")
        parameter = emb

        def undo() -> None:
            parameter.data = old

        return undo

    @precondition(lambda self: self.ready)
    @rule(
        kind=st.sampled_from(
            ["rows_up", "rows_down", "reshape_shared", "dtype", "requires_grad", "extra"]
        ),
        param=st.sampled_from(["shared", "emb", "branch", "sub.weight", "sub.bias", "frozen"]),
        after=st.sampled_from(["revert", "discard"]),
        micro=micros(),
        recover=st.sampled_from(["load", "discard"]),
    )
    def change_model(self, kind: str, param: str, after: str, micro: Micro, recover: str) -> None:
        """Mid-window (issued > 0) the change is refused by both (Z also refuses a dtype != D,
        B converts), then reverted or the window discarded; between windows both bind anew."""
        self.step = f"change_model({kind=}, {param=}, {after=}, micro={micro!r})"
        if kind == "requires_grad" and param not in ("branch", "emb", "sub.bias", "frozen"):
            param = "frozen"
        if kind == "dtype" and param == "frozen":
            param = "shared"
        self.heal(recover)
        mid = self.acc_b.state.issued > 0
        if not mid:
            self.net_z.zero_grad(set_to_none=True)  # the optimizer's zero_grad came first
            self.net_b.zero_grad(set_to_none=True)
        undo_z = self.change(self.net_z, kind, param)
        undo_b = self.change(self.net_b, kind, param)
        if undo_z is None or undo_b is None:
            return
        if not mid and kind in ("rows_up", "rows_down", "reshape_shared"):
            # A plain backward after the resize works, with no accumulator in the way.
            plain = replace(micro, twist=None, ckpt=None)
            for net in (self.net_z, self.net_b):
                error = _outcome(lambda: self.loss(net, plain).backward())  # noqa: B023
                self.check(
                    error is None,
                    "Z" if net is self.net_z else "B",
                    f"a plain backward after {kind} raised {error!r}",
                )
            for (name, p_z), p_b in zip(
                self.net_z.named_parameters(), self.net_b.parameters(), strict=True
            ):
                problem = _values_differ(p_z.grad, p_b.grad)
                self.check(
                    problem is None, "Z vs B", f"plain backward after {kind}: {name}.grad {problem}"
                )
            self.net_z.zero_grad(set_to_none=True)
            self.net_b.zero_grad(set_to_none=True)
        if not mid and kind != "dtype":
            return  # both bind the changed model at their next microbatch
        pending = self.microbatch_step(micro, recover, defer=True)
        if kind == "dtype" and self.net_z.get_parameter(param).requires_grad:
            # Z cannot restore a window into a parameter of another dtype: refused, unchanged.
            record = _roundtrip(self.acc_b.state_dict())
            if _record_fits(record, self.net_z) and not self.z_faults("state_dict"):
                snapshot = self.z_snapshot()
                error = _outcome(lambda: self.acc_z.load_state_dict(record, self.net_z))
                self.check(
                    isinstance(error, ZeroCopyError),
                    "Z",
                    f"load_state_dict with a parameter of dtype != D must raise ZeroCopyError, "
                    f"got {error!r}",
                )
                self.assert_z_unchanged(snapshot, "refused load")
        if mid and after == "discard":
            self.recover("discard")
            pending = False
            if kind != "dtype":
                return
        undo_z()
        undo_b()
        if pending:
            self.recover(recover)

    @precondition(lambda self: self.ready)
    @rule(
        param=st.sampled_from(["shared", "emb", "branch", "sub", "lin"]),
        after=st.sampled_from(["put_back", "keep", "load"]),
    )
    def reregister(self, param: str, after: str) -> None:
        """A parameter re-registered (or a submodule replaced) by an identical copy."""
        self.step = f"reregister({param=}, {after=})"
        olds = []
        for net in (self.net_z, self.net_b):
            old = getattr(net, param)
            new: nn.Module | nn.Parameter
            if isinstance(old, nn.Parameter):
                new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
            else:
                copied = copy.deepcopy(old)
                for parameter in copied.parameters():
                    parameter.grad = None
                new = copied
            setattr(net, param, new)
            olds.append(old)
        names = (
            [param]
            if isinstance(olds[0], nn.Parameter)
            else [f"{param}.{n}" for n, _ in olds[0].named_parameters()]
        )
        if any(name in self.zbuf for name in names):
            # The window's buffer is no tracked parameter's .grad now: refused, nothing changed.
            faults = self.z_faults("state_dict")
            self.check(
                BrokenWindowError in faults,
                "machine",
                "a re-registered buffered parameter must be a fault",
            )
            error = _outcome(self.acc_z.state_dict)
            self.check(
                isinstance(error, BrokenWindowError),
                "Z",
                f"state_dict after re-registering {param} mid-window must raise "
                f"BrokenWindowError, got {error!r}",
            )
            error = self.probe_entry()
            self.check(
                _name(error) in _names(self.z_faults("entry")),
                "Z",
                f"the block's entry after re-registering {param} must raise BrokenWindowError, "
                f"got {error!r}",
            )
        if after == "put_back":
            for net, old in zip((self.net_z, self.net_b), olds, strict=True):
                setattr(net, param, old)
        elif after == "load":
            self.recover("load")

    @precondition(lambda self: self.ready)
    @rule(
        kind=st.sampled_from(["rows_up", "rows_down", "reshape_shared"]),
        micro=micros(),
        recover=st.sampled_from(["load", "discard"]),
    )
    def resize_inside_block(self, kind: str, micro: Micro, recover: str) -> None:
        """.data resized between a block's entry and its backward (mid-window)."""
        self.step = f"resize_inside_block({kind=}, micro={micro!r})"
        self.heal(recover)
        if self.acc_b.state.issued == 0:
            return
        if kind == "rows_up" and self.net_b.emb.shape[0] >= MAX_ROWS:
            kind = "rows_down"
        if kind == "rows_down" and self.net_b.emb.shape[0] <= ROWS:
            kind = "rows_up"
        if not self.net_b.emb.requires_grad:
            kind = "reshape_shared"  # a frozen emb is not tracked: resizing it changes nothing
        self.step = f"resize_inside_block({kind=}, micro={micro!r})"
        micro = replace(micro, twist=None)
        if self.reference_dry_run(micro) is not None:
            micro = replace(micro, weight=1)  # a valid weight: the change is what is refused
        # B: the user resizes, runs the microbatch; accumulate refuses the changed shape.
        undo_b = self.change(self.net_b, kind, "emb")
        assert undo_b is not None
        b = self.run_b(micro, None)
        undo_b()
        self.check(
            _name(b.accumulate) == "ParameterMismatchError",
            "B",
            f"accumulate after a mid-window {kind} must raise ParameterMismatchError, got "
            f"{b.accumulate!r}",
        )
        # Z: the same change between the block's entry and its backward.
        snapshot = self.z_snapshot()
        entered = False
        undo_z: Callable[[], None] | None = None
        try:
            with self.acc_z.microbatch(self.net_z, weight=micro.weight, kind=micro.kind):  # type: ignore[arg-type]
                entered = True
                undo_z = self.change(self.net_z, kind, "emb")
                loss = self.loss(self.net_z, micro)
                error = _run_backward(loss, thread=micro.thread, ftz=False, double=False)
                if error is not None:
                    raise error
            z_error: Exception | None = None
        except AssertionError:
            raise
        except Exception as error:
            z_error = _detached(error)
        finally:
            if undo_z is not None:
                undo_z()
        self.check(entered, "Z", f"the block's entry raised {z_error!r}")
        self.check(
            _name(z_error) in ("ParameterMismatchError", "RuntimeError"),  # READING 3
            "Z",
            f"a {kind} inside the block must be refused (ParameterMismatchError), got {z_error!r}",
        )
        probe = _outcome(self.acc_z.state_dict)
        if isinstance(probe, BrokenWindowError):
            self.note_window_buffers()
            self.check_broken(snapshot.state, f"{kind} inside the block")
            self.z_broken = True
            self.recover(recover)
        else:
            self.check(probe is None, "Z", f"state_dict after the refused block raised {probe!r}")
            self.assert_z_unchanged(snapshot, f"{kind} inside the block")

    def swap_models(self) -> None:
        """Between windows the accumulators hold nothing of a past binding: the old models
        die once the loop drops them."""
        self.net_z.zero_grad(set_to_none=True)
        self.net_b.zero_grad(set_to_none=True)
        watched = [
            (mode, what, weakref.ref(obj))
            for mode, net in (("Z", self.net_z), ("B", self.net_b))
            for what, obj in (("the module", net), *net.named_parameters())
        ]
        self.net_z, self.net_b = copy.deepcopy(self.net_z), copy.deepcopy(self.net_b)
        gc.collect()
        alive = [f"{mode}: {what}" for mode, what, ref in watched if ref() is not None]
        self.check(not alive, "Z/B", f"still alive after finish/discard and del: {alive}")

    # ---------------------------------------------------------------------- invariant
    @invariant()
    def modes_agree(self) -> None:
        if not self.ready:
            return
        where = self.step
        assert not denormals_flushed(), f"[{where}] the machine left flush-to-zero on"
        state_z, state_b, state_r = self.acc_z.state, self.acc_b.state, self.ref.state
        counters = [
            (s.issued, s.zero_weight, float(s.total_weight).hex())
            for s in (state_z, state_b, state_r)
        ]
        self.check(
            counters[0] == counters[1] == counters[2],
            "Z, B, reference",
            f"counters (issued, zero_weight, W) differ: {counters}",
        )
        params_z = list(self.net_z.named_parameters())
        params_b = list(self.net_b.named_parameters())
        self.check(
            [n for n, _ in params_z] == [n for n, _ in params_b], "models", "parameter names differ"
        )
        for (name, p_z), (_, p_b) in zip(params_z, params_b, strict=True):
            self.check(
                p_z.requires_grad == p_b.requires_grad, "models", f"{name}.requires_grad differs"
            )
            problem = _values_differ(p_z.detach(), p_b.detach())
            self.check(problem is None, "models", f"{name} differs: {problem}")
        record_b = self.acc_b.state_dict()
        record_r: dict[str, Any] = self.ref.state_dict()
        self.check(
            record_b[CHECKSUM_KEY] == record_r[CHECKSUM_KEY],
            "B vs reference",
            "record checksums differ",
        )
        self.check(
            set(record_b["pending"]) == set(record_r["pending"]),
            "B vs reference",
            "pending names differ",
        )
        for name, buffer in record_b["pending"].items():
            problem = _array_differs(buffer, record_r["pending"][name])
            self.check(problem is None, "B vs reference", f"pending {name}: {problem}")
        faults = self.z_faults("state_dict")
        if faults:
            error = _outcome(self.acc_z.state_dict)
            self.check(
                _name(error) in _names(faults),
                "Z",
                f"state_dict must raise one of {sorted(_names(faults))}, got {error!r}",
            )
            return
        record_z = self.acc_z.state_dict()
        problem = _records_differ(record_z, record_b)
        self.check(problem is None, "Z vs B", f"records differ: {problem}")
        parameters = _trainable(self.net_z)
        for name, buffer in record_z["pending"].items():
            parameter = parameters.get(name)
            grad = None if parameter is None else parameter.grad
            problem = _values_differ(grad, buffer)
            self.check(problem is None, "Z", f"pending buffer {name} is not its .grad: {problem}")


# Fewer examples, each a longer loop; scaled from the active profile (nightly: 20 times ci's).
_PROFILE = settings.default
assert _PROFILE is not None
TrainingLoopMachine.TestCase.settings = settings(
    _PROFILE,
    max_examples=max(1, _PROFILE.max_examples // EXAMPLES_DIVISOR),
    stateful_step_count=STEPS,
)
TestTrainingLoopMachine = TrainingLoopMachine.TestCase


def test_zeroing_a_frozen_parameters_foreign_grad_inside_a_block_is_no_touch() -> None:
    """A block whose edit only clears the ``.grad`` of a frozen parameter (a foreign tensor a
    loop put there) is counted: the window tracks trainable parameters only (semantics §3).

    The machine's model once counted that edit as a touch and expected BrokenWindowError; the
    sequence that found it (a random seed of the nightly profile) is replayed here."""
    machine = TrainingLoopMachine()
    plain = Micro(
        weight=0, kind="sum", tokens=1, seed=0, branch=False, ckpt=None, shared_outside=False,
        thread=False, twist=None, edit_op=None, edit_target=None,
    )  # fmt: skip
    try:
        machine.start(dtype=torch.float32, scale=16.0, seed=0)
        machine.modes_agree()
        machine.change_model(
            after="revert", kind="requires_grad", micro=plain, param="emb", recover="load"
        )
        machine.modes_agree()
        assert not dict(machine.net_z.named_parameters())["emb"].requires_grad
        machine.edit_grads(op="foreign", param="emb")
        machine.modes_agree()
        zero = replace(plain, twist="edit_before", edit_op="zero_none", edit_target="lin.weight")
        machine.microbatch_with_a_twist(micro=zero, recover="load")
        machine.modes_agree()
        assert machine.acc_z.state.issued == 1 and not machine.z_broken
    finally:
        machine.teardown()
