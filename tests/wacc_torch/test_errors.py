"""§11: every bad input raises its specific error, names the culprit, and changes nothing."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import wacc_torch
from tests.wacc_torch.support import (
    TwoLayer,
    assert_unchanged,
    flushing_subnormals,
    grads_snapshot,
    tracked_shapes,
)
from wacc_torch import (
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    RecordError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    WeightedGradientsAccumulator,
    ZeroCopyError,
    ZeroTotalWeightError,
)


def test_error_hierarchy() -> None:
    """Every §11 error is exported and derives from WeightedAccumulationError(ValueError)."""
    assert issubclass(WeightedAccumulationError, ValueError)
    for error in (
        InvalidLossScaleError,
        InvalidWeightError,
        ParameterMismatchError,
        ZeroTotalWeightError,
        RecordError,
    ):
        assert issubclass(error, WeightedAccumulationError)
        assert getattr(wacc_torch, error.__name__) is error


def test_wacc_torch_does_not_import_the_reference() -> None:
    """Importing wacc_torch alone pulls in no wacc_ref module (production never needs the judge)."""
    code = "import sys, wacc_torch; sys.exit(any(m.startswith('wacc_ref') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _busy_accumulator(module: nn.Module) -> WeightedGradientsAccumulator:
    """An accumulator mid-window with one buffer and the module's .grad set to marker values."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=4.0)
    accumulator.accumulate_sum(module, 3, grads={"first.weight": torch.full((3, 4), 1.5)})
    accumulator.accumulate_mean(module, 0)
    for parameter in module.parameters():
        parameter.grad = torch.full_like(parameter, 2.5)
    return accumulator


BAD_WEIGHTS = [
    True,
    False,
    float("nan"),
    float("inf"),
    -float("inf"),
    -1,
    -(2.0**-1074),
    10**400,
    1 + 0j,
    "3",
    None,
    torch.tensor([1.0]),
    torch.ones(2, 2),
    torch.tensor(float("nan")),
    torch.tensor(-2.0),
    torch.tensor(True),
    torch.tensor(1 + 0j),
]


def _weight_id(weight: object) -> str:
    # One line, no spaces: pytest escapes a line break in an id, and mutmut cannot pass such an
    # id back to pytest (tests/mutation/test_mutant.py).
    return "".join(repr(weight).split())


@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
@pytest.mark.parametrize("weight", BAD_WEIGHTS, ids=_weight_id)
def test_bad_weight_raises_invalid_weight_and_changes_nothing(method: str, weight: object) -> None:
    """bool, NaN, inf, negative, huge, complex, non-real, non-0-d weights: InvalidWeightError."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    with pytest.raises(InvalidWeightError) as caught:
        getattr(accumulator, method)(module, weight)
    assert repr(weight) in str(caught.value), str(caught.value)
    assert_unchanged(accumulator, record, module, grads)


def test_total_weight_overflow_is_refused() -> None:
    """A weight that would make W infinite raises InvalidWeightError and changes nothing."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    big = sys.float_info.max
    accumulator.accumulate_sum(module, big, grads={})
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    with pytest.raises(InvalidWeightError, match=re.escape(repr(big))):
        accumulator.accumulate_sum(module, big, grads={})
    assert_unchanged(accumulator, record, module, grads)


def _with_grads(**changes: Any) -> Callable[[nn.Module], dict[str, Any]]:
    def build(module: nn.Module) -> dict[str, Any]:
        grads: dict[str, Any] = {
            name: torch.ones(shape) for name, shape in tracked_shapes(module).items()
        }
        grads.update(changes)
        return grads

    return build


BAD_GRADS = [
    pytest.param(_with_grads(other=torch.ones(1)), "'other'", id="unknown-name"),
    pytest.param(_with_grads(frozen=torch.ones(5)), "'frozen'", id="untracked-name"),
    pytest.param(
        _with_grads(**{"second.bias": torch.ones(3)}), r"'second.bias'.*\[3\]", id="shape"
    ),
    pytest.param(
        _with_grads(**{"second.bias": torch.ones(2, dtype=torch.int64)}),
        "int64",
        id="integer-dtype",
    ),
    pytest.param(
        _with_grads(**{"second.bias": torch.ones(2, dtype=torch.complex64)}),
        "complex64",
        id="complex-dtype",
    ),
    pytest.param(_with_grads(**{"second.bias": torch.ones(2, device="meta")}), "meta", id="device"),
    pytest.param(_with_grads(**{"second.bias": torch.ones(2).to_sparse()}), "sparse", id="sparse"),
    pytest.param(
        _with_grads(**{"second.bias": [1.0, 1.0]}), "'second.bias'.*list", id="not-a-tensor"
    ),
]


@pytest.mark.parametrize("weight", [2, 0], ids=["positive", "zero"])
@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
@pytest.mark.parametrize(("build", "message"), BAD_GRADS)
def test_bad_gradient_raises_parameter_mismatch_and_changes_nothing(
    build: Callable[[nn.Module], dict[str, Any]], message: str, method: str, weight: int
) -> None:
    """A bad name, shape, dtype kind, device or type in grads raises ParameterMismatchError."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    with pytest.raises(ParameterMismatchError, match=message):
        getattr(accumulator, method)(module, weight, grads=build(module))
    assert_unchanged(accumulator, record, module, grads)


def _drop_layer(module: TwoLayer) -> nn.Module:
    del module.second
    return module


def _add_layer(module: TwoLayer) -> nn.Module:
    module.third = nn.Linear(2, 2)
    return module


def _reshape_layer(module: TwoLayer) -> nn.Module:
    module.second = nn.Linear(3, 4)
    return module


def _move_to_meta(module: TwoLayer) -> nn.Module:
    module.second.bias = nn.Parameter(torch.ones(2, device="meta"))
    return module


def _freeze_layer(module: TwoLayer) -> nn.Module:
    module.second.bias.requires_grad_(False)
    return module


BAD_MODULES = [
    pytest.param(
        _drop_layer,
        r"missing from the module: \['second.weight', 'second.bias'\]",
        id="missing-parameter",
    ),
    pytest.param(
        _add_layer,
        r"trainable but not tracked: \['third.weight', 'third.bias'\]",
        id="extra-parameter",
    ),
    pytest.param(_reshape_layer, r"'second.weight'.*\[4, 3\].*\[2, 3\]", id="shape"),
    pytest.param(
        _move_to_meta,
        "gradient of 'second.bias' is on meta, the tracked device is cpu",
        id="device",
    ),
    pytest.param(
        _freeze_layer,
        r"frozen \(requires_grad=False\) since it was bound: \['second.bias'\]",
        id="no-longer-requires-grad",
    ),
]


@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
@pytest.mark.parametrize(("change", "message"), BAD_MODULES)
def test_module_that_left_the_tracked_set_raises_and_changes_nothing(
    change: Callable[[TwoLayer], nn.Module], message: str, method: str
) -> None:
    """After binding, a module with missing/extra parameters, or whose gradients (from .grad)
    have other shapes or devices than the tracked ones, is refused, nothing changed."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    changed = change(module)
    for parameter in changed.parameters():
        parameter.grad = torch.full_like(parameter, 2.5)
    on_meta = {n: p.grad for n, p in changed.named_parameters() if p.device.type == "meta"}
    for parameter in changed.parameters():
        if parameter.device.type == "meta":
            parameter.grad = None  # a meta tensor has no bits to compare: identity below
    record, grads = accumulator.state_dict(), grads_snapshot(changed)
    for name, parameter in changed.named_parameters():
        if name in on_meta:
            parameter.grad = on_meta[name]
    with pytest.raises(ParameterMismatchError, match=message):
        getattr(accumulator, method)(changed, 1)
    for name, parameter in changed.named_parameters():
        if name in on_meta:
            assert parameter.grad is on_meta[name]
            parameter.grad = None
    assert_unchanged(accumulator, record, changed, grads)


def test_complex_parameter_cannot_be_bound() -> None:
    """A requires_grad parameter of complex dtype raises ParameterMismatchError at binding."""
    module = TwoLayer()
    module.phase = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    record = accumulator.state_dict()
    with pytest.raises(ParameterMismatchError, match="'phase'.*complex64"):
        accumulator.accumulate_sum(module, 1, grads={})
    assert_unchanged(accumulator, record)


@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
def test_module_without_trainable_parameters_is_refused(method: str) -> None:
    """A module with no requires_grad parameter raises ParameterMismatchError and binds nothing."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    record = accumulator.state_dict()
    for module in (nn.Module(), nn.Linear(2, 2).requires_grad_(False)):
        with pytest.raises(ParameterMismatchError, match="no requires_grad parameter"):
            getattr(accumulator, method)(module, 1)
    assert_unchanged(accumulator, record)


def test_weight_error_comes_before_parameter_error_before_mean_weight_error() -> None:
    """Validation order: the weight itself, then the module and gradients, then w_D in D."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    accumulator.accumulate_sum(TwoLayer(), 0)
    other = nn.Linear(1, 1)
    with pytest.raises(InvalidWeightError):
        accumulator.accumulate_mean(other, -1.0)
    # 70000 is a valid weight that fp16 cannot hold: the module mismatch is reported first.
    with pytest.raises(ParameterMismatchError):
        accumulator.accumulate_mean(other, 70000)
    with pytest.raises(InvalidWeightError, match="70000"):
        accumulator.accumulate_mean(TwoLayer(), 70000)


def test_non_module_and_non_mapping_arguments_raise_type_error() -> None:
    """A module that is not an nn.Module, or grads that are not a mapping, raise TypeError."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    with pytest.raises(TypeError, match="dict"):
        accumulator.accumulate_sum({"weight": torch.ones(1)}, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list"):
        accumulator.accumulate_sum(module, 1, grads=[torch.ones(1)])  # type: ignore[arg-type]
    assert_unchanged(accumulator, record, module, grads)


@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
def test_buffered_call_on_a_zero_copy_accumulator_names_the_call(method: str) -> None:
    """accumulate_sum / accumulate_mean on a zero-copy accumulator raise ZeroCopyError whose
    message begins with the call the user made (``accumulate_sum()``), and change nothing."""
    module = TwoLayer()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, zero_copy=True)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    with pytest.raises(ZeroCopyError, match=rf"^{method}\(\) on a zero-copy accumulator"):
        getattr(accumulator, method)(module, 1)
    assert_unchanged(accumulator, record, module, grads)


@pytest.mark.parametrize("method", ["accumulate_sum", "accumulate_mean"])
def test_flush_to_zero_is_refused_naming_the_call(method: str) -> None:
    """With flush-to-zero on (§2 needs gradual underflow), a positive-weight accumulate_sum /
    accumulate_mean raises UnsupportedEnvironmentError whose message begins with the call the
    user made, and changes nothing."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    record, grads = accumulator.state_dict(), grads_snapshot(module)
    shapes = tracked_shapes(module)
    with (
        flushing_subnormals(),
        pytest.raises(UnsupportedEnvironmentError, match=rf"^{method}: the CPU flushes"),
    ):
        getattr(accumulator, method)(
            module, 2, grads={name: torch.ones(shape) for name, shape in shapes.items()}
        )
    assert_unchanged(accumulator, record, module, grads)


# The six gradient dtypes of semantics §2 ("Reading (gradient dtypes)").
GRADIENT_DTYPE_NAMES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
]


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float8_e4m3fnuz], ids=str)
def test_a_gradient_of_another_dtype_is_refused_naming_it_and_the_six_accepted(
    dtype: torch.dtype,
) -> None:
    """A gradient whose dtype is not one of the six gradient dtypes raises
    ParameterMismatchError naming the parameter, its dtype and each dtype that is accepted."""
    module = TwoLayer()
    accumulator = _busy_accumulator(module)
    grads = _with_grads(**{"second.bias": torch.zeros(2, dtype=dtype)})(module)
    with pytest.raises(ParameterMismatchError) as raised:
        accumulator.accumulate_sum(module, 1, grads=grads)
    message = str(raised.value)
    assert re.search(rf"'second\.bias'.*{re.escape(str(dtype))}", message), message
    for name in GRADIENT_DTYPE_NAMES:
        assert re.search(rf"torch\.{name}\b", message), (name, message)


@pytest.mark.parametrize("weight", [5e-324, -5e-324, 2.0**-1030], ids=["min", "negative", "mid"])
def test_a_subnormal_weight_under_flush_to_zero_is_refused_not_dropped(weight: float) -> None:
    """Under flush-to-zero the CPU's comparisons read a subnormal as 0, so a weight of 5e-324
    was silently counted as a zero-weight batch (its gradient never read) and -5e-324 accepted:
    both raise UnsupportedEnvironmentError naming the weight from its bits, and nothing
    changes; without flush-to-zero the positive one is an ordinary weight."""
    module = nn.Linear(1, 1, bias=False)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=1.0)
    before = accumulator.state
    bits = weight.hex()  # read before the flush: hex() computes with the value
    with flushing_subnormals():
        with pytest.raises(
            UnsupportedEnvironmentError, match=rf"^weight {re.escape(bits)} is subnormal"
        ):
            accumulator.accumulate_sum(module, weight, grads={"weight": torch.ones(1, 1)})
    assert accumulator.state == before
    if weight > 0:
        accumulator.accumulate_sum(module, weight, grads={"weight": torch.ones(1, 1)})
        assert accumulator.state.issued == 1 and accumulator.state.zero_weight == 0


def test_a_subnormal_loss_scale_under_flush_to_zero_names_the_environment() -> None:
    """A float64-subnormal loss scale under flush-to-zero is an UnsupportedEnvironmentError (it
    read as 'not > 0, got 0.0' before), naming the scale from its bits; without the flush it is
    a valid float64 scale."""
    scale = 2.0**-1070
    shown = scale.hex()
    with flushing_subnormals():
        with pytest.raises(
            UnsupportedEnvironmentError, match=rf"^loss_scale {re.escape(shown)} is subnormal"
        ):
            WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=scale)
    assert (
        WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=scale).state.loss_scale
        == scale
    )


def test_is_subnormal_reads_the_bits() -> None:
    """is_subnormal is true exactly for the nonzero float64s below the smallest normal, of
    either sign, and never for ±0, normal, infinite or NaN values (the IEEE 754 definition)."""
    from wacc_torch._environment import is_subnormal

    tiny = 2.0**-1022
    for value in (5e-324, -5e-324, tiny - 5e-324, -(tiny - 5e-324), 2.0**-1030):
        assert is_subnormal(value), value.hex()
    for value in (0.0, -0.0, tiny, -tiny, 1.0, 1.5, -1.5, math.inf, -math.inf, math.nan):
        assert not is_subnormal(value), value
