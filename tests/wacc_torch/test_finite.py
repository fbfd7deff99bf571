"""``found_inf`` collected across several :class:`FiniteCheck` objects (semantics §7, §8): the
one-synchronisation answer of the DDP hook (``found_in``) and the flag FSDP reduces with MAX
(``flag_of``), against the definition: some element is NaN or ±inf."""

from __future__ import annotations

import math

import pytest
import torch

from wacc_torch._finite import FiniteCheck, flag_of, found_in
from wacc_torch._work import CHUNK_ELEMENTS, piece_count, pieces

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


def _one_check(tensors: list[torch.Tensor]) -> FiniteCheck:
    """One FiniteCheck over all ``tensors``, fed piece by piece in order."""
    check = FiniteCheck(tensors)
    for tensor in tensors:
        for (piece,) in pieces(tensor):
            check.add(piece)
    return check


# Where the bad element goes in the tensors of test_one_check_over_many_pieces...: (tensor,
# piece, element); tensor 1 is cut into three pieces of ROWS rows (the last one row long).
ROWS = CHUNK_ELEMENTS // 4
SPOTS = {
    "tensor0": (0, (1,)),
    "tensor1-piece2": (1, (ROWS + 1, 0)),
    "tensor1-piece3": (1, (ROWS * 2, 3)),
    "tensor2": (2, (1,)),
    "float64-tensor": (4, (0,)),
}
BAD_CASES = [pytest.param(None, None, id="all-finite")] + [
    pytest.param(spot, bad, id=f"{name}-{spot}")
    for spot in SPOTS
    for bad, name in ((math.inf, "inf"), (-math.inf, "-inf"), (math.nan, "nan"))
]


@pytest.mark.parametrize(("spot", "bad"), BAD_CASES)
def test_one_check_over_many_pieces_finds_a_bad_element_in_any_piece(
    spot: str | None, bad: float | None
) -> None:
    """A check over several tensors of one device and dtype (and one of another dtype), one of
    them cut into several pieces, finds a NaN or ±inf whichever piece holds it, the first, the
    second or a later one (found, found_in and flag_of agree); with none, nothing is found."""
    tensors = [
        torch.zeros(3),
        torch.full((ROWS * 2 + 1, 4), 0.5),
        torch.tensor([1.0, -2.0]),
        torch.tensor([], dtype=torch.float32),  # empty: no slot, nothing added
        torch.tensor([7.0], dtype=torch.float64),
    ]
    assert piece_count(tensors[1].shape) == 3
    if spot is not None:
        index, element = SPOTS[spot]
        tensors[index][element] = bad
    expected = spot is not None
    assert _one_check(tensors).found() is expected
    assert found_in([_one_check(tensors)]) is expected
    assert flag_of([_one_check(tensors)], torch.device("cpu")).item() == int(expected)
