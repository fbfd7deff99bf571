"""``WindowLossScaler`` (semantics §13): GradScaler's policy window by window, hysteresis as in
Megatron-LM and DeepSpeed, every scale a value of the work dtype, and a state that resumes bit for
bit. The training-loop tests with an accumulator are in ``test_dynamic_loss_scaling.py``."""

from __future__ import annotations

import math
import random
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.wacc_torch.support import WORK_DTYPE_PARAMS, WORK_DTYPES, dtype_name, format_of
from wacc_ref import formats
from wacc_torch import (
    InvalidLossScaleError,
    RecordError,
    WeightedAccumulationError,
    WeightedGradientsAccumulator,
    WindowLossScaler,
)
from wacc_torch.scaler import SCALER_KEYS, round_to_dtype

decisions = st.lists(st.booleans(), max_size=120)


def _grad_scaler_run(overflows: list[bool], **options: Any) -> list[tuple[bool, float]]:
    """torch.amp.GradScaler driven through real steps: per window, whether the optimizer step
    ran and the scale after ``update()``; a window overflows when its gradient holds an inf."""
    scaler = torch.amp.GradScaler("cpu", **options)
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    out = []
    for overflow in overflows:
        optimizer.zero_grad()
        poison = torch.tensor([math.inf if overflow else 1.0, 1.0])
        scaler.scale((parameter * poison).sum()).backward()
        before = parameter.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        out.append((not torch.equal(before, parameter.detach()), scaler.get_scale()))
    return out


@given(overflows=decisions, interval=st.sampled_from([1, 2, 3, 2000]))
def test_the_defaults_follow_grad_scaler_window_by_window(
    overflows: list[bool], interval: int
) -> None:
    """With GradScaler's defaults (and a float32 work dtype, GradScaler's own scale dtype), the
    windows applied and the scale after each equal GradScaler's on the same overflow decisions,
    growth to the top of float32 included (growth_interval=1)."""
    ours = WindowLossScaler(growth_interval=interval, dtype=torch.float32)
    expected = _grad_scaler_run(overflows, growth_interval=interval)
    got = [(ours.update(overflow), ours.scale) for overflow in overflows]
    assert got == expected


def _amp_update_scale_run(
    overflows: list[bool], scale: float, growth: float, backoff: float, interval: int
) -> list[float]:
    """The scale after each window from torch._amp_update_scale_, GradScaler's own update (its
    float32 scale tensor, its float64 factors as GradScaler passes them)."""
    current = torch.tensor([scale], dtype=torch.float32)
    tracker = torch.zeros(1, dtype=torch.int32)
    out = []
    for overflow in overflows:
        found_inf = torch.tensor([1.0 if overflow else 0.0])
        torch._amp_update_scale_(current, tracker, found_inf, growth, backoff, interval)
        out.append(current.item())
    return out


def test_non_power_of_two_factors_give_grad_scalers_scales_bit_for_bit() -> None:
    """With factors that round (1.0001 and 0.7, as the issue found, and random ones), 400 seeded
    random decision sequences give, window by window, exactly the float32 scale of
    torch._amp_update_scale_ on the same found_inf decisions (GradScaler rounds the float64
    product to float32: two roundings, which the scaler models)."""
    rng = random.Random(32)
    for sequence in range(400):
        growth = [1.0001, 1.5, 3.0, rng.uniform(1.0, 4.0)][sequence % 4]
        backoff = [0.7, 0.3, 1 / 3, rng.uniform(0.05, 1.0)][(sequence // 4) % 4]
        interval = rng.randint(1, 3)
        scale = rng.choice([2.0**16, 1.0, 3.0, 2.0**100])
        overflows = [rng.random() < 0.4 for _ in range(rng.randint(1, 120))]
        ours = WindowLossScaler(scale, growth, backoff, interval, dtype=torch.float32)
        got = []
        for overflow in overflows:
            ours.update(overflow)
            got.append(ours.scale)
        expected = _amp_update_scale_run(overflows, scale, growth, backoff, interval)
        assert [value.hex() for value in got] == [value.hex() for value in expected], (
            sequence,
            growth,
            backoff,
            interval,
            scale,
        )


def test_growth_to_the_top_of_float32_stops_like_grad_scaler() -> None:
    """Forty clean windows of growth interval 1 from 2**100: GradScaler and the scaler both stop
    at 2**127, the largest power of two float32 holds (the next growth would be inf)."""
    ours = WindowLossScaler(2.0**100, growth_interval=1, dtype=torch.float32)
    expected = _grad_scaler_run([False] * 40, init_scale=2.0**100, growth_interval=1)
    got = [(ours.update(False), ours.scale) for _ in range(40)]
    assert got == expected and got[-1][1] == 2.0**127


def _megatron(
    overflows: list[bool], scale: float, hysteresis: int, interval: int, cap: float
) -> list[float]:
    """Megatron-LM's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py) on floats,
    growth 2, backoff 0.5, min_scale 1, and the growth capped at ``cap`` (Megatron has no cap):
    the hysteresis tracker counts overflows since the last growth."""
    growth_tracker, hysteresis_tracker, out = 0, hysteresis, []
    for found_inf in overflows:
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth_tracker += 1
            if growth_tracker == interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = min(scale * 2.0, cap)
        out.append(scale)
    return out


@given(overflows=decisions, hysteresis=st.integers(1, 4), interval=st.integers(1, 5))
def test_hysteresis_follows_megatron(overflows: list[bool], hysteresis: int, interval: int) -> None:
    """hysteresis=h: the h-th overflow since the last growth backs off, and every one after it
    until the next growth (Megatron-LM's rule, transcribed above); a window that overflowed is
    skipped whether or not it backs off."""
    ours = WindowLossScaler(
        2.0**10, growth_interval=interval, hysteresis=hysteresis, min_scale=1.0, max_scale=2.0**15
    )
    scales, applied = [], []
    for overflow in overflows:
        applied.append(ours.update(overflow))
        scales.append(ours.scale)
    assert applied == [not overflow for overflow in overflows]
    assert scales == _megatron(overflows, 2.0**10, hysteresis, interval, 2.0**15)


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_round_to_dtype_is_the_reference_rounding(dtype: torch.dtype) -> None:
    """round_to_dtype(x) equals wacc_ref's exact round_D on products of a value of D and a
    factor (the rationals a scaler forms: not floats in general), near the top and bottom of
    D's range, ties included; and torch's own float64 -> D conversion on float64 values."""
    fmt = format_of(dtype)
    generator = random.Random(7)
    top, bottom = Fraction(fmt.max_finite), Fraction(fmt.min_subnormal)
    values = [top, top * Fraction(3, 2), bottom, bottom / 2, bottom * Fraction(3, 4)]
    for _ in range(3000):
        scale = Fraction(2) ** generator.randint(fmt.emin - fmt.precision, fmt.emax)
        factor = Fraction(generator.randint(1, 2**12), generator.choice([1, 3, 7, 1024, 1000]))
        values.append(scale * factor)
    for value in values:
        want = formats.round_to(value, fmt)
        assert round_to_dtype(value, dtype) == want, (value, dtype)
    for _ in range(2000):
        exponent = generator.randint(fmt.emin - 12, min(fmt.emax + 2, 1022))  # a float64
        x = abs(generator.gauss(0.0, 1.0)) * 2.0**exponent
        if x:
            converted = torch.tensor(x, dtype=torch.float64).to(dtype).item()
            assert round_to_dtype(Fraction(x), dtype) == converted, (x, dtype)


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@given(
    overflows=decisions,
    growth=st.sampled_from([1.5, 3.0, 1.1, 10.0, 2.0]),
    backoff=st.sampled_from([0.3, 0.9, 0.5, 0.125, 1 / 3]),
)
def test_every_scale_is_a_loss_scale_the_accumulator_accepts(
    dtype: torch.dtype, overflows: list[bool], growth: float, backoff: float
) -> None:
    """With any factors, every scale the scaler hands out is finite, > 0 and exactly
    representable in D (the constructor's check passes), and each new scale is
    round_D(round_64(scale x factor)), GradScaler's float64 product rounded to D, or the old
    scale where D cannot hold the product."""
    fmt = format_of(dtype)
    scaler = WindowLossScaler(
        2.0**8, growth_factor=growth, backoff_factor=backoff, growth_interval=2, dtype=dtype
    )
    for overflow in overflows:
        before = scaler.scale
        scaler.update(overflow)
        torch_ok = WindowLossScaler(scaler.scale, dtype=dtype)  # raises if not a loss scale of D
        assert torch_ok.scale == scaler.scale
        if scaler.scale != before:
            factor = backoff if overflow else growth
            # GradScaler's float64 product, then rounded to D (§13).
            product = formats.round_to(Fraction(before) * Fraction(factor), formats.FLOAT64)
            assert scaler.scale == formats.round_to(product, fmt)


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_growth_past_the_top_of_d_keeps_the_scale_or_takes_max_scale(dtype: torch.dtype) -> None:
    """From D's largest power of two, growth would overflow D: without max_scale the scale stays
    (as GradScaler keeps its scale when growth would be inf); with it, it becomes max_scale."""
    fmt = format_of(dtype)
    top = 2.0**fmt.emax
    free = WindowLossScaler(top, growth_interval=1, dtype=dtype)
    assert free.update(False) and free.scale == top
    capped_at = float(Fraction(fmt.max_finite))
    capped = WindowLossScaler(top, growth_interval=1, max_scale=capped_at, dtype=dtype)
    assert capped.update(False) and capped.scale == capped_at


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_backoff_below_the_bottom_of_d_keeps_the_scale_or_takes_min_scale(
    dtype: torch.dtype,
) -> None:
    """From D's smallest subnormal, a backoff of 1/4 rounds to 0: without min_scale the scale
    stays there; with it, it becomes min_scale (never 0, never inexact)."""
    fmt = format_of(dtype)
    bottom = float(Fraction(fmt.min_subnormal))
    free = WindowLossScaler(bottom, backoff_factor=0.25, dtype=dtype)
    assert not free.update(True) and free.scale == bottom
    floor = WindowLossScaler(1.0, backoff_factor=0.25, min_scale=0.5, dtype=dtype)
    assert not floor.update(True) and floor.scale == 0.5
    assert not floor.update(True) and floor.scale == 0.5


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"init_scale": 0.0}, InvalidLossScaleError, r"0\.0"),
        ({"init_scale": math.inf}, InvalidLossScaleError, "inf"),
        ({"init_scale": 2049.0, "dtype": torch.float16}, InvalidLossScaleError, "2049"),
        ({"dtype": torch.float16}, InvalidLossScaleError, r"2\*\*16 is beyond float16"),
        ({"init_scale": 2.0**16, "dtype": torch.bfloat16, "max_scale": 2.0**10},
         InvalidLossScaleError, "outside"),
        ({"growth_factor": 1.0}, WeightedAccumulationError, r"growth_factor.*1\.0"),
        ({"growth_factor": math.nan}, WeightedAccumulationError, "nan"),
        ({"growth_factor": True}, WeightedAccumulationError, "True"),
        ({"backoff_factor": 1.0}, WeightedAccumulationError, r"backoff_factor.*1\.0"),
        ({"backoff_factor": 0.0}, WeightedAccumulationError, r"backoff_factor.*0\.0"),
        ({"backoff_factor": -0.5}, WeightedAccumulationError, "-0.5"),
        ({"growth_interval": 0}, WeightedAccumulationError, "growth_interval.*0"),
        ({"growth_interval": 2.0}, TypeError, r"growth_interval.*2\.0"),
        ({"growth_interval": True}, TypeError, "growth_interval.*True"),
        ({"hysteresis": 0}, WeightedAccumulationError, "hysteresis.*0"),
        ({"min_scale": 4.0, "max_scale": 2.0}, InvalidLossScaleError, r"4\.0.*2\.0"),
        ({"min_scale": 3.0000001}, InvalidLossScaleError, "3.0000001"),
        ({"dtype": torch.int32}, WeightedAccumulationError, "int32"),
        ({"dtype": "float16"}, TypeError, "float16"),
        # Ints beyond float64's range: refused as the argument's §11 error, never OverflowError.
        ({"init_scale": 10**400}, InvalidLossScaleError, "1" + "0" * 400),
        ({"growth_factor": 10**400}, WeightedAccumulationError,
         r"growth_factor 1" + "0" * 400 + " is not exactly a float64"),
        ({"growth_factor": 2**1024}, WeightedAccumulationError,
         rf"growth_factor {2**1024} is not exactly a float64"),
        ({"growth_factor": -(2**1024)}, WeightedAccumulationError, rf"> 1.*-{2**1024}"),
        ({"backoff_factor": 2**1024}, WeightedAccumulationError, rf"between 0 and 1.*{2**1024}"),
        ({"min_scale": 2**1024}, InvalidLossScaleError, str(2**1024)),
        ({"max_scale": 10**400}, InvalidLossScaleError, "1" + "0" * 400),
        # Numpy ints and 0-d tensors: read exactly, so one that is no float64 is refused.
        ({"growth_factor": np.uint64(2**64 - 1)}, WeightedAccumulationError,
         str(2**64 - 1)),
        ({"growth_factor": torch.tensor(2**62 + 1)}, WeightedAccumulationError,
         str(2**62 + 1)),
        ({"backoff_factor": torch.tensor(1)}, WeightedAccumulationError, r"between 0 and 1"),
        ({"init_scale": torch.tensor(2**53 + 1)}, InvalidLossScaleError, str(2**53 + 1)),
        ({"max_scale": np.int64(2**53 + 1)}, InvalidLossScaleError, str(2**53 + 1)),
        # The counts are Python ints, as GradScaler's growth_interval.
        ({"growth_interval": np.int64(3)}, TypeError, "growth_interval.*3"),
        ({"hysteresis": torch.tensor(2)}, TypeError, "hysteresis.*2"),
    ],
    ids=lambda value: repr(value)[:60] if isinstance(value, dict) else '',
)  # fmt: skip
def test_bad_options_are_refused_naming_the_value(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Every option is checked: the error is the §11 class of that argument (TypeError for a
    wrong type), and the message names the value."""
    with pytest.raises(error, match=message):
        WindowLossScaler(**options)


def test_update_refuses_a_non_bool_and_changes_nothing() -> None:
    """update() takes the finished result's found_inf, a bool: a tensor or a number is refused
    with TypeError naming it, and the scaler is unchanged."""
    scaler = WindowLossScaler(growth_interval=1)
    before = scaler.state_dict()
    for bad in (torch.tensor(True), 1, None, "yes"):
        with pytest.raises(TypeError, match="found_inf"):
            scaler.update(bad)  # type: ignore[arg-type]
        assert scaler.state_dict() == before


@given(overflows=decisions, cut=st.integers(0, 120), hysteresis=st.integers(1, 3))
def test_a_restored_state_continues_the_same_sequence(
    overflows: list[bool], cut: int, hysteresis: int
) -> None:
    """A scaler restored from another's state_dict() (saved and loaded as a file with
    torch.save / torch.load(weights_only=True)) at any point continues the same decisions and
    scales, bit for bit."""
    import io

    options = {"growth_interval": 3, "hysteresis": hysteresis, "dtype": torch.float16}
    original = WindowLossScaler(2.0**12, **options)
    cut = min(cut, len(overflows))
    for overflow in overflows[:cut]:
        original.update(overflow)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = WindowLossScaler(2.0**12, **options)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.state_dict() == original.state_dict()
    for overflow in overflows[cut:]:
        assert restored.update(overflow) == original.update(overflow)
        assert restored.scale == original.scale


def test_state_dict_has_exactly_the_documented_keys() -> None:
    """state_dict() holds exactly SCALER_KEYS, in plain Python types."""
    state = WindowLossScaler(min_scale=1.0).state_dict()
    assert tuple(state) == SCALER_KEYS
    assert {type(v) for v in state.values()} <= {int, float, str, type(None)}


def _with(**changes: Any) -> dict[str, Any]:
    state = WindowLossScaler(growth_interval=4, hysteresis=2).state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({k: v for k, v in _with().items() if k != "scale"}, "scale"),
        (_with(extra=1), "extra"),
        (_with(format_version=2), "format_version"),
        (_with(dtype="bfloat16"), "dtype"),
        (_with(growth_interval=5), "growth_interval"),
        (_with(growth_interval=4.0), "growth_interval"),
        (_with(hysteresis=1), "hysteresis"),
        (_with(growth_factor=3.0), "growth_factor"),
        (_with(backoff_factor=0.25), "backoff_factor"),
        (_with(min_scale=1.0), "min_scale"),
        (_with(max_scale=2.0**15), "max_scale"),
        (_with(scale=3.0000001), "scale"),
        (_with(scale=0.0), "scale"),
        (_with(scale=65536), "scale"),  # an int, not the float state_dict writes
        (_with(scale=math.inf), "scale"),
        (_with(growth_tracker=4), "growth_tracker"),
        (_with(growth_tracker=-1), "growth_tracker"),
        (_with(growth_tracker=True), "growth_tracker"),
        (_with(hysteresis_left=3), "hysteresis_left"),
        (_with(hysteresis_left=1.0), "hysteresis_left"),
    ],
)
def test_a_bad_state_is_refused_naming_the_field_and_changes_nothing(
    state: dict[str, Any], field: str
) -> None:
    """load_state_dict checks every field first: a missing, unknown, mistyped, out-of-range or
    differing one raises RecordError naming it, and the scaler keeps its own state."""
    scaler = WindowLossScaler(growth_interval=4, hysteresis=2)
    scaler.update(True)
    before = scaler.state_dict()
    with pytest.raises(RecordError, match=field):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_a_non_mapping_state_is_refused() -> None:
    """A state that is not a mapping raises RecordError naming its type."""
    with pytest.raises(RecordError, match="list"):
        WindowLossScaler().load_state_dict([])  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", WORK_DTYPES, ids=dtype_name)
def test_formats_table_matches_the_reference(dtype: torch.dtype) -> None:
    """The scaler's own (precision, emin, emax) table agrees with wacc_ref's formats."""
    from wacc_torch.scaler import _FORMATS

    fmt = formats.get_format(dtype_name(dtype))
    assert _FORMATS[dtype] == (fmt.precision, fmt.emin, fmt.emax)


@given(
    overflows=decisions,
    dtype=st.sampled_from(WORK_DTYPES),
    growth=st.sampled_from([2.0, 1.5, 3.0, 1.0001, 65536.0]),
    backoff=st.sampled_from([0.5, 0.3, 1 / 3, 0.999, 2.0**-20, 0.7]),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    bounds=st.sampled_from([(None, None), (1.0, 2.0**10), (2.0**-3, None), (None, 2.0**14)]),
)
def test_the_reference_scaler_takes_the_same_decisions_and_scales(
    overflows: list[bool],
    dtype: torch.dtype,
    growth: float,
    backoff: float,
    interval: int,
    hysteresis: int,
    bounds: tuple[float | None, float | None],
) -> None:
    """wacc_ref's ReferenceLossScaler (exact arithmetic, no torch) and WindowLossScaler agree on
    every decision and every scale, bit for bit, for any options and overflow sequence,
    including factors that round and scales that reach the ends of D."""
    from wacc_ref.scaler import ReferenceLossScaler

    options: dict[str, Any] = {
        "growth_factor": growth,
        "backoff_factor": backoff,
        "growth_interval": interval,
        "hysteresis": hysteresis,
        "min_scale": bounds[0],
        "max_scale": bounds[1],
    }
    ours = WindowLossScaler(2.0**8, dtype=dtype, **options)
    reference = ReferenceLossScaler(2.0**8, dtype=dtype_name(dtype), **options)
    for overflow in overflows:
        assert ours.update(overflow) == reference.update(overflow)
        assert ours.scale.hex() == reference.scale.hex()
        state = ours.state_dict()
        assert (state["growth_tracker"], state["hysteresis_left"]) == (
            reference.growth_tracker,
            reference.hysteresis_left,
        )


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_the_reference_scaler_rounds_like_grad_scaler_in_every_work_dtype(
    dtype: torch.dtype,
) -> None:
    """300 seeded random sequences with factors that round (1.0001, 0.7, random ones): wacc_ref's
    ReferenceLossScaler, which models round_D(round_64(scale x factor)) with wacc_ref.formats,
    gives every scale of WindowLossScaler bit for bit, in each work dtype."""
    from wacc_ref.scaler import ReferenceLossScaler

    rng = random.Random(320 + WORK_DTYPES.index(dtype))
    for sequence in range(300):
        growth = [1.0001, rng.uniform(1.0, 4.0)][sequence % 2]
        backoff = [0.7, rng.uniform(0.05, 1.0)][(sequence // 2) % 2]
        interval = rng.randint(1, 3)
        scale = rng.choice([2.0**10, 1.0, 3.0, 0.75])
        ours = WindowLossScaler(scale, growth, backoff, interval, dtype=dtype)
        reference = ReferenceLossScaler(scale, growth, backoff, interval, dtype=dtype_name(dtype))
        for _ in range(rng.randint(1, 120)):
            overflow = rng.random() < 0.4
            assert ours.update(overflow) == reference.update(overflow)
            assert ours.scale.hex() == reference.scale.hex(), (sequence, growth, backoff)


@pytest.mark.parametrize(
    "options",
    [
        {"init_scale": 0.0},
        {"init_scale": 2049.0, "dtype": "float16"},
        {"growth_factor": 1.0},
        {"growth_factor": True},
        {"backoff_factor": 1.0},
        {"growth_interval": 0},
        {"growth_interval": 2.0},
        {"hysteresis": 0},
        {"min_scale": 4.0, "max_scale": 2.0},
        {"init_scale": 2.0**20, "max_scale": 2.0**10},
        {"init_scale": 10**400},
        {"init_scale": 2**1024},
        {"growth_factor": 10**400},
        {"growth_factor": 2**1024},
        {"backoff_factor": 10**400},
        {"backoff_factor": -(2**1024)},
        {"min_scale": 2**1024},
        {"max_scale": 10**400},
        {"growth_factor": np.uint64(2**64 - 1)},
        {"init_scale": np.int64(2**53 + 1)},
        {"growth_interval": np.int64(3)},
        {"hysteresis": np.int32(2)},
    ],
    ids=lambda options: repr(options)[:60],
)
def test_both_scalers_refuse_the_same_options_with_the_same_class(options: dict[str, Any]) -> None:
    """The two packages accept the same options and refuse a bad one with the same class name,
    a §11 error or TypeError (semantics §4's one rule for numbers applies to both; an int beyond
    float64's range included)."""
    from wacc_ref.scaler import ReferenceLossScaler

    torch_options = dict(options)
    if "dtype" in torch_options:
        torch_options["dtype"] = getattr(torch, torch_options["dtype"])
    with pytest.raises(Exception) as ours:
        WindowLossScaler(**torch_options)
    with pytest.raises(Exception) as reference:
        ReferenceLossScaler(**options)
    # A §11 error (or TypeError for a wrong type), never a raw OverflowError from both.
    assert isinstance(ours.value, WeightedAccumulationError | TypeError)
    assert type(ours.value).__name__ == type(reference.value).__name__


_HUGE_OR_EXOTIC = [10**400, 2**1024, 2**53 + 1, 3, 2**62]


@pytest.mark.parametrize(
    "option",
    [
        "init_scale",
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
        "growth_interval",
        "hysteresis",
    ],
)
@pytest.mark.parametrize("value", _HUGE_OR_EXOTIC, ids=["10^400", "2^1024", "2^53+1", "3", "2^62"])
@pytest.mark.parametrize("kind", ["int", "numpy", "tensor"])
def test_every_numeric_option_is_read_by_one_rule_in_both_packages(
    option: str, value: int, kind: str
) -> None:
    """Every numeric option of both scalers, given a huge int, a numpy int or a 0-d tensor (the
    reference's counterpart: a 0-d numpy array), is accepted by both or refused by both with the
    same class, never with a raw OverflowError; an accepted one gives the same state."""
    from wacc_ref.scaler import ReferenceLossScaler

    if kind != "int" and value >= 2**63:
        pytest.skip("no 64-bit integer holds it")
    ours_value: Any = value
    reference_value: Any = value
    if kind == "numpy":
        ours_value = reference_value = np.int64(value)
    elif kind == "tensor":
        ours_value, reference_value = torch.tensor(value), np.array(value, dtype=np.int64)
    # init_scale 2.0 so that a large bound is consistent with it.
    base: dict[str, Any] = {"init_scale": 2.0} if option != "init_scale" else {}
    outcomes = []
    try:
        ours = WindowLossScaler(**base, **{option: ours_value})
        outcomes.append(repr([ours.update(False) for _ in range(3)] + [ours.state_dict()["scale"]]))
    except Exception as error:  # the class is what is compared
        outcomes.append(type(error).__name__)
    try:
        reference = ReferenceLossScaler(**base, **{option: reference_value})
        outcomes.append(repr([reference.update(False) for _ in range(3)] + [reference.scale]))
    except Exception as error:
        outcomes.append(type(error).__name__)
    assert "OverflowError" not in outcomes
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    ("value", "named"), [(Fraction(0), r"\b0$"), (Fraction(-1, 3), r"-1/3$")], ids=["zero", "neg"]
)
@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_round_to_dtype_refuses_a_value_that_is_not_positive(
    value: Fraction, named: str, dtype: torch.dtype
) -> None:
    """round_to_dtype is round_D of a POSITIVE rational (its docstring): 0 and a negative value
    raise ValueError naming the value, never a rounded 0.0."""
    with pytest.raises(ValueError, match=named):
        round_to_dtype(value, dtype)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"growth_factor": 1.0}, r"^growth_factor\b.*(?<![\w.])> 1\b.*\b1\.0\b"),
        ({"growth_factor": 0.5}, r"^growth_factor\b.*(?<![\w.])> 1\b.*\b0\.5\b"),
        ({"backoff_factor": 1.0}, r"^backoff_factor\b.*(?<!\w)strictly between 0 and 1\b.*1\.0"),
        ({"backoff_factor": 0.0}, r"^backoff_factor\b.*(?<!\w)strictly between 0 and 1\b.*0\.0"),
        ({"backoff_factor": math.inf}, r"^backoff_factor\b.*(?<!\w)strictly between 0 and 1\b"),
        ({"growth_factor": "2"}, r"^growth_factor\b.*'2'"),
        ({"growth_factor": 2**53 + 1}, r"^growth_factor\b.*\b9007199254740993\b.*float64"),
        ({"growth_interval": 0}, r"^growth_interval\b.*\b0\b"),
        ({"hysteresis": 0}, r"^hysteresis\b.*\b0\b"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else "",
)
def test_a_refused_option_is_named_with_its_range_and_value_as_the_reference_does(
    options: dict[str, Any], message: str
) -> None:
    """The message of a refused factor or count starts with the option's name, says the range
    it must lie in ("> 1" for growth, "strictly between 0 and 1" for backoff) and names the
    value; the reference scaler's message says the same (the regex is checked on both)."""
    from wacc_ref.scaler import ReferenceLossScaler

    with pytest.raises(Exception) as reference:
        ReferenceLossScaler(**options)
    assert re.search(message, str(reference.value)), str(reference.value)
    with pytest.raises((WeightedAccumulationError, TypeError), match=message):
        WindowLossScaler(**options)


@pytest.mark.parametrize(
    ("init_scale", "dtype"),
    [(2049.0, torch.float16), (0.0, torch.float32), (2.0**-30, torch.float16), (2**53 + 1, None)],
    ids=str,
)
def test_a_refused_init_scale_has_the_accumulators_loss_scale_message(
    init_scale: float, dtype: torch.dtype | None
) -> None:
    """A refused init_scale (other than GradScaler's default 2**16 in float16) raises the same
    InvalidLossScaleError message the accumulator gives for that loss scale in the same work
    dtype, prefixed by the argument's name, and nothing else (no hint)."""
    work = torch.float32 if dtype is None else dtype
    with pytest.raises(InvalidLossScaleError) as accumulator:
        WeightedGradientsAccumulator(dtype=work, loss_scale=init_scale)
    with pytest.raises(InvalidLossScaleError) as ours:
        WindowLossScaler(init_scale, dtype=work)
    assert str(ours.value) == f"init_scale: {accumulator.value}"


def test_grad_scalers_default_in_float16_is_refused_with_the_hint_to_start_lower() -> None:
    """WindowLossScaler(dtype=float16) with GradScaler's default 2**16 (beyond float16, §13):
    the message names the value and ends by naming GradScaler's default and 2.0**15 to start
    at."""
    with pytest.raises(InvalidLossScaleError) as error:
        WindowLossScaler(dtype=torch.float16)
    text = str(error.value)
    assert text.startswith("init_scale: ") and "65536" in text
    assert re.search(r"\(GradScaler's default 2\*\*16\b.*\b2\.0\*\*15\)$", text), text


def test_the_defaults_are_grad_scalers() -> None:
    """§13: the defaults are torch.amp.GradScaler's (read from GradScaler itself): the scale,
    both factors, and the growth interval, which shows in use: 1999 clean windows keep the
    scale and the 2000th grows it."""
    grad_scaler = torch.amp.GradScaler("cpu")
    scaler = WindowLossScaler()
    state = scaler.state_dict()
    assert (state["scale"], state["growth_factor"], state["backoff_factor"]) == (
        grad_scaler.get_scale(),
        grad_scaler.get_growth_factor(),
        grad_scaler.get_backoff_factor(),
    )
    interval = grad_scaler.get_growth_interval()
    assert state["growth_interval"] == interval
    for _ in range(interval - 1):
        scaler.update(False)
    assert scaler.scale == grad_scaler.get_scale()
    scaler.update(False)
    assert scaler.scale == grad_scaler.get_scale() * grad_scaler.get_growth_factor()


@pytest.mark.parametrize(
    ("init_scale", "bounds"),
    [(4.0, (4.0, 4.0)), (4.0, (4.0, None)), (4.0, (None, 4.0)), (4.0, (2.0, 4.0))],
    ids=str,
)
def test_a_scale_on_its_bounds_is_accepted_runs_and_resumes(
    init_scale: float, bounds: tuple[float | None, float | None]
) -> None:
    """The bounds are inclusive: min_scale == max_scale, and an init_scale (or a saved scale)
    equal to a bound, are accepted; the scaler then takes the reference scaler's decisions and
    scales, and each state along the way loads into a fresh scaler."""
    from wacc_ref.scaler import ReferenceLossScaler

    options: dict[str, Any] = {
        "growth_interval": 1,
        "min_scale": bounds[0],
        "max_scale": bounds[1],
    }
    ours = WindowLossScaler(init_scale, **options)
    reference = ReferenceLossScaler(init_scale, **options)
    for overflow in [False, True, True, False, False, False, True]:
        assert ours.update(overflow) == reference.update(overflow)
        assert ours.scale == reference.scale
        fresh = WindowLossScaler(init_scale, **options)
        fresh.load_state_dict(ours.state_dict())
        assert fresh.state_dict() == ours.state_dict()


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_a_backoff_that_underflows_to_zero_takes_min_scale(dtype: torch.dtype) -> None:
    """From twice D's smallest subnormal, a backoff of 1/8 rounds to 0: with min_scale (the
    smallest subnormal) set, the next scale is min_scale (§13), as the reference scaler's."""
    from wacc_ref.scaler import ReferenceLossScaler

    bottom = float(Fraction(format_of(dtype).min_subnormal))
    options: dict[str, Any] = {"backoff_factor": 0.125, "min_scale": bottom}
    ours = WindowLossScaler(2 * bottom, dtype=dtype, **options)
    reference = ReferenceLossScaler(2 * bottom, dtype=dtype_name(dtype), **options)
    assert not ours.update(True) and not reference.update(True)
    assert ours.scale == reference.scale == bottom


@pytest.mark.parametrize("scale", [0.5, 2.0**11], ids=str)
def test_a_state_scale_outside_the_bounds_is_refused_naming_it(scale: float) -> None:
    """load_state_dict refuses a saved scale below min_scale or above max_scale (one bound
    broken is enough) with RecordError naming the field and the value, and changes nothing."""
    scaler = WindowLossScaler(4.0, min_scale=1.0, max_scale=2.0**10)
    before = scaler.state_dict()
    state = dict(before, scale=scale)
    with pytest.raises(RecordError, match=rf"'scale'.*{re.escape(repr(scale))}"):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_repr_names_the_class_the_options_and_the_state() -> None:
    """repr() names the class and every option and state value."""
    scaler = WindowLossScaler(8.0, 3.0, 0.25, 5, hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    scaler.update(True)
    text = repr(scaler)
    assert text.startswith("WindowLossScaler(scale=8.0, ")
    for part in (
        "growth_factor=3.0",
        "backoff_factor=0.25",
        "growth_interval=5",
        "hysteresis=2",
        "min_scale=1.0",
        "max_scale=1048576.0",
        "dtype=torch.float32",
        "growth_tracker=0",
        "hysteresis_left=1",
    ):
        assert part in text, (part, text)
