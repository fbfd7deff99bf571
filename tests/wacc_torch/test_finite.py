"""``found_inf`` collected across several :class:`FiniteCheck` objects (semantics §7, §8): the
one-synchronisation answer of the DDP hook (``found_in``) and the flag FSDP reduces with MAX
(``flag_of``), against the definition: some element is NaN or ±inf."""

from __future__ import annotations

import math

import pytest
import torch

from wacc_torch._finite import FiniteCheck, flag_of, found_in
from wacc_torch._work import pieces

CASES = {
    "finite": [[1.0, -2.0], [3.5]],
    "inf": [[1.0, math.inf], [3.5]],
    "-inf": [[1.0, 2.0], [-math.inf]],
    "nan": [[math.nan, 2.0], [3.5]],
    "one-check": [[0.0, -0.0, 2.0**-149]],
    "one-bad-check": [[math.inf]],
}


def _checks(groups: list[list[float]], dtype: torch.dtype) -> list[FiniteCheck]:
    """One FiniteCheck per group, fed its tensor piece by piece as the finishing pass does."""
    checks = []
    for values in groups:
        tensor = torch.tensor(values, dtype=dtype)
        check = FiniteCheck([tensor])
        for (piece,) in pieces(tensor):
            check.add(piece)
        checks.append(check)
    return checks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_found_in_and_flag_of_say_whether_any_element_is_not_finite(
    case: str, dtype: torch.dtype
) -> None:
    """Over several checks, found_in is True and flag_of is a 0-d int32 1 on the device asked
    for exactly when some element fed to some check is NaN or ±inf (math.isfinite says which);
    else False and 0."""
    groups = CASES[case]
    expected = any(not math.isfinite(x) for values in groups for x in values)
    checks = _checks(groups, dtype)
    assert found_in(checks) is expected
    flag = flag_of(checks, torch.device("cpu"))
    assert (flag.shape, flag.dtype, flag.device.type) == ((), torch.int32, "cpu")
    assert flag.item() == int(expected)


def test_no_checks_found_nothing() -> None:
    """No checks (nothing to check): found_in is False and flag_of is a 0-d int32 0."""
    assert found_in([]) is False
    flag = flag_of([], torch.device("cpu"))
    assert (flag.shape, flag.dtype, flag.device.type, flag.item()) == ((), torch.int32, "cpu", 0)


@pytest.mark.parametrize("groups", [[], [[1.0, math.inf]]], ids=["no-checks", "one-check"])
def test_flag_of_is_on_the_device_asked_for(groups: list[list[float]]) -> None:
    """flag_of answers on the device it is given (there the collective runs), not where the
    checks' tensors live: asked for the meta device, the flag is a 0-d int32 meta tensor."""
    flag = flag_of(_checks(groups, torch.float32), torch.device("meta"))
    assert (flag.shape, flag.dtype, flag.device.type) == ((), torch.int32, "meta")
