"""Helpers shared by the tests of wacc_ref's scenario, corruption, trace and oracle modules."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from wacc_ref import formats
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.faults import Fault
from wacc_ref.scenario import Accumulate, Checkpoint, Finish, Restore, RestoreCorrupted, Scenario

TWO_PARAMS = (("weight", (2, 3)), ("bias", (3,)))


def make_scenario(steps: tuple[Any, ...], **overrides: Any) -> Scenario:
    options: dict[str, Any] = {
        "work_dtype": "float32",
        "grad_dtype": "float32",
        "loss_scale": 2.0,
        "fused": False,
        "parameters": (("w", (2,)),),
        "steps": steps,
    }
    options.update(overrides)
    return Scenario(**options)


def bits(value: float) -> str:
    """A float shown so that ±0 and NaN are visible in assertion messages."""
    return float(value).hex()


def assert_array_bits(actual: np.ndarray | None, expected: list[float], what: str) -> None:
    assert actual is not None, f"{what}: no array"
    got = [float(v) for v in np.asarray(actual).reshape(-1)]
    assert len(got) == len(expected), f"{what}: {got} vs {expected}"
    for position, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert formats.same_value_bits(g, e), (
            f"{what}[{position}]: got {bits(g)}, expected {bits(e)}"
        )


SPECIAL_VALUES = [
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    formats.get_format("float32").min_subnormal,
    -formats.get_format("float32").max_finite,
    1.0 + 2.0**-23,
]


def special_scenario() -> Scenario:
    return Scenario(
        work_dtype="bfloat16",
        grad_dtype="float32",
        loss_scale=2.0**-3,
        fused=True,
        parameters=(("a", (2, 2)), ("b", ()), ("c", (0,))),
        steps=(
            Accumulate.of("mean", 1001.0, {"a": SPECIAL_VALUES[:4], "b": [SPECIAL_VALUES[4]]}),
            Checkpoint(asynchronous=True),
            Accumulate.of("sum", -0.0, {"a": SPECIAL_VALUES[4:], "b": None, "c": []}),
            RestoreCorrupted("pending_wrong_shape"),
            Restore(),
            Finish("sums"),
            Accumulate.of("sum", math.nan, {}),
            Finish("mean"),
        ),
    )


def two_params() -> dict[str, tuple[int, ...]]:
    return dict(TWO_PARAMS)


def record_with_pending() -> dict[str, object]:
    """A bfloat16 record with a 'weight' buffer, no 'bias' buffer, a zero-weight batch."""
    source = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    source.accumulate_sum(two_params(), 5.0, grads={"weight": np.arange(6.0).reshape(2, 3)})
    source.accumulate_sum(two_params(), 0.0, grads={})
    return source.state_dict()


# Parameters every fault kind applies to (wacc_ref.faults.fault_problem), and their values.
FAULT_SHAPES = {"w": (2, 2), "c": (1, 2, 1, 2)}
FAULT_VALUES = {"w": (1.5, -2.0, 3.0, 0.25), "c": (0.5, 1.0, -1.0, 2.0)}


def fault_scenario(
    kind: str,
    weight: float,
    op: str,
    *,
    work: str = "float32",
    fused: bool = False,
    middle: bool = True,
) -> Scenario:
    """A window: a dense step, the step with a ``kind`` fault (left out when not ``middle``),
    a dense step, then its mean."""
    name = "c" if kind == "channels_last" else "w"
    target = "stray.weight" if kind == "unknown" else name
    faulty = Accumulate(op, weight, tuple(FAULT_VALUES.items()), fault=Fault(kind, target))  # type: ignore[arg-type]
    return Scenario(
        work_dtype=work,
        grad_dtype="bfloat16",
        loss_scale=1.0,
        fused=fused,
        parameters=tuple(FAULT_SHAPES.items()),
        steps=(
            Accumulate.of("sum", 3.0, FAULT_VALUES),
            *((faulty,) if middle else ()),
            Accumulate.of("mean", 2.0, FAULT_VALUES),
            Finish("mean"),
        ),
    )
