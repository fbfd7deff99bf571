"""Nothing lost, whatever the training loop does (issue 15): each defect found by trying the newest
paths the way training loops use them, and each test gap found by hand-made mutants, pinned by a
test that failed on the code before the fix.

Zero-copy: a pending ``.grad`` changed in place, replaced or removed — inside a block or after the
last one — is refused, never silently counted or handed over; flush-to-zero is checked in the
thread that runs the hooks; a parameter reshaped mid-window is refused; between windows nothing of
the old binding is held (a resized embedding backpropagates). Buffered: the caches accept exactly
what the full checks accept; ``apply_to`` checks flush-to-zero. Distributed entry points read
numbers with the one rule and add weights with one rounding.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.wacc_torch.support import (
    assert_bitwise_equal,
    assert_records_equal,
    grads_snapshot,
    hooked_window_weight,
)
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_torch import (
    BrokenWindowError,
    ParameterMismatchError,
    UnsupportedEnvironmentError,
    WeightedGradientsAccumulator,
    ZeroCopyError,
)
from wacc_torch.records import CHECKSUM_KEY

SCALE = 4.0


class Net(nn.Module):
    """A layer, a bias-like vector and an embedding-like table, all float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.layer = nn.Linear(3, 2)
        self.table = nn.Parameter(torch.randn(5, 2))

    def forward(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + self.table[rows]


def _batch(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3, generator=generator), torch.randint(
        0, 5, (tokens,), generator=generator
    )


def _loss(net: Net, tokens: int, seed: int) -> torch.Tensor:
    x, rows = _batch(tokens, seed)
    return SCALE * (net(x, rows) ** 2).mean()


def _zero_copy() -> WeightedGradientsAccumulator:
    return WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE, zero_copy=True)


def _block(acc: WeightedGradientsAccumulator, net: Net, tokens: int, seed: int) -> None:
    with acc.microbatch(net, weight=tokens, kind="mean"):
        _loss(net, tokens, seed).backward()


def _started() -> tuple[WeightedGradientsAccumulator, Net]:
    acc, net = _zero_copy(), Net()
    _block(acc, net, 3, seed=1)
    return acc, net


def _every_call(acc: WeightedGradientsAccumulator, net: Net) -> list[Callable[[], object]]:
    return [
        acc.state_dict,
        acc.state_dict_async,
        acc.finish_sums,
        acc.finish_mean,
        lambda: _block(acc, net, 2, seed=9),
    ]


@pytest.fixture
def flush_denormals() -> Iterator[None]:
    """Flush-to-zero available on this CPU (it is switched on by the test, always off after)."""
    available = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    if not available:
        pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# ----------------------------------------------------------------------- 1. inside a block
MEDDLES: dict[str, Callable[[Net], object]] = {
    "zero_grad(set_to_none=False)": lambda net: torch.optim.SGD(net.parameters(), lr=0.1).zero_grad(
        set_to_none=False
    ),
    "clip_grad_norm_": lambda net: nn.utils.clip_grad_norm_(net.parameters(), 1e-3),
    "mul_": lambda net: net.layer.weight.grad.mul_(2),  # type: ignore[union-attr]
}


@pytest.mark.parametrize("meddle", list(MEDDLES))
def test_defect_1_a_grad_changed_in_place_inside_a_block_breaks_the_window(meddle: str) -> None:
    """A pending .grad changed in place between backward() and the end of the block (zero_grad
    without set_to_none, clipping) wipes or changes earlier microbatches: leaving the block
    raises BrokenWindowError, the block is not counted, and every later call refuses until
    discard()."""
    acc, net = _started()
    with pytest.raises(BrokenWindowError, match="changed in place"):
        with acc.microbatch(net, weight=2, kind="mean"):
            _loss(net, 2, seed=2).backward()
            MEDDLES[meddle](net)
    assert acc.state.issued == 1
    for call in _every_call(acc, net):
        with pytest.raises(BrokenWindowError):
            call()
    acc.discard()
    assert all(p.grad is None for p in net.parameters())
    _block(acc, net, 2, seed=2)
    assert acc.state.issued == 1


def test_defect_1_a_grad_changed_before_the_backward_is_refused_by_its_hook() -> None:
    """The same change made inside the block before backward() is found by the parameter's hook,
    which refuses before adding: the backward raises BrokenWindowError and the window is broken
    (the change already lost the earlier microbatches)."""
    acc, net = _started()
    with pytest.raises(BrokenWindowError, match="inside the microbatch block"):
        with acc.microbatch(net, weight=2, kind="mean"):
            net.zero_grad(set_to_none=False)
            _loss(net, 2, seed=2).backward()
    with pytest.raises(BrokenWindowError):
        acc.finish_mean()


# ---------------------------------------------------------------------- 2. after the last block
@pytest.mark.parametrize("edit", ["zero_grad", "foreign", "in_place"])
@pytest.mark.parametrize("call", ["finish_mean", "finish_sums", "state_dict"])
def test_defect_2_a_grad_edited_after_the_last_block_is_caught_by_finish_and_records(
    edit: str, call: str
) -> None:
    """A pending .grad removed (model.zero_grad()), replaced by a foreign tensor or changed in
    place after the last block is caught by finish_mean / finish_sums / state_dict
    (BrokenWindowError), which change nothing; before, .grad ended as None or the stray tensor
    instead of the result."""
    acc, net = _started()
    _block(acc, net, 4, seed=3)
    state = acc.state
    if edit == "zero_grad":
        net.zero_grad()
    elif edit == "foreign":
        net.table.grad = torch.ones_like(net.table)
    else:
        net.layer.bias.grad.add_(1.0)  # type: ignore[union-attr]
    with pytest.raises(BrokenWindowError):
        getattr(acc, call)()
    assert acc.state == state


def test_defect_2_a_foreign_grad_on_a_parameter_without_buffer_is_refused_and_recoverable() -> None:
    """Mid-window, a .grad on a parameter the window has no buffer for (never reached) is not the
    window's: finish refuses with ZeroCopyError, nothing changed; removing it makes finish work."""
    acc, net = _zero_copy(), Net()
    with acc.microbatch(net, weight=3, kind="sum"):
        (SCALE * net.layer(torch.ones(1, 3)).sum()).backward()  # table gets no gradient
    net.table.grad = torch.zeros_like(net.table)
    with pytest.raises(ZeroCopyError, match="'table' has a .grad this window does not own"):
        acc.finish_mean()
    assert acc.state.issued == 1
    net.table.grad = None
    result = acc.finish_mean()
    assert result.grads["table"] is None and net.layer.weight.grad is result.grads["layer.weight"]


# ---------------------------------------------------------------------- 3. the hooks' thread
def test_defect_3_flush_to_zero_in_the_backward_thread_is_refused_by_the_hooks(
    flush_denormals: None,
) -> None:
    """The hooks add in the thread that runs backward(), which may not be the one that entered
    the block: flush-to-zero there is refused by the first hook, before anything is added, so
    the block raises UnsupportedEnvironmentError and nothing changed."""
    acc, net = _started()
    record, grads = acc.state_dict(), grads_snapshot(net)
    errors: list[BaseException] = []
    loss = _loss(net, 2, seed=4)

    def backward() -> None:
        torch.set_flush_denormal(True)
        try:
            loss.backward()
        except BaseException as error:  # the hook's refusal, raised from backward()
            errors.append(error)
        finally:
            torch.set_flush_denormal(False)

    with pytest.raises(UnsupportedEnvironmentError, match="flushes subnormals"):
        with acc.microbatch(net, weight=2, kind="mean"):
            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
    assert len(errors) == 1 and isinstance(errors[0], UnsupportedEnvironmentError)
    assert_records_equal(acc.state_dict(), record)
    for name, parameter in net.named_parameters():
        assert_bitwise_equal(parameter.grad, grads[name], name)


def test_defect_3_a_backward_in_another_thread_is_counted_like_one_in_this_thread() -> None:
    """Without flush-to-zero, a block whose backward runs in another thread gives the bits of
    one run in the thread that entered it."""
    here, net_here = _started()
    there, net_there = _started()
    _block(here, net_here, 5, seed=5)
    loss = _loss(net_there, 5, seed=5)
    with there.microbatch(net_there, weight=5, kind="mean"):
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()
    assert here.state_dict()[CHECKSUM_KEY] == there.state_dict()[CHECKSUM_KEY]


# ------------------------------------------------------------------- 4. reshaped mid-window
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "buffered"])
def test_defect_4_a_parameter_reshaped_mid_window_is_refused_in_both_modes(zero_copy: bool) -> None:
    """A parameter whose .data gets another shape mid-window (here (4,) -> (1, 4), which autograd
    could sum back down to (4,)) is refused with ParameterMismatchError before anything
    changes, in both modes; back in shape, the next microbatch is counted. (The buffered mode's
    refused microbatch left its .grad, which the loop drops.)"""
    module = nn.Module()
    module.p = nn.Parameter(torch.arange(4.0))
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=zero_copy)

    def feed(factor: float) -> None:
        if zero_copy:
            with acc.microbatch(module, weight=1, kind="sum"):
                (module.p * factor).sum().backward()
        else:
            (module.p * factor).sum().backward()
            acc.accumulate_sum(module, 1)

    feed(2.0)
    record, buffer = acc.state_dict(), module.p.grad
    original = module.p.data
    module.p.data = original.reshape(1, 4)
    with pytest.raises(ParameterMismatchError, match="'p' has shape \\[1, 4\\]"):
        feed(7.0)
    module.p.data = original
    if not zero_copy:
        module.p.grad = None
    assert module.p.grad is buffer
    assert_records_equal(acc.state_dict(), record)
    feed(3.0)
    assert acc.state.issued == 2
    assert acc.finish_sums().grads["p"].tolist() == [5.0] * 4  # type: ignore[union-attr]


def test_defect_4_a_parameter_reshaped_inside_a_block_is_refused_by_its_hook() -> None:
    """A .data reshape between entering the block and the backward is refused by the hook
    (nothing of it counted): before, autograd's kept node summed the new gradient down to the
    old shape and the block counted it."""
    module = nn.Module()
    module.p = nn.Parameter(torch.arange(4.0))
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=True)
    with pytest.raises((ParameterMismatchError, RuntimeError)):
        with acc.microbatch(module, weight=1, kind="sum"):
            module.p.data = module.p.data.reshape(1, 4)
            (module.p * 2).sum().backward()
    assert acc.state.issued == 0 and module.p.grad is None


# ------------------------------------------------------------------- 5. resized between windows
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "buffered"])
def test_defect_5_an_embedding_resized_between_windows_backpropagates_everywhere(
    zero_copy: bool,
) -> None:
    """After a window, an embedding grown for new tokens (its .data replaced by a larger table)
    backpropagates: plainly, through a new accumulator and through the old one, which binds to
    the new shape; before, kept AccumulateGrad nodes made every later backward fail inside
    autograd."""

    def feed(acc: WeightedGradientsAccumulator, embedding: nn.Embedding, rows: list[int]) -> None:
        loss = SCALE * embedding(torch.tensor(rows)).sum()
        if zero_copy:
            with acc.microbatch(embedding, weight=len(rows), kind="sum"):
                loss.backward()
        else:
            loss.backward()
            acc.accumulate_sum(embedding, len(rows))

    def make() -> WeightedGradientsAccumulator:
        return WeightedGradientsAccumulator(
            dtype=torch.float32, loss_scale=SCALE, zero_copy=zero_copy
        )

    embedding = nn.Embedding(4, 2)
    acc = make()
    feed(acc, embedding, [0, 3])
    acc.finish_mean()
    embedding.weight.grad = None
    with torch.no_grad():
        embedding.weight.data = torch.cat([embedding.weight.data, torch.zeros(2, 2)])
    embedding.num_embeddings = 6
    (embedding(torch.tensor([5])).sum()).backward()  # plain
    assert embedding.weight.grad is not None and embedding.weight.grad.shape == (6, 2)
    embedding.weight.grad = None
    feed(make(), embedding, [5])  # a new accumulator
    embedding.weight.grad = None
    feed(acc, embedding, [4, 5])  # the old one binds anew
    result = acc.finish_sums()
    assert result.grads["weight"] is not None and result.grads["weight"].shape == (6, 2)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "buffered"])
def test_defect_5_nothing_of_a_finished_window_is_held(zero_copy: bool) -> None:
    """After finish_* or discard() the accumulator holds nothing of the window's module: once
    the caller drops it (and the results), the module and its parameters are collected."""
    for end in ("finish_mean", "discard"):
        net = Net()
        acc = WeightedGradientsAccumulator(
            dtype=torch.float32, loss_scale=SCALE, zero_copy=zero_copy
        )
        if zero_copy:
            _block(acc, net, 3, seed=1)
        else:
            _loss(net, 3, seed=1).backward()
            acc.accumulate_mean(net, 3)
        getattr(acc, end)()
        module_ref, parameter_ref = weakref.ref(net), weakref.ref(net.table)
        del net
        gc.collect()
        assert module_ref() is None and parameter_ref() is None, f"{end}: still held"


# ------------------------------------------------------------- 6, 7. buffered: the caches
def _two() -> nn.Module:
    module = nn.Module()
    module.p = nn.Parameter(torch.zeros(4))
    module.q = nn.Parameter(torch.zeros(3))
    return module


@pytest.mark.parametrize("complete", [True, False], ids=["complete", "partial"])
def test_defect_6_after_a_reshape_gradients_are_judged_by_the_tracked_shape_alone(
    complete: bool,
) -> None:
    """After .data is reshaped mid-window, the buffered mode judges each gradient against the
    tracked shape, whether the set is complete (the signature cache) or not (the full check):
    gradients of the tracked shape are accumulated in both cases (before: accepted by the cache,
    refused by the full check), one of the new shape is refused in both, changing nothing; and
    the finished result does not fit the reshaped parameter, which apply_to refuses."""
    module = _two()
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    grads = {"p": torch.ones(4), "q": torch.ones(3)}
    acc.accumulate_sum(module, 1, grads=grads)
    module.p.data = torch.zeros(2, 2)
    record = acc.state_dict()
    new_shape = {"p": torch.ones(2, 2), "q": torch.ones(3)} if complete else {"p": torch.ones(2, 2)}
    with pytest.raises(ParameterMismatchError, match="'p' has shape \\[2, 2\\], the tracked"):
        acc.accumulate_sum(module, 1, grads=new_shape)
    assert_records_equal(acc.state_dict(), record)
    acc.accumulate_sum(module, 1, grads=grads if complete else {"p": torch.ones(4)})
    assert acc.state.issued == 2
    result = acc.finish_sums()
    with pytest.raises(ParameterMismatchError, match="'p' has shape \\[4\\]"):
        result.apply_to(module)
    assert module.p.grad is None and module.q.grad is None


class _TensorLike:
    """Has a tensor's shape, dtype, device and layout, and nothing else of one."""

    shape = torch.Size([3])
    dtype = torch.float32
    device = torch.device("cpu")
    layout = torch.strided


def test_defect_7_a_non_tensor_with_tensor_attributes_is_refused_before_anything_changes() -> None:
    """A gradient set whose signature (shape, dtype, device, layout) matches the last accepted
    one but holds a non-tensor is refused by the full check (ParameterMismatchError) before the
    commit; before, the cache let it through and the commit raised after adding the first
    buffer."""
    module = nn.Module()
    module.big = nn.Parameter(torch.zeros(40_000))
    module.q = nn.Parameter(torch.zeros(3))
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    acc.accumulate_sum(module, 1, grads={"big": torch.ones(40_000), "q": torch.ones(3)})
    record = acc.state_dict()
    with pytest.raises(ParameterMismatchError, match="'q' must be a tensor or None, got _Tensor"):
        acc.accumulate_sum(module, 1, grads={"big": torch.ones(40_000), "q": _TensorLike()})  # type: ignore[dict-item]
    assert_records_equal(acc.state_dict(), record)


# ----------------------------------------------------------------------------- 8. apply_to
def test_defect_8_apply_to_refuses_to_convert_under_flush_to_zero(flush_denormals: None) -> None:
    """apply_to converts the results into the parameters' dtype on the CPU: under flush-to-zero
    a subnormal mean would be written as 0.0, so it raises UnsupportedEnvironmentError and
    writes no .grad; in IEEE mode it writes the subnormal."""
    module = nn.Module()
    module.p = nn.Parameter(torch.zeros(2))
    acc = WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=1.0)
    acc.accumulate_sum(module, 1, grads={"p": torch.full((2,), 1e-40, dtype=torch.float64)})
    result = acc.finish_mean()
    torch.set_flush_denormal(True)
    try:
        with pytest.raises(UnsupportedEnvironmentError, match="apply_to"):
            result.apply_to(module)
    finally:
        torch.set_flush_denormal(False)
    assert module.p.grad is None
    result.apply_to(module)
    assert module.p.grad is not None and module.p.grad.tolist() == [float(np.float32(1e-40))] * 2


# ------------------------------------------------------------ 9, 10. distributed entry points
WEIGHTS_THE_ACCUMULATOR_TAKES = [
    np.int64(3),
    np.uint8(7),
    np.float32(2.5),
    np.float16(0.5),
    np.array(3.0),
    torch.tensor(3),
    torch.tensor(2.5, dtype=torch.bfloat16),
    2**53 + 1,
]


def test_defect_9_the_ddp_hook_adds_a_big_integer_weight_with_one_rounding(
    one_rank_group: None,
) -> None:
    """W = 1 plus an integer weight 2**53 + 1 is round_64 of the exact sum, 2**53 + 2, in the DDP
    hook as in the accumulator (before: float(w) first, then the sum: 2**53)."""
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    module = _two()
    acc.accumulate_sum(module, 1, grads={})
    acc.accumulate_sum(module, 2**53 + 1, grads={})
    assert acc.state.total_weight == 2.0**53 + 2
    assert hooked_window_weight(2**53 + 1, mean=False) == 2.0**53 + 2


@pytest.mark.parametrize("weight", WEIGHTS_THE_ACCUMULATOR_TAKES, ids=repr)
def test_defect_10_the_ddp_hook_takes_every_number_the_accumulator_takes(
    weight: object, one_rank_group: None
) -> None:
    """numpy integers and floats, 0-d arrays and 0-d tensors are read by the hook's
    last_microbatch_* as by accumulate_*, counting the same W (before: refused)."""
    for mean in (False, True):
        acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
        module = _two()
        acc.accumulate_sum(module, 1, grads={})
        (acc.accumulate_mean if mean else acc.accumulate_sum)(module, weight, grads={})  # type: ignore[arg-type]
        assert hooked_window_weight(weight, mean=mean) == acc.state.total_weight


def _fsdp_window() -> tuple[nn.Module, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wacc_torch.fsdp import FSDPWeightedWindow

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model, FSDPWeightedWindow(model, loss_scale=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("weight", [*WEIGHTS_THE_ACCUMULATOR_TAKES, 0, np.int32(0)], ids=repr)
def test_defects_9_10_fsdp_add_weight_reads_and_adds_weights_like_the_accumulator(
    weight: object, one_rank_group: None
) -> None:
    """FSDPWeightedWindow.add_weight takes the numbers accumulate_sum takes and adds them with
    one rounding of the exact sum (a window 1 + (2**53 + 1) finishes with W = 2**53 + 2)."""
    model, window = _fsdp_window()
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    module = _two()
    for microbatch, w in enumerate((1, weight)):
        window.microbatch(last=microbatch == 1)  # type: ignore[attr-defined]
        model(torch.ones(1, 2)).sum().backward()
        window.add_weight(w)  # type: ignore[attr-defined]
        acc.accumulate_sum(module, w, grads={})  # type: ignore[arg-type]
    result = window.finish_mean()  # type: ignore[attr-defined]
    assert result.weight == acc.state.total_weight
    assert (result.issued, result.zero_weight) == (acc.state.issued, acc.state.zero_weight)


# --------------------------------------------------------------------- gaps found by mutants
def test_mixed_gradient_dtypes_among_small_parameters_keep_the_per_tensor_bits() -> None:
    """Small (arena) parameters whose gradients come in several dtypes are converted one by one
    (conv_D of each), never concatenated into the first one's dtype: a float32 gradient after a
    bfloat16 one keeps its float32 bits in a float32 window (the reference's checksum)."""
    shapes = {"a": (3,), "b": (4,), "c": (2, 2)}
    module = nn.Module()
    for name, shape in shapes.items():
        setattr(module, name, nn.Parameter(torch.zeros(shape)))
    generator = torch.Generator().manual_seed(3)
    grads = {
        "a": torch.randn(3, generator=generator).to(torch.bfloat16),
        "b": torch.randn(4, generator=generator) / 3,  # float32 bits beyond bfloat16's
        "c": torch.randn(2, 2, generator=generator, dtype=torch.float64) / 7,
    }
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    reference = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    for weight in (1, 3):
        acc.accumulate_sum(module, weight, grads=grads)
        acc.accumulate_mean(module, weight, grads=grads)
        numpy_grads = {n: g.double().numpy() for n, g in grads.items()}
        reference.accumulate_sum(shapes, weight, grads=numpy_grads)
        reference.accumulate_mean(shapes, weight, grads=numpy_grads)
    assert acc.state_dict()[CHECKSUM_KEY] == reference.state_dict()[CHECKSUM_KEY]


def test_a_refused_zero_copy_load_changes_nothing_issued_included() -> None:
    """load_state_dict into a zero-copy accumulator with a module whose parameter dtype is not D
    raises ZeroCopyError after the record was validated, and changes nothing: counters, record,
    .grad."""
    acc, net = _started()
    record = acc.state_dict()
    other = Net().double()
    state, grads = acc.state, grads_snapshot(net)
    with pytest.raises(ZeroCopyError, match="dtype torch.float64"):
        acc.load_state_dict(
            WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE).state_dict(), other
        )
    assert acc.state == state and acc.state.issued == 1
    assert_records_equal(acc.state_dict(), record)
    for name, parameter in net.named_parameters():
        assert_bitwise_equal(parameter.grad, grads[name], name)


@pytest.mark.parametrize(
    ("parameter_dtype", "work_dtype"),
    [
        (torch.float16, torch.bfloat16),
        (torch.bfloat16, torch.float16),
        (torch.float32, torch.float64),
    ],
    ids=["fp16-in-bf16", "bf16-in-fp16", "fp32-in-fp64"],
)
def test_a_parameter_dtype_other_than_d_is_refused_even_of_the_same_width(
    parameter_dtype: torch.dtype, work_dtype: torch.dtype
) -> None:
    """A float16 model under a bfloat16 work dtype (same width, other format) is refused at entry
    with ZeroCopyError, as any dtype other than D is; nothing changes."""
    net = Net().to(parameter_dtype)
    acc = WeightedGradientsAccumulator(dtype=work_dtype, loss_scale=SCALE, zero_copy=True)
    with pytest.raises(ZeroCopyError, match=f"has dtype {parameter_dtype}"):
        acc.microbatch(net, weight=1).__enter__()
    assert acc.state.issued == 0 and all(p.grad is None for p in net.parameters())


def test_fsdp_is_refused_by_zero_copy_at_the_first_block_and_mid_window(
    one_rank_group: None,
) -> None:
    """A module with an FSDP unit (fully_shard) is refused with ZeroCopyError at a window's first
    block, and so is one sharded mid-window, after blocks of the same module passed: the check
    runs again whenever the module's structure changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _ = _fsdp_window()
    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=True)
    with pytest.raises(ZeroCopyError, match="FSDP"):
        acc.microbatch(model, weight=1).__enter__()
    assert acc.state.issued == 0

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with acc.microbatch(plain, weight=1, kind="sum"):
        plain(torch.ones(1, 2)).sum().backward()
    fully_shard(plain[1], mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ZeroCopyError, match="FSDP"):
        acc.microbatch(plain, weight=1).__enter__()
    assert acc.state.issued == 1


def test_a_zero_weight_block_refuses_a_second_backward_and_stays_intact() -> None:
    """A zero-weight block reads no gradient, yet a second backward in it is still refused
    (ZeroCopyError, nothing added so nothing broken); an exception after its backward leaves
    the window intact and the block uncounted."""
    acc, net = _started()
    record = acc.state_dict()
    loss = _loss(net, 2, seed=6)
    with pytest.raises(ZeroCopyError, match="second gradient"):
        with acc.microbatch(net, weight=0, kind="mean"):
            loss.backward(retain_graph=True)
            loss.backward()
    assert_records_equal(acc.state_dict(), record)
    with pytest.raises(KeyError):
        with acc.microbatch(net, weight=0, kind="mean"):
            _loss(net, 2, seed=6).backward()
            raise KeyError("after the backward")
    assert_records_equal(acc.state_dict(), record)
    with acc.microbatch(net, weight=0, kind="mean"):
        _loss(net, 2, seed=6).backward()
    assert (acc.state.issued, acc.state.zero_weight) == (2, 1)


def test_the_ddp_hook_refuses_a_zero_copy_accumulator(one_rank_group: None) -> None:
    """WeightedAllReduceHook's last microbatch is a plain DDP backward, which would add into a
    zero-copy window's .grad: a zero-copy accumulator is refused at construction."""
    from wacc_torch.ddp_hook import WeightedAllReduceHook

    model = DistributedDataParallel(nn.Linear(2, 1))
    with pytest.raises(ZeroCopyError, match="buffered accumulator"):
        WeightedAllReduceHook(model, _zero_copy())


# ------------------------------------------------------- zero-copy: the rest of the .grad rule
def test_a_parameter_re_registered_mid_window_breaks_the_window_until_it_is_put_back() -> None:
    """A tracked parameter replaced in the module by another tensor of the same name and shape
    leaves the window's sum on the old tensor: the next block raises BrokenWindowError with
    nothing changed; with the old parameter back, the window goes on."""
    acc, net = _started()
    record = acc.state_dict()
    old = net.table
    net.table = nn.Parameter(old.detach().clone())
    with pytest.raises(BrokenWindowError, match="'table'.*re-registered"):
        _block(acc, net, 2, seed=7)
    net.table = old
    assert_records_equal(acc.state_dict(), record)
    _block(acc, net, 2, seed=7)
    assert acc.state.issued == 2


def test_a_grad_removed_inside_a_block_after_the_backward_breaks_the_window() -> None:
    """model.zero_grad() between backward() and the end of the block removes the window's sums
    from .grad: leaving the block raises BrokenWindowError and the block is not counted."""
    acc, net = _started()
    with pytest.raises(BrokenWindowError, match="removed"):
        with acc.microbatch(net, weight=2, kind="sum"):
            _loss(net, 2, seed=8).backward()
            net.zero_grad()
    assert acc.state.issued == 1
    with pytest.raises(BrokenWindowError):
        acc.state_dict()


def test_a_foreign_grad_set_inside_a_block_before_the_backward_is_refused_by_the_hook() -> None:
    """A .grad set inside the block, before the backward, on a parameter the window has no
    buffer for yet is refused by its hook (ZeroCopyError from backward); nothing was added, so
    nothing changed and the window goes on once the stray tensor is gone."""
    acc, net = _zero_copy(), Net()
    with acc.microbatch(net, weight=1, kind="sum"):
        (SCALE * net.layer(torch.ones(1, 3)).sum()).backward()  # table gets no gradient
    record = acc.state_dict()
    stray = torch.zeros_like(net.table)
    with pytest.raises(ZeroCopyError, match="'table' got a .grad inside the microbatch block"):
        with acc.microbatch(net, weight=1, kind="sum"):
            net.table.grad = stray
            (SCALE * net(torch.ones(1, 3), torch.tensor([0])).sum()).backward()
    assert net.table.grad is stray
    net.table.grad = None
    assert_records_equal(acc.state_dict(), record)


class _Checkpointed(nn.Module):
    """``inner`` runs under activation checkpointing; with ``shared`` it is used outside too."""

    def __init__(self, *, reentrant: bool, shared: bool) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.inner = nn.Linear(3, 3)
        self.outer = nn.Linear(3, 1)
        self.reentrant, self.shared = reentrant, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        def segment(t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.inner(t))

        hidden = checkpoint(segment, x, use_reentrant=self.reentrant)
        if self.shared:
            hidden = hidden + self.inner(x)
        return self.outer(hidden).sum()


@pytest.mark.parametrize(
    ("reentrant", "shared"),
    [(False, False), (False, True), (True, False)],
    ids=["non-reentrant", "non-reentrant-shared", "reentrant-inside-only"],
)
def test_activation_checkpointing_gives_the_buffered_bits(reentrant: bool, shared: bool) -> None:
    """Non-reentrant checkpointing, and reentrant checkpointing of parameters used only inside
    the segment, hand each parameter one gradient: the zero-copy window equals the buffered
    one bit for bit."""
    zero_copy, buffered = (
        _zero_copy(),
        WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE),
    )
    net_z = _Checkpointed(reentrant=reentrant, shared=shared)
    net_b = _Checkpointed(reentrant=reentrant, shared=shared)
    for tokens in (3, 1, 5):
        x = torch.randn(tokens, 3, generator=torch.Generator().manual_seed(tokens))
        x.requires_grad_(reentrant)  # the reentrant variant needs an input that requires grad
        with zero_copy.microbatch(net_z, weight=tokens, kind="mean"):
            (SCALE * net_z(x) / tokens).backward()
        (SCALE * net_b(x) / tokens).backward()
        buffered.accumulate_mean(net_b, tokens)
    assert zero_copy.state_dict()[CHECKSUM_KEY] == buffered.state_dict()[CHECKSUM_KEY]


def test_reentrant_checkpointing_of_a_shared_parameter_is_refused_and_says_so() -> None:
    """With use_reentrant=True a parameter used inside and outside the checkpointed segment gets
    two gradients in one backward; the second is refused with a message naming reentrant
    checkpointing, and the window, which already received part of the microbatch, is broken."""
    acc, net = _zero_copy(), _Checkpointed(reentrant=True, shared=True)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(ZeroCopyError, match="reentrant activation checkpointing"):
        with acc.microbatch(net, weight=2, kind="mean"):
            net(x).backward()
    with pytest.raises(BrokenWindowError, match="added to"):
        acc.finish_mean()
    acc.discard()
    assert acc.state.issued == 0 and all(p.grad is None for p in net.parameters())
