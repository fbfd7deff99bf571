"""Record checksums: the same state gives the same checksum in wacc_torch and wacc_ref, a
change that leaves every field valid is caught by it, and every damaged field is still named.

The checksum is verified last (after every field check), so each corruption kind of
``wacc_ref.corruption`` still raises RecordError naming its own field in both packages.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import wacc_ref.records
import wacc_torch
import wacc_torch.records
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.corruption import applicable_corruptions, corrupt_record, corruption_field
from wacc_ref.errors import RecordError as ReferenceRecordError
from wacc_ref.formats import get_format
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


# --------------------------------------------------------------------------------------------
# NaNs: every sign and payload is hashed as D's canonical quiet NaN, in both packages
# --------------------------------------------------------------------------------------------


def _width(work_dtype: str) -> int:
    return torch.finfo(getattr(torch, work_dtype)).bits


_SIGNED = {16: torch.int16, 32: torch.int32, 64: torch.int64}


def _nan_bits(work_dtype: str) -> tuple[int, list[int]]:
    """D's canonical quiet NaN (sign +, exponent all ones, top mantissa bit only) and NaNs of
    both signs with several payloads (quiet and signalling), from D's width and precision."""
    width = _width(work_dtype)
    mantissa = get_format(work_dtype).precision - 1
    exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    canonical = exponent | 1 << (mantissa - 1)
    payloads = (1 << (mantissa - 1), (1 << (mantissa - 1)) | 1, 1, 0b10, (1 << mantissa) - 1)
    return canonical, [
        sign | exponent | payload for sign in (0, 1 << (width - 1)) for payload in payloads
    ]


def _bits_of(buffer: torch.Tensor) -> list[int]:
    """The unsigned bit patterns of a D tensor's elements."""
    width = buffer.element_size() * 8
    return [int(b) % (1 << width) for b in buffer.view(_SIGNED[width]).view(-1)]


def _buffer(work_dtype: str, bits: list[int]) -> torch.Tensor:
    """A D tensor holding exactly ``bits`` (unsigned patterns of D's width)."""
    width = _width(work_dtype)
    signed = [b - (1 << width) if b >> (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=_SIGNED[width]).view(getattr(torch, work_dtype))


# The record of the NaN test: the counters and S (the buffer is the test's).
_FIELDS: dict[str, Any] = {
    "loss_scale": 4.0,
    "fused": False,
    "issued": 2,
    "zero_weight": 0,
    "total_weight": 3.0,
}


def _documented_checksum(work_dtype: str, bits: list[int]) -> str:
    """The checksum of the record of ``_FIELDS`` with one buffer "w" holding ``bits``, by the
    documented layout (wacc_torch.records' docstring): the compact JSON header, then the bits
    little-endian."""
    header = [
        1,  # format_version
        work_dtype,
        float(_FIELDS["loss_scale"]).hex(),
        _FIELDS["fused"],
        _FIELDS["issued"],
        _FIELDS["zero_weight"],
        float(_FIELDS["total_weight"]).hex(),
        ["w"],
        [[len(bits)]],
        ["w"],
    ]
    digest = hashlib.sha256(json.dumps(header, separators=(",", ":")).encode())
    digest.update(b"".join(b.to_bytes(_width(work_dtype) // 8, "little") for b in bits))
    return "sha256:" + digest.hexdigest()


@pytest.mark.parametrize("work_dtype", WORK_DTYPES)
def test_every_nan_is_hashed_as_the_canonical_nan_in_both_packages(work_dtype: str) -> None:
    """A buffer holding NaNs of both signs and several payloads (next to 1.0, -0.0 and -inf)
    has the checksum of the same buffer with every NaN replaced by D's canonical quiet NaN,
    written by the documented layout, in wacc_torch and in wacc_ref alike (semantics §9)."""
    canonical, nans = _nan_bits(work_dtype)
    ordinary = _bits_of(torch.tensor([1.0, -0.0, -math.inf], dtype=getattr(torch, work_dtype)))
    bits = [*nans, *ordinary]
    buffer = _buffer(work_dtype, bits)
    assert buffer[: len(nans)].isnan().all() and not buffer[len(nans) :].isnan().any()
    expected = _documented_checksum(work_dtype, [canonical] * len(nans) + ordinary)
    production = wacc_torch.records.record_checksum(
        dtype=getattr(torch, work_dtype),
        param_names=["w"],
        param_shapes=[[len(bits)]],
        pending={"w": buffer},
        **_FIELDS,
    )
    # The reference keeps D values in float64 arrays; the NaNs keep their signs there.
    in_d = buffer.view(_SIGNED[_width(work_dtype)]).numpy().view(NUMPY_OF[work_dtype])
    with np.errstate(invalid="ignore"):  # a signalling NaN is quieted, its sign kept
        values = in_d.astype(np.float64)
    signs = [b >> (_width(work_dtype) - 1) == 1 for b in bits]
    assert np.signbit(values).tolist() == signs, values
    reference = wacc_ref.records.record_checksum(
        dtype=get_format(work_dtype),
        binding=(("w", (len(bits),)),),
        pending={"w": values},
        **_FIELDS,
    )
    assert (production, reference) == (expected, expected), [hex(b) for b in bits]


@pytest.mark.parametrize("work_dtype", WORK_DTYPES)
def test_inf_minus_inf_gives_the_same_checksum_in_both_packages(work_dtype: str) -> None:
    """+inf then -inf summed into one element gives a NaN (on the CPU, with the sign bit set in
    most dtypes, in torch and in the reference alike) and the same record checksum in wacc_torch
    and wacc_ref."""
    module = nn.Module()
    module.w = nn.Parameter(torch.zeros(3))
    production = wacc_torch.WeightedGradientsAccumulator(
        dtype=getattr(torch, work_dtype), loss_scale=1.0
    )
    reference = ReferenceAccumulator(dtype=work_dtype, loss_scale=1.0)
    for gradient in ([math.inf, 1.0, -2.0], [-math.inf, 0.5, 2.0]):
        production.accumulate_sum(
            module, 1.0, grads={"w": torch.tensor(gradient, dtype=getattr(torch, work_dtype))}
        )
        reference.accumulate_sum({"w": (3,)}, 1.0, grads={"w": np.array(gradient)})
    record, reference_record = production.state_dict(), reference.state_dict()
    reference_pending = reference_record["pending"]
    assert isinstance(reference_pending, dict)
    buffer, reference_buffer = record["pending"]["w"], reference_pending["w"]
    assert buffer[0].isnan() and math.isnan(reference_buffer[0])
    assert record[CHECKSUM_KEY] == reference_record[CHECKSUM_KEY], (
        _bits_of(buffer),
        reference_buffer,
    )
