"""semantics §3-§4: construction options, their validation, and the state copy."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from tests.wacc_torch.support import WORK_DTYPE_PARAMS, TwoLayer, flushing_subnormals
from wacc_ref.formats import FORMATS, is_representable
from wacc_torch import (
    AccumulatorState,
    InvalidLossScaleError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    WeightedGradientsAccumulator,
)
from wacc_torch._scalars import as_float64


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_new_accumulator_starts_with_an_empty_window(dtype: torch.dtype) -> None:
    """A new accumulator reports its options and zero counters in ``state``."""
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=2.0**10)
    assert accumulator.state == AccumulatorState(
        dtype=dtype, loss_scale=2.0**10, issued=0, zero_weight=0, total_weight=0.0, fused=False
    )
    record = accumulator.state_dict()
    assert record["param_names"] == [] and record["pending"] == {}


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.bool]
)
def test_unsupported_work_dtype_is_refused_by_name(dtype: torch.dtype) -> None:
    """A torch dtype other than the four work dtypes raises a ValueError naming it."""
    with pytest.raises(WeightedAccumulationError, match=str(dtype).removeprefix("torch.")):
        WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)


@pytest.mark.parametrize("dtype", ["float32", None, float])
def test_non_dtype_is_refused_with_type_error(dtype: object) -> None:
    """A dtype option that is not a torch.dtype raises TypeError naming it."""
    with pytest.raises(TypeError, match=repr(dtype).replace("(", r"\(").replace(")", r"\)")):
        WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)  # type: ignore[arg-type]


def test_unsupported_work_dtype_message_lists_the_four_work_dtypes() -> None:
    """The refusal of an unsupported torch dtype lists the four work dtypes in torch spelling."""
    with pytest.raises(
        WeightedAccumulationError,
        match=r"expected one of torch\.float64, torch\.float32, torch\.float16, torch\.bfloat16$",
    ):
        WeightedGradientsAccumulator(dtype=torch.int32, loss_scale=1.0)


@pytest.mark.parametrize(("dtype", "type_name"), [("float32", "str"), (float, "type")])
def test_non_dtype_message_lists_the_work_dtypes_and_names_the_type(
    dtype: object, type_name: str
) -> None:
    """The TypeError for a non-dtype lists the four work dtypes and names the value's type."""
    with pytest.raises(
        TypeError,
        match=rf"\(one of float64, float32, float16, bfloat16\), got .* of type {type_name}$",
    ):
        WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0)  # type: ignore[arg-type]


def test_options_are_keyword_only() -> None:
    """dtype, loss_scale and fused cannot be passed positionally."""
    with pytest.raises(TypeError):
        WeightedGradientsAccumulator(torch.float32, 1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_largest_representable_power_of_two_loss_scale_is_accepted(dtype: torch.dtype) -> None:
    """The largest power of two below D's overflow threshold is a valid loss scale."""
    fmt = FORMATS[str(dtype).removeprefix("torch.")]
    scale = 2.0**fmt.emax
    assert WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale).state.loss_scale == scale


def test_float16_accepts_2_pow_15_and_refuses_2_pow_16() -> None:
    """fp16 takes S = 2**15 but refuses S = 2**16 (not representable), naming value and dtype."""
    assert WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=2.0**15)
    assert not is_representable(2.0**16, "float16")
    with pytest.raises(InvalidLossScaleError, match=r"65536\.0.*float16"):
        WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=2.0**16)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        # 1 + 2**-8 needs 9 significand bits: fine in fp16 (11), not in bf16 (8).
        pytest.param(torch.bfloat16, 1.0 + 2.0**-8, id="bf16-9-bits"),
        # 1 + 2**-11 needs 12 bits: not in fp16.
        pytest.param(torch.float16, 1.0 + 2.0**-11, id="fp16-12-bits"),
        # 1 + 2**-24 needs 25 bits: not in fp32.
        pytest.param(torch.float32, 1.0 + 2.0**-24, id="fp32-25-bits"),
    ],
)
def test_loss_scale_not_representable_in_dtype_is_refused(dtype: torch.dtype, scale: float) -> None:
    """A loss scale that D would round raises InvalidLossScaleError naming the value and D."""
    assert not is_representable(scale, str(dtype).removeprefix("torch."))
    with pytest.raises(InvalidLossScaleError, match=rf"{scale!r}.*{dtype}"):
        WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale)


@pytest.mark.parametrize(
    "scale",
    [0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf"), True, "1.0", None, 1 + 0j],
    ids=repr,
)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_invalid_loss_scale_is_refused_by_value(dtype: torch.dtype, scale: object) -> None:
    """Zero, negative, non-finite, non-real loss scales raise InvalidLossScaleError (S, D named)."""
    with pytest.raises(InvalidLossScaleError) as caught:
        WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale)  # type: ignore[arg-type]
    assert repr(scale) in str(caught.value) and str(dtype) in str(caught.value)


def test_integer_loss_scale_is_taken_exactly() -> None:
    """An int loss scale is accepted as the equal float; one beyond float64 precision is refused."""
    assert (
        WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=1024).state.loss_scale
        == 1024.0
    )
    with pytest.raises(InvalidLossScaleError, match=str(2**53 + 1)):
        WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=2**53 + 1)


@pytest.mark.parametrize("fused", [1, 0, "yes", None])
def test_fused_must_be_a_bool(fused: object) -> None:
    """A non-bool ``fused`` raises TypeError naming it."""
    with pytest.raises(TypeError, match=repr(fused)):
        WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, fused=fused)  # type: ignore[arg-type]


@pytest.mark.parametrize("zero_copy", [1, 0, "yes", None])
def test_zero_copy_must_be_a_bool(zero_copy: object) -> None:
    """A non-bool ``zero_copy`` raises TypeError naming it."""
    with pytest.raises(
        TypeError, match=rf"zero_copy must be a bool, got {re.escape(repr(zero_copy))}$"
    ):
        WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=zero_copy)  # type: ignore[arg-type]


@pytest.mark.parametrize("sign", [1, -1], ids=["positive", "negative"])
def test_integer_loss_scale_beyond_float64_is_refused_by_value(sign: int) -> None:
    """An int loss scale too large for a float64 (10**400) raises InvalidLossScaleError naming
    the value and D; a negative one is refused as not > 0, also by value."""
    scale = sign * 10**400
    with pytest.raises(InvalidLossScaleError, match=rf"{scale}\b.*torch\.float32"):
        WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=scale)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        # Below D's smallest normal number, exactly representable in D (a subnormal of D).
        pytest.param(torch.float32, 2.0**-140, id="float32"),
        pytest.param(torch.float16, 2.0**-20, id="float16"),
        pytest.param(torch.bfloat16, 2.0**-130, id="bfloat16"),
    ],
)
def test_subnormal_loss_scale_is_refused_under_flush_to_zero(
    dtype: torch.dtype, scale: float
) -> None:
    """Under flush-to-zero, a loss scale below D's smallest normal (its conversion to D would be
    flushed) raises UnsupportedEnvironmentError naming the value and D."""
    assert 0.0 < scale < torch.finfo(dtype).tiny
    assert is_representable(scale, str(dtype).removeprefix("torch."))
    with (
        flushing_subnormals(),
        pytest.raises(
            UnsupportedEnvironmentError, match=rf"converting {re.escape(repr(scale))} to {dtype}:"
        ),
    ):
        WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale)
    # In IEEE mode the same value is a valid loss scale.
    assert WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale).state.loss_scale == scale


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_smallest_normal_loss_scale_is_accepted_under_flush_to_zero(dtype: torch.dtype) -> None:
    """D's smallest normal number converts alike in every mode, so flush-to-zero does not refuse
    it as a loss scale."""
    tiny = torch.finfo(dtype).tiny
    with flushing_subnormals():
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=tiny)
    assert accumulator.state.loss_scale == tiny


def test_fused_mode_is_declared_in_state() -> None:
    """``fused=True`` is visible in ``state`` and in the record."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, fused=True)
    assert accumulator.state.fused is True
    assert accumulator.state_dict()["fused"] is True


def test_state_is_a_frozen_copy() -> None:
    """``state`` cannot be mutated and reading it changes nothing (counters, buffers, .grad)."""
    module = TwoLayer()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=4.0)
    for parameter in module.parameters():
        parameter.grad = torch.ones_like(parameter) if parameter.requires_grad else None
    accumulator.accumulate_sum(module, 3)
    before = accumulator.state
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.issued = 7  # type: ignore[misc]
    record = accumulator.state_dict()
    for _ in range(3):
        assert accumulator.state == before
    assert accumulator.state_dict()["pending"].keys() == record["pending"].keys()
    for name, buffer in record["pending"].items():
        assert torch.equal(accumulator.state_dict()["pending"][name], buffer)
    assert before == AccumulatorState(
        dtype=torch.float32, loss_scale=4.0, issued=1, zero_weight=0, total_weight=3.0, fused=False
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(10**400, math.inf, id="positive-beyond-range"),
        pytest.param(-(10**400), -math.inf, id="negative-beyond-range"),
        pytest.param(2**1024, math.inf, id="2**1024"),
        pytest.param(-(2**1024), -math.inf, id="-2**1024"),
        # 2**53 + 1 lies halfway between 2**53 and 2**53 + 2: ties to even give 2**53.
        pytest.param(2**53 + 1, 2.0**53, id="tie-to-even"),
        pytest.param(-(2**53 + 3), -(2.0**53 + 4), id="negative-tie-to-even"),
    ],
)
def test_an_integer_is_read_as_round_64_with_signed_infinity_beyond_range(
    value: int, expected: float
) -> None:
    """as_float64 of an int is round_64(value) (nearest float64, ties to even), and an int
    beyond float64's range becomes the infinity of its own sign, never an error."""
    result = as_float64(value)
    assert type(result) is float
    assert result == expected and math.copysign(1.0, result) == math.copysign(1.0, expected)
