"""Issue 10's defects in wacc_ref, one test each: every one failed before the fix."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.errors import (
    InvalidLossScaleError,
    ParameterMismatchError,
    RecordError,
)

PARAMS = {"w": (2,), "b": (1,)}


def _ragged() -> object:
    return [[1.0, 2.0], [3.0]]


def _torch_bfloat16() -> object:
    torch = pytest.importorskip("torch")  # numpy cannot read a bf16 tensor (__array__ raises)
    return torch.zeros(2, dtype=torch.bfloat16)


@pytest.mark.skipif(
    np.finfo(np.longdouble).nmant <= np.finfo(np.float64).nmant,
    reason="numpy.longdouble is float64 on this platform: 1 + 2**-60 is 1 exactly",
)
def test_defect_4_longdouble_loss_scale_is_refused_not_rounded() -> None:
    """np.longdouble(1 + 2**-60) as S raises InvalidLossScaleError instead of running with 1.0."""
    scale = np.longdouble(1) + np.longdouble(2) ** -60
    assert scale != 1  # the value really is not a float64
    with pytest.raises(InvalidLossScaleError, match="longdouble|float128"):
        ReferenceAccumulator(dtype="float64", loss_scale=scale)  # type: ignore[arg-type]


def test_defect_5_parameters_match_by_name_not_order() -> None:
    """The tracked set is matched by name (as wacc_torch does): another order is the same set."""
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum(PARAMS, 1, grads={"w": [1.0, 2.0]})
    reordered = {"b": (1,), "w": (2,)}
    acc.accumulate_sum(reordered, 2, grads={"w": [1.0, 1.0], "b": [4.0]})
    record = acc.state_dict()
    assert record["param_names"] == ["w", "b"]  # the bound order is kept
    other = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    other.load_state_dict(record, reordered)
    assert other.finish_sums().grads["w"].tolist() == [2.0, 3.0]  # type: ignore[union-attr]


@pytest.mark.parametrize("make", [_ragged, _torch_bfloat16], ids=["ragged list", "torch bf16"])
def test_defect_6_unreadable_arrays_raise_spec_errors_naming_the_field(
    make: Callable[[], object],
) -> None:
    """A gradient or pending buffer numpy cannot read raises the §11 error naming it."""
    value = make()
    acc = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    acc.accumulate_sum(PARAMS, 1, grads={"w": [1.0, 2.0]})
    before = acc.state_dict()
    with pytest.raises(ParameterMismatchError, match="gradient of 'w'"):
        acc.accumulate_sum(PARAMS, 1, grads={"w": value})  # type: ignore[dict-item]
    record = {**before, "pending": {"w": value}}
    del record["checksum"]
    with pytest.raises(RecordError, match=r"pending\['w'\]"):
        acc.load_state_dict(record, PARAMS)
    after = acc.state_dict()
    assert after["checksum"] == before["checksum"]  # every field and buffer bit as before


@pytest.mark.parametrize("mode", ["emulated", "exact"])
def test_defect_8_big_integer_weight_is_added_exactly(mode: str) -> None:
    """W = 1 plus w = 2**53 + 1 gives round_64(2**53 + 2) = 2**53 + 2: one rounding."""
    acc = ReferenceAccumulator(dtype="float64", loss_scale=1.0, mode=mode)
    acc.accumulate_sum(PARAMS, 1, grads={})
    acc.accumulate_sum(PARAMS, 2**53 + 1, grads={})
    assert acc.finish_sums().weight == 2.0**53 + 2
