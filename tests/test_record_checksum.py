"""Record checksums: the same state gives the same checksum in wacc_torch and wacc_ref, a
change that leaves every field valid is caught by it, and every damaged field is still named.

The checksum is verified last (after every field check), so each corruption kind of
``wacc_ref.corruption`` still raises RecordError naming its own field in both packages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import wacc_torch
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.corruption import applicable_corruptions, corrupt_record, corruption_field
from wacc_ref.errors import RecordError as ReferenceRecordError
from wacc_torch.records import CHECKSUM_KEY

WORK_DTYPES = ("float64", "float32", "float16", "bfloat16")
NUMPY_OF = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
PARAMS = {"b": (1,), "a.weight": (2, 3), "a.bias": (3,)}  # module order: own first


def _module() -> nn.Module:
    module = nn.Module()
    module.a = nn.Module()
    module.a.weight = nn.Parameter(torch.zeros(2, 3))
    module.a.bias = nn.Parameter(torch.zeros(3))
    module.b = nn.Parameter(torch.zeros(1))
    assert [n for n, _ in module.named_parameters()] == list(PARAMS)
    return module


def _gradients(work_dtype: str, seed: int) -> list[dict[str, np.ndarray | None]]:
    """Three microbatches of D values (so both packages see exactly the same numbers), with a
    NaN, +-inf, -0.0 and a subnormal among them; "b" never gets a gradient."""
    rng = np.random.default_rng(seed)
    d = NUMPY_OF[work_dtype]
    batches: list[dict[str, np.ndarray | None]] = []
    for index in range(3):
        weight = rng.normal(size=(2, 3)).astype(d).astype(np.float64)
        bias = rng.normal(size=3).astype(d).astype(np.float64)
        if index == 1:
            weight[0, 0] = math.nan
            weight[1, 2] = -0.0
            bias[0] = math.inf
            bias[1] = float(ml_dtypes.finfo(d).smallest_subnormal)
        batches.append({"a.weight": weight, "a.bias": bias if index else None, "b": None})
    return batches


def _both(work_dtype: str, steps: int, seed: int) -> tuple[dict[str, Any], dict[str, object]]:
    module = _module()
    production = wacc_torch.WeightedGradientsAccumulator(
        dtype=getattr(torch, work_dtype), loss_scale=4.0
    )
    reference = ReferenceAccumulator(dtype=work_dtype, loss_scale=4.0)
    weights = (3, 0, 7.5)
    for batch, weight in list(zip(_gradients(work_dtype, seed), weights, strict=True))[:steps]:
        production.accumulate_mean(
            module,
            weight,
            grads={
                n: None if g is None else torch.tensor(g).to(getattr(torch, work_dtype))
                for n, g in batch.items()
            },
        )
        reference.accumulate_mean(PARAMS, weight, grads=batch)
    return production.state_dict(), reference.state_dict()


@pytest.mark.parametrize("steps", [0, 1, 2, 3], ids=lambda n: f"{n}-steps")
@pytest.mark.parametrize("work_dtype", WORK_DTYPES)
def test_both_packages_give_the_same_checksum(work_dtype: str, steps: int) -> None:
    """The same window (unbound, zero-weight only, NaN/inf/-0/subnormal buffers) gives the
    same checksum string in wacc_torch and wacc_ref."""
    production, reference = _both(work_dtype, steps, seed=steps)
    assert production[CHECKSUM_KEY] == reference[CHECKSUM_KEY]


def test_different_states_give_different_checksums() -> None:
    """The checksum depends on the state: each of the windows above has its own."""
    checksums = {
        _both(work_dtype, steps, seed=steps)[0][CHECKSUM_KEY]
        for work_dtype in WORK_DTYPES
        for steps in range(4)
    }
    assert len(checksums) == len(WORK_DTYPES) * 4


def _flip_mantissa(record: dict[str, Any]) -> None:
    buffer = record["pending"]["a.weight"]
    if isinstance(buffer, torch.Tensor):
        changed = buffer.clone()
        changed.view(torch.int32).view(-1)[1] ^= 1
    else:
        changed = buffer.copy()
        changed.reshape(-1)[1] = np.nextafter(np.float32(changed.reshape(-1)[1]), np.float32(9))
    record["pending"] = {**record["pending"], "a.weight": changed}


# Changes that leave every field valid and consistent: only the checksum can tell.
SILENT_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "one more zero-weight batch": lambda r: r.update(
        issued=r["issued"] + 1, zero_weight=r["zero_weight"] + 1
    ),
    "another total weight": lambda r: r.update(total_weight=r["total_weight"] * 2),
    "a mantissa bit of a buffer": _flip_mantissa,
    "a buffer dropped": lambda r: r.update(
        pending={n: b for n, b in r["pending"].items() if n != "a.bias"}
    ),
}


@pytest.mark.parametrize("change", list(SILENT_CHANGES))
def test_a_consistent_change_is_caught_by_the_checksum(change: str) -> None:
    """A change every field check accepts raises RecordError naming the checksum, in both."""
    production, reference = _both("float32", 3, seed=1)
    for record, load, error in (
        (
            production,
            lambda r: wacc_torch.WeightedGradientsAccumulator(
                dtype=torch.float32, loss_scale=4.0
            ).load_state_dict(r, _module()),
            wacc_torch.RecordError,
        ),
        (
            reference,
            lambda r: ReferenceAccumulator(dtype="float32", loss_scale=4.0).load_state_dict(
                r, PARAMS
            ),
            ReferenceRecordError,
        ),
    ):
        changed = dict(record)
        SILENT_CHANGES[change](changed)
        unsealed = {k: v for k, v in changed.items() if k != CHECKSUM_KEY}
        load(unsealed)  # every field is valid: without a checksum the change would load
        with pytest.raises(error, match="checksum"):
            load(changed)


@pytest.mark.parametrize("package", ["wacc_torch", "wacc_ref"])
def test_every_corruption_kind_still_names_its_field(package: str) -> None:
    """The checksum is checked last: each scenario corruption kind raises naming its field."""
    production, reference = _both("float32", 3, seed=2)
    record = production if package == "wacc_torch" else reference
    kinds = applicable_corruptions(record)
    assert len(kinds) >= 20
    for kind in kinds:
        corrupted = corrupt_record(record, kind)
        field = corruption_field(record, kind)
        if package == "wacc_torch":
            target = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=4.0)
            with pytest.raises(wacc_torch.RecordError) as caught:
                target.load_state_dict(corrupted, _module())
        else:
            reference_target = ReferenceAccumulator(dtype="float32", loss_scale=4.0)
            with pytest.raises(ReferenceRecordError) as caught:
                reference_target.load_state_dict(corrupted, PARAMS)
        # Only the two checksum kinds may name the checksum: every other is caught before it.
        assert field in str(caught.value), kind
        assert ("checksum" in str(caught.value)) == (field == "checksum"), kind


@pytest.mark.parametrize("package", ["wacc_torch", "wacc_ref"])
@pytest.mark.parametrize("bad", [None, 17, "sha256:xyz", "md5:" + "0" * 64])
def test_a_malformed_checksum_field_is_named(package: str, bad: object) -> None:
    """A checksum that is not "sha256:" + 64 hex digits raises RecordError naming it."""
    production, reference = _both("bfloat16", 2, seed=3)
    if package == "wacc_torch":
        target = wacc_torch.WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=4.0)
        with pytest.raises(wacc_torch.RecordError, match="'checksum'"):
            target.load_state_dict({**production, CHECKSUM_KEY: bad}, _module())
    else:
        reference_target = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
        with pytest.raises(ReferenceRecordError, match="checksum"):
            reference_target.load_state_dict({**reference, CHECKSUM_KEY: bad}, PARAMS)


def test_records_without_a_checksum_still_load() -> None:
    """A record written before checksums (no "checksum" key) loads, field-checked, in both."""
    production, reference = _both("float16", 3, seed=4)
    old_production = {k: v for k, v in production.items() if k != CHECKSUM_KEY}
    old_reference = {k: v for k, v in reference.items() if k != CHECKSUM_KEY}
    restored = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=4.0)
    restored.load_state_dict(old_production, _module())
    assert restored.state_dict()[CHECKSUM_KEY] == production[CHECKSUM_KEY]
    reference_restored = ReferenceAccumulator(dtype="float16", loss_scale=4.0)
    reference_restored.load_state_dict(old_reference, PARAMS)
    assert reference_restored.state_dict()[CHECKSUM_KEY] == reference[CHECKSUM_KEY]
