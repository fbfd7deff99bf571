"""The buffered fast path gives the bits of the plain per-tensor order (semantics §5, §6, §8).

The accumulator adds small parameters as one concatenated tensor into a per-device arena, skips
re-validation when a call's structure matches the last one accepted, processes large tensors in
pieces and divides each arena as one tensor. None of that may change a bit, a counter or an
error. The reference here is the order written out tensor by tensor with plain torch operations
(``_spec_order``), independent of the accumulator's code.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import wacc_torch._arena
import wacc_torch._work
from tests.wacc_torch.support import (
    WORK_DTYPE_PARAMS,
    assert_bitwise_equal,
    assert_records_equal,
    awkward_values,
)
from wacc_torch import (
    AccumulatorState,
    ParameterMismatchError,
    WeightedGradientsAccumulator,
)
from wacc_torch._binding import binding_of, tracked_parameters
from wacc_torch._gradients import GradientCheck

Shapes = dict[str, tuple[int, ...]]
# Small (arena) parameters of several ranks, a 0-d one and two large ones.
SHAPES: Shapes = {
    "bias": (5,),
    "norm": (7,),
    "table": (3, 4),
    "scalar": (),
    "big": (40, 30),
    "wide": (2, 700),
}


class Bag(nn.Module):
    """A module with one parameter per entry of ``shapes``, in that order, of ``dtype``."""

    def __init__(self, shapes: Shapes, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=dtype)))


def _spec_order(
    batches: list[tuple[str, float, dict[str, torch.Tensor]]],
    *,
    dtype: torch.dtype,
    loss_scale: float,
) -> dict[str, torch.Tensor | None]:
    """The semantics' order, tensor by tensor: conv_D, (round_D(c * w_D)), add; then / S, / W."""
    buffers: dict[str, torch.Tensor] = {}
    total = 0.0
    for kind, weight, grads in batches:
        w_d = float(torch.tensor(float(weight), dtype=torch.float64).to(dtype).item())
        counted = w_d if kind == "mean" else weight
        if weight == 0:
            continue
        total += counted
        for name, grad in grads.items():
            converted = grad.to(dtype)
            term = torch.mul(converted, w_d) if kind == "mean" else converted
            buffers.setdefault(name, torch.zeros(grad.shape, dtype=dtype)).add_(term)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    out: dict[str, torch.Tensor | None] = {}
    for name in SHAPES:
        if name not in buffers:
            out[name] = None
            continue
        y = torch.div(buffers[name], torch.tensor(loss_scale, dtype=dtype))
        out[name] = y.to(wide).div_(torch.tensor(total, dtype=wide)).to(dtype)
    return out


def _gradients(
    shapes: Shapes, dtype: torch.dtype, seed: int, *, missing: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
        for name, shape in shapes.items()
        if name not in missing
    }


@pytest.fixture(autouse=True)
def small_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arena members of at most 100 elements and pieces of 64, so that "big" and "wide" are
    large tensors processed in several pieces."""
    monkeypatch.setattr(wacc_torch._arena, "SMALL_ELEMENTS", 100)
    monkeypatch.setattr(wacc_torch._work, "CHUNK_ELEMENTS", 64)


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
def test_mixed_windows_match_the_per_tensor_order(
    dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    """Sums and means, complete and partial gradient sets, give the per-tensor order's bits."""
    module = Bag(SHAPES)
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=8.0)
    batches: list[tuple[str, float, dict[str, torch.Tensor]]] = [
        ("mean", 61, _gradients(SHAPES, grad_dtype, 1)),  # complete: the arena as one tensor
        ("sum", 3, _gradients(SHAPES, grad_dtype, 2, missing=frozenset({"norm"}))),  # partial
        ("mean", 0, _gradients(SHAPES, grad_dtype, 3)),  # zero weight: nothing read
        ("mean", 1001, _gradients(SHAPES, grad_dtype, 4)),
        ("sum", 17, _gradients(SHAPES, grad_dtype, 5, missing=frozenset({"big", "bias"}))),
    ]
    for kind, weight, grads in batches:
        getattr(accumulator, f"accumulate_{kind}")(module, weight, grads=grads)
    result = accumulator.finish_mean()
    expected = _spec_order(batches, dtype=dtype, loss_scale=8.0)
    for name, tensor in expected.items():
        actual = result.grads[name]
        if tensor is None:
            assert actual is None, name
        else:
            assert actual is not None, name
            assert_bitwise_equal(actual, tensor, name)


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_awkward_values_in_the_arena_keep_their_bits(dtype: torch.dtype) -> None:
    """±0, subnormals, inf and NaN in small tensors go through the arena as tensor by tensor."""
    shapes: Shapes = {f"p{i}": (16,) for i in range(6)}
    module = Bag(shapes)
    generator = torch.Generator().manual_seed(0)
    grads = {
        name: awkward_values((16,), dtype=dtype, around=dtype, generator=generator)
        for name in shapes
    }
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    accumulator.accumulate_mean(module, 3, grads=grads)
    accumulator.accumulate_sum(module, 2, grads=grads)
    sums = accumulator.finish_sums()
    for name, grad in grads.items():
        w_d = float(torch.tensor(3.0, dtype=dtype).item())
        expected = torch.zeros(16, dtype=dtype).add_(torch.mul(grad, w_d)).add_(grad)
        actual = sums.grads[name]
        assert actual is not None
        assert_bitwise_equal(actual, expected, name)


def test_small_parameters_share_one_arena_and_are_handed_over_as_views() -> None:
    """The small buffers are views of one storage; the large and the 0-d ones have their own."""
    module = Bag(SHAPES)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(module, 1, grads=_gradients(SHAPES, torch.float32, 0))
    grads = accumulator.finish_sums().grads
    storages = {
        name: tensor.untyped_storage().data_ptr()
        for name, tensor in grads.items()
        if tensor is not None
    }
    assert storages["bias"] == storages["norm"] == storages["table"]
    assert len({storages["bias"], storages["scalar"], storages["big"], storages["wide"]}) == 4


def test_arena_views_can_be_adopted_by_from_pending() -> None:
    """Disjoint views of one arena are adopted; a buffer overlapping another is refused."""
    module = Bag(SHAPES)
    original = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    original.accumulate_sum(module, 2, grads=_gradients(SHAPES, torch.float32, 0))
    record = original.state_dict()
    sums = original.finish_sums()
    pending = {name: tensor for name, tensor in sums.grads.items() if tensor is not None}
    state = AccumulatorState(torch.float32, 1.0, 1, 0, 2.0, False)
    adopted = WeightedGradientsAccumulator.from_pending(module, pending, state)
    assert_records_equal(adopted.state_dict(), record)
    storage = torch.zeros(12)
    overlapping = dict(pending, bias=storage[0:5], norm=storage[4:11])
    with pytest.raises(ParameterMismatchError, match="'norm' shares the memory of pending"):
        WeightedGradientsAccumulator.from_pending(module, overlapping, state)


def test_a_resumed_window_goes_on_through_the_arena() -> None:
    """load_state_dict restores small buffers into an arena and the next call uses it."""
    module = Bag(SHAPES)
    first = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=2.0)
    first.accumulate_mean(module, 5, grads=_gradients(SHAPES, torch.float32, 1))
    second = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=2.0)
    second.load_state_dict(first.state_dict(), Bag(SHAPES))
    assert second._mode.arenas, "the restored small buffers should live in an arena"
    for accumulator in (first, second):
        accumulator.accumulate_mean(module, 7, grads=_gradients(SHAPES, torch.float32, 2))
    expected, actual = first.finish_mean(), second.finish_mean()
    for name in SHAPES:
        left, right = actual.grads[name], expected.grads[name]
        assert left is not None and right is not None
        assert_bitwise_equal(left, right, name)


def test_a_known_layout_with_a_new_shape_is_still_refused() -> None:
    """After a call is accepted, a gradient of the same size but another shape raises."""
    module = Bag(SHAPES)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    grads = _gradients(SHAPES, torch.float32, 0)
    accumulator.accumulate_sum(module, 1, grads=grads)
    accumulator.accumulate_sum(module, 1, grads=grads)  # the cached layout
    record = accumulator.state_dict()
    bad = dict(grads, table=torch.zeros(4, 3))
    with pytest.raises(ParameterMismatchError, match=r"'table' has shape \[4, 3\]"):
        accumulator.accumulate_sum(module, 1, grads=bad)
    assert_records_equal(accumulator.state_dict(), record)
    not_a_tensor = dict(grads, bias=[0.0] * 5)
    with pytest.raises(ParameterMismatchError, match="'bias' must be a tensor or None"):
        accumulator.accumulate_sum(module, 1, grads=not_a_tensor)  # type: ignore[arg-type]
    assert_records_equal(accumulator.state_dict(), record)


def test_a_parameter_whose_data_moved_mid_window_is_refused_through_its_grad() -> None:
    """A parameter reshaped in place mid-window: its .grad no longer fits the tracked shape."""
    module = Bag(SHAPES)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(module, 1, grads=_gradients(SHAPES, torch.float32, 0))
    module.table.data = torch.zeros(2, 6)
    for name, grad in _gradients({**SHAPES, "table": (2, 6)}, torch.float32, 1).items():
        getattr(module, name).grad = grad
    record = accumulator.state_dict()
    with pytest.raises(ParameterMismatchError, match=r"'table'.*tracked shape is \[3, 4\]"):
        accumulator.accumulate_sum(module, 1)
    assert_records_equal(accumulator.state_dict(), record)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=2, max_size=8),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["sum", "mean"]),
            st.integers(0, 300),
            st.integers(0, 2**16),  # a mask of missing gradients
            st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        ),
        min_size=1,
        max_size=4,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_any_window_of_small_tensors_matches_the_per_tensor_order(
    sizes: list[int],
    steps: list[tuple[str, int, int, torch.dtype]],
    dtype: torch.dtype,
) -> None:
    """Random small parameters, weights, missing gradients and dtypes: the same bits."""
    shapes: Shapes = {f"p{i}": (size,) for i, size in enumerate(sizes)}
    module = Bag(shapes)
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    fresh = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)
    reference = Bag(shapes)
    for index, (kind, weight, mask, grad_dtype) in enumerate(steps):
        missing = frozenset(name for i, name in enumerate(shapes) if mask >> i & 1)
        grads = _gradients(shapes, grad_dtype, index, missing=missing)
        getattr(accumulator, f"accumulate_{kind}")(module, weight, grads=grads)
        # The same calls tensor by tensor: one parameter per call cannot use the arena.
        for name, grad in grads.items():
            getattr(fresh, f"accumulate_{kind}")(reference, weight, grads={name: grad})
    for name in shapes:
        left = accumulator._mode.window.pending.get(name)
        right = fresh._mode.window.pending.get(name)
        assert (left is None) == (right is None), name
        if left is not None and right is not None:
            assert_bitwise_equal(left, right, name)
    assert math.isfinite(accumulator.state.total_weight)


def test_pieces_cover_every_element_once() -> None:
    """pieces() splits along dim 0 into views that together are the tensor, in order."""
    for shape, chunk in (((10, 3), 7), ((5,), 2), ((), 4), ((0, 4), 3), ((3, 100), 10)):
        tensor = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        wacc_torch._work.CHUNK_ELEMENTS = chunk  # restored by the small_limits fixture
        parts = [piece for (piece,) in wacc_torch._work.pieces(tensor)]
        need = wacc_torch._work.chunk_numel(tensor.shape)
        flat = torch.cat([part.reshape(-1) for part in parts]) if parts else tensor.reshape(-1)
        assert torch.equal(flat, tensor.reshape(-1)), shape
        assert all(part.numel() <= need for part in parts), shape


def test_small_groups_take_small_parameters_of_one_device_only() -> None:
    """small_groups: at least 1-d and at most SMALL_ELEMENTS elements, two or more per device."""
    cpu = torch.device("cpu")
    limit = wacc_torch._arena.SMALL_ELEMENTS  # 100 here (small_limits)
    shapes = [torch.Size(s) for s in ((3,), (), (limit,), (limit + 1,), (0,), (2, 2))]
    assert wacc_torch._arena.small_groups(shapes, [cpu] * 6) == {cpu: (0, 2, 5)}
    assert wacc_torch._arena.small_groups(shapes[:2], [cpu] * 2) == {}


def test_a_set_missing_only_large_gradients_still_matches_the_per_tensor_order() -> None:
    """A call whose small gradients are all there but a large one is missing (no cached
    signature): the small ones, of one dtype or of several, give the per-tensor order's bits."""
    module = Bag(SHAPES)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=2.0)
    one_dtype = _gradients(SHAPES, torch.float32, 11, missing=frozenset({"big"}))
    mixed = _gradients(SHAPES, torch.float32, 12, missing=frozenset({"wide"}))
    mixed["bias"] = mixed["bias"].to(torch.bfloat16)  # two dtypes among the small ones
    batches: list[tuple[str, float, dict[str, torch.Tensor]]] = [
        ("sum", 3, one_dtype),
        ("mean", 5, mixed),
        ("mean", 7, one_dtype),
    ]
    for kind, weight, grads in batches:
        getattr(accumulator, f"accumulate_{kind}")(module, weight, grads=grads)
    result = accumulator.finish_mean()
    for name, tensor in _spec_order(batches, dtype=torch.float32, loss_scale=2.0).items():
        actual = result.grads[name]
        assert actual is not None and tensor is not None, name
        assert_bitwise_equal(actual, tensor, name)


def test_common_dtype_is_the_groups_one_dtype_or_none() -> None:
    """GradientCheck.common_dtype: the one dtype of a group of the last collected set, None
    when one of the group is missing or their dtypes differ; the same answers with the set's
    signature cached (complete set), without it (a gradient missing elsewhere) and after
    forget() has dropped the cache."""
    shapes: Shapes = {"a": (3,), "b": (4,), "c": (2, 2), "big": (30, 30)}
    parameters = tracked_parameters(Bag(shapes))
    binding = binding_of(parameters)
    grads = _gradients(shapes, torch.float32, 0)
    grads["c"] = grads["c"].to(torch.bfloat16)
    check = GradientCheck()

    def answers(collected: list[torch.Tensor | None]) -> list[torch.dtype | None]:
        return [
            check.common_dtype(group, [collected[i] for i in group])
            for group in ((0, 1), (1, 2), (0, 3), (2,))
        ]

    complete = check.collect(binding, parameters, grads)
    assert answers(complete) == [torch.float32, None, torch.float32, torch.bfloat16]
    again = check.collect(binding, parameters, grads)  # the cached signature
    assert answers(again) == [torch.float32, None, torch.float32, torch.bfloat16]
    check.forget()
    assert answers(again) == [torch.float32, None, torch.float32, torch.bfloat16]
    no_big = check.collect(binding, parameters, {k: v for k, v in grads.items() if k != "big"})
    assert answers(no_big) == [torch.float32, None, None, torch.bfloat16]
    no_a = check.collect(binding, parameters, {k: v for k, v in grads.items() if k != "a"})
    assert answers(no_a) == [None, None, None, torch.bfloat16]


@pytest.mark.parametrize(
    "shapes",
    [
        {"m": (3, 4), "n": (2, 5), "k": (2, 2, 2)},
        {"m": (3, 4), "n": (2, 5), "o": (4, 1)},  # all 2-d, of different widths
    ],
    ids=["mixed-ranks", "all-2d"],
)
def test_an_arena_of_multi_dimensional_parameters_adds_like_tensor_by_tensor(
    shapes: Shapes,
) -> None:
    """Small parameters that are all at least 2-d (of mixed ranks, or all 2-d with different
    row widths) share one arena and a complete set of their gradients is added as one tensor:
    the sums are each parameter's own, bit for bit."""
    module = Bag(shapes)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    first, second = _gradients(shapes, torch.float32, 1), _gradients(shapes, torch.float32, 2)
    accumulator.accumulate_sum(module, 1, grads=first)
    accumulator.accumulate_sum(module, 1, grads=second)
    sums = accumulator.finish_sums().grads
    storages = {
        tensor.untyped_storage().data_ptr() for tensor in sums.values() if tensor is not None
    }
    assert len(storages) == 1, "the three small buffers should be views of one arena"
    for name, shape in shapes.items():
        expected = torch.zeros(shape).add_(first[name]).add_(second[name])
        actual = sums[name]
        assert actual is not None
        assert_bitwise_equal(actual, expected, name)


def test_a_loaded_record_becomes_contiguous_copies_on_the_parameters_device() -> None:
    """load_state_dict copies the record's buffers (arena members and the others) onto each
    parameter's device as contiguous tensors: a transposed tensor in the record comes back
    dense, and accumulating afterwards leaves the record as it was (semantics §9: on the
    parameters' devices, as copies)."""
    module = Bag(SHAPES)
    first = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    first.accumulate_sum(module, 2, grads=_gradients(SHAPES, torch.float32, 3))
    record = first.state_dict()
    big = record["pending"]["big"]
    record["pending"]["big"] = big.t().contiguous().t()  # same values, transposed
    assert not record["pending"]["big"].is_contiguous()
    kept = copy.deepcopy(record)
    second = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    second.load_state_dict(record, module)
    restored = second._mode.window.pending
    assert set(restored) == set(SHAPES)
    for name, buffer in restored.items():
        assert buffer.is_contiguous(), name
        assert_bitwise_equal(buffer, kept["pending"][name], name)
    second.accumulate_sum(module, 1, grads=_gradients(SHAPES, torch.float32, 4))
    assert_records_equal(record, kept)


def test_small_parameters_on_the_meta_device_get_buffers_on_their_own_device() -> None:
    """A module with small, 0-d and large parameters on the meta device next to CPU ones: every
    buffer is allocated on its parameter's device, those in an arena (added as one tensor) and
    those on their own, for sums and means; the CPU buffers hold the per-tensor order's bits
    (semantics §9: buffers live on the parameters' devices)."""
    module = Bag(SHAPES)
    for name in ("bias", "table", "scalar", "big"):
        module.register_parameter(name, nn.Parameter(torch.zeros(SHAPES[name], device="meta")))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    batches: list[tuple[str, float, dict[str, torch.Tensor]]] = []
    for seed, kind in ((1, "sum"), (2, "mean")):
        grads = _gradients(SHAPES, torch.float32, seed)
        grads = {name: grad.to(getattr(module, name).device) for name, grad in grads.items()}
        getattr(accumulator, f"accumulate_{kind}")(module, 3, grads=grads)
        batches.append((kind, 3, {k: v for k, v in grads.items() if v.device.type == "cpu"}))
    sums = accumulator.finish_sums().grads
    for name, parameter in module.named_parameters():
        buffer = sums[name]
        assert buffer is not None and buffer.device == parameter.device, name
        assert buffer.shape == parameter.shape, name
    # The CPU ones against the per-tensor order (finish_sums: no division, so undo none).
    for name in ("norm", "wide"):
        expected = torch.zeros(SHAPES[name])
        for kind, weight, grads in batches:  # w_D = 3.0: exact in float32
            expected.add_(torch.mul(grads[name], float(weight)) if kind == "mean" else grads[name])
        actual = sums[name]
        assert actual is not None
        assert_bitwise_equal(actual, expected, name)


def test_a_window_adopted_without_an_arena_still_gives_other_devices_theirs() -> None:
    """from_pending with the small buffers of one device (meta) adopted as they are: that
    device gets no arena, but the small parameters of every other device (CPU) still share
    one, and their sums are the per-tensor order's bits."""
    module = Bag({"a": (3,), "b": (4,), "c": (5,), "d": (2, 3)})
    for name, shape in (("a", (3,)), ("b", (4,))):
        module.register_parameter(name, nn.Parameter(torch.zeros(shape, device="meta")))
    pending = {"a": torch.zeros(3, device="meta"), "b": torch.zeros(4, device="meta")}
    state = AccumulatorState(torch.float32, 1.0, 1, 0, 2.0, False)
    adopted = WeightedGradientsAccumulator.from_pending(module, pending, state)
    grads = {
        name: torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)).to(
            parameter.device
        )
        for name, parameter in module.named_parameters()
    }
    adopted.accumulate_sum(module, 1, grads=grads)
    adopted.accumulate_sum(module, 1, grads=grads)
    sums = adopted.finish_sums().grads
    c, d = sums["c"], sums["d"]
    assert c is not None and d is not None
    assert c.untyped_storage().data_ptr() == d.untyped_storage().data_ptr(), (
        "the CPU small buffers should be views of one arena"
    )
    for name, actual in (("c", c), ("d", d)):
        expected = torch.zeros(grads[name].shape).add_(grads[name]).add_(grads[name])
        assert_bitwise_equal(actual, expected, name)
    for name in ("a", "b"):
        buffer = sums[name]
        assert buffer is not None and buffer.device.type == "meta", name


class _AddCounter(TorchDispatchMode):
    """Counts the in-place additions (aten.add_) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten.add_:
            self.adds += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_a_complete_set_of_small_gradients_is_added_in_one_operation(kind: str) -> None:
    """The arena's promise (module docstring of wacc_torch._arena): a complete set of one
    device's small gradients of one dtype is added with one in-place addition, not one per
    tensor; with two dtypes among them each is added on its own (one addition per tensor)."""
    shapes: Shapes = {f"p{i}": (4 + i,) for i in range(6)}
    module = Bag(shapes)
    grads = _gradients(shapes, torch.float32, 0)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    with _AddCounter() as counter:
        getattr(accumulator, f"accumulate_{kind}")(module, 3, grads=grads)
    assert counter.adds == 1
    mixed = dict(grads, p0=grads["p0"].to(torch.bfloat16))
    with _AddCounter() as counter:
        getattr(accumulator, f"accumulate_{kind}")(module, 3, grads=mixed)
    assert counter.adds == len(shapes)


@pytest.mark.parametrize(
    "other_dtype", [torch.float32, torch.bfloat16], ids=["arena", "per-tensor"]
)
def test_a_gradient_aliasing_an_adopted_pending_buffer_is_refused(other_dtype: torch.dtype) -> None:
    """A gradient that shares memory with a buffer from_pending adopted would be read after the
    per-tensor path added into that buffer and before the arena's one-step add did, so the two
    paths would disagree: both refuse it with ParameterMismatchError naming the gradient and the
    buffer, and nothing changes; a copy of the same values is accumulated by both alike."""
    module = nn.Module()
    module.big = nn.Parameter(torch.zeros(20_000))
    module.a = nn.Parameter(torch.zeros(3))
    module.b = nn.Parameter(torch.zeros(3))
    adopted = torch.ones(20_000)
    state = AccumulatorState(
        dtype=torch.float32, loss_scale=1.0, issued=1, zero_weight=0, total_weight=1.0,
        fused=False, zero_copy=False,
    )  # fmt: skip
    accumulator = WeightedGradientsAccumulator.from_pending(module, {"big": adopted}, state)
    grads = {"big": torch.ones(20_000), "a": adopted[:3], "b": torch.ones(3, dtype=other_dtype)}
    before = accumulator.state_dict()
    with pytest.raises(
        ParameterMismatchError, match=r"gradient 'a' shares the memory of pending buffer 'big'"
    ):
        accumulator.accumulate_sum(module, 1, grads=grads)
    assert_records_equal(accumulator.state_dict(), before)
    grads["a"] = adopted[:3].clone()
    accumulator.accumulate_sum(module, 1, grads=grads)
    result = accumulator.finish_sums().grads
    assert_bitwise_equal(result["a"], torch.ones(3), "the copy, added once")
    assert_bitwise_equal(result["big"], torch.full((20_000,), 2.0), "the adopted buffer + 1")


def test_small_groups_count_one_element_parameters_and_pairs_of_them() -> None:
    """small_groups: a parameter of one element is small (1 <= numel), a device with exactly
    two small parameters gets a group, one with a single small parameter (the other holds no
    element) none; shapes and devices pair one to one (ValueError for unequal lengths rather
    than silently dropping the unpaired parameters)."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    shapes = [torch.Size(s) for s in ((1,), (1, 1), (4,), (0, 3))]
    assert wacc_torch._arena.small_groups(shapes, [cpu, cpu, meta, meta]) == {cpu: (0, 1)}
    with pytest.raises(ValueError):
        wacc_torch._arena.small_groups(shapes, [cpu, cpu, meta])


def test_common_dtype_before_collect_and_for_the_first_complete_set() -> None:
    """A fresh GradientCheck (nothing collected, like after forget()) answers common_dtype from
    the gradients handed in; the first complete set, checked in full, is already answered from
    its signature (the gradients handed in are not looked at)."""
    check = GradientCheck()
    float32, bfloat16 = torch.ones(2), torch.ones(2, dtype=torch.bfloat16)
    assert check.common_dtype((0, 1), [float32, float32]) == torch.float32
    assert check.common_dtype((0, 1), [float32, bfloat16]) is None
    shapes: Shapes = {"a": (3,), "b": (4,)}
    parameters = tracked_parameters(Bag(shapes))
    check.collect(binding_of(parameters), parameters, _gradients(shapes, torch.float32, 0))
    assert check.common_dtype((0, 1), [None, None]) == torch.float32


@pytest.mark.parametrize(
    ("shape", "rows"),
    [
        ((150,), [64, 64, 22]),  # 1-d: CHUNK_ELEMENTS (64) elements per piece
        ((10, 20), [3, 3, 3, 1]),  # floor(64 / 20) = 3 whole rows per piece
        ((5, 100), [1, 1, 1, 1, 1]),  # a row alone exceeds 64: one row per piece
        ((64, 1), [64]),  # exactly CHUNK_ELEMENTS: one piece
    ],
    ids=["1d", "rows-of-20", "rows-of-100", "one-column"],
)
def test_pieces_are_as_many_whole_rows_as_fit_in_a_chunk(
    shape: tuple[int, ...], rows: list[int]
) -> None:
    """A tensor larger than CHUNK_ELEMENTS is cut along dim 0 into pieces of
    floor(CHUNK_ELEMENTS / row) whole rows (at least one: a row larger than the chunk is a piece
    of its own); chunk_numel is the largest piece and piece_count their number."""
    tensor = torch.zeros(shape)
    row = math.prod(shape[1:])
    assert [piece.shape[0] for (piece,) in wacc_torch._work.pieces(tensor)] == rows
    assert wacc_torch._work.chunk_numel(tensor.shape) == max(rows) * row
    assert wacc_torch._work.piece_count(tensor.shape) == len(rows)


def test_scratch_holds_exactly_the_largest_need_per_device_and_dtype() -> None:
    """Scratch preallocates, per (device, dtype), a work tensor of exactly the largest need
    among those given: no element more, an empty one when every need is 0 elements."""
    cpu = torch.device("cpu")
    scratch = wacc_torch._work.Scratch(
        [(cpu, torch.float32, 0), (cpu, torch.float64, 5), (cpu, torch.float64, 3)]
    )
    sizes = {key: tensor.numel() for key, tensor in scratch._storage.items()}
    assert sizes == {(cpu, torch.float32): 0, (cpu, torch.float64): 5}


def _adopted_window(
    base: torch.Tensor, start: int
) -> tuple[nn.Module, WeightedGradientsAccumulator]:
    module = nn.Module()
    module.big = nn.Parameter(torch.zeros(20_000))
    module.empty = nn.Parameter(torch.zeros(0))  # checked before 'a': it must not end the check
    module.a = nn.Parameter(torch.zeros(3))
    state = AccumulatorState(
        dtype=torch.float32, loss_scale=1.0, issued=1, zero_weight=0, total_weight=1.0,
        fused=False, zero_copy=False,
    )  # fmt: skip
    pending = {"big": base[start : start + 20_000]}
    return module, WeightedGradientsAccumulator.from_pending(module, pending, state)


@pytest.mark.parametrize(
    ("start", "where", "refused"),
    [
        (0, slice(19_998, 20_001), True),  # starts inside the buffer, ends past it
        (3, slice(0, 3), False),  # ends where the buffer starts
        (0, slice(20_000, 20_003), False),  # starts where the buffer ends
        (3, slice(2, 5), True),  # straddles the buffer's start
    ],
    ids=["past-the-end", "just-before", "just-after", "across-the-start"],
)
def test_only_a_gradient_whose_bytes_overlap_an_adopted_buffer_is_refused(
    start: int, where: slice, refused: bool
) -> None:
    """The alias check compares byte ranges: a gradient overlapping the adopted buffer at
    either end is refused (with the message naming the remedy), one that merely touches it is
    accumulated; a parameter without a gradient or with no elements before it does not end the
    check."""
    base = torch.ones(20_006)
    module, accumulator = _adopted_window(base, start)
    grads = {"empty": torch.zeros(0), "big": torch.ones(20_000), "a": base[where]}
    if refused:
        with pytest.raises(
            ParameterMismatchError,
            match=r"^gradient 'a' shares the memory of pending buffer 'big' \(adopted by "
            r"from_pending\): the window would read a buffer it adds into; pass a copy$",
        ):
            accumulator.accumulate_sum(module, 1, grads=grads)
        assert accumulator.state.issued == 1
    else:
        accumulator.accumulate_sum(module, 1, grads=grads)
        assert accumulator.state.issued == 2
    module2, accumulator2 = _adopted_window(torch.ones(20_006), 0)
    accumulator2.accumulate_sum(module2, 1, grads={"big": torch.ones(20_000), "a": None})
    assert accumulator2.state.issued == 2  # a None gradient is skipped, not read
