"""A reproducible mean multiplies a gradient it owns in place (semantics §6 Reading).

``t = round_D(conv_D(g) * w_D)`` needs a tensor of its own. When the accumulator owns ``g`` — a
gradient autograd hands a zero-copy hook and holds nothing else of — and ``g`` is in D,
``g.mul_(w_D)`` is that tensor (no work tensor); otherwise, and always for a ``.grad`` the buffered
mode takes, the product goes through a piece-sized work tensor. Both must give the reference's
bits, and a tensor anyone else can see must never change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.wacc_torch.support import (
    WORK_DTYPE_PARAMS,
    WORK_DTYPES,
    assert_bitwise_equal,
    assert_matches_reference,
    assert_records_equal,
    awkward_values,
    bits,
    dtype_name,
)
from wacc_ref.arith import add_rounded, conv_array, mul_rounded
from wacc_ref.formats import conv_to
from wacc_torch import WeightedGradientsAccumulator, _ownership
from wacc_torch._work import CHUNK_ELEMENTS, chunk_numel
from wacc_torch.buffered import BufferedMode
from wacc_torch.zero_copy import ZeroCopyMode

WEIGHTS = (3.0, 1001.0, 0.1)
# More than CHUNK_ELEMENTS elements: both paths (a work tensor, or in place) cut it in pieces.
LARGE = (CHUNK_ELEMENTS // 1000 + 3, 1000)


class One(nn.Module):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=dtype))


def _grads(shape: tuple[int, ...], grad_dtype: torch.dtype, work: torch.dtype, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [
        awkward_values(shape, dtype=grad_dtype, around=work, generator=generator) for _ in WEIGHTS
    ]


def _taken(grads: list[torch.Tensor], work: torch.dtype, layout: str) -> torch.Tensor:
    """The buffered mode taking each gradient as ``.grad`` (nothing else holds it): the product
    goes through the work tensor all the same."""
    module = One(tuple(grads[0].shape), grads[0].dtype)
    accumulator = WeightedGradientsAccumulator(dtype=work, loss_scale=1.0)
    for grad, weight in zip(grads, WEIGHTS, strict=True):
        module.weight.grad = _laid_out(grad, layout)
        accumulator.accumulate_mean(module, weight)
    mode = accumulator._mode
    assert isinstance(mode, BufferedMode)
    kept = mode.kept_work
    assert kept is not None and work in {dtype for _, dtype in kept._sizes}
    result = accumulator.finish_sums().grads["weight"]
    assert result is not None
    return result


def _handed(grads: list[torch.Tensor], work: torch.dtype) -> torch.Tensor:
    """The buffered mode with ``grads=`` (the caller's tensors: the pieces' path)."""
    module = One(tuple(grads[0].shape), grads[0].dtype)
    accumulator = WeightedGradientsAccumulator(dtype=work, loss_scale=1.0)
    for grad, weight in zip(grads, WEIGHTS, strict=True):
        accumulator.accumulate_mean(module, weight, grads={"weight": grad})
    result = accumulator.finish_sums().grads["weight"]
    assert result is not None
    return result


def _laid_out(grad: torch.Tensor, layout: str) -> torch.Tensor:
    """A fresh copy of ``grad`` with the same values and the given memory layout."""
    if layout == "contiguous" or grad.dim() < 2:
        return grad.clone()
    if layout == "transposed":
        return grad.transpose(0, -1).contiguous().transpose(0, -1)
    wide = torch.zeros(*grad.shape[:-1], grad.shape[-1] * 2, dtype=grad.dtype)
    wide[..., ::2] = grad
    return wide[..., ::2]  # every other element of the last dim: odd strides


def _reference(grads: list[torch.Tensor], work: torch.dtype, index: torch.Tensor) -> np.ndarray:
    """wacc_ref's two roundings at the flat positions ``index``, from a +0 buffer."""
    name = dtype_name(work)
    buffer = np.zeros(index.numel())
    for grad, weight in zip(grads, WEIGHTS, strict=True):
        values = grad.flatten()[index].to(torch.float64).numpy()
        term = mul_rounded(conv_array(values, name), conv_to(weight, name), name)
        buffer = add_rounded(buffer, term, name)
    return buffer


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(), (0,), (0, 3), (7,), (5, 3), (3, 1, 4), (129, 130)]),
    work=st.sampled_from(WORK_DTYPES),
    other=st.sampled_from([None, *WORK_DTYPES]),
    layout=st.sampled_from(["contiguous", "transposed", "strided"]),
    seed=st.integers(0, 2**16),
)
def test_taken_gradients_give_the_pieces_bits_and_the_references(
    shape: tuple[int, ...],
    work: torch.dtype,
    other: torch.dtype | None,
    layout: str,
    seed: int,
) -> None:
    """On random shapes (0-d and empty included), every work dtype, gradients in D or in another
    dtype, contiguous, transposed or with odd strides: the ``.grad`` path equals the ``grads=``
    path and wacc_ref bit for bit."""
    grad_dtype = work if other is None else other
    grads = _grads(shape, grad_dtype, work, seed)
    taken = _taken(grads, work, layout)
    assert_bitwise_equal(taken, _handed(grads, work), "taken .grad vs grads=")
    index = torch.arange(taken.numel())
    assert_matches_reference(
        taken.flatten(), _reference(grads, work, index), f"{dtype_name(work)} mean"
    )


@pytest.mark.parametrize("work", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("in_d", [True, False], ids=["grad-in-D", "grad-float32"])
def test_a_large_taken_gradient_gives_the_pieces_bits_and_the_references(
    work: torch.dtype, in_d: bool
) -> None:
    """A tensor of more than CHUNK_ELEMENTS elements: the whole-tensor in-place product equals
    the piecewise path bit for bit, and wacc_ref at 4096 random positions (elementwise steps, so
    a sample is a complete check of those elements)."""
    grad_dtype = work if in_d else torch.float64 if work == torch.float32 else torch.float32
    grads = _grads(LARGE, grad_dtype, work, seed=21)
    taken = _taken(grads, work, "contiguous")
    assert_bitwise_equal(taken, _handed(grads, work), "taken .grad vs grads=")
    index = torch.randint(taken.numel(), (4096,), generator=torch.Generator().manual_seed(1))
    assert_matches_reference(
        taken.flatten()[index], _reference(grads, work, index), f"{dtype_name(work)} mean"
    )


def test_a_grad_someone_else_can_see_is_never_changed() -> None:
    """A ``.grad`` the caller still holds, one a view of which is held, one shared by two
    parameters, and one whose memory numpy owns are left exactly as they were (the product goes
    through a work tensor), with the same sums as when nothing holds them."""
    shape = (40, 30)
    generator = torch.Generator().manual_seed(5)
    values = [torch.randn(shape, generator=generator) for _ in range(4)]

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(shape))
            self.b = nn.Parameter(torch.zeros(shape))

    module = Two()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    expected = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    held = values[0].clone()
    module.a.grad, module.b.grad = held, values[1].clone()
    view = module.b.grad[3:]
    accumulator.accumulate_mean(module, 3.0)
    expected.accumulate_mean(module, 3.0, grads={"a": values[0], "b": values[1]})
    assert_bitwise_equal(held, values[0], "a held .grad")
    assert_bitwise_equal(view, values[1][3:], "a held view's .grad")
    shared = values[2].clone()
    module.a.grad = module.b.grad = shared
    accumulator.accumulate_mean(module, 7.0)
    expected.accumulate_mean(module, 7.0, grads={"a": values[2], "b": values[2]})
    del shared
    array = values[3].numpy().copy()
    module.a.grad = torch.from_numpy(array)
    accumulator.accumulate_mean(module, 2.0)
    expected.accumulate_mean(module, 2.0, grads={"a": values[3]})
    assert np.array_equal(array.view(np.int32), values[3].numpy().view(np.int32))
    got, want = accumulator.finish_sums().grads, expected.finish_sums().grads
    for name in ("a", "b"):
        assert_bitwise_equal(got[name], want[name], name)


def test_a_taken_grad_is_never_written_even_when_nothing_else_holds_it() -> None:
    """The buffered mode reads a ``.grad`` it takes and nothing else holds, never writes it: no
    operation writes into or adds from its storage (each product comes from the piece-sized work
    tensor, which it makes), and the sum is round_D(g * w_D) (the work piece measured faster than
    writing into the gradient: issue 21)."""
    module = One(LARGE, torch.float32)
    grad = torch.randn(LARGE, generator=torch.Generator().manual_seed(3))
    module.weight.grad = grad.clone()
    # A pointer to the storage, not a reference: nothing but the parameter holds the .grad.
    original = module.weight.grad.untyped_storage().data_ptr()
    from_original: list[str] = []
    real_add, real_mul = torch.Tensor.add_, torch.Tensor.mul_

    def add_spy(self: torch.Tensor, other: torch.Tensor, *args: object, **kwargs: object):
        if isinstance(other, torch.Tensor) and other.untyped_storage().data_ptr() == original:
            from_original.append("add_")
        return real_add(self, other, *args, **kwargs)

    def mul_spy(self: torch.Tensor, *args: object, **kwargs: object):
        if self.untyped_storage().data_ptr() == original:
            from_original.append("mul_")
        return real_mul(self, *args, **kwargs)

    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    torch.Tensor.add_, torch.Tensor.mul_ = add_spy, mul_spy  # type: ignore[method-assign]
    try:
        accumulator.accumulate_mean(module, 3.0)
    finally:
        torch.Tensor.add_, torch.Tensor.mul_ = real_add, real_mul  # type: ignore[method-assign]
    assert from_original == []
    mode = accumulator._mode
    assert isinstance(mode, BufferedMode) and mode.kept_work is not None
    assert mode.kept_work._sizes == {(torch.device("cpu"), torch.float32): chunk_numel(grad.shape)}
    assert module.weight.grad is None
    result = accumulator.finish_sums().grads["weight"]
    assert result is not None
    assert_bitwise_equal(result, torch.mul(grad, 3.0), "the sum of one taken .grad")


def test_only_a_plain_dense_tensor_of_d_may_be_written_in_place() -> None:
    """``_plain``: contiguous, non-empty, of D, not part of a graph, not an inference tensor,
    not a subclass, with memory PyTorch allocated."""
    from wacc_torch._ownership import _plain

    assert _plain(torch.ones(4), torch.float32)
    assert _plain(torch.ones(()), torch.float32)
    with torch.inference_mode():
        inference = torch.ones(4)
    refused = [
        (None, torch.float32),
        (torch.ones(4), torch.float64),
        (torch.ones(4, 2).t(), torch.float32),
        (torch.ones(0), torch.float32),
        (torch.ones(4, requires_grad=True), torch.float32),
        (nn.Parameter(torch.ones(4), requires_grad=False), torch.float32),
        (torch.from_numpy(np.ones(4, dtype=np.float32)), torch.float32),
        (inference, torch.float32),
    ]
    for tensor, dtype in refused:
        assert not _plain(tensor, dtype)


def _zero_copy(
    shape: tuple[int, ...], seeds: list[torch.Tensor], backward
) -> tuple[torch.Tensor, ZeroCopyMode]:
    module = One(shape, torch.float32)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=True)
    for seed, weight in zip(seeds, WEIGHTS, strict=True):
        with accumulator.microbatch(module, weight=weight, kind="mean"):
            backward(module.weight, seed)
    mode = accumulator._mode
    assert isinstance(mode, ZeroCopyMode)
    result = accumulator.finish_sums().grads["weight"]
    assert result is not None
    return result, mode


def test_zero_copy_mean_multiplies_autograds_own_gradient_in_place() -> None:
    """A gradient autograd made and holds nothing else of (``(p * 1.0)``'s backward) is
    multiplied in place: no work tensor, the bits of the buffered ``grads=`` path."""
    seeds = _grads(LARGE, torch.float32, torch.float32, seed=8)

    def backward(parameter: torch.Tensor, seed: torch.Tensor) -> None:
        torch.autograd.backward([parameter * 1.0], grad_tensors=[seed])

    result, mode = _zero_copy(LARGE, seeds, backward)
    assert mode.kept_work is None
    assert_bitwise_equal(result, _handed(seeds, torch.float32), "zero-copy vs buffered")


def test_zero_copy_never_overwrites_a_gradient_someone_else_holds() -> None:
    """A seed handed straight to the parameter (the caller holds it), a gradient a tensor hook
    keeps, and one autograd hands to two parameters (``a + b``) stay as they were; the sums are
    the buffered mode's bit for bit."""
    seeds = _grads(LARGE, torch.float32, torch.float32, seed=9)
    copies = [seed.clone() for seed in seeds]

    def straight(parameter: torch.Tensor, seed: torch.Tensor) -> None:
        torch.autograd.backward([parameter], grad_tensors=[seed])

    result, mode = _zero_copy(LARGE, seeds, straight)
    for seed, copy in zip(seeds, copies, strict=True):
        assert torch.equal(bits(seed), bits(copy))
    assert mode.kept_work is not None  # the product went through a work tensor
    assert_bitwise_equal(result, _handed(copies, torch.float32), "seeded zero-copy")

    kept: list[torch.Tensor] = []

    def hooked(parameter: torch.Tensor, seed: torch.Tensor) -> None:
        handle = parameter.register_hook(lambda grad: kept.append(grad) or None)
        try:
            torch.autograd.backward([parameter * 1.0], grad_tensors=[seed])
        finally:
            handle.remove()

    result, _ = _zero_copy(LARGE, seeds, hooked)
    for grad, seed in zip(kept, seeds, strict=True):
        assert torch.equal(bits(grad), bits(seed))
    assert_bitwise_equal(result, _handed(copies, torch.float32), "hooked zero-copy")

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(LARGE))
            self.b = nn.Parameter(torch.zeros(LARGE))

    module = Two()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=True)
    expected = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for seed, weight in zip(seeds, WEIGHTS, strict=True):
        with accumulator.microbatch(module, weight=weight, kind="mean"):
            torch.autograd.backward([(module.a * 1.0) + module.b], grad_tensors=[seed])
        expected.accumulate_mean(module, weight, grads={"a": seed, "b": seed})
    got, want = accumulator.finish_sums().grads, expected.finish_sums().grads
    for name in ("a", "b"):
        assert_bitwise_equal(got[name], want[name], f"a + b: {name}")


def test_calibrate_reads_the_hooked_probe_outside_a_backward() -> None:
    """``calibrate`` caches both probes' counts under the keys ``hooked_gradient`` reads, so
    that no hook runs a probe (a backward of its own) inside the caller's backward."""
    _ownership._BASES.clear()
    _ownership.calibrate()
    assert set(_ownership._BASES) == {"hooked", "hooked view"}
    assert _ownership._BASES["hooked"] == _ownership._hooked_probe()
    assert _ownership._BASES["hooked view"] == _ownership._hooked_view_probe()
    # A gradient of its own: three counts; a view: its base's two more.
    assert len(_ownership._BASES["hooked"]) == 3
    assert len(_ownership._BASES["hooked view"]) == 5


def test_the_first_count_is_the_python_objects_references() -> None:
    """``_counts``' first number follows the Python object's references alone: one more name
    for the tensor raises it by one and leaves the tensor's and the storage's counts as they
    were (so a reference only Python knows of is seen: a tensor hook's ``kept.append(grad)``)."""
    items = [torch.ones(3)]
    before = _ownership._counts(items, 0)
    other = items[0]
    after = _ownership._counts(items, 0)
    assert after == (before[0] + 1, *before[1:])
    del other
    view = [torch.ones(2, 3).t()]
    before = _ownership._counts(view, 0)
    assert len(before) == 5
    held = view[0]._base
    after = _ownership._counts(view, 0)
    # The base's Python object now has our name too; the view's own counts are unchanged.
    assert after[:3] == before[:3] and after[3] == before[3] + 1
    del held


def _hook_counts(backward, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """The counts and the verdict of ``hooked_gradient`` for a parameter's gradient, read in an
    ``AccumulateGrad`` pre-hook the way the zero-copy hooks read them."""
    parameter = nn.Parameter(torch.zeros(shape))
    node = parameter.view_as(parameter).grad_fn.next_functions[0][0]
    seen: list[tuple[tuple[int, ...], bool]] = []

    def hook(grads):
        owned = _ownership.hooked_gradient(grads, 0, torch.float32)
        seen.append((_ownership._counts(grads, 0), owned))
        return (None,)

    _ownership.calibrate()
    handle = node.register_prehook(hook)
    try:
        backward(parameter)
    finally:
        handle.remove()
    (result,) = seen
    return result


def test_a_gradient_kept_by_a_tensor_hook_is_not_owned_though_only_python_knows() -> None:
    """A leaf's tensor hook that keeps the gradient raises only its Python object's count (the
    tensor's and the storage's are the probe's): that alone makes it not the accumulator's; the
    same backward without the hook gives an owned gradient."""
    probe = _ownership._BASES.get("hooked") or _ownership._hooked_probe()

    def plain(parameter: torch.Tensor) -> None:
        (parameter * 2.0).sum().backward()

    counts, owned = _hook_counts(plain, (4,))
    assert owned and counts == probe
    kept: list[torch.Tensor] = []

    def hooked(parameter: torch.Tensor) -> None:
        parameter.register_hook(lambda grad: kept.append(grad) or None)
        (parameter * 2.0).sum().backward()

    counts, owned = _hook_counts(hooked, (4,))
    assert counts[1:] == probe[1:] and counts[0] > probe[0]  # Python's count alone is higher
    assert not owned
    assert torch.equal(kept[0], torch.full((4,), 2.0))


def test_a_view_gradient_is_owned_only_while_nothing_else_holds_its_base() -> None:
    """``nn.Linear``'s weight gradient arrives as a view of the tensor the backward made: owned.
    Not owned when its base is also another tensor's (a tensor hook on the transposed weight
    that keeps it) or the base's storage is another view's too (two parameters' gradients cut
    from one tensor by ``cat``'s backward). (``retain_grad`` keeps a copy: no reference.)"""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))

    def linear(parameter: torch.Tensor) -> None:
        torch.nn.functional.linear(x, parameter).sum().backward()

    counts, owned = _hook_counts(linear, (3, 4))
    assert len(counts) == 5 and owned
    kept: list[torch.Tensor] = []

    def keeps_base(parameter: torch.Tensor) -> None:
        transposed = parameter.t()
        transposed.register_hook(lambda grad: kept.append(grad) or None)
        (x @ transposed).sum().backward()

    counts, owned = _hook_counts(keeps_base, (3, 4))
    assert not owned
    other = nn.Parameter(torch.zeros(3, 4))

    def shared(parameter: torch.Tensor) -> None:
        both = torch.cat([parameter, other])
        (both * torch.arange(24.0).reshape(6, 4)).sum().backward()

    counts, owned = _hook_counts(shared, (3, 4))
    assert not owned


def test_zero_copy_never_changes_a_view_gradients_base_someone_holds() -> None:
    """In a real block over ``nn.Linear``: the weight's gradient, a view whose base a hook on
    ``weight.t()`` keeps, is never written (the kept tensors are as the backward made them),
    and the window's sums are the buffered mode's bit for bit; without the hook the gradient is
    owned (no work tensor) with the same bits."""
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(k, 6, generator=generator) for k in (3, 1, 7)]

    class Model(nn.Module):
        def __init__(self, keep: list[torch.Tensor] | None) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(1)
            self.weight = nn.Parameter(torch.randn(4, 6, generator=generator))
            self.keep = keep

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            transposed = self.weight.t()
            if self.keep is not None:
                keep = self.keep
                transposed.register_hook(lambda grad: keep.append(grad) or None)
            return x @ transposed

    def run(keep: list[torch.Tensor] | None, zero_copy: bool):
        model = Model(keep)
        accumulator = WeightedGradientsAccumulator(
            dtype=torch.float32, loss_scale=1.0, zero_copy=zero_copy
        )
        copies = []
        for x, weight in zip(inputs, WEIGHTS, strict=True):
            if zero_copy:
                with accumulator.microbatch(model, weight=weight, kind="mean"):
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
                accumulator.accumulate_mean(model, weight)
            if keep:
                copies.append(keep[-1].clone())
        return accumulator, copies

    kept: list[torch.Tensor] = []
    accumulator, copies = run(kept, zero_copy=True)
    assert len(kept) == len(inputs)
    for grad, copy in zip(kept, copies, strict=True):
        assert torch.equal(bits(grad), bits(copy))
    assert isinstance(accumulator._mode, ZeroCopyMode) and accumulator._mode.kept_work is not None
    expected, _ = run(None, zero_copy=False)
    want = expected.finish_sums().grads["weight"]
    assert_bitwise_equal(accumulator.finish_sums().grads["weight"], want, "kept base")
    owned, _ = run(None, zero_copy=True)
    assert isinstance(owned._mode, ZeroCopyMode) and owned._mode.kept_work is None
    assert_bitwise_equal(owned.finish_sums().grads["weight"], want, "owned view")


def test_zero_copy_mean_never_writes_an_expanded_gradient() -> None:
    """A gradient autograd hands the hook as a broadcast view (``p.sum()``'s backward expands one
    value over the parameter: stride 0) is not a plain tensor of its own: the product goes
    through the work tensor, with the bits of the buffered ``grads=`` path."""
    seeds = [torch.tensor(float(k + 1) / 3.0) for k in range(len(WEIGHTS))]

    def backward(parameter: torch.Tensor, seed: torch.Tensor) -> None:
        torch.autograd.backward([parameter.sum()], grad_tensors=[seed])

    shape = (64, 32)
    result, mode = _zero_copy(shape, seeds, backward)
    assert mode.kept_work is not None
    expanded = [seed.expand(shape).contiguous() for seed in seeds]
    assert_bitwise_equal(result, _handed(expanded, torch.float32), "zero-copy vs buffered")


# ---------------------------------------------------------------- disposable=True (issue 21)
class Pair(nn.Module):
    """A 5-element parameter and a larger one, of ``dtype`` (an arena when both are small)."""

    def __init__(self, large: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(5, dtype=dtype))
        self.weight = nn.Parameter(torch.zeros(large, dtype=dtype))


def _window(
    grads: list[dict[str, torch.Tensor]], work: torch.dtype, *, disposable: bool, fused: bool
) -> WeightedGradientsAccumulator:
    module = Pair(tuple(grads[0]["weight"].shape), grads[0]["weight"].dtype)
    accumulator = WeightedGradientsAccumulator(dtype=work, loss_scale=1.0, fused=fused)
    for batch, weight in zip(grads, WEIGHTS, strict=True):
        accumulator.accumulate_mean(module, weight, grads=batch, disposable=disposable)
    return accumulator


@settings(max_examples=25, deadline=None)
@given(
    large=st.sampled_from([(129, 130), (3, 1, 400), LARGE]),
    work=st.sampled_from(WORK_DTYPES),
    other=st.sampled_from([None, *WORK_DTYPES]),
    layout=st.sampled_from(["contiguous", "transposed", "strided"]),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_disposable_gradients_give_the_same_bits_and_record(
    large: tuple[int, ...],
    work: torch.dtype,
    other: torch.dtype | None,
    layout: str,
    fused: bool,
    seed: int,
) -> None:
    """On random shapes, work dtypes, gradient dtypes and layouts, fused or reproducible:
    ``disposable=True`` gives the record of the same window without it bit for bit (buffers,
    counters); without it no gradient changes, with it only a reproducible mean's plain
    gradient in D is written (into ``round_D(g * w_D)``, the product it added)."""
    grad_dtype = work if other is None else other
    generator = torch.Generator().manual_seed(seed)
    values = [
        {
            "bias": awkward_values((5,), dtype=grad_dtype, around=work, generator=generator),
            "weight": awkward_values(large, dtype=grad_dtype, around=work, generator=generator),
        }
        for _ in WEIGHTS
    ]
    # Two fresh tensors of each, laid out alike: the fused float16/bfloat16 kernel's bits depend
    # on an element's position in the kernel (semantics §6 Reading), so a layout changes them.
    grads = [{k: _laid_out(v, layout) for k, v in batch.items()} for batch in values]
    copies = [{k: _laid_out(v, layout) for k, v in batch.items()} for batch in values]
    expected = _window(copies, work, disposable=False, fused=fused)
    for batch, copy in zip(grads, copies, strict=True):
        for name in batch:
            assert torch.equal(bits(batch[name]), bits(copy[name]))  # copies: untouched inputs
    given_over = _window(grads, work, disposable=True, fused=fused)
    assert_records_equal(given_over.state_dict(), expected.state_dict())
    mode = given_over._mode
    assert isinstance(mode, BufferedMode)
    # Small gradients are concatenated into a tensor of the accumulator's own (an arena): only
    # the others are the caller's to write.
    in_arena = {name for arena in mode.arenas.values() for name in arena.names}
    for batch, copy, weight in zip(grads, copies, WEIGHTS, strict=True):
        for name, grad in batch.items():
            plain = grad_dtype == work and grad.is_contiguous()
            written = not fused and plain and name not in in_arena
            product = torch.mul(copy[name], conv_to(weight, dtype_name(work)))
            assert torch.equal(bits(grad), bits(product if written else copy[name])), name


def test_disposable_never_writes_memory_another_gradient_or_a_parameter_shares() -> None:
    """The same tensor handed for two parameters, a gradient that is a parameter's memory (a
    tracked one's, a frozen one's) or a buffer's, and tied parameters' one ``.grad`` are read
    only (the others' values would change), with the bits of the window without
    ``disposable``; a gradient of its own is written."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.zeros(LARGE))
            self.b = nn.Parameter(torch.zeros(LARGE))
            # Not tracked, but the module's: their memory is never written either.
            self.frozen = nn.Parameter(torch.zeros(LARGE), requires_grad=False)
            self.register_buffer("stats", torch.zeros(LARGE))

    seeds = _grads(LARGE, torch.float32, torch.float32, seed=31)
    cases = {
        "one tensor twice": lambda m, s: {"a": s, "b": s},
        "a parameter's memory": lambda m, s: {"a": m.b.data, "b": s},
        "a frozen parameter's memory": lambda m, s: {"a": m.frozen.data, "b": s},
        "a buffer's memory": lambda m, s: {"a": m.stats, "b": s},
        "an omitted gradient": lambda m, s: {"b": s},  # a None among the call's gradients
    }
    for case, make in cases.items():
        module, reference = Two(), Two()
        with torch.no_grad():
            for tensor in (module.b, module.frozen, module.stats):
                tensor.copy_(seeds[0])
            for tensor in (reference.b, reference.frozen, reference.stats):
                tensor.copy_(seeds[0])
        given_over = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
        expected = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
        for seed, weight in zip(seeds, WEIGHTS, strict=True):
            handed = make(module, seed.clone())
            before = {k: v.clone() for k, v in handed.items()}
            given_over.accumulate_mean(module, weight, grads=handed, disposable=True)
            expected.accumulate_mean(reference, weight, grads=make(reference, seed.clone()))
            shared = [k for k in handed if sum(v is handed[k] for v in handed.values()) > 1]
            modules = (module.b, module.frozen, module.stats)
            owned = {t.untyped_storage().data_ptr() for t in modules}
            for name, tensor in handed.items():
                if name in shared or tensor.untyped_storage().data_ptr() in owned:
                    assert torch.equal(bits(tensor), bits(before[name])), (case, name)
        for name in ("b", "frozen", "stats"):
            got, want = getattr(module, name).detach(), getattr(reference, name).detach()
            assert torch.equal(bits(got), bits(want)), (case, name)
        assert_records_equal(given_over.state_dict(), expected.state_dict())

    # Tied parameters' one .grad, taken from the module: read only.
    tied, reference = Two(), Two()
    given_over = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    expected = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for seed, weight in zip(seeds, WEIGHTS, strict=True):
        shared_grad = seed.clone()
        tied.a.grad = tied.b.grad = shared_grad
        given_over.accumulate_mean(tied, weight, disposable=True)
        assert torch.equal(bits(shared_grad), bits(seed))
        expected.accumulate_mean(reference, weight, grads={"a": seed, "b": seed})
    assert_records_equal(given_over.state_dict(), expected.state_dict())


# PyTorch's notes on its sparse layouts, not faults of the code under test.
_SPARSE_NOTES = (
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
)


def _odd_tensor(kind: str) -> torch.Tensor:
    """A tensor without a storage of its own: sparse (its values and indices are dense tensors)
    or mkldnn (opaque); skips when this torch has no mkldnn on the CPU."""
    dense = torch.arange(9.0).reshape(3, 3)
    if kind == "mkldnn":
        if not torch.backends.mkldnn.is_available():
            pytest.skip("this torch has no mkldnn on the CPU")
        return dense.to_mkldnn()
    return dense.to_sparse_csr() if kind == "csr" else dense.to_sparse()


class Holding(nn.Module):
    """Two large parameters (no arena: each gradient is the caller's to write) and, as in a
    graph network's adjacency or a converted inference layer, a sparse or mkldnn tensor held as a
    buffer or as a frozen parameter."""

    odd: torch.Tensor

    def __init__(self, odd: str, kind: str) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(LARGE))
        self.b = nn.Parameter(torch.zeros(LARGE))
        if odd == "buffer":
            self.register_buffer("odd", _odd_tensor(kind))
        else:
            self.odd = nn.Parameter(_odd_tensor(kind), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x).mean() + (self.b * x * x).mean()


@_SPARSE_NOTES[0]
@_SPARSE_NOTES[1]
@pytest.mark.parametrize(
    ("odd", "kind"),
    [("buffer", "coo"), ("buffer", "csr"), ("buffer", "mkldnn"), ("frozen parameter", "coo")],
)
def test_disposable_accepts_a_module_holding_sparse_or_mkldnn_tensors(odd: str, kind: str) -> None:
    """A module holding a sparse or mkldnn buffer, or a sparse frozen parameter, is accepted by
    ``accumulate_mean(..., disposable=True)`` as without it (its tensors have no storage to
    read, which once raised a raw NotImplementedError): after real backwards, the window's
    record equals the one without ``disposable`` bit for bit. A sparse tensor's memory is its
    dense parts', so a gradient of its own is still written (the product); an mkldnn tensor's
    memory cannot be read, so with one in the module no gradient is written."""
    inputs = _grads(LARGE, torch.float32, torch.float32, seed=35)
    module, reference = Holding(odd, kind), Holding(odd, kind)
    given_over = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    expected = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for x, weight in zip(inputs, WEIGHTS, strict=True):
        module(x).backward()
        given_over.accumulate_mean(module, weight, disposable=True)
        reference(x).backward()
        expected.accumulate_mean(reference, weight)
    assert_records_equal(given_over.state_dict(), expected.state_dict())

    # Handed as a mapping, the gradients show whether the product was written into them.
    mine = inputs[0].clone()
    given_over.accumulate_mean(module, 3.0, grads={"a": mine}, disposable=True)
    expected.accumulate_mean(reference, 3.0, grads={"a": inputs[0].clone()})
    written = kind != "mkldnn"
    assert torch.equal(bits(mine), bits(inputs[0] * 3.0 if written else inputs[0]))
    assert_records_equal(given_over.state_dict(), expected.state_dict())


@_SPARSE_NOTES[0]
@_SPARSE_NOTES[1]
@pytest.mark.parametrize("kind", ["coo", "csr"])
def test_disposable_never_writes_a_gradient_that_is_a_sparse_tensors_values(kind: str) -> None:
    """``torch.sparse_coo_tensor(indices, values)`` (and the CSR constructor) keep ``values``
    itself, so a dense gradient can be a sparse buffer's memory: handed with
    ``disposable=True`` it is read only (the buffer keeps its values) and the window has the
    bits of the same window without ``disposable``."""

    def holding(values: torch.Tensor) -> Holding:
        module = Holding("buffer", "coo")
        if kind == "coo":
            indices = torch.zeros(1, 1, dtype=torch.long)
            module.odd = torch.sparse_coo_tensor(indices, values.unsqueeze(0), (1, *LARGE))
        else:
            rows, columns = LARGE
            crow = torch.arange(rows + 1) * columns
            col = torch.arange(columns).repeat(rows)
            module.odd = torch.sparse_csr_tensor(crow, col, values.view(-1), LARGE)
        return module

    seeds = _grads(LARGE, torch.float32, torch.float32, seed=37)
    shared = seeds[1].clone()
    module, reference = holding(shared), holding(seeds[1].clone())
    stored = module.odd._values() if kind == "coo" else module.odd.values()
    assert stored.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    given_over = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    expected = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for seed, weight in zip(seeds, WEIGHTS, strict=True):
        given_over.accumulate_mean(module, weight, grads={"a": shared}, disposable=True)
        expected.accumulate_mean(reference, weight, grads={"a": seeds[1]})
        assert torch.equal(bits(shared), bits(seeds[1])), seed.shape
    assert_records_equal(given_over.state_dict(), expected.state_dict())


def test_a_disposable_grad_taken_from_the_module_needs_no_work_tensor() -> None:
    """``accumulate_mean(module, w, disposable=True)`` on the ``.grad`` it takes writes the
    product into it (no work tensor of D) and gives the bits of the ``grads=`` path."""
    seeds = _grads(LARGE, torch.float32, torch.float32, seed=33)
    module = One(LARGE, torch.float32)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for seed, weight in zip(seeds, WEIGHTS, strict=True):
        module.weight.grad = seed.clone()
        accumulator.accumulate_mean(module, weight, disposable=True)
        assert module.weight.grad is None
    mode = accumulator._mode
    assert isinstance(mode, BufferedMode)
    assert mode.kept_work is None or torch.float32 not in {d for _, d in mode.kept_work._sizes}
    result = accumulator.finish_sums().grads["weight"]
    assert_bitwise_equal(result, _handed(seeds, torch.float32), "disposable .grad vs grads=")


def test_disposable_must_be_a_bool_and_a_refusal_changes_nothing() -> None:
    """``disposable`` other than True/False raises TypeError naming the value, before anything
    is read: the window's record is what it was and the gradients are untouched."""
    module = One((4, 3), torch.float32)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_mean(module, 2.0, grads={"weight": torch.ones(4, 3)})
    before = accumulator.state_dict()
    grad = torch.full((4, 3), 5.0)
    for bad in (1, "yes", None, torch.tensor(True)):
        with pytest.raises(TypeError, match="disposable must be True or False, got"):
            accumulator.accumulate_mean(module, 3.0, grads={"weight": grad}, disposable=bad)  # type: ignore[arg-type]
        assert_records_equal(accumulator.state_dict(), before)
        assert torch.equal(grad, torch.full((4, 3), 5.0))


def test_no_probe_runs_inside_a_backward() -> None:
    """The hooks read the probes' counts from the cache ``calibrate`` filled at block entry (a
    probe is a backward of its own, not to be run inside the caller's): after a block whose
    gradients are of both kinds (``nn.Linear``'s views, ``p * 1.0``'s own), the cache holds
    exactly the two keys, each with the counts its probe gives, and no probe ran in the block."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)
            self.gain = nn.Parameter(torch.ones(5, 3))  # its gradient is no view

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * self.gain

    module = Mixed()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=True)
    _ownership._BASES.clear()
    ran: list[str] = []
    probe, view_probe = _ownership._hooked_probe, _ownership._hooked_view_probe

    def counted(name, function):
        def run():
            ran.append(name)
            return function()

        return run

    try:
        _ownership._hooked_probe = counted("own", probe)  # type: ignore[assignment]
        _ownership._hooked_view_probe = counted("view", view_probe)  # type: ignore[assignment]
        views: list[bool] = []
        for parameter in module.parameters():
            parameter.register_hook(lambda grad: views.append(grad._is_view()) or None)
        block = accumulator.microbatch(module, weight=3.0, kind="mean")
        with block:
            entered = list(ran)
            module(torch.randn(5, 4)).sum().backward()
    finally:
        _ownership._hooked_probe, _ownership._hooked_view_probe = probe, view_probe
    assert sorted(views) == [False, True, True]  # gradients of both kinds arrived
    assert sorted(entered) == ["own", "view"]  # both at entry
    assert ran == entered  # none inside the backward
    assert _ownership._BASES == {"hooked": probe(), "hooked view": view_probe()}
