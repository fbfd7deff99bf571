"""The division of semantics §8 as ``wacc_torch.normalize`` offers it to callers of their own.

``normalize_sums`` divides a mapping of scaled sums by the loss scale S, then by the total weight
W, per element in each tensor's own dtype (``y = round_D(g / S)``, ``round_D(round_op(y /
round_op(W)))``); it checks S in every gradient's dtype (float64 when every entry is None) and
refuses flush-to-zero naming itself. ``may_overlap`` tells a layout whose elements may share
memory; ``check_writable`` refuses, for an in-place division, such a tensor and an inference
tensor outside inference mode, naming the value. Expected quotients come from Python's float
division (IEEE binary64, correctly rounded), never from the code under test.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.wacc_torch.support import assert_bitwise_equal, flushing_subnormals
from wacc_torch import (
    InvalidLossScaleError,
    ParameterMismatchError,
    UnsupportedEnvironmentError,
    normalize_sums,
)
from wacc_torch.normalize import divide_sums, may_overlap

# A loss scale that float64 holds exactly and float32 does not (it rounds to 1.0 there).
FINE_SCALE = 1.0 + 2.0**-40


def _float64_quotients(grad: torch.Tensor, *, loss_scale: float, weight: float) -> torch.Tensor:
    """§8 for D = float64 element by element with Python floats: (g / S) / W, each division
    correctly rounded to binary64 (op(float64) is float64)."""
    values = [value / loss_scale / weight for value in grad.reshape(-1).tolist()]
    return torch.tensor(values, dtype=torch.float64).reshape(grad.shape)


def test_float64_sums_are_divided_by_the_loss_scale_in_float64() -> None:
    """float64 sums are divided by S as a float64 (a scale float32 cannot hold included), then
    by W; a None entry stays None and the input is left untouched."""
    generator = torch.Generator().manual_seed(7)
    grad = torch.randn(5, 3, generator=generator, dtype=torch.float64) * 1000
    before = grad.clone()
    result = normalize_sums({"g": grad, "none": None}, loss_scale=FINE_SCALE, total_weight=3.0)
    assert result["none"] is None
    divided = result["g"]
    assert divided is not None
    expected = _float64_quotients(before, loss_scale=FINE_SCALE, weight=3.0)
    assert_bitwise_equal(divided, expected, "g")
    assert_bitwise_equal(grad, before, "input")


def test_without_tensors_the_loss_scale_is_checked_as_a_float64() -> None:
    """Every entry None: S must still be a finite float64 > 0 (one float32 cannot hold is
    fine), and a bad one raises InvalidLossScaleError naming the value and float64."""
    grads: dict[str, torch.Tensor | None] = {"a": None, "b": None}
    result = normalize_sums(grads, loss_scale=FINE_SCALE, total_weight=2.0)
    assert result == {"a": None, "b": None}
    with pytest.raises(InvalidLossScaleError, match=r"-2\.0.*float64"):
        normalize_sums(grads, loss_scale=-2.0, total_weight=2.0)


def test_flush_to_zero_is_refused_naming_normalize_sums() -> None:
    """Under CPU flush-to-zero normalize_sums raises UnsupportedEnvironmentError whose message
    starts with its own name, and nothing is written (semantics §11 Reading)."""
    grad = torch.full((4,), 6.0)
    refused = pytest.raises(UnsupportedEnvironmentError, match=r"^normalize_sums: ")
    with flushing_subnormals(), refused:
        normalize_sums({"g": grad}, loss_scale=2.0, total_weight=3.0, in_place=True)
    assert_bitwise_equal(grad, torch.full((4,), 6.0), "g")


def test_out_of_place_results_are_new_contiguous_tensors() -> None:
    """in_place=False makes each result a new contiguous tensor even for a transposed gradient,
    with the quotients of §8 at the same logical positions."""
    base = torch.arange(12, dtype=torch.float64).reshape(4, 3) * 3 + 1
    grad = base.t()
    assert not grad.is_contiguous()
    divided = normalize_sums({"g": grad}, loss_scale=2.0, total_weight=5.0)["g"]
    assert divided is not None
    assert divided.is_contiguous()
    assert divided.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()
    assert_bitwise_equal(divided, _float64_quotients(grad, loss_scale=2.0, weight=5.0), "g")


@pytest.mark.parametrize(
    ("tensor", "overlaps"),
    [
        pytest.param(torch.zeros(3, 4), False, id="contiguous"),
        pytest.param(torch.zeros(3, 4).t(), False, id="transposed"),
        pytest.param(torch.zeros(3, 8)[:, ::2], False, id="gaps"),
        pytest.param(torch.zeros(()).expand(1), False, id="0-d-expanded-to-1"),
        pytest.param(torch.zeros(3).as_strided((1, 3), (0, 1)), False, id="stride-0-of-size-1"),
        pytest.param(torch.zeros(1).expand(2), True, id="expanded-to-2"),
        pytest.param(torch.zeros(1).expand(3, 2), True, id="expanded-2d"),
        pytest.param(torch.zeros(6).as_strided((3, 2), (1, 1)), True, id="sliding-window"),
        pytest.param(torch.zeros(8).as_strided((2, 2, 2), (4, 1, 2)), False, id="permuted"),
    ],
)
def test_may_overlap_tells_layouts_whose_elements_share_memory(
    tensor: torch.Tensor, overlaps: bool
) -> None:
    """may_overlap is True exactly when two distinct indices reach one address, for layouts the
    sorted-stride test decides (a size-1 dim of any stride shares nothing), checked here by
    listing every element's offset."""
    offsets = [
        sum(i * s for i, s in zip(index, tensor.stride(), strict=True))
        for index in torch.cartesian_prod(*(torch.arange(n) for n in tensor.shape))
        .reshape(-1, tensor.dim())
        .tolist()
    ]
    assert (len(set(offsets)) < len(offsets)) is overlaps  # the ground truth of the case
    assert may_overlap(tensor) is overlaps


def test_in_place_division_refuses_overlapping_memory_naming_its_strides() -> None:
    """in_place=True refuses a gradient two of whose elements share memory, naming the
    gradient, its shape and its strides, and writes nothing; a stride-0 dim of size 1 is fine."""
    storage = torch.arange(6, dtype=torch.float32)
    sliding = storage.as_strided((3, 2), (1, 1))
    named = r"'g' has overlapping memory \(shape \[3, 2\], strides \[1, 1\]\)"
    with pytest.raises(ParameterMismatchError, match=named):
        normalize_sums({"g": sliding}, loss_scale=1.0, total_weight=2.0, in_place=True)
    assert_bitwise_equal(storage, torch.arange(6, dtype=torch.float32), "storage")
    value = torch.tensor(8.0, dtype=torch.float64)
    expanded = value.expand(1)  # a 0-d tensor broadcast to one element: stride 0, size 1
    result = normalize_sums({"g": expanded}, loss_scale=2.0, total_weight=4.0, in_place=True)
    assert result["g"] is expanded
    assert_bitwise_equal(value, torch.tensor(8.0 / 2.0 / 4.0, dtype=torch.float64), "value")


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside-inference-mode"])
def test_in_place_division_refuses_an_inference_tensor_naming_it(inside: bool) -> None:
    """in_place=True refuses a tensor made under torch.inference_mode() with
    ParameterMismatchError naming it and saying why (the update runs outside inference mode,
    where it cannot be written), and writes nothing, outside inference mode and inside it
    (the division runs with inference mode off, where writing it would raise part way: the
    ordinary tensor before it would be divided and it would not)."""
    ordinary = torch.full((3,), 8.0)
    with torch.inference_mode():
        grad = torch.full((3,), 8.0)
    context = torch.inference_mode() if inside else contextlib.nullcontext()
    why = r"wacc_torch updates in place outside inference mode, where it cannot be written$"
    with (
        context,
        pytest.raises(ParameterMismatchError, match=r"'g' is an inference tensor.*" + why),
    ):
        normalize_sums({"f": ordinary, "g": grad}, loss_scale=2.0, total_weight=4.0, in_place=True)
    assert_bitwise_equal(ordinary, torch.full((3,), 8.0), "f")
    assert_bitwise_equal(grad, torch.full((3,), 8.0), "g")


@pytest.mark.parametrize("find_inf", [False, True], ids=["without-check", "with-check"])
def test_divide_sums_checks_the_quotients_for_nan_and_inf_only_when_asked(find_inf: bool) -> None:
    """divide_sums gives normalize_sums' quotients and, with find_inf, a check whose found()
    says whether a quotient is NaN or ±inf (here fp16 65504 / 0.5 = 131008 overflows to inf,
    1 / 0.5 = 2 does not); without find_inf the check is None."""
    finite = torch.tensor([1.0, -1.0], dtype=torch.float16)
    overflowing = torch.tensor([65504.0, 1.0], dtype=torch.float16)
    for grad, holds_inf in [(finite, False), (overflowing, True)]:
        quotients, check = divide_sums(
            {"g": grad, "none": None},
            loss_scale=0.5,
            total_weight=1.0,
            in_place=False,
            find_inf=find_inf,
        )
        expected = [value / 0.5 for value in grad.tolist()]  # W = 1: exact powers of two
        expected_grad = torch.tensor(expected, dtype=torch.float32).to(torch.float16)
        assert quotients["none"] is None
        assert_bitwise_equal(quotients["g"], expected_grad, "g")
        if find_inf:
            assert check is not None
            assert check.found() is holds_inf
        else:
            assert check is None


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("scale", [1.0, 2.0], ids=["S=1", "S=2"])
def test_a_gradient_that_requires_grad_is_refused_naming_it_whatever_the_scale(
    scale: float, in_place: bool
) -> None:
    """A gradient made with create_graph=True requires grad: the division is on values, so
    it is refused with ParameterMismatchError naming the gradient, for S = 1 (a copy) and S != 1
    (out=) alike, before anything is written; its .detach() is divided as usual."""
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    (grad,) = torch.autograd.grad((weight**2).sum(), weight, create_graph=True)
    assert grad.requires_grad
    before = grad.detach().clone()
    with pytest.raises(ParameterMismatchError, match=r"gradient 'w' requires grad.*'w'\.detach"):
        normalize_sums({"w": grad}, loss_scale=scale, total_weight=2.0, in_place=in_place)
    assert_bitwise_equal(grad.detach(), before, "the refused gradient")
    result = normalize_sums({"w": grad.detach()}, loss_scale=scale, total_weight=2.0)["w"]
    assert result is not None and not result.requires_grad
    assert_bitwise_equal(result, before / scale / 2.0, "the detached gradient, divided")


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_a_float32_work_tensor_is_prepared_only_for_the_narrow_dtypes(
    in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The division prepares a work tensor only where it rounds twice: for a float16 or bfloat16
    sum, a float32 one (op(D), semantics §2) sized for its largest piece; float32 and float64
    sums are divided in their own tensors and need none."""
    import wacc_torch.normalize as normalize

    needs: list[list[tuple[torch.device, torch.dtype, int]]] = []

    class Recording(normalize.Scratch):
        def __init__(self, wanted: object) -> None:
            listed = list(wanted)  # type: ignore[call-overload]
            needs.append(listed)
            super().__init__(listed)

    monkeypatch.setattr(normalize, "Scratch", Recording)
    cpu = torch.device("cpu")
    wide = {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, 2)}
    normalize_sums(wide, loss_scale=2.0, total_weight=3.0, in_place=in_place)
    narrow = dict(
        wide, c=torch.ones(5, dtype=torch.float16), d=torch.ones(4, 2, dtype=torch.bfloat16)
    )
    normalize_sums(narrow, loss_scale=2.0, total_weight=3.0, in_place=in_place)
    assert needs == [[], [(cpu, torch.float32, 5), (cpu, torch.float32, 8)]]
