"""wacc/judge/integrity.py: record integrity is a declared feature, found by one probe for every
layout (semantics §9 Reading "integrity is a declared feature")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

import wacc_torch
from tests.wacc import impls
from wacc import baselines
from wacc.implementation import wacc_torch_reproducible
from wacc.judge.implementation import error_class, load_implementation
from wacc.judge.integrity import (
    OPAQUE_INTEGRITY_KINDS,
    PROBE_FLIPS,
    SCHEMA_INTEGRITY_KINDS,
    IntegrityProbe,
    flip_byte,
    load_bytes,
    probe_integrity,
    same_record,
    save_bytes,
)
from wacc_ref.corruption import CHECKSUM_KINDS


def _probe(factory: Any) -> IntegrityProbe:
    return probe_integrity(factory, refusal=lambda exc: error_class(exc) is not None)


@pytest.mark.parametrize(
    ("factory", "layout", "integrity"),
    [
        (wacc_torch_reproducible, "schema", True),
        (impls.schema_unchecked, "schema", False),
        (baselines.spec_accumulator, "schema", False),
        (impls.opaque_records, "opaque", True),
        (impls.opaque_unchecked, "opaque", False),
        (impls.opaque_credulous, "opaque", False),
    ],
    ids=["wacc_torch", "schema-no-checksum", "spec-accumulator", "opaque-sha256",
         "opaque-unchecked", "opaque-credulous"],
)  # fmt: skip
def test_the_probe_finds_integrity_in_either_layout(
    factory: Any, layout: str, integrity: bool
) -> None:
    """Records with a checksum (the §9 field, or an opaque record's own hash) refuse every
    flipped byte that loads; records without one accept at least one. Both layouts alike."""
    probe = _probe(factory)
    assert probe.layout == layout and not probe.problem
    assert probe.has_integrity is integrity, probe
    assert probe.refused + probe.accepted > 0  # some flipped file reached the implementation
    assert probe.refused + probe.accepted <= PROBE_FLIPS
    assert (probe.describe() == "") is integrity
    assert probe.kinds == (SCHEMA_INTEGRITY_KINDS if layout == "schema" else OPAQUE_INTEGRITY_KINDS)


def test_the_integrity_kinds_are_the_checksum_kinds_and_the_flipped_file() -> None:
    """For the documented layout, the kinds that need the checksum field; for any other layout,
    the flipped byte of the file (where it lands in a value, only a checksum can tell)."""
    assert set(SCHEMA_INTEGRITY_KINDS) == set(CHECKSUM_KINDS)
    assert OPAQUE_INTEGRITY_KINDS == ("flipped_byte_file",)


class _RaisesOnRecord(impls._Delegating):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("no records today")


class _LoadRaisesOther(impls._Delegating):
    """Refuses a changed record, but with an exception outside §11."""

    def load_state_dict(self, record: Mapping[str, Any], module: nn.Module) -> None:
        try:
            self._inner.load_state_dict(record, module)
        except wacc_torch.RecordError as exc:
            raise RuntimeError(str(exc)) from None


def test_a_probe_that_cannot_take_a_record_says_why() -> None:
    """An implementation whose state_dict raises has no integrity, and the reason is its error."""
    probe = _probe(_RaisesOnRecord)
    assert not probe.has_integrity and probe.layout == ""
    assert probe.problem == "RuntimeError: no records today"
    assert "no records today" in probe.describe()


def test_a_refusal_outside_the_semantics_errors_is_not_integrity() -> None:
    """Only a §11 error counts as refusing a changed record (the judge counts the same way)."""
    probe = _probe(_LoadRaisesOther)
    assert probe.refused == 0 and probe.accepted > 0 and not probe.has_integrity


def test_load_implementation_reports_checksum_only_for_implementations_with_records() -> None:
    """``checksum`` is missing exactly when records exist but lack integrity; an implementation
    without records misses records (and async_records), not checksum."""
    cases = {
        "wacc.implementation:wacc_torch_reproducible": (),
        "tests.wacc.impls:opaque_records": (),
        "tests.wacc.impls:opaque_unchecked": ("checksum",),
        "tests.wacc.impls:schema_unchecked": ("checksum",),
        "tests.wacc.impls:counters_only": ("records", "async_records"),
    }
    for spec, missing in cases.items():
        implementation = load_implementation(spec)
        assert implementation.missing == missing, spec
        assert (implementation.integrity is None) is ("records" in missing), spec


def test_the_unsupported_line_names_the_skipped_kinds_and_the_flag() -> None:
    """One line: the feature, why (the probe's counts), the kinds not judged, the flag."""
    opaque = load_implementation("tests.wacc.impls:opaque_unchecked")
    line = opaque.unsupported("checksum")
    assert line.startswith("unsupported: checksum: records of its own layout carry no integrity")
    assert "(flipped_byte_file) are not judged" in line
    assert line.endswith("(allow with --allow-missing checksum)") and "\n" not in line
    schema = load_implementation("tests.wacc.impls:schema_unchecked")
    line = schema.unsupported("checksum", flag="--wacc-allow-missing")
    assert "records in the documented layout carry no integrity check" in line
    assert "(checksum_malformed, checksum_mismatch)" in line
    assert line.endswith("(allow with --wacc-allow-missing checksum)")
    records = load_implementation("tests.wacc.impls:counters_only").unsupported("records")
    assert records.startswith("unsupported: records: no state_dict")


def test_flip_byte_flips_one_byte_and_refuses_a_place_outside() -> None:
    """Every bit of the one byte at the place, nothing else; a place outside is a ValueError."""
    assert flip_byte(b"\x00\x0f\xff", 1) == b"\x00\xf0\xff"
    for place in (-1, 3):
        with pytest.raises(ValueError, match=f"position {place} is outside the 3 bytes"):
            flip_byte(b"abc", place)


def test_same_record_compares_bits_nan_positions_and_structure() -> None:
    """Tensors by their bits (a NaN equals itself, -0.0 differs from +0.0), dicts by keys,
    sequences by length, scalars by type and value."""
    nan = torch.tensor([float("nan"), 1.0])
    assert same_record({"a": [nan, 1.5]}, {"a": [nan.clone(), 1.5]})
    assert not same_record(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_record(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert not same_record({"a": 1}, {"b": 1}) and not same_record([1, 2], [1])
    assert not same_record(1, 1.0) and same_record(float("nan"), float("nan"))


def test_save_and_load_bytes_round_trip_a_record() -> None:
    """A record through torch.save bytes and torch.load(weights_only=True) is the same record."""
    acc = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    module = nn.Linear(2, 1)
    acc.accumulate_sum(module, 1.0, grads={"weight": torch.ones(1, 2), "bias": torch.ones(1)})
    record = acc.state_dict()
    assert same_record(load_bytes(save_bytes(record)), record)


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor([0.0, 2.5, 0.0, -1.0]).to_sparse(), torch.zeros(1).expand(4)],
    ids=["sparse", "stride-0"],
)
def test_same_record_reads_sparse_and_stride_zero_tensors_through_a_file(
    tensor: torch.Tensor,
) -> None:
    """A record's sparse or stride-0 (expanded) tensor, as ``torch.load`` gives it back, is
    compared by its values: the same after a round trip, changed when a value changes, and of
    another layout never the same as its dense twin; nothing raises."""
    loaded = load_bytes(save_bytes({"extra": tensor}))["extra"]
    assert same_record({"extra": loaded}, {"extra": tensor})
    changed = tensor.to_dense().clone() if tensor.is_sparse else tensor.clone()
    changed[1] = 7.0
    changed = changed.to_sparse() if tensor.is_sparse else changed
    assert not same_record(loaded, changed)
    if tensor.is_sparse:  # of another layout: never the same as its dense twin
        assert not same_record(tensor.to_dense(), tensor)


@pytest.mark.parametrize("factory", [impls.sparse_record, impls.stride_zero_record])
def test_the_probe_judges_records_that_hold_sparse_or_stride_zero_tensors(
    factory: Any,
) -> None:
    """The probe of records holding a sparse or stride-0 tensor ends with a layout and counts
    (their flipped files compared, not a crash of the judge)."""
    probe = probe_integrity(factory, refusal=lambda exc: error_class(exc) is not None)
    assert probe.layout == "opaque" and not probe.problem
    assert probe.refused + probe.accepted > 0
