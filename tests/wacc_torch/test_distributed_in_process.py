"""wacc_torch.distributed in this process: a real single-process gloo group, and the agreement step.

``tests/wacc_torch/test_distributed.py`` runs the helpers on spawned ranks.  Here, where one
process suffices: every input the local check refuses (exactly its class, and the full message,
which names the caller and the value; nothing changed), the results of ``all_reduce_sums`` /
``all_reduce_mean`` on one rank (a fresh copy of the local sums; ``finish_mean``'s division), the
process group they talk on and their local refusals when there is none, ``_agree`` handed the
reports that several ranks would gather, and this process as rank 0 of two (the other rank's
report handed in by the exchange): what a rank contributes to the one all_reduce, and every
disagreement raising the documented error before any buffer moves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wacc_torch import WeightedGradientsAccumulator
from wacc_torch import distributed as wacc_distributed
from wacc_torch.distributed import (
    _ERROR_CLASSES,
    ProcessGroupUnavailableError,
    _agree,
    _checked_report,
    _local_device,
    _problem_report,
    _RankReport,
    all_reduce_mean,
    all_reduce_sums,
)
from wacc_torch.errors import (
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroTotalWeightError,
)
from wacc_torch.normalize import normalize_sums
from wacc_torch.results import AccumulatedGradients

from .support import assert_bitwise_equal, flushing_subnormals

CALLERS: dict[str, Callable[..., AccumulatedGradients]] = {
    "all_reduce_sums": all_reduce_sums,
    "all_reduce_mean": all_reduce_mean,
}
LOSS_SCALE = 4.0
WORK_DTYPE_NAMES = "['bfloat16', 'float16', 'float32', 'float64']"


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))


def _window(dtype: torch.dtype) -> WeightedGradientsAccumulator:
    """A window over a two-layer model whose first layer never gets a gradient (its entries,
    first in the parameter order, finish as None), with a zero-weight batch among the others."""
    model = _two_layers()
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
    torch.manual_seed(1)
    for weight in (3.0, 0.0, 5.0):
        model.zero_grad(set_to_none=True)
        (LOSS_SCALE * model[1](torch.randn(4, 2)).square().sum()).backward()
        accumulator.accumulate_sum(model, weight)
    return accumulator


def _local(grads: dict[str, torch.Tensor | None], **fields: Any) -> AccumulatedGradients:
    """A hand-built finish_sums() result; ``fields`` override the valid defaults."""
    values: dict[str, Any] = {
        "weight": 3.0,
        "loss_scale": LOSS_SCALE,
        "issued": 2,
        "zero_weight": 1,
        "normalized": False,
        "found_inf": False,
    }
    values.update(fields)
    return AccumulatedGradients(grads=grads, **values)


def _valid_grads() -> dict[str, torch.Tensor | None]:
    return {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": None,
        "c": torch.tensor([0.5, -2.0]),
    }


def _snapshot(value: object) -> Any:
    """What the caller holds, deep enough to see any change (meta tensors: their metadata)."""
    if isinstance(value, AccumulatedGradients):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        fields["grads"] = _snapshot(value.grads)
        fields["grads_object"] = id(value.grads)
        return fields
    if isinstance(value, dict):
        return {name: _snapshot(item) for name, item in value.items()}
    if isinstance(value, torch.Tensor):
        data = None if value.is_meta else value.clone().tolist()
        return (id(value), value.dtype, value.device, tuple(value.shape), data)
    return (id(value), repr(value))


def _raised(call: Callable[[], object]) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as info:
        call()
    return info.type, str(info.value)


def _report(**fields: Any) -> _RankReport:
    """A valid rank report (no problem); ``fields`` override the defaults."""
    values: dict[str, Any] = {
        "problem": None,
        "dtype": "float32",
        "loss_scale": LOSS_SCALE,
        "names": ("a", "b"),
        "shapes": ((2, 3), (2,)),
        "device_type": "cpu",
        "weight": 1.0,
        "issued": 1,
        "zero_weight": 0,
    }
    values.update(fields)
    return _RankReport(**values)


@pytest.fixture
def flush_denormals() -> Iterator[None]:
    """CPU flush-to-zero / denormals-are-zero on for the test, always off again afterwards."""
    with flushing_subnormals():
        yield


# ----------------------------------------------------------------------------------------------
# Results on one rank
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_one_rank_sums_are_a_fresh_copy_of_the_local_sums(
    one_rank_group: None, dtype: torch.dtype
) -> None:
    """On one rank all_reduce_sums returns the local sums bit for bit (None entries stay None,
    wherever they sit in the order), with the weight, S and counters, normalized=False (the
    bool), in tensors of their own: the input and its buffers are left as they were."""
    local = _window(dtype).finish_sums()
    assert local.grads["0.weight"] is None and local.grads["1.weight"] is not None
    before = _snapshot(local)
    result = all_reduce_sums(local)
    assert _snapshot(local) == before
    assert result.normalized is False
    assert (result.weight, result.loss_scale, result.issued, result.zero_weight) == (
        8.0,
        LOSS_SCALE,
        3,
        1,
    )
    assert list(result.grads) == list(local.grads)
    for name, grad in local.grads.items():
        assert_bitwise_equal(result.grads[name], grad, name)
        reduced = result.grads[name]
        if grad is not None and reduced is not None:
            assert reduced.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()
    first = result.grads["1.weight"]
    assert first is not None
    first.add_(1.0)  # writing into the result leaves the caller's buffers alone
    assert _snapshot(local) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_one_rank_mean_is_finish_mean(one_rank_group: None, dtype: torch.dtype) -> None:
    """On one rank all_reduce_mean divides the local sums as finish_mean does (by S, then by W,
    semantics §8): bit for bit the finish_mean of the same window, normalized=True, the input
    left as it was."""
    local = _window(dtype).finish_sums()
    expected = _window(dtype).finish_mean()
    before = _snapshot(local)
    result = all_reduce_mean(local)
    assert _snapshot(local) == before
    assert result.normalized is True
    assert (result.weight, result.loss_scale, result.issued, result.zero_weight) == (
        expected.weight,
        expected.loss_scale,
        expected.issued,
        expected.zero_weight,
    )
    assert list(result.grads) == list(expected.grads)
    for name, grad in expected.grads.items():
        assert_bitwise_equal(result.grads[name], grad, name)


def test_a_window_of_zero_weight_batches_only(one_rank_group: None) -> None:
    """A window with no buffer at all (zero-weight batches only: issued == zero_weight, W = 0) is
    valid input: all_reduce_sums returns its None entries and counters, all_reduce_mean raises
    ZeroTotalWeightError (the global weight is 0) naming the per-rank weights."""
    model = _two_layers()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=LOSS_SCALE)
    accumulator.accumulate_sum(model, 0.0)
    accumulator.accumulate_sum(model, 0)
    local = accumulator.finish_sums()
    assert (local.issued, local.zero_weight, local.weight) == (2, 2, 0.0)
    before = _snapshot(local)
    result = all_reduce_sums(local)
    assert result == AccumulatedGradients(
        grads=dict.fromkeys(local.grads),
        weight=0.0,
        loss_scale=LOSS_SCALE,
        issued=2,
        zero_weight=2,
        normalized=False,
        found_inf=False,
    )
    assert _raised(lambda: all_reduce_mean(local)) == (
        ZeroTotalWeightError,
        "all_reduce_mean: the global weight is 0 (weights per rank: [0.0]); nothing to normalize",
    )
    assert _snapshot(local) == before


def test_counters_at_their_bounds_are_accepted(one_rank_group: None) -> None:
    """0 <= zero_weight <= issued holds at both ends: no zero-weight batch (zero_weight = 0), an
    empty window (0, 0) and only zero-weight batches (zero_weight = issued) are all valid input,
    and the counters come back as they were (one rank: the global sums are the local ones)."""
    for issued, zero_weight in ((3, 0), (0, 0), (3, 3)):
        local = _local(_valid_grads(), issued=issued, zero_weight=zero_weight)
        for caller, call in CALLERS.items():
            result = call(local)
            assert (result.issued, result.zero_weight) == (issued, zero_weight), caller


FOUND_INF_CASES = {
    # name: (the one rank's sums, S, W, found_inf of all_reduce_sums, of all_reduce_mean)
    "finite": ({"a": torch.tensor([1.0, -2.0]), "b": None}, 4.0, 3.0, False, False),
    "inf": ({"a": torch.tensor([1.0, -math.inf]), "b": None}, 4.0, 3.0, True, True),
    "nan": ({"a": None, "b": torch.tensor([math.nan, 2.0])}, 4.0, 3.0, True, True),
    # 60000 is finite in float16 (max 65504); 60000 / 1 / 0.5 = 120000 overflows it.
    "mean-overflows": (
        {"a": torch.tensor([60000.0, 1.0], dtype=torch.float16), "b": None},
        1.0,
        0.5,
        False,
        True,
    ),
}


@pytest.mark.parametrize("case", list(FOUND_INF_CASES))
def test_found_inf_says_whether_the_reduced_result_holds_a_nan_or_an_infinity(
    one_rank_group: None, case: str
) -> None:
    """found_inf of a helper's result is the bool True exactly when one of its tensors holds a
    NaN or ±inf (on one rank the global sums are the local ones): all_reduce_sums answers for
    the sums, all_reduce_mean for the means, which can overflow where the sums do not (a float16
    sum divided by S = 1 and W = 0.5)."""
    grads, loss_scale, weight, sums_found, mean_found = FOUND_INF_CASES[case]
    local = _local(dict(grads), loss_scale=loss_scale, weight=weight)
    for caller, expected in (("all_reduce_sums", sums_found), ("all_reduce_mean", mean_found)):
        result = CALLERS[caller](local)
        non_finite = any(
            not bool(g.isfinite().all()) for g in result.grads.values() if g is not None
        )
        assert non_finite is expected, caller
        assert result.found_inf is expected, caller


def test_the_helpers_talk_on_the_group_they_are_given(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both helpers run their metadata exchange and their buffer all_reduce on the ``group``
    argument, not on the default group."""
    group = dist.new_group([0])
    used: list[tuple[str, object]] = []
    real_gather, real_reduce = dist.all_gather_object, dist.all_reduce

    def gather(*args: Any, **kwargs: Any) -> Any:
        used.append(("all_gather_object", kwargs.get("group")))
        return real_gather(*args, **kwargs)

    def reduce(*args: Any, **kwargs: Any) -> Any:
        used.append(("all_reduce", kwargs.get("group")))
        return real_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_object", gather)
    monkeypatch.setattr(dist, "all_reduce", reduce)
    for name, call in CALLERS.items():
        used.clear()
        local = _local(_valid_grads())
        result = call(local, group=group)
        assert result.normalized is (name == "all_reduce_mean")
        assert used == [("all_gather_object", group), ("all_reduce", group)], name
    dist.destroy_process_group(group)


# ----------------------------------------------------------------------------------------------
# Every refused input: a problem report, raised by every rank (here: the one rank)
# ----------------------------------------------------------------------------------------------


def _mixed_devices() -> dict[str, torch.Tensor | None]:
    return {
        "a": torch.zeros(2),
        "b": None,
        "c": torch.zeros(2, device="meta"),
        "d": torch.zeros(3),
    }


def _mixed_dtypes() -> dict[str, torch.Tensor | None]:
    return {
        "a": torch.zeros(2),
        "b": None,
        "c": torch.zeros(2, dtype=torch.float64),
        "d": torch.zeros(1, dtype=torch.float64),
        "e": torch.zeros(3),
    }


# (label, the bad input, the exception class, the message after "{caller}")
REFUSED: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    (
        "not_accumulated_gradients",
        _valid_grads,
        TypeError,
        " expects the AccumulatedGradients of finish_sums(), got dict",
    ),
    (
        "none",
        lambda: None,
        TypeError,
        " expects the AccumulatedGradients of finish_sums(), got NoneType",
    ),
    (
        "normalized",  # checked before the weight: this is the message, not the weight's
        lambda: _local(_valid_grads(), normalized=True, weight=-1.0),
        WeightedAccumulationError,
        " expects un-normalized sums (finish_sums()), got an AccumulatedGradients with "
        "normalized=True (finish_mean() or a reduced mean); S and W would be divided out twice",
    ),
    (
        "negative_weight",
        lambda: _local(_valid_grads(), weight=-1.0),
        InvalidWeightError,
        ": the weight: total_weight must be finite and >= 0, got -1.0",
    ),
    (
        "nan_weight",
        lambda: _local(_valid_grads(), weight=math.nan),
        InvalidWeightError,
        ": the weight: total_weight must be finite and >= 0, got nan",
    ),
    (
        "infinite_weight",
        lambda: _local(_valid_grads(), weight=math.inf),
        InvalidWeightError,
        ": the weight: total_weight must be finite and >= 0, got inf",
    ),
    (
        "bool_weight",
        lambda: _local(_valid_grads(), weight=True),
        InvalidWeightError,
        ": the weight: total_weight must be a real number, got the bool True",
    ),
    (
        "weight_not_a_float64",
        lambda: _local(_valid_grads(), weight=2**53 + 1),
        InvalidWeightError,
        ": the weight: total_weight 9007199254740993 is not exactly a float64 (W is a float64 sum)",
    ),
    (
        "float_issued",
        lambda: _local(_valid_grads(), issued=1.5, zero_weight=0),
        WeightedAccumulationError,
        ": the counters need 0 <= zero_weight <= issued, got zero_weight=0, issued=1.5",
    ),
    (
        "bool_zero_weight",
        lambda: _local(_valid_grads(), issued=2, zero_weight=True),
        WeightedAccumulationError,
        ": the counters need 0 <= zero_weight <= issued, got zero_weight=True, issued=2",
    ),
    (
        "negative_zero_weight",
        lambda: _local(_valid_grads(), issued=1, zero_weight=-1),
        WeightedAccumulationError,
        ": the counters need 0 <= zero_weight <= issued, got zero_weight=-1, issued=1",
    ),
    (
        "zero_weight_above_issued",
        lambda: _local(_valid_grads(), issued=1, zero_weight=2),
        WeightedAccumulationError,
        ": the counters need 0 <= zero_weight <= issued, got zero_weight=2, issued=1",
    ),
    (
        "zero_loss_scale",
        lambda: _local(_valid_grads(), loss_scale=0.0),
        InvalidLossScaleError,
        ": loss_scale must be a finite float > 0, got 0.0 (work dtype torch.float64)",
    ),
    (
        "nan_loss_scale",
        lambda: _local(_valid_grads(), loss_scale=math.nan),
        InvalidLossScaleError,
        ": loss_scale must be a finite float > 0, got nan (work dtype torch.float64)",
    ),
    (
        "bool_loss_scale",
        lambda: _local(_valid_grads(), loss_scale=True),
        InvalidLossScaleError,
        ": loss_scale must be a real number, got the bool True (work dtype torch.float64)",
    ),
    (
        "buffer_not_a_tensor",
        lambda: _local({"a": torch.zeros(2), "b": None, "c": cast(Any, [1.0, 2.0])}),
        TypeError,
        ": the pending buffer of 'c' must be a torch.Tensor or None, got list",
    ),
    (
        "mixed_dtypes",
        lambda: _local(_mixed_dtypes()),
        ParameterMismatchError,
        ": the pending buffers have several dtypes: float32 ('a'), float64 ('c')",
    ),
    (
        "mixed_devices",
        lambda: _local(_mixed_devices()),
        ParameterMismatchError,
        ": the pending buffers of one rank must be on one device, got cpu ('a'), meta ('c')",
    ),
    (
        "integer_buffers",
        lambda: _local({"a": None, "b": torch.zeros(2, dtype=torch.int64)}),
        ParameterMismatchError,
        f": pending buffers of dtype int64 are not in a work dtype {WORK_DTYPE_NAMES}",
    ),
    (
        "float8_buffers",
        lambda: _local({"a": torch.zeros(2, dtype=torch.float8_e4m3fn)}),
        ParameterMismatchError,
        f": pending buffers of dtype float8_e4m3fn are not in a work dtype {WORK_DTYPE_NAMES}",
    ),
    (
        "loss_scale_beyond_float16",
        lambda: _local({"a": torch.zeros(2, dtype=torch.float16)}, loss_scale=2.0**16),
        InvalidLossScaleError,
        ": loss_scale 65536.0 (0x1.0000000000000p+16) is not exactly representable in "
        "torch.float16 (it converts to inf)",
    ),
    (
        "loss_scale_not_in_bfloat16",
        lambda: _local({"a": torch.zeros(2, dtype=torch.bfloat16)}, loss_scale=1.0 + 2.0**-10),
        InvalidLossScaleError,
        ": loss_scale 1.0009765625 (0x1.0040000000000p+0) is not exactly representable in "
        "torch.bfloat16 (it converts to 1.0)",
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [case[1:] for case in REFUSED],
    ids=[case[0] for case in REFUSED],
)
def test_a_refused_input_raises_its_class_naming_the_caller_and_the_value(
    one_rank_group: None,
    make: Callable[[], object],
    error: type[Exception],
    message: str,
) -> None:
    """Each input the local check refuses raises exactly its class (not a subclass, not a
    parent) with the message of the rank that sent it: "rank 0 of 1: " + the caller's name +
    what is wrong, naming the value, + " (raised on every rank)"; the input is left as it was."""
    for caller, call in CALLERS.items():
        bad = make()
        before = _snapshot(bad)
        raised = _raised(partial(call, bad))
        assert raised == (error, f"rank 0 of 1: {caller}{message} (raised on every rank)")
        assert _snapshot(bad) == before


def test_flush_to_zero_is_a_problem_of_the_rank_that_flushes(
    one_rank_group: None, flush_denormals: None
) -> None:
    """Under flush-to-zero the helpers (host arithmetic on the weights) refuse with
    UnsupportedEnvironmentError naming the caller, through the metadata exchange (so every
    rank raises together); the input is left as it was."""
    for caller, call in CALLERS.items():
        local = _local(_valid_grads())
        before = _snapshot(local)
        raised = _raised(partial(call, local))
        assert raised == (
            UnsupportedEnvironmentError,
            f"rank 0 of 1: {caller}: the CPU flushes subnormals to zero (flush-to-zero / "
            "denormals-are-zero is on, e.g. torch.set_flush_denormal(True)); §2 rounds with "
            "gradual underflow, so CPU results would differ. Call torch.set_flush_denormal(False) "
            "first. (raised on every rank)",
        )
        assert _snapshot(local) == before


# ----------------------------------------------------------------------------------------------
# The agreement: the reports several ranks would gather
# ----------------------------------------------------------------------------------------------


def _agree_error(reports: Sequence[_RankReport]) -> tuple[type[BaseException], str]:
    return _raised(lambda: _agree(reports, caller="all_reduce_mean", world_size=len(reports)))


def test_the_first_rank_with_a_problem_decides_the_error_of_every_rank() -> None:
    """A problem report of any of the error classes is raised as that class, with the message of
    the first rank that reported one, before anything else is compared (a loss scale that
    differs on another rank included)."""
    for error in _ERROR_CLASSES.values():
        reports = [
            _report(),
            _report(loss_scale=2 * LOSS_SCALE),
            _problem_report(error, "what rank 2 saw"),
            _problem_report(InvalidWeightError, "what rank 3 saw"),
        ]
        assert _agree_error(reports) == (
            error,
            "rank 2 of 4: what rank 2 saw (raised on every rank)",
        )
    assert _agree_error([_problem_report(TypeError, "rank 0's")]) == (
        TypeError,
        "rank 0 of 1: rank 0's (raised on every rank)",
    )


def test_a_problem_report_says_only_what_went_wrong() -> None:
    """_problem_report keeps the class name and the message; it refuses a class that no rank
    could raise by name."""
    report = _problem_report(ParameterMismatchError, "the message")
    assert report.problem == ("ParameterMismatchError", "the message")
    with pytest.raises(AssertionError):
        _problem_report(KeyError, "not a class the ranks know")
    assert _checked_report(report, rank=3) is report
    with pytest.raises(AssertionError, match=r"^rank 3 sent dict\b"):
        _checked_report({}, rank=3)


def test_ranks_disagreeing_on_the_loss_scale() -> None:
    """A loss scale that differs from rank 0's raises InvalidLossScaleError naming both values
    and the first rank that differs."""
    reports = [_report(), _report(), _report(loss_scale=8.0), _report(loss_scale=2.0)]
    assert _agree_error(reports) == (
        InvalidLossScaleError,
        "all_reduce_mean: loss scale 8.0 on rank 2 differs from 4.0 on rank 0; S must be the "
        "same on every rank",
    )


def test_ranks_disagreeing_on_the_parameter_names() -> None:
    """Parameter sets that differ raise ParameterMismatchError listing the names on each side
    only (sorted); a rank that tracks no parameter at all is pointed out.  The same names in
    another order agree (the layout keeps rank 0's order)."""
    names = ("b", "a", "c")
    shapes = ((2,), (2, 3), (1,))
    assert _agree_error(
        [_report(names=names, shapes=shapes), _report(names=("a", "d", "e"), shapes=(None,) * 3)]
    ) == (
        ParameterMismatchError,
        "all_reduce_mean: parameter names differ between rank 0 and rank 1: only on rank 1: "
        "['d', 'e']; only on rank 0: ['b', 'c']",
    )
    hint = (
        "tracks no parameter: its accumulator never accumulated; a zero-weight accumulate_sum "
        "there binds the parameter set)"
    )
    assert _agree_error(
        [_report(), _report(), _report(names=(), shapes=(), dtype=None, device_type=None)]
    ) == (
        ParameterMismatchError,
        "all_reduce_mean: parameter names differ between rank 0 and rank 2: only on rank 2: []; "
        f"only on rank 0: ['a', 'b'] (rank 2 {hint}",
    )
    assert _agree_error([_report(names=(), shapes=(), dtype=None), _report()]) == (
        ParameterMismatchError,
        "all_reduce_mean: parameter names differ between rank 0 and rank 1: only on rank 1: "
        f"['a', 'b']; only on rank 0: [] (rank 0 {hint}",
    )
    layout = _agree(
        [_report(names=names, shapes=shapes), _report(names=("c", "b", "a"), shapes=(None,) * 3)],
        caller="all_reduce_mean",
        world_size=2,
    )
    assert layout.names == names
    assert dict(layout.shapes) == dict(zip(names, shapes, strict=True))


def test_ranks_disagreeing_on_the_work_dtype_or_device_type() -> None:
    """Work dtypes or device types that differ raise ParameterMismatchError listing those of
    every rank that has buffers (a rank without any has no say)."""
    reports = [
        _report(dtype="float32"),
        _report(dtype=None, device_type=None, shapes=(None, None)),
        _report(dtype="bfloat16", device_type="cuda"),
    ]
    assert _agree_error(reports) == (
        ParameterMismatchError,
        "all_reduce_mean: the work dtype differs across ranks: rank 0: float32, rank 2: bfloat16",
    )
    reports[2] = _report(device_type="cuda")
    assert _agree_error(reports) == (
        ParameterMismatchError,
        "all_reduce_mean: the buffers' device type differs across ranks: rank 0: cpu, rank 2: cuda",
    )


def test_ranks_disagreeing_on_a_shape() -> None:
    """A parameter whose buffers have different shapes on two ranks raises
    ParameterMismatchError naming it, both shapes and both ranks (the first rank holding a
    buffer, not rank 0 when rank 0 has none)."""
    reports = [
        _report(shapes=((2, 3), None)),
        _report(shapes=(None, (2,))),
        _report(shapes=((2, 3), (2,))),
        _report(shapes=((2, 3), (3,))),
    ]
    assert _agree_error(reports) == (
        ParameterMismatchError,
        "all_reduce_mean: parameter 'b' has shape [3] on rank 3 but [2] on rank 1",
    )


def test_the_agreed_layout() -> None:
    """Compatible reports give the common dtype, device type and S, rank 0's names, the shape
    of every parameter with a buffer on some rank, the correctly rounded sum of the weights
    (math.fsum: 2**53 + 1 + 1 is 2**53 + 2, where a running float sum gives 2**53), and the
    exact sums of the counters."""
    reports = [
        _report(names=("a", "b", "c"), shapes=((2, 3), None, None), weight=2.0**53),
        _report(
            names=("c", "a", "b"),
            shapes=(None, None, None),
            dtype=None,
            device_type=None,
            weight=1.0,
            issued=4,
            zero_weight=4,
        ),
        _report(
            names=("b", "c", "a"),
            shapes=((5,), None, (2, 3)),
            weight=1.0,
            issued=7,
            zero_weight=2,
        ),
    ]
    layout = _agree(reports, caller="all_reduce_sums", world_size=3)
    assert layout == wacc_distributed._GlobalLayout(
        dtype=torch.float32,
        device_type="cpu",
        loss_scale=LOSS_SCALE,
        names=("a", "b", "c"),
        shapes={"a": (2, 3), "b": (5,)},
        weight=2.0**53 + 2,
        issued=12,
        zero_weight=6,
    )
    nothing = _agree(
        [_report(dtype=None, device_type=None, shapes=(None, None), weight=0.0)],
        caller="all_reduce_sums",
        world_size=1,
    )
    assert (nothing.dtype, nothing.device_type, dict(nothing.shapes)) == (None, None, {})
    huge = _agree(
        [_report(weight=1.5e308), _report(weight=1.5e308)], caller="all_reduce_sums", world_size=2
    )
    assert huge.weight == math.inf


# ----------------------------------------------------------------------------------------------
# This process as rank 0 of two: the other rank's report is handed in by the exchange
# ----------------------------------------------------------------------------------------------


class _RankZeroOfTwo:
    """This process plays rank 0 of a two-rank ``group``: the group's size is 2, the metadata
    exchange hands back this rank's report and ``other`` (rank 1's), and the buffer all_reduce is
    the real one of the one-rank group, recorded first: ``contributions`` holds what this rank
    puts into the sum (each call's flat buffer), and a result's buffers hold exactly that."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.group = dist.new_group([0])
        self.other: object = None
        self.contributions: list[torch.Tensor] = []
        real_size, real_reduce = dist.get_world_size, dist.all_reduce

        def world_size(group: object = None) -> int:
            return 2 if group is self.group else real_size(group)  # type: ignore[arg-type]

        def gather(out: list[object], report: object, group: object = None) -> None:
            assert out == [None, None] and group is self.group
            out[:] = [report, self.other]

        def reduce(tensor: torch.Tensor, op: object = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
            assert op == dist.ReduceOp.SUM and kwargs == {"group": self.group}
            self.contributions.append(tensor.clone())
            return real_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

        monkeypatch.setattr(dist, "get_world_size", world_size)
        monkeypatch.setattr(dist, "all_gather_object", gather)
        monkeypatch.setattr(dist, "all_reduce", reduce)


@pytest.fixture
def rank_zero_of_two(one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> _RankZeroOfTwo:
    """This process as rank 0 of a two-rank group (see :class:`_RankZeroOfTwo`)."""
    return _RankZeroOfTwo(monkeypatch)


def _default_device(name: str | None) -> Any:
    return contextlib.nullcontext() if name is None else torch.device(name)


def _storages(result: AccumulatedGradients) -> set[int]:
    return {g.untyped_storage().data_ptr() for g in result.grads.values() if g is not None}


@pytest.mark.parametrize("default_device", [None, "meta"])
def test_rank_zero_contributes_its_buffers_and_zeros_in_its_name_order(
    rank_zero_of_two: _RankZeroOfTwo, default_device: str | None
) -> None:
    """What a rank puts into the one all_reduce: its buffers flattened in rank 0's name order,
    +0.0 of the work dtype on its buffers' device (whatever the default device) for a parameter
    whose buffer exists on the other rank only, nothing for one without a buffer anywhere (it
    stays None).  The results are views into that one new buffer (all_reduce_mean divides it in
    place, by S and then by the global weight); the weight is the sum over ranks, the counters
    too; the input is left as it was."""
    w = torch.tensor([[1.5, -2.0, 0.25], [3.0, -0.5, 8.0]], dtype=torch.bfloat16)
    b = torch.tensor([-1.0, 0.75], dtype=torch.bfloat16)
    v = torch.tensor([2.0, -4.0, 0.125, 6.0], dtype=torch.bfloat16)
    grads: dict[str, torch.Tensor | None] = {
        "w": w,
        "only_1": None,
        "nowhere": None,
        "b": b,
        "v": v,
    }
    local = _local(grads, weight=3.0, issued=2, zero_weight=1)
    rank_zero_of_two.other = _report(
        dtype="bfloat16",
        names=("v", "only_1", "nowhere", "b", "w"),
        shapes=((4,), (3,), None, None, (2, 3)),
        weight=5.0,
        issued=4,
        zero_weight=0,
    )
    zeros = torch.zeros(3, dtype=torch.bfloat16)
    contribution = torch.cat([w.reshape(-1), zeros, b, v])
    sums: dict[str, torch.Tensor | None] = {
        "w": w,
        "only_1": zeros,
        "nowhere": None,
        "b": b,
        "v": v,
    }
    means = normalize_sums(sums, loss_scale=LOSS_SCALE, total_weight=8.0)
    before = _snapshot(local)
    for caller, call in CALLERS.items():
        rank_zero_of_two.contributions.clear()
        with _default_device(default_device):
            result = call(local, group=rank_zero_of_two.group)
        assert _snapshot(local) == before
        assert len(rank_zero_of_two.contributions) == 1
        assert_bitwise_equal(rank_zero_of_two.contributions[0], contribution, caller)
        mean = caller == "all_reduce_mean"
        assert (result.weight, result.loss_scale, result.issued, result.zero_weight) == (
            8.0,
            LOSS_SCALE,
            6,
            1,
        )
        assert result.normalized is mean
        expected = means if mean else sums
        assert list(result.grads) == list(grads)
        for name, grad in expected.items():
            assert_bitwise_equal(result.grads[name], grad, f"{caller}: {name}")
        assert len(_storages(result)) == 1, caller
        assert _storages(result).isdisjoint({w.data_ptr(), b.data_ptr(), v.data_ptr()})


@pytest.mark.parametrize("default_device", [None, "meta"])
def test_a_rank_without_buffers_contributes_zeros_of_the_agreed_dtype_on_its_device(
    rank_zero_of_two: _RankZeroOfTwo, default_device: str | None
) -> None:
    """A rank that holds no buffer at all (only zero-weight batches) still joins the reduction:
    it contributes +0.0 in the work dtype agreed with the other rank, on a device of the agreed
    device type (the CPU here, whatever the default device), and gets the global result."""
    local = _local({"w": None, "b": None}, weight=0.0, issued=1, zero_weight=1)
    rank_zero_of_two.other = _report(
        dtype="float16", names=("w", "b"), shapes=((2, 3), (2,)), weight=2.0, issued=1
    )
    before = _snapshot(local)
    for caller, call in CALLERS.items():
        rank_zero_of_two.contributions.clear()
        with _default_device(default_device):
            result = call(local, group=rank_zero_of_two.group)
        assert _snapshot(local) == before
        assert len(rank_zero_of_two.contributions) == 1
        assert_bitwise_equal(
            rank_zero_of_two.contributions[0], torch.zeros(8, dtype=torch.float16), caller
        )
        assert (result.weight, result.issued, result.zero_weight) == (2.0, 2, 1)
        for name, shape in (("w", (2, 3)), ("b", (2,))):
            grad = result.grads[name]
            assert grad is not None and grad.device == torch.device("cpu")
            assert_bitwise_equal(grad, torch.zeros(shape, dtype=torch.float16), name)


def _other_rank_disagrees() -> list[tuple[str, object, type[BaseException], str]]:
    """(label, rank 1's report, the error, its message after "{caller}") against rank 0's
    ``_local(_valid_grads())``: float32 buffers "a" (2, 3) and "c" (2,), "b" None, S = 4."""
    names, shapes = ("a", "b", "c"), ((2, 3), None, (2,))
    return [
        (
            "problem",
            _problem_report(InvalidWeightError, "rank 1's own message"),
            InvalidWeightError,
            "rank 1 of 2: rank 1's own message (raised on every rank)",
        ),
        (
            "loss_scale",
            _report(names=names, shapes=shapes, loss_scale=8.0),
            InvalidLossScaleError,
            "{caller}: loss scale 8.0 on rank 1 differs from 4.0 on rank 0; S must be the same "
            "on every rank",
        ),
        (
            "names",
            _report(names=("a", "c", "d"), shapes=((2, 3), (2,), (1,))),
            ParameterMismatchError,
            "{caller}: parameter names differ between rank 0 and rank 1: only on rank 1: ['d']; "
            "only on rank 0: ['b']",
        ),
        (
            "dtype",
            _report(names=names, shapes=shapes, dtype="bfloat16"),
            ParameterMismatchError,
            "{caller}: the work dtype differs across ranks: rank 0: float32, rank 1: bfloat16",
        ),
        (
            "device_type",
            _report(names=names, shapes=shapes, device_type="cuda"),
            ParameterMismatchError,
            "{caller}: the buffers' device type differs across ranks: rank 0: cpu, rank 1: cuda",
        ),
        (
            "shape",
            _report(names=names, shapes=((3, 2), None, (2,))),
            ParameterMismatchError,
            "{caller}: parameter 'a' has shape [3, 2] on rank 1 but [2, 3] on rank 0",
        ),
    ]


def test_a_disagreement_with_another_rank_raises_here_before_any_buffer_moves(
    rank_zero_of_two: _RankZeroOfTwo,
) -> None:
    """When the gathered reports disagree (another rank's problem, S, parameter names, work
    dtype, device type or a shape), this rank raises the documented error naming the caller and
    the values of both ranks, before any buffer is communicated, with its input unchanged."""
    for label, other, error, message in _other_rank_disagrees():
        rank_zero_of_two.other = other
        for caller, call in CALLERS.items():
            local = _local(_valid_grads())
            before = _snapshot(local)
            raised = _raised(partial(call, local, group=rank_zero_of_two.group))
            assert raised == (error, message.format(caller=caller)), label
            assert rank_zero_of_two.contributions == [], label
            assert _snapshot(local) == before
    rank_zero_of_two.other = {"not": "a report"}
    with pytest.raises(AssertionError, match=r"^rank 1 sent dict\b"):
        all_reduce_sums(_local(_valid_grads()), group=rank_zero_of_two.group)


def test_a_global_weight_of_zero_or_beyond_float64_refuses_a_mean(
    rank_zero_of_two: _RankZeroOfTwo,
) -> None:
    """A mean needs a global weight that is > 0 (ZeroTotalWeightError) and finite
    (InvalidWeightError): each naming the weights per rank, raised before any buffer moves,
    although every rank's own weight is valid."""
    for weight, error, message in (
        (
            0.0,
            ZeroTotalWeightError,
            "all_reduce_mean: the global weight is 0 (weights per rank: [0.0, 0.0]); nothing to "
            "normalize",
        ),
        (
            1.5e308,
            InvalidWeightError,
            "all_reduce_mean: the global weight overflows float64 (weights per rank: "
            "[1.5e+308, 1.5e+308])",
        ),
    ):
        rank_zero_of_two.other = _report(
            names=("a", "b", "c"), shapes=((2, 3), None, (2,)), weight=weight
        )
        local = _local(_valid_grads(), weight=weight)
        raised = _raised(partial(all_reduce_mean, local, group=rank_zero_of_two.group))
        assert raised == (error, message)
        assert rank_zero_of_two.contributions == []


# ----------------------------------------------------------------------------------------------
# No process group to talk to: refused locally
# ----------------------------------------------------------------------------------------------


def test_without_an_initialized_process_group_the_helpers_refuse_locally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without torch.distributed, or before init_process_group, both helpers raise
    ProcessGroupUnavailableError naming the caller, without communicating."""
    assert not dist.is_initialized()
    local = _local(_valid_grads())
    for caller, call in CALLERS.items():
        assert _raised(partial(call, local)) == (
            ProcessGroupUnavailableError,
            f"{caller}: the default process group is not initialized; call "
            "torch.distributed.init_process_group(...) on every rank first",
        )
    monkeypatch.setattr(dist, "is_available", lambda: False)
    for caller, call in CALLERS.items():
        assert _raised(partial(call, local)) == (
            ProcessGroupUnavailableError,
            f"{caller}: torch.distributed is not available in this PyTorch build",
        )


def test_a_process_outside_the_group_is_refused_locally(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that is not a member of ``group`` (torch.distributed gives it rank -1 there)
    raises ProcessGroupUnavailableError naming the caller, its global rank and the group,
    without communicating."""
    group = dist.new_group([0])
    real_rank = dist.get_rank

    def get_rank(group_asked: object = None) -> int:
        return -1 if group_asked is group else real_rank(group_asked)  # type: ignore[arg-type]

    def communicate(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process outside the group communicated")

    monkeypatch.setattr(dist, "get_rank", get_rank)
    monkeypatch.setattr(dist, "all_gather_object", communicate)
    monkeypatch.setattr(dist, "all_reduce", communicate)
    local = _local(_valid_grads())
    for caller, call in CALLERS.items():
        assert _raised(partial(call, local, group=group)) == (
            ProcessGroupUnavailableError,
            f"{caller}: this process (global rank 0) is not a member of the given process "
            f"group {group!r}",
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_rank_without_buffers_makes_its_zeros_on_its_current_device() -> None:
    """A rank without buffers whose group agreed on CUDA makes its zeros on this process's
    current CUDA device (as torch.distributed assumes); with a buffer, on that buffer's device."""
    current = torch.device("cuda", torch.cuda.current_device())
    assert _local_device({"a": None}, device_type="cuda") == current
    buffer = torch.zeros(1, device=current)
    assert _local_device({"a": None, "b": buffer}, device_type="cuda") == buffer.device
