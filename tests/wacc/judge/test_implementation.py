"""The implementation protocol (wacc.judge.implementation): loading factories and classifying
errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import wacc_torch
from wacc.errors import UsageError
from wacc.judge.implementation import DEFAULT_IMPL, error_class, load_implementation


def test_default_implementation_is_wacc_torch_with_every_feature() -> None:
    """The default factory builds a reproducible-order wacc_torch accumulator with records."""
    implementation = load_implementation(DEFAULT_IMPL)
    assert implementation.fused is False and implementation.missing == ()
    made = implementation.make(torch.float32, 1.0)
    assert isinstance(made, wacc_torch.WeightedGradientsAccumulator)


def test_missing_features_are_listed() -> None:
    """An accumulator without records reports both record features as missing."""
    implementation = load_implementation("tests.wacc.impls:counters_only")
    assert implementation.missing == ("records", "async_records")


def test_dynamic_scaling_features_are_listed(tmp_path: Path) -> None:
    """A factory without ``loss_scaler`` misses that feature; an accumulator without
    ``set_loss_scale`` misses that one too (semantics §13; the dynamic_scaling family needs
    both, and is skipped without them)."""
    assert load_implementation("tests.wacc.impls:no_loss_scaler").missing == ("loss_scaler",)
    source = tmp_path / "fixed_scale.py"
    source.write_text(
        "import wacc_torch\n"
        "class Fixed:\n"
        "    def __init__(self, dtype, loss_scale):\n"
        "        self._a = wacc_torch.WeightedGradientsAccumulator(\n"
        "            dtype=dtype, loss_scale=loss_scale)\n"
        "        for name in ('accumulate_sum', 'accumulate_mean', 'finish_sums', 'finish_mean',\n"
        "                     'state_dict', 'load_state_dict', 'state_dict_async'):\n"
        "            setattr(self, name, getattr(self._a, name))\n"
        "    @property\n"
        "    def state(self):\n"
        "        return self._a.state\n",
        encoding="utf-8",
    )
    missing = load_implementation(f"{source}:Fixed").missing
    assert missing == ("set_loss_scale", "loss_scaler")


def test_a_file_path_factory_loads(tmp_path: Path) -> None:
    """``path/to/file.py:attr`` imports the file and takes its factory."""
    source = tmp_path / "my_acc.py"
    source.write_text(
        "import wacc_torch\n"
        "def make(dtype, loss_scale):\n"
        "    return wacc_torch.WeightedGradientsAccumulator(\n"
        "        dtype=dtype, loss_scale=loss_scale, fused=True)\n",
        encoding="utf-8",
    )
    assert load_implementation(f"{source}:make").fused is True


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("no_colon", "must be 'module:attr'"),
        ("a:b:c", "must be 'module:attr'"),
        ("wacc_no_such_module:make", "cannot import module"),
        ("tests.wacc.impls:nothing_here", "has no attribute 'nothing_here'"),
        ("tests.wacc.impls:NOT_A_FACTORY", "is not callable"),
        ("tests.wacc.impls:factory_raises", "raised for (torch.float32, 1.0)"),
        ("/no/such/file.py:make", "does not exist"),
    ],
)
def test_bad_specs_raise_a_usage_error_naming_the_problem(spec: str, fragment: str) -> None:
    """Every way a spec can be wrong is one UsageError whose message says which."""
    with pytest.raises(UsageError) as info:
        load_implementation(spec)
    assert fragment in str(info.value)


def test_errors_count_by_class_or_by_name() -> None:
    """A subclass of an error of §11, or a foreign class with a §11 name, counts as that error."""

    class RecordError(Exception):  # an implementation that does not import wacc_torch
        pass

    class Mine(wacc_torch.InvalidWeightError):
        pass

    assert error_class(RecordError("x")) == "RecordError"
    assert error_class(Mine("x")) == "InvalidWeightError"
    assert error_class(wacc_torch.WeightedAccumulationError("x")) == "WeightedAccumulationError"
    assert error_class(RuntimeError("x")) is None
