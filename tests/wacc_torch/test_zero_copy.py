"""The zero-copy mode (wacc_torch.zero_copy): the buffered mode's bits, counters and records with
``.grad`` as the pending buffer; every refusal changes nothing; a raising backward breaks the
window.

The buffered reference of every comparison is fed the gradients of a plain backward of an
identical copy of the model (autograd's own, deterministic on one device), so the two modes see
the same gradients and must give the same bits.
"""

from __future__ import annotations

import copy
import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.wacc_torch.support import (
    DEVICES,
    WORK_DTYPE_PARAMS,
    assert_bitwise_equal,
    assert_records_equal,
    bits,
)
from wacc_torch import (
    BrokenWindowError,
    InvalidWeightError,
    ParameterMismatchError,
    UnsupportedEnvironmentError,
    WeightedGradientsAccumulator,
    ZeroCopyError,
)
from wacc_torch.records import CHECKSUM_KEY
from wacc_torch.zero_copy import Microbatch

Kind = Literal["sum", "mean"]
SCALE = 2.0**4
IN, HIDDEN, OUT = 4, 3, 2


class Net(nn.Module):
    """Shared weights used twice per forward, an optional branch, a never-used parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(IN, HIDDEN)
        self.second = nn.Linear(HIDDEN, OUT)
        self.branch = nn.Parameter(torch.zeros(OUT))
        self.unused = nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor, *, branch: bool = False) -> torch.Tensor:
        hidden = self.first(x)
        # `second` (and `first`, through `hidden`) is used twice: autograd sums both uses before
        # the parameter's AccumulateGrad node, where the zero-copy hook sits.
        out = self.second(torch.tanh(hidden)) + self.second(hidden)
        if branch:
            out = out * self.branch
        return out


@dataclass(frozen=True)
class Micro:
    """One microbatch: inputs, targets, weight, kind, whether the branch is used."""

    x: torch.Tensor
    y: torch.Tensor
    weight: float
    kind: Kind
    branch: bool = False


def _net(dtype: torch.dtype, device: str, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        net.branch.normal_()
    return net.to(device=device, dtype=dtype)


def _micros(
    dtype: torch.dtype, device: str, plan: Sequence[tuple[int, float, Kind, bool]]
) -> list[Micro]:
    generator = torch.Generator().manual_seed(7)
    return [
        Micro(
            x=torch.randn(tokens, IN, generator=generator).to(device=device, dtype=dtype),
            y=torch.randn(tokens, OUT, generator=generator).to(device=device, dtype=dtype),
            weight=weight,
            kind=kind,
            branch=branch,
        )
        for tokens, weight, kind, branch in plan
    ]


def _loss(net: nn.Module, micro: Micro) -> torch.Tensor:
    error = (net(micro.x, branch=micro.branch) - micro.y) ** 2
    loss = error.sum() if micro.kind == "sum" else error.mean()
    return SCALE * loss


# A window of four unequal microbatches, a zero-weight one among them, both kinds, the branch used
# in one of them only (`unused` never gets a gradient: it finishes as None).
PLAN: list[tuple[int, float, Kind, bool]] = [
    (3, 3.0, "mean", False),
    (1, 0.0, "mean", True),
    (7, 7.0, "sum", True),
    (2, 2.0, "mean", False),
]


def _zero_copy(dtype: torch.dtype, *, fused: bool = False) -> WeightedGradientsAccumulator:
    return WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused, zero_copy=True)


def _buffered(dtype: torch.dtype, *, fused: bool = False) -> WeightedGradientsAccumulator:
    return WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)


def _feed_zero_copy(acc: WeightedGradientsAccumulator, net: nn.Module, micro: Micro) -> None:
    with acc.microbatch(net, weight=micro.weight, kind=micro.kind):
        _loss(net, micro).backward()


def _feed_buffered(acc: WeightedGradientsAccumulator, net: nn.Module, micro: Micro) -> None:
    _loss(net, micro).backward()  # a plain backward into .grad, which accumulate_* takes
    method = acc.accumulate_sum if micro.kind == "sum" else acc.accumulate_mean
    method(net, micro.weight)


def _assert_same_grads(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_bitwise_equal(actual[name], expected[name], name)


def _grads(net: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in net.named_parameters()}


# ------------------------------------------------------------------------------- bit identity
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("finish", ["sums", "mean", "fused_mean"])
def test_zero_copy_window_is_bit_identical_to_buffered(
    finish: str, dtype: torch.dtype, device: str
) -> None:
    """A window of unequal, zero-weight, shared-weight, partial microbatches gives the buffered
    mode's bits in every work dtype, counters and records too, with the result left in .grad."""
    fused = finish == "fused_mean"
    zero_copy, buffered = _zero_copy(dtype, fused=fused), _buffered(dtype, fused=fused)
    net_z, net_b = _net(dtype, device), _net(dtype, device)
    for micro in _micros(dtype, device, PLAN):
        _feed_zero_copy(zero_copy, net_z, micro)
        _feed_buffered(buffered, net_b, micro)
        assert zero_copy.state.issued == buffered.state.issued
        record_z, record_b = zero_copy.state_dict(), buffered.state_dict()
        assert record_z[CHECKSUM_KEY] == record_b[CHECKSUM_KEY]
        assert_records_equal(record_z, record_b)
    state_z, state_b = zero_copy.state, buffered.state
    assert (state_z.issued, state_z.zero_weight, state_z.total_weight) == (4, 1, 12.0)
    assert (state_b.issued, state_b.zero_weight, state_b.total_weight) == (4, 1, 12.0)
    assert state_z.zero_copy and not state_b.zero_copy
    if finish == "sums":
        result_z, result_b = zero_copy.finish_sums(), buffered.finish_sums()
    else:
        result_z, result_b = zero_copy.finish_mean(), buffered.finish_mean()
    _assert_same_grads(result_z.grads, result_b.grads)
    assert result_z.grads["unused"] is None
    assert (result_z.weight, result_z.issued, result_z.zero_weight, result_z.normalized) == (
        result_b.weight,
        result_b.issued,
        result_b.zero_weight,
        result_b.normalized,
    )
    for name, parameter in net_z.named_parameters():
        assert parameter.grad is result_z.grads[name]  # the result is .grad itself, no copy
    assert zero_copy.state.issued == 0


def _value_lists(dtype: torch.dtype, size: int) -> st.SearchStrategy[list[float]]:
    width = {torch.float64: 64, torch.float32: 32, torch.float16: 16, torch.bfloat16: 32}[dtype]
    values = st.floats(width=width, allow_nan=True, allow_infinity=True)
    return st.lists(values, min_size=size, max_size=size)


WEIGHTS = st.one_of(
    st.sampled_from([0.0, 0.0, 1.0, 3.0, 1001.0, 1e-40, 2.0**-30, 7.5]),
    st.integers(0, 10**6),
    st.floats(min_value=0.0, max_value=1e30, allow_nan=False),
)
Window = tuple[torch.dtype, float, bool, list[tuple[float | int, Kind, list[float]]]]


@st.composite
def _windows(draw: st.DrawFn) -> Window:
    dtype = draw(st.sampled_from([p.values[0] for p in WORK_DTYPE_PARAMS]))
    loss_scale = draw(st.sampled_from([1.0, 2.0**-3, 3.0, 2.0**10]))  # exact in every D
    # Up to 40 elements: past the vectorized kernels' width, so their tails are covered too.
    size = draw(st.integers(1, 40))
    steps = draw(
        st.lists(
            st.tuples(WEIGHTS, st.sampled_from(["sum", "mean"]), _value_lists(dtype, size)),
            min_size=1,
            max_size=4,
        )
    )
    return dtype, loss_scale, draw(st.booleans()), steps


def _outcome(call: Callable[[], object]) -> str | None:
    try:
        call()
    except InvalidWeightError:
        return "InvalidWeightError"
    return None


def _backward_of(
    acc: WeightedGradientsAccumulator,
    module: nn.Module,
    weight: float | int,
    kind: Kind,
    seed: torch.Tensor,
) -> None:
    with acc.microbatch(module, weight=weight, kind=kind):
        # d(sum(p * seed))/dp = 1 * seed: exactly seed, NaN, inf and -0.0 kept
        (module.p * seed).sum().backward()


@given(window=_windows())
def test_zero_copy_matches_buffered_on_any_weights_and_values(window: Window) -> None:
    """On arbitrary weights (zero, huge, not surviving D), values (±0, subnormal, inf, NaN),
    loss scales and either evaluation order, each zero-copy block raises what the buffered call
    raises and leaves the same record, and the means agree bit for bit."""
    dtype, loss_scale, fused, steps = window
    options = {"dtype": dtype, "loss_scale": loss_scale, "fused": fused}
    zero_copy = WeightedGradientsAccumulator(**options, zero_copy=True)
    buffered = WeightedGradientsAccumulator(**options)
    size = len(steps[0][2])
    module_z, module_b = nn.Module(), nn.Module()
    module_z.p = nn.Parameter(torch.zeros(size, dtype=dtype))
    module_b.p = nn.Parameter(torch.zeros(size, dtype=dtype))
    for weight, kind, values in steps:
        seed = torch.tensor(values, dtype=torch.float64).to(dtype)
        method = buffered.accumulate_sum if kind == "sum" else buffered.accumulate_mean
        expected = _outcome(partial(method, module_b, weight, grads={"p": seed}))
        got = _outcome(partial(_backward_of, zero_copy, module_z, weight, kind, seed))
        assert got == expected
        assert_records_equal(zero_copy.state_dict(), buffered.state_dict())
        assert zero_copy.state_dict()[CHECKSUM_KEY] == buffered.state_dict()[CHECKSUM_KEY]
    if buffered.state.total_weight > 0:
        assert_bitwise_equal(
            zero_copy.finish_mean().grads["p"], buffered.finish_mean().grads["p"], "p"
        )


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_negative_zero_gradients_finish_as_positive_zero(dtype: torch.dtype) -> None:
    """A first microbatch of -0.0 gradients leaves +0.0 (the buffer starts at +0.0): the
    gradient is never adopted as the buffer, unlike a plain backward into an empty .grad."""
    zero_copy = _zero_copy(dtype)
    module = nn.Module()
    module.p = nn.Parameter(torch.zeros(4, dtype=dtype))
    minus_zero = torch.full((4,), -0.0, dtype=dtype)
    for kind in ("sum", "mean"):
        with zero_copy.microbatch(module, weight=2, kind=kind):
            (module.p * minus_zero).sum().backward()
        assert module.p.grad is not None
        assert not bool(torch.signbit(module.p.grad).any()), kind
        zero_copy.finish_sums()
        module.p.grad = None
    # The contrast: autograd alone adopts the gradient, -0.0 kept.
    (module.p * minus_zero).sum().backward()
    assert bool(torch.signbit(module.p.grad).all())


# ------------------------------------------------------------------------------------ resume
def _round_trip(record: dict[str, Any]) -> dict[str, Any]:
    file = io.BytesIO()
    torch.save(record, file)
    file.seek(0)
    loaded: dict[str, Any] = torch.load(file, weights_only=True)
    return loaded


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize(
    ("first_mode", "second_mode"),
    [("zero_copy", "zero_copy"), ("zero_copy", "buffered"), ("buffered", "zero_copy")],
)
def test_resume_through_a_file_is_bit_identical_in_either_mode(
    first_mode: str, second_mode: str, dtype: torch.dtype
) -> None:
    """A mid-window record, saved and loaded with weights_only=True into a fresh accumulator of
    either mode and a fresh module, continues to the uninterrupted run's bits."""
    micros = _micros(dtype, "cpu", PLAN)
    uninterrupted, net = _zero_copy(dtype), _net(dtype, "cpu")
    for micro in micros:
        _feed_zero_copy(uninterrupted, net, micro)
    expected = uninterrupted.finish_mean()

    feeds = {"zero_copy": (_zero_copy, _feed_zero_copy), "buffered": (_buffered, _feed_buffered)}
    make, feed = feeds[first_mode]
    first, first_net = make(dtype), _net(dtype, "cpu")
    for micro in micros[:2]:
        feed(first, first_net, micro)
    record = _round_trip(first.state_dict())

    make, feed = feeds[second_mode]
    second, second_net = make(dtype), _net(dtype, "cpu")
    second.load_state_dict(record, second_net)
    if second_mode == "zero_copy":
        # The restored buffers are the fresh module's .grad.
        assert_bitwise_equal(
            second_net.first.weight.grad, record["pending"]["first.weight"], "grad"
        )
    assert second.state.issued == 2
    for micro in micros[2:]:
        feed(second, second_net, micro)
    _assert_same_grads(second.finish_mean().grads, expected.grads)


# ---------------------------------------------------------------------------------- refusals
@dataclass
class Frozen:
    """What a refused call must leave as it was: counters, record, each .grad (identity, bits)."""

    state: Any
    record: dict[str, Any]
    grads: dict[str, torch.Tensor | None]
    copies: dict[str, torch.Tensor | None]

    @classmethod
    def of(cls, acc: WeightedGradientsAccumulator, net: nn.Module) -> Frozen:
        grads = _grads(net)
        copies = {n: None if g is None else g.detach().clone() for n, g in grads.items()}
        return cls(acc.state, acc.state_dict(), grads, copies)

    def check(self, acc: WeightedGradientsAccumulator, net: nn.Module) -> None:
        assert acc.state == self.state
        assert_records_equal(acc.state_dict(), self.record)
        for name, grad in _grads(net).items():
            assert grad is self.grads[name], f"{name}.grad was replaced"
            assert_bitwise_equal(grad, self.copies[name], f"{name}.grad")


def _started(
    dtype: torch.dtype = torch.float32,
) -> tuple[WeightedGradientsAccumulator, Net, list[Micro]]:
    """A zero-copy window with its first microbatch in."""
    acc, net = _zero_copy(dtype), _net(dtype, "cpu")
    micros = _micros(dtype, "cpu", PLAN)
    _feed_zero_copy(acc, net, micros[0])
    return acc, net, micros


def test_a_parameter_dtype_other_than_d_is_refused() -> None:
    """A float32 model under a float64 (or bfloat16) work dtype is refused at entry; nothing
    changes, so the gradients can never arrive in a dtype the semantics would convert first."""
    net = _net(torch.float32, "cpu")
    for dtype in (torch.float64, torch.bfloat16):
        acc = _zero_copy(dtype)
        frozen = Frozen.of(acc, net)
        with pytest.raises(ZeroCopyError, match="branch. has dtype torch.float32"):
            acc.microbatch(net, weight=1.0).__enter__()
        frozen.check(acc, net)
        with pytest.raises(ZeroCopyError, match="dtype"):
            acc.load_state_dict(acc.state_dict(), net)


def test_a_foreign_grad_at_the_first_block_is_refused() -> None:
    """A .grad left by an earlier backward is refused at the window's first block, untouched."""
    acc, net = _zero_copy(torch.float32), _net(torch.float32, "cpu")
    micro = _micros(torch.float32, "cpu", PLAN)[0]
    _loss(net, micro).backward()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ZeroCopyError, match="does not own"):
        _feed_zero_copy(acc, net, micro)
    frozen.check(acc, net)


@pytest.mark.parametrize("replacement", ["clone", "none"])
def test_a_grad_replaced_or_removed_mid_window_is_refused_by_every_call(replacement: str) -> None:
    """A pending .grad replaced by another tensor or removed (model.zero_grad()) between blocks
    makes every call raise BrokenWindowError, changing nothing; nothing is recorded, so putting
    the very same tensor back makes the window usable again."""
    acc, net, micros = _started()
    original = net.first.weight.grad
    assert original is not None
    frozen = Frozen.of(acc, net)
    net.first.weight.grad = original.clone() if replacement == "clone" else None
    what = "replaced" if replacement == "clone" else "removed"
    for call in (
        acc.state_dict,
        acc.state_dict_async,
        acc.finish_mean,
        acc.finish_sums,
        lambda: _feed_zero_copy(acc, net, micros[2]),
    ):
        with pytest.raises(BrokenWindowError, match=f"first.weight.*{what}"):
            call()
    assert acc.state == frozen.state
    net.first.weight.grad = original
    frozen.check(acc, net)
    _feed_zero_copy(acc, net, micros[2])
    assert acc.state.issued == 2


@pytest.mark.parametrize(
    "meddle",
    [
        pytest.param(lambda net, micro: _loss(net, micro).backward(), id="plain-backward"),
        pytest.param(lambda net, micro: net.zero_grad(set_to_none=False), id="zero-grad-in-place"),
    ],
)
def test_a_grad_changed_in_place_outside_a_block_breaks_the_window(
    meddle: Callable[[nn.Module, Micro], None],
) -> None:
    """A pending .grad changed in place between blocks raises BrokenWindowError at every next
    call (counters kept) until discard(), which releases the .grad and starts afresh."""
    acc, net, micros = _started()
    state = acc.state
    meddle(net, micros[0])  # micros[0] reaches only parameters that have a pending buffer
    for call in (
        acc.state_dict,
        acc.finish_mean,
        acc.finish_sums,
        lambda: _feed_zero_copy(acc, net, micros[2]),
    ):
        with pytest.raises(BrokenWindowError, match="changed in place"):
            call()
    assert acc.state == state
    acc.discard()
    assert acc.state.issued == 0 and net.first.weight.grad is None
    _feed_zero_copy(acc, net, micros[0])
    assert acc.state.issued == 1


def test_a_nested_block_is_refused_and_the_outer_block_goes_on() -> None:
    """A block inside a block is refused at entry; the outer block still counts its backward."""
    acc, net, micros = _started()
    reference = _buffered(torch.float32)
    net_b = _net(torch.float32, "cpu")
    _feed_buffered(reference, net_b, micros[0])
    with acc.microbatch(net, weight=micros[2].weight, kind=micros[2].kind):
        with pytest.raises(ZeroCopyError, match="inside a microbatch block"):
            acc.microbatch(net, weight=1.0).__enter__()
        _loss(net, micros[2]).backward()
    _feed_buffered(reference, net_b, micros[2])
    _assert_same_grads(acc.finish_mean().grads, reference.finish_mean().grads)


def test_the_accumulators_calls_inside_a_block_are_refused() -> None:
    """state_dict, finish, discard and load inside a block raise ZeroCopyError; the block then
    counts its backward as usual."""
    acc, net, micros = _started()
    record = acc.state_dict()
    with acc.microbatch(net, weight=micros[2].weight, kind=micros[2].kind):
        for call in (
            acc.state_dict,
            acc.state_dict_async,
            acc.finish_mean,
            acc.finish_sums,
            acc.discard,
            lambda: acc.load_state_dict(record, net),
        ):
            with pytest.raises(ZeroCopyError, match="inside a microbatch block"):
                call()
        _loss(net, micros[2]).backward()
    assert acc.state.issued == 2


def test_an_unknown_kind_is_refused_at_entry() -> None:
    """A kind other than "sum" or "mean" raises ValueError at entry, nothing changed."""
    acc, net, _ = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ValueError, match="kind must be"):
        acc.microbatch(net, weight=1.0, kind="avg").__enter__()  # type: ignore[arg-type]
    frozen.check(acc, net)


def test_the_calls_of_the_other_mode_are_refused() -> None:
    """accumulate_* on a zero-copy accumulator and microbatch() on a buffered one are refused."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    for call in (acc.accumulate_sum, acc.accumulate_mean):
        with pytest.raises(ZeroCopyError, match="microbatch"):
            call(net, 1.0)
    frozen.check(acc, net)
    buffered = _buffered(torch.float32)
    with pytest.raises(ZeroCopyError) as caught:
        buffered.microbatch(net, weight=1.0).__enter__()
    assert str(caught.value) == (
        "microbatch() needs an accumulator made with zero_copy=True; this one buffers "
        "(use accumulate_sum / accumulate_mean)"
    )
    assert buffered.state.issued == 0


@pytest.mark.parametrize("weight", [-1.0, math.nan, math.inf, 1e-42])
def test_an_invalid_weight_is_refused_at_entry_with_no_hook_left(weight: float) -> None:
    """A negative, NaN, infinite or (bfloat16) vanishing weight raises InvalidWeightError at
    entry, before the backward; a plain backward afterwards adds into .grad as if no block ran."""
    dtype = torch.bfloat16
    acc, net = _zero_copy(dtype), _net(dtype, "cpu")
    micro = _micros(dtype, "cpu", PLAN)[0]
    with pytest.raises(InvalidWeightError):
        with acc.microbatch(net, weight=weight, kind="mean"):
            pytest.fail("the block must not be entered")
    assert acc.state.issued == 0
    plain = _net(dtype, "cpu")
    _loss(plain, micro).backward()
    _loss(net, micro).backward()
    _assert_same_grads(_grads(net), _grads(plain))


def test_hooks_are_removed_after_a_block_on_every_exit_path() -> None:
    """After a normal block, a forward that raised, and a backward that raised, a plain
    backward adopts its gradient unchanged: no hook (weight 3, +0.0 start) intercepts it."""
    acc, net = _zero_copy(torch.float32), nn.Module()
    net.p = nn.Parameter(torch.zeros(3))
    seed = torch.tensor([-0.0, 1.5, -2.0])

    def plain_backward_is_untouched() -> None:
        net.p.grad = None
        (net.p * seed).sum().backward()
        assert_bitwise_equal(net.p.grad, seed, "p.grad")
        net.p.grad = None

    with acc.microbatch(net, weight=3.0, kind="mean"):
        (net.p * seed).sum().backward()
    acc.finish_sums()
    plain_backward_is_untouched()
    with pytest.raises(RuntimeError, match="in the forward"):
        with acc.microbatch(net, weight=3.0, kind="mean"):
            raise RuntimeError("in the forward")
    plain_backward_is_untouched()
    with pytest.raises(RuntimeError, match="in the backward"):
        with acc.microbatch(net, weight=3.0, kind="mean"):
            (_Raise.apply(net.p * 1.0) * seed).sum().backward()
    plain_backward_is_untouched()
    assert acc.state.issued == 0


def test_a_block_whose_hooks_fail_to_register_leaves_no_block_and_no_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Entering a block registers one hook per parameter; when a registration fails part way
    (here the second), the error propagates, the hooks already registered are removed and the
    accumulator is not left inside a block: a plain backward adopts its gradient unchanged, the
    accumulator's calls are allowed, and the next block accumulates normally."""
    acc, net = _zero_copy(torch.float32), nn.Module()
    net.p = nn.Parameter(torch.zeros(3))
    net.q = nn.Parameter(torch.zeros(3))
    seed = torch.tensor([-0.0, 1.5, -2.0])
    real_hook_for = Microbatch._hook_for
    made: list[str] = []

    def fail_second(self: Microbatch, name: str, *args: Any) -> Any:
        made.append(name)
        if len(made) == 2:
            raise RuntimeError(f"no hook for {name}")
        return real_hook_for(self, name, *args)

    monkeypatch.setattr(Microbatch, "_hook_for", fail_second)
    with pytest.raises(RuntimeError, match="no hook for q"):
        acc.microbatch(net, weight=3.0, kind="sum").__enter__()
    monkeypatch.undo()
    (net.p * seed + net.q * seed).sum().backward()
    assert_bitwise_equal(net.p.grad, seed, "p.grad")
    net.p.grad = net.q.grad = None
    assert acc.state.issued == 0
    acc.state_dict()  # refused inside a block
    untouched, twin = _zero_copy(torch.float32), copy.deepcopy(net)
    for accumulator, module in ((acc, net), (untouched, twin)):
        with accumulator.microbatch(module, weight=3.0, kind="sum"):
            (module.p * seed + module.q * seed).sum().backward()
    assert acc.state == untouched.state
    assert_records_equal(acc.state_dict(), untouched.state_dict())


def test_a_second_backward_in_one_block_is_refused_and_breaks_the_window() -> None:
    """A second backward reaching a parameter in one block raises ZeroCopyError (the first one's
    gradient is in: the window is broken); a record taken before the block repairs it."""
    acc, net, micros = _started()
    record = acc.state_dict()
    with pytest.raises(ZeroCopyError, match="second gradient"):
        with acc.microbatch(net, weight=micros[2].weight, kind="sum"):
            loss = _loss(net, micros[2])
            loss.backward(retain_graph=True)
            loss.backward()
    with pytest.raises(BrokenWindowError, match="ZeroCopyError"):
        acc.state_dict()
    acc.load_state_dict(record, net)
    assert_records_equal(acc.state_dict(), record)


def test_a_refusal_caught_inside_the_block_does_not_count_the_block() -> None:
    """A hook's refusal swallowed inside the block still spoils it: leaving raises, and the
    microbatch is not counted (ZeroCopyError when nothing was added, else BrokenWindowError)."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ZeroCopyError, match="not counted"):
        with acc.microbatch(net, weight=1.0, kind="sum"):
            with pytest.raises(ZeroCopyError, match="create_graph"):
                _loss(net, micros[2]).backward(create_graph=True)
    frozen.check(acc, net)
    with pytest.raises(BrokenWindowError, match="refused"):
        with acc.microbatch(net, weight=1.0, kind="sum"):
            loss = _loss(net, micros[2])
            loss.backward(retain_graph=True)
            with pytest.raises(ZeroCopyError, match="second gradient"):
                loss.backward()
    with pytest.raises(BrokenWindowError):
        acc.state_dict()


def test_create_graph_is_refused_before_anything_is_added() -> None:
    """backward(create_graph=True) is refused by the first hook it reaches: nothing changed, and
    the window goes on."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ZeroCopyError, match="create_graph"):
        with acc.microbatch(net, weight=1.0, kind="mean"):
            _loss(net, micros[2]).backward(create_graph=True)
    frozen.check(acc, net)
    _feed_zero_copy(acc, net, micros[2])
    assert acc.state.issued == 2


def test_a_sparse_gradient_is_refused_before_anything_is_added() -> None:
    """An nn.Embedding(sparse=True) gradient is refused in the hook; nothing changed."""
    acc = _zero_copy(torch.float32)
    net = nn.Embedding(10, 3, sparse=True)
    frozen = Frozen.of(acc, net)
    with pytest.raises(ZeroCopyError, match="sparse"):
        with acc.microbatch(net, weight=1.0, kind="sum"):
            net(torch.tensor([1, 4, 4])).sum().backward()
    frozen.check(acc, net)
    assert net.weight.grad is None


# --------------------------------------------------------------------- a backward that raises
class _Raise(torch.autograd.Function):
    """Identity forward; its backward raises (after the parameters behind it got gradients)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("in the backward")


def test_an_exception_in_the_forward_changes_nothing() -> None:
    """A block left by an exception before any gradient arrived changes nothing; the window then
    continues to the buffered mode's bits without that microbatch."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(RuntimeError, match="in the forward"):
        with acc.microbatch(net, weight=5.0, kind="mean"):
            raise RuntimeError("in the forward")
    frozen.check(acc, net)
    _feed_zero_copy(acc, net, micros[2])
    reference, net_b = _buffered(torch.float32), _net(torch.float32, "cpu")
    for micro in (micros[0], micros[2]):
        _feed_buffered(reference, net_b, micro)
    _assert_same_grads(acc.finish_mean().grads, reference.finish_mean().grads)


def _raising_backward(net: Net, micro: Micro) -> None:
    # `second` is behind the raising node in the forward, so its gradient arrives (and is added)
    # before the backward reaches _Raise; `first` never gets one.
    hidden = _Raise.apply(net.first(micro.x))
    (SCALE * ((net.second(hidden) - micro.y) ** 2).mean()).backward()


@pytest.mark.parametrize("recover", ["discard", "load_state_dict"])
def test_a_backward_that_raises_after_some_gradient_breaks_the_window(recover: str) -> None:
    """A backward raising after `second` received its gradient leaves the window broken: every
    call but discard()/load_state_dict() raises BrokenWindowError naming `second`; either one
    recovers (the record continues to the buffered mode's bits)."""
    acc, net, micros = _started()
    record = acc.state_dict()
    with pytest.raises(RuntimeError, match="in the backward"):
        with acc.microbatch(net, weight=micros[2].weight, kind="mean"):
            _raising_backward(net, micros[2])
    for call in (
        acc.state_dict,
        acc.finish_mean,
        acc.finish_sums,
        lambda: _feed_zero_copy(acc, net, micros[2]),
    ):
        with pytest.raises(BrokenWindowError, match=r"RuntimeError.*second\.weight"):
            call()
    assert acc.state.issued == 1  # the broken block was not counted
    if recover == "discard":
        acc.discard()
        assert acc.state.issued == 0
        assert all(p.grad is None for p in net.parameters())
        expected_micros = [micros[2]]
    else:
        acc.load_state_dict(_round_trip(record), net)
        expected_micros = [micros[0], micros[2]]
    _feed_zero_copy(acc, net, micros[2])
    reference, net_b = _buffered(torch.float32), _net(torch.float32, "cpu")
    for micro in expected_micros:
        _feed_buffered(reference, net_b, micro)
    _assert_same_grads(acc.finish_mean().grads, reference.finish_mean().grads)


def test_a_window_broken_in_its_first_block_refuses_every_call_but_discard_and_load() -> None:
    """A backward that raises half-way in the window's first block (``issued == 0``) breaks the
    window: every call but discard()/load_state_dict() raises — BrokenWindowError, or
    ZeroCopyError for the other mode's calls, which are wrong in any state — set_loss_scale
    included, and changes nothing (``state``, a read, still answers, and the loss scale stays);
    the empty window's record taken before the block still loads, and the window then gives the
    buffered mode's bits."""
    acc, net = _zero_copy(torch.float32), _net(torch.float32, "cpu")
    micros = _micros(torch.float32, "cpu", PLAN)
    record = _round_trip(acc.state_dict())
    with pytest.raises(RuntimeError, match="in the backward"):
        with acc.microbatch(net, weight=micros[0].weight, kind="mean"):
            _raising_backward(net, micros[0])
    state = acc.state
    assert state.issued == 0 and state.loss_scale == SCALE
    held = _grads(net)
    copies = {n: None if g is None else g.detach().clone() for n, g in held.items()}
    broken = re.compile(r"RuntimeError.*second\.weight")
    for call in (
        lambda: acc.set_loss_scale(2 * SCALE),
        lambda: acc.set_loss_scale(SCALE),
        acc.state_dict,
        acc.state_dict_async,
        acc.finish_mean,
        acc.finish_sums,
        lambda: _feed_zero_copy(acc, net, micros[1]),
    ):
        with pytest.raises(BrokenWindowError, match=broken):
            call()
    for other_mode in (acc.accumulate_sum, acc.accumulate_mean):
        with pytest.raises(ZeroCopyError, match="zero-copy accumulator"):
            other_mode(net, 1.0)
    assert acc.state == state
    for name, grad in _grads(net).items():
        assert grad is held[name], name
        assert_bitwise_equal(grad, copies[name], name)
    acc.load_state_dict(record, net)  # the record kept from before the block still fits
    assert acc.state == state
    _feed_zero_copy(acc, net, micros[0])
    reference, net_b = _buffered(torch.float32), _net(torch.float32, "cpu")
    _feed_buffered(reference, net_b, micros[0])
    _assert_same_grads(acc.finish_mean().grads, reference.finish_mean().grads)


def test_a_training_loop_steps_with_zero_copy_as_with_buffers() -> None:
    """Two SGD steps with finish_mean in .grad, optimizer.step, zero_grad(set_to_none=True)
    give the buffered loop's parameters bit for bit."""
    dtype = torch.float32
    nets = {"zero_copy": _net(dtype, "cpu"), "buffered": _net(dtype, "cpu")}
    optimizers = {name: torch.optim.SGD(net.parameters(), lr=0.1) for name, net in nets.items()}
    accs = {"zero_copy": _zero_copy(dtype), "buffered": _buffered(dtype)}
    for _ in range(2):
        for micro in _micros(dtype, "cpu", PLAN):
            _feed_zero_copy(accs["zero_copy"], nets["zero_copy"], micro)
            _feed_buffered(accs["buffered"], nets["buffered"], micro)
        accs["zero_copy"].finish_mean()
        accs["buffered"].finish_mean().apply_to(nets["buffered"])
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, p_z), p_b in zip(
        nets["zero_copy"].named_parameters(), nets["buffered"].parameters(), strict=True
    ):
        assert torch.equal(bits(p_z), bits(p_b)), name


def test_calls_inside_a_block_name_the_way_out() -> None:
    """discard() and load_state_dict() inside a block raise ZeroCopyError with the message that
    says to leave the block first; state_dict() and finish_mean() the one that says only the
    block's backward may run."""
    acc, net, micros = _started()
    record = acc.state_dict()
    with acc.microbatch(net, weight=micros[2].weight, kind=micros[2].kind):
        for call in (acc.discard, lambda: acc.load_state_dict(record, net)):
            with pytest.raises(ZeroCopyError) as caught:
                call()
            assert str(caught.value) == (
                "discard() or load_state_dict() inside a microbatch block; leave the block first"
            )
        for read in (acc.state_dict, acc.finish_mean):
            with pytest.raises(ZeroCopyError) as caught:
                read()
            assert str(caught.value) == (
                "the accumulator is inside a microbatch block; only the block's backward may "
                "run until it is left"
            )
        _loss(net, micros[2]).backward()


def test_discard_releases_only_the_grads_the_window_still_owns() -> None:
    """discard() sets the window's .grad buffers to None but leaves a .grad that the user put in
    place of one (someone else's tensor) as it is."""
    acc, net, _ = _started()
    assert net.first.weight.grad is not None and net.second.weight.grad is not None
    replacement = net.first.weight.grad.clone()
    net.first.weight.grad = replacement
    acc.discard()
    assert net.first.weight.grad is replacement
    assert net.second.weight.grad is None and net.first.bias.grad is None
    assert acc.state.issued == 0


def test_a_loaded_record_becomes_fresh_dense_grads_on_the_parameters_device() -> None:
    """load_state_dict in zero-copy mode makes each .grad a contiguous copy of the record's
    tensor on its parameter's device: a transposed tensor in the record comes back dense, and
    accumulating afterwards leaves the record as it was."""
    acc, net, micros = _started()
    record = acc.state_dict()
    weight = record["pending"]["first.weight"]
    record["pending"]["first.weight"] = weight.t().contiguous().t()  # same values, transposed
    assert not record["pending"]["first.weight"].is_contiguous()
    kept = copy.deepcopy(record)
    second, second_net = _zero_copy(torch.float32), _net(torch.float32, "cpu")
    second.load_state_dict(record, second_net)
    grad = second_net.first.weight.grad
    assert grad is not None and grad.is_contiguous()
    assert_bitwise_equal(grad, weight, "first.weight.grad")
    _feed_zero_copy(second, second_net, micros[2])
    assert_records_equal(record, kept)


def test_the_first_gradient_becomes_a_grad_on_the_parameters_device() -> None:
    """A block on a module on another device than the default (here the meta device) makes each
    new .grad buffer on the parameter's device."""
    net = nn.Linear(IN, OUT, device="meta")
    acc = _zero_copy(torch.float32)
    with acc.microbatch(net, weight=2.0, kind="sum"):
        net(torch.ones(3, IN, device="meta")).sum().backward()
    assert acc.state.issued == 1
    for parameter in net.parameters():
        assert parameter.grad is not None and parameter.grad.device.type == "meta"


def test_a_parameter_reshaped_inside_the_block_is_refused_naming_it() -> None:
    """A parameter whose .data changes shape between the forward and the backward of a block
    raises ParameterMismatchError naming it, both shapes and the device; the block is not
    counted."""
    net = nn.Linear(IN, OUT)
    acc = _zero_copy(torch.float32)
    with pytest.raises(ParameterMismatchError) as caught:
        with acc.microbatch(net, weight=2.0, kind="sum"):
            loss = net(torch.ones(3, IN)).sum()
            net.bias.data = torch.zeros(5)
            loss.backward()
    assert str(caught.value) == (
        "parameter 'bias' changed inside the microbatch block: it has shape [5] on cpu and its "
        f"gradient shape [{OUT}], but the tracked shape is [{OUT}] on cpu"
    )
    assert acc.state.issued == 0


@pytest.mark.parametrize("meddle", ["removed", "replaced", "changed in place"])
def test_a_grad_meddled_with_inside_the_block_is_refused_naming_what_happened(
    meddle: str,
) -> None:
    """A pending .grad removed, replaced or changed in place between a block's forward and its
    backward raises BrokenWindowError naming the parameter and what happened to its .grad."""
    acc, net, micros = _started()
    grad = net.second.bias.grad
    assert grad is not None
    with pytest.raises(BrokenWindowError) as caught:
        with acc.microbatch(net, weight=micros[2].weight, kind=micros[2].kind):
            loss = _loss(net, micros[2])
            if meddle == "removed":
                net.second.bias.grad = None
            elif meddle == "replaced":
                net.second.bias.grad = grad.clone()
            else:
                grad.add_(1.0)
            loss.backward()
    assert str(caught.value).startswith(
        f"the .grad of 'second.bias' was {meddle} inside the microbatch block before its "
        "gradient arrived: the window's sum is no longer in .grad. call discard(), or "
        "load_state_dict() with an earlier record"
    )


def test_a_parameter_dtype_changed_inside_the_block_is_refused_naming_it() -> None:
    """A parameter whose .data changes dtype between a block's forward and backward (its
    gradient still in D) raises ZeroCopyError naming both dtypes and D; nothing is counted."""
    net = nn.Linear(IN, OUT)
    acc = _zero_copy(torch.float32)
    with pytest.raises(ZeroCopyError) as caught:
        with acc.microbatch(net, weight=2.0, kind="sum"):
            loss = net(torch.ones(3, IN)).sum()
            net.bias.data = net.bias.data.double()
            loss.backward()
    assert str(caught.value) == (
        "parameter 'bias' has dtype torch.float64 (its gradient torch.float32) inside the "
        "block, but the work dtype is torch.float32"
    )
    assert acc.state.issued == 0


def test_flushed_subnormals_turned_on_inside_the_block_are_refused_at_the_backward() -> None:
    """Flush-to-zero switched on after a block's entry is refused when the gradient arrives on
    the CPU, naming the backward's thread; nothing is counted."""
    net = nn.Linear(IN, OUT)
    acc = _zero_copy(torch.float32)
    with pytest.raises(UnsupportedEnvironmentError) as caught:
        with acc.microbatch(net, weight=2.0, kind="sum"):
            if not torch.set_flush_denormal(True):
                torch.set_flush_denormal(False)
                pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
            try:
                net(torch.ones(3, IN)).sum().backward()
            finally:
                torch.set_flush_denormal(False)
    assert str(caught.value).startswith(
        "microbatch (in the backward's thread): the CPU flushes subnormals to zero"
    )
    assert acc.state.issued == 0


def test_grads_meddled_with_in_a_block_without_backward_break_the_window_on_leaving() -> None:
    """A block that runs no backward but replaces one pending .grad and removes another raises
    BrokenWindowError on leaving, naming both, and every later call raises until discard()."""
    acc, net, _ = _started()
    grad = net.second.bias.grad
    assert grad is not None
    with pytest.raises(BrokenWindowError) as caught:
        with acc.microbatch(net, weight=1.0, kind="sum"):
            net.second.bias.grad = grad.clone()
            net.first.weight.grad = None
    message = (
        "the .grad of ['second.bias'] was replaced by another tensor; the .grad of "
        "['first.weight'] was removed (set to None: model.zero_grad() or optimizer.zero_grad() "
        "mid-window?) left a zero-copy microbatch block after part of the window's sums had "
        "changed (added to []); the window cannot be "
        "completed: call discard(), or load_state_dict() with an earlier record (taken before "
        "the block)"
    )
    assert str(caught.value) == message
    with pytest.raises(BrokenWindowError, match="second.bias"):
        acc.finish_mean()
    acc.discard()
    assert acc.state.issued == 0


# --------------------------------------------------------------------- gaps found by mutants
def test_ddp_outside_no_sync_is_refused_naming_the_way_out(one_rank_group: None) -> None:
    """A block on a DistributedDataParallel model outside no_sync() raises ZeroCopyError at
    entry, nothing changed, with the message that names the way out (no_sync() around each
    block, all_reduce_sums after); inside no_sync() the same block runs and is counted."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(IN, OUT))
    acc = _zero_copy(torch.float32)
    x = torch.ones(3, IN)
    with pytest.raises(ZeroCopyError) as caught:
        with acc.microbatch(ddp, weight=3.0, kind="mean"):
            pytest.fail("the block must not be entered")
    assert str(caught.value) == (
        "zero-copy accumulation under DistributedDataParallel needs its no_sync() context: "
        "DDP would all-reduce a .grad the backward did not fill. Run every microbatch in "
        "`with ddp.no_sync(), acc.microbatch(...)` and reduce the finished sums with "
        "wacc_torch.all_reduce_sums"
    )
    assert acc.state.issued == 0 and all(p.grad is None for p in ddp.parameters())
    with ddp.no_sync(), acc.microbatch(ddp, weight=3.0, kind="mean"):
        ddp(x).sum().backward()
    assert acc.state.issued == 1 and acc.state.total_weight == 3.0


def test_fsdp_is_refused_naming_the_buffered_way_out(one_rank_group: None) -> None:
    """A module with an FSDP unit (fully_shard) is refused at entry with ZeroCopyError whose
    message names FSDP and the way out (the buffered accumulator with FSDPWeightedWindow);
    nothing changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    acc = _zero_copy(torch.float32)
    with pytest.raises(ZeroCopyError) as caught:
        acc.microbatch(model, weight=1.0, kind="sum").__enter__()
    assert str(caught.value) == (
        "zero-copy accumulation does not support FSDP (fully_shard): FSDP writes sharded "
        ".grad itself; use the buffered accumulator with FSDPWeightedWindow"
    )
    assert acc.state.issued == 0


def test_a_block_is_entered_once() -> None:
    """Entering a block object a second time, after it counted its backward, raises
    ZeroCopyError saying to make a new one; nothing changes, and a new block goes on."""
    acc, net, micros = _started()
    block = acc.microbatch(net, weight=micros[2].weight, kind=micros[2].kind)
    with block:
        _loss(net, micros[2]).backward()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ZeroCopyError) as caught:
        with block:
            pytest.fail("the block must not be entered again")
    assert str(caught.value) == "a microbatch block can be entered once; make a new one"
    frozen.check(acc, net)
    _feed_zero_copy(acc, net, micros[3])
    assert acc.state.issued == 3


def test_a_nested_block_is_refused_with_the_rule_it_breaks() -> None:
    """A block entered inside a block raises ZeroCopyError saying that only the outer block's
    backward may run until it is left."""
    acc, net, micros = _started()
    with acc.microbatch(net, weight=micros[2].weight, kind=micros[2].kind):
        with pytest.raises(ZeroCopyError) as caught:
            acc.microbatch(net, weight=1.0, kind="sum").__enter__()
        _loss(net, micros[2]).backward()
    assert str(caught.value) == (
        "a microbatch block inside a microbatch block; only the outer block's backward may run "
        "until it is left"
    )
    assert acc.state.issued == 2


def test_every_kind_of_damage_is_named_with_its_parameters() -> None:
    """Between blocks, a pending .grad clipped in place, another replaced and a third removed:
    the next call raises BrokenWindowError naming each parameter with what happened to it, all
    three listed, in place first."""
    acc, net, _ = _started()
    assert net.second.bias.grad is not None
    nn.utils.clip_grad_norm_([net.first.weight], max_norm=1e-3)  # in place
    net.second.bias.grad = net.second.bias.grad.clone()
    net.first.bias.grad = None
    with pytest.raises(BrokenWindowError) as caught:
        acc.finish_mean()
    message = str(caught.value)
    assert re.match(
        r"the \.grad of \['first\.weight'\] was changed in place \(.*\); "
        r"the \.grad of \['second\.bias'\] was replaced by another tensor; "
        r"the \.grad of \['first\.bias'\] was removed \(.*\): "
        r"the window's sums are no longer in \.grad\.",
        message,
    ), message
    acc.discard()
    assert acc.state.issued == 0


def test_a_weight_not_surviving_d_is_refused_naming_it() -> None:
    """A mean weight that vanishes in bfloat16 is refused at entry with InvalidWeightError
    naming the weight as given and D."""
    acc, net = _zero_copy(torch.bfloat16), _net(torch.bfloat16, "cpu")
    with pytest.raises(InvalidWeightError, match=r"weight 1e-42 does not survive .*bfloat16"):
        acc.microbatch(net, weight=1e-42, kind="mean").__enter__()
    assert acc.state.issued == 0 and all(p.grad is None for p in net.parameters())


def test_flushed_subnormals_at_entry_are_refused_naming_microbatch() -> None:
    """Flush-to-zero on when a positive-weight block is entered raises
    UnsupportedEnvironmentError naming the call (microbatch); nothing changes."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
    try:
        with pytest.raises(UnsupportedEnvironmentError) as caught:
            acc.microbatch(net, weight=2.0, kind="sum").__enter__()
    finally:
        torch.set_flush_denormal(False)
    assert str(caught.value).startswith("microbatch: the CPU flushes subnormals to zero")
    frozen.check(acc, net)


def test_a_model_moved_to_another_device_inside_the_block_is_refused_naming_it() -> None:
    """A model moved (module.to with swapped parameters: same shapes, another device) between a
    block's forward and its backward raises ParameterMismatchError naming both devices; the
    block is not counted."""
    net = nn.Linear(IN, OUT)
    acc = _zero_copy(torch.float32)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(ParameterMismatchError, match=r"on meta .* tracked shape .* on cpu"):
            with acc.microbatch(net, weight=2.0, kind="sum"):
                loss = net(torch.ones(3, IN)).sum()
                net.to("meta")
                loss.backward()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert acc.state.issued == 0


# ------------------------------------------------- the tracked set changed inside a block (§3)
def _reference_of(micros: Sequence[Micro]) -> dict[str, Any]:
    """The buffered mode's means of ``micros`` on a fresh copy of the model."""
    reference, net = _buffered(torch.float32), _net(torch.float32, "cpu")
    for micro in micros:
        _feed_buffered(reference, net, micro)
    return reference.finish_mean().grads


def test_a_parameter_frozen_inside_the_block_is_refused_as_the_buffered_mode_refuses_it() -> None:
    """A tracked parameter frozen with ``requires_grad_(False)`` inside a block, before its
    backward, is refused with ParameterMismatchError naming it as frozen — what the buffered
    mode raises for the same microbatch — by the backward's first gradient, before anything is
    added: nothing changed, and after unfreezing, the window gives the buffered mode's bits
    without that microbatch. Frozen before a block's entry, it is refused at the entry; between
    windows the next window binds without it (semantics §3)."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ParameterMismatchError, match=r"frozen.*\['second\.bias'\]"):
        with acc.microbatch(net, weight=micros[2].weight, kind="sum"):
            net.second.bias.requires_grad_(False)
            _loss(net, micros[2]).backward()
    net.second.bias.requires_grad_(True)
    frozen.check(acc, net)
    # The buffered mode, same microbatch: refused with the same words.
    buffered, net_b = _buffered(torch.float32), _net(torch.float32, "cpu")
    _feed_buffered(buffered, net_b, micros[0])
    _loss(net_b, micros[2]).backward()
    net_b.second.bias.requires_grad_(False)
    with pytest.raises(ParameterMismatchError, match=r"frozen.*\['second\.bias'\]"):
        buffered.accumulate_sum(net_b, micros[2].weight)

    net.second.bias.requires_grad_(False)  # frozen before the entry: refused there
    with pytest.raises(ParameterMismatchError, match=r"frozen.*\['second\.bias'\]"):
        acc.microbatch(net, weight=1.0).__enter__()
    net.second.bias.requires_grad_(True)
    frozen.check(acc, net)
    _feed_zero_copy(acc, net, micros[3])
    _assert_same_grads(acc.finish_mean().grads, _reference_of([micros[0], micros[3]]))

    # Between windows the set is free: the next window binds without the frozen parameter.
    net.zero_grad(set_to_none=True)
    net.second.bias.requires_grad_(False)
    _feed_zero_copy(acc, net, micros[3])
    assert "second.bias" not in acc.finish_mean().grads


def test_a_parameter_frozen_inside_the_block_after_its_backward_is_refused_on_leaving() -> None:
    """Frozen after the block's backward (as a buffered loop freezing it between backward and
    accumulate_mean, which is refused), the block is refused on leaving: with gradients added,
    BrokenWindowError from the ParameterMismatchError naming the frozen parameter (the window
    cannot be completed; discard() recovers); in a zero-weight block, where nothing is added,
    ParameterMismatchError, nothing changed and the block not counted."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ParameterMismatchError, match=r"frozen.*\['second\.bias'\].*not counted"):
        with acc.microbatch(net, weight=0.0, kind="sum"):
            _loss(net, micros[2]).backward()
            net.second.bias.requires_grad_(False)
    net.second.bias.requires_grad_(True)
    frozen.check(acc, net)
    with pytest.raises(BrokenWindowError, match=r"frozen.*\['second\.bias'\]") as caught:
        with acc.microbatch(net, weight=micros[2].weight, kind="sum"):
            _loss(net, micros[2]).backward()
            net.second.bias.requires_grad_(False)
    assert isinstance(caught.value.__cause__, ParameterMismatchError)
    net.second.bias.requires_grad_(True)
    assert acc.state == frozen.state  # the block was not counted
    with pytest.raises(BrokenWindowError, match=r"frozen.*\['second\.bias'\]"):
        acc.finish_mean()
    acc.discard()
    _feed_zero_copy(acc, net, micros[3])
    _assert_same_grads(acc.finish_mean().grads, _reference_of([micros[3]]))


def _loss_with_extra(net: Net, micro: Micro) -> torch.Tensor:
    extra = net.second.get_parameter("extra")
    return SCALE * ((net(micro.x) * extra - micro.y) ** 2).mean()


def test_a_parameter_added_inside_the_block_is_refused_and_its_grad_never_finished() -> None:
    """A parameter registered (trainable) inside a block is refused with ParameterMismatchError
    naming it as not tracked — as the buffered mode refuses the same microbatch — before
    anything is added; autograd wrote its gradient raw into its own ``.grad`` (no hook sits on
    it), so finishing the window refuses (ZeroCopyError naming it) while that ``.grad`` is there,
    rather than leave it to the optimizer beside the means; with it removed, the window finishes
    with the buffered mode's bits."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    with pytest.raises(ParameterMismatchError, match=r"not tracked: \['second\.extra'\]"):
        with acc.microbatch(net, weight=micros[3].weight, kind="mean"):
            net.second.extra = nn.Parameter(torch.ones(OUT))
            _loss_with_extra(net, micros[3]).backward()
    assert net.second.extra.grad is not None  # autograd's raw gradient, not the window's
    assert acc.state == frozen.state
    for name, grad in frozen.grads.items():
        assert _grads(net)[name] is grad, name
        assert_bitwise_equal(grad, frozen.copies[name], name)
    # The buffered mode, same microbatch: refused with the same words.
    buffered, net_b = _buffered(torch.float32), _net(torch.float32, "cpu")
    _feed_buffered(buffered, net_b, micros[0])
    net_b.second.extra = nn.Parameter(torch.ones(OUT))
    _loss_with_extra(net_b, micros[3]).backward()
    with pytest.raises(ParameterMismatchError, match=r"not tracked: \['second\.extra'\]"):
        buffered.accumulate_mean(net_b, micros[3].weight)

    for finish in (acc.finish_mean, acc.finish_sums, acc.state_dict):
        with pytest.raises(ZeroCopyError, match=r"\['second\.extra'\].*not tracked"):
            finish()
    assert acc.state == frozen.state
    del net.second.extra
    _feed_zero_copy(acc, net, micros[3])
    _assert_same_grads(acc.finish_mean().grads, _reference_of([micros[0], micros[3]]))


def test_a_parameter_added_inside_the_last_block_after_its_backward_breaks_the_window() -> None:
    """Added after the block's backward (its gradients are in), the parameter is refused on
    leaving: BrokenWindowError naming it, the block not counted, and finish_mean refuses rather
    than hand over a window without a microbatch it was given."""
    acc, net, micros = _started()
    with pytest.raises(BrokenWindowError, match=r"not tracked: \['second\.extra'\]"):
        with acc.microbatch(net, weight=micros[3].weight, kind="mean"):
            _loss(net, micros[3]).backward()
            net.second.extra = nn.Parameter(torch.ones(OUT))
    assert acc.state.issued == 1
    with pytest.raises(BrokenWindowError, match="second.extra"):
        acc.finish_mean()


def test_a_parameter_re_registered_inside_the_block_is_refused_before_anything_is_added() -> None:
    """A tracked parameter re-registered as another tensor inside a block (its gradient would
    reach the new tensor's ``.grad`` past the hooks, which sit on the entry's parameters) is
    refused with ZeroCopyError naming it, before anything is added: with the original put back,
    the window gives the buffered mode's bits without that microbatch."""
    acc, net, micros = _started()
    frozen = Frozen.of(acc, net)
    original = net.second.bias
    with pytest.raises(ZeroCopyError, match=r"\['second\.bias'\] were re-registered"):
        with acc.microbatch(net, weight=micros[2].weight, kind="sum"):
            net.second.bias = nn.Parameter(original.detach().clone())
            _loss(net, micros[2]).backward()
    net.second.bias = original
    frozen.check(acc, net)
    _feed_zero_copy(acc, net, micros[3])
    _assert_same_grads(acc.finish_mean().grads, _reference_of([micros[0], micros[3]]))
