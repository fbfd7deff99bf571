"""One acceptance rule for numbers: wacc_torch and wacc_ref accept exactly the same weights and
loss scales, raise the same error class for the rest, and count the same W (semantics §12.3).

The rule (``wacc_torch._scalars.read_real`` / ``wacc_ref.records.read_real``): a Python int (not
bool) or float, or a numpy scalar / 0-d array / 0-d torch tensor of an integer dtype of at most
64 bits or one of the six formats; read exactly, never rounded on the way in. The reference has
no torch, so where wacc_torch gets a 0-d tensor the reference gets the equal 0-d numpy array.
"""

from __future__ import annotations

import math
import warnings
from decimal import Decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import wacc_torch
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.errors import WeightedAccumulationError as ReferenceError

WORK_DTYPES = ("float64", "float32", "float16", "bfloat16")
NUMPY_DTYPES: tuple[object, ...] = (
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    np.longdouble,  # refused: wider than float64
    np.complex64,  # refused: not real
    np.complex128,
    np.bool_,  # refused: a bool is not a count
)
# The torch counterpart of each numpy dtype a 0-d tensor can have.
TORCH_OF_NUMPY = {
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
    np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
    np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
    np.dtype(np.bool_): torch.bool,
}

EDGE_INTS = (0, 1, 2**24 + 2**16 + 1, 2**53 + 1, 2**63 - 1, 2**64 + 5, 2**1023 * 3, 2**1100, -1)
EDGE_FLOATS = (0.0, -0.0, 5e-324, 1.0, 1001.0, 65504.0, 65520.0, 2.0**15, 3.0e38, 1e300)

python_numbers = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EDGE_FLOATS),
    st.floats(allow_nan=True, allow_infinity=True),
)


def _numpy_value(dtype: object, value: int | float) -> np.ndarray:
    """``value`` cast to ``dtype`` as a 0-d array (wrapping, saturating or NaN as numpy does)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # overflow on cast is the point of some examples
        if abs(value) > 2**1000:
            value = 2.0**1000 if value > 0 else -(2.0**1000)  # numpy overflows beyond
        source = np.array(float(value) if abs(value) > 2**63 else value)
        return source.astype(dtype)


@st.composite
def numbers(draw: st.DrawFn) -> tuple[object, object]:
    """(what wacc_torch gets, what wacc_ref gets): the same object, or a 0-d tensor vs array."""
    kind = draw(
        st.sampled_from(
            ["python", "numpy scalar", "numpy 0-d", "torch 0-d", "other", "numpy 1-d", "bool"]
        )
    )
    if kind == "python":
        value = draw(python_numbers)
        return value, value
    if kind == "bool":
        value = draw(st.booleans())
        return value, value
    if kind == "other":
        value = draw(
            st.one_of(
                st.fractions(max_denominator=8),
                st.decimals(allow_nan=False, allow_infinity=False, places=2),
                st.complex_numbers(allow_nan=False, max_magnitude=1e6),
                st.none(),
                st.text(max_size=3),
                st.lists(st.floats(0, 10), max_size=2),
            )
        )
        return value, value
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    value = draw(python_numbers.filter(lambda v: not (isinstance(v, float) and math.isnan(v))))
    if isinstance(value, float) and not math.isfinite(value) and np.dtype(dtype).kind in "iub":
        value = 7  # casting inf to an integer dtype is undefined in numpy
    array = _numpy_value(dtype, value)
    if kind == "numpy scalar":
        return array[()], array[()]
    if kind == "numpy 1-d":
        return array.reshape(1), array.reshape(1)
    if kind == "numpy 0-d":
        return array, array
    item = array.item()
    torch_dtype = TORCH_OF_NUMPY.get(array.dtype)
    if torch_dtype is None:
        return array, array  # longdouble has no torch dtype: both get the array
    if torch_dtype.is_floating_point:
        item = float(item)
    return torch.tensor(item, dtype=torch_dtype), array


def _torch_outcome(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except wacc_torch.WeightedAccumulationError as error:
        return type(error).__name__
    return None


def _reference_outcome(call: object) -> str | None:
    try:
        call()  # type: ignore[operator]
    except ReferenceError as error:
        return type(error).__name__
    return None


def _module() -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(2))
    return module


@settings(max_examples=400)
@given(pair=numbers(), work_dtype=st.sampled_from(WORK_DTYPES), mean=st.booleans())
def test_weights_are_accepted_alike(
    pair: tuple[object, object], work_dtype: str, mean: bool
) -> None:
    """The same weight is accepted by both (with the same counters and W bits) or refused by
    both with the same error class."""
    for_torch, for_reference = pair
    module = _module()
    production = wacc_torch.WeightedGradientsAccumulator(
        dtype=getattr(torch, work_dtype), loss_scale=1.0
    )
    reference = ReferenceAccumulator(dtype=work_dtype, loss_scale=1.0)
    params = {"weight": (2,)}
    # A W that is neither 0 nor a power of two, so that W + w rounds in some examples.
    production.accumulate_sum(module, 3, grads={})
    reference.accumulate_sum(params, 3, grads={})
    method = "accumulate_mean" if mean else "accumulate_sum"
    got = _torch_outcome(
        lambda: getattr(production, method)(
            module, for_torch, grads={"weight": torch.tensor([1.0, -2.0])}
        )
    )
    want = _reference_outcome(
        lambda: getattr(reference, method)(params, for_reference, grads={"weight": [1.0, -2.0]})
    )
    assert got == want, f"{for_torch!r} / {for_reference!r}: wacc_torch {got}, wacc_ref {want}"
    p, r = production.state, reference.state
    assert (p.issued, p.zero_weight) == (r.issued, r.zero_weight)
    assert float(p.total_weight).hex() == float(r.total_weight).hex(), for_reference


@settings(max_examples=300)
@given(pair=numbers(), work_dtype=st.sampled_from(WORK_DTYPES))
def test_loss_scales_are_accepted_alike(pair: tuple[object, object], work_dtype: str) -> None:
    """The same loss scale is accepted by both (as the same float) or refused by both with the
    same error class."""
    for_torch, for_reference = pair
    made: list[object] = []

    def production() -> None:
        made.append(
            wacc_torch.WeightedGradientsAccumulator(
                dtype=getattr(torch, work_dtype),
                loss_scale=for_torch,  # type: ignore[arg-type]
            ).state.loss_scale
        )

    def reference() -> None:
        made.append(
            ReferenceAccumulator(
                dtype=work_dtype,
                loss_scale=for_reference,  # type: ignore[arg-type]
            ).state.loss_scale
        )

    got, want = _torch_outcome(production), _reference_outcome(reference)
    assert got == want, f"{for_torch!r} / {for_reference!r}: wacc_torch {got}, wacc_ref {want}"
    if got is None:
        assert made[0] == made[1] and type(made[0]) is type(made[1]) is float


@settings(max_examples=200)
@given(pair=numbers(), work_dtype=st.sampled_from(WORK_DTYPES), mid_window=st.booleans())
def test_set_loss_scale_accepts_alike(
    pair: tuple[object, object], work_dtype: str, mid_window: bool
) -> None:
    """set_loss_scale (semantics §4 Reading) accepts the same values in both packages, as the
    same float, and refuses the same ones with the same class; mid-window both refuse any value
    with InvalidLossScaleError and keep their scale."""
    for_torch, for_reference = pair
    production = wacc_torch.WeightedGradientsAccumulator(
        dtype=getattr(torch, work_dtype), loss_scale=1.0
    )
    reference = ReferenceAccumulator(dtype=work_dtype, loss_scale=1.0)
    if mid_window:
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(torch.zeros(1, dtype=getattr(torch, work_dtype)))
        production.accumulate_sum(module, 0.0, grads={"w": torch.zeros(1)})
        reference.accumulate_sum({"w": (1,)}, 0.0, grads={"w": np.zeros(1)})
    got = _torch_outcome(lambda: production.set_loss_scale(for_torch))  # type: ignore[arg-type]
    want = _reference_outcome(
        lambda: reference.set_loss_scale(for_reference)  # type: ignore[arg-type]
    )
    assert got == want, f"{for_torch!r} / {for_reference!r}: wacc_torch {got}, wacc_ref {want}"
    if mid_window:
        assert got == "InvalidLossScaleError"
    p, r = production.state.loss_scale, reference.state.loss_scale
    assert type(p) is type(r) is float and p.hex() == r.hex()


@pytest.mark.parametrize(
    ("value", "accepted"),
    [
        (3, True),
        (2.5, True),
        (np.float16(2.5), True),
        (np.uint64(2**64 - 1), True),
        (np.array(7, dtype=np.int32), True),
        (ml_dtypes.bfloat16(1.5), True),
        (True, False),
        (Fraction(3, 2), False),
        (Decimal("1.5"), False),
        (np.longdouble(1.5), False),
        (np.complex64(1.5), False),
        (np.array([1.0]), False),
        ("1.5", False),
    ],
    ids=repr,
)
def test_the_rule_as_documented(value: object, accepted: bool) -> None:
    """The documented examples of the rule, on both packages (accepted means: counted)."""
    module = _module()
    production = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    reference = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    got = _torch_outcome(lambda: production.accumulate_sum(module, value, grads={}))  # type: ignore[arg-type]
    want = _reference_outcome(
        lambda: reference.accumulate_sum({"weight": (2,)}, value, grads={})  # type: ignore[arg-type]
    )
    expected = None if accepted else "InvalidWeightError"
    assert (got, want) == (expected, expected)
