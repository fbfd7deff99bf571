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
    """``calibrate`` caches the hooked probe's counts under the key ``hooked_gradient`` reads, so
    that no hook runs the probe (a backward of its own) inside the caller's backward."""
    _ownership._BASES.clear()
    _ownership.calibrate()
    assert set(_ownership._BASES) == {"hooked"}
    assert _ownership._BASES["hooked"] == _ownership._hooked_probe()


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
