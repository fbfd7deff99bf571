"""Tests of wacc_ref.corruption: corrupted records, refused naming their field."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.wacc_ref.scenario_support import (
    assert_array_bits,
    record_with_pending,
    two_params,
)
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.corruption import (
    CORRUPTION_FIELDS,
    CORRUPTION_KINDS,
    CorruptionNotApplicableError,
    applicable_corruptions,
    corrupt_record,
    corruption_field,
)
from wacc_ref.errors import RecordError
from wacc_ref.traces import (
    RECORD_KEYS,
    snapshot_record,
)

# --------------------------------------------------------------------------------------------
# Corrupted records
# --------------------------------------------------------------------------------------------


def _record_bound_without_pending() -> dict[str, object]:
    source = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    source.accumulate_sum(two_params(), 0.0, grads={"bias": np.ones(3)})
    return source.state_dict()


def _record_of_a_finished_window() -> dict[str, object]:
    """Bound, and empty (issued == 0): the record taken between windows, which loads at any loss
    scale of D (§9), so its wrong loss scale must be one of no D."""
    source = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    source.accumulate_sum(two_params(), 2.0, grads={"bias": np.ones(3)})
    source.finish_sums()
    return source.state_dict()


def _record_unbound() -> dict[str, object]:
    return ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0).state_dict()


def _busy_target() -> ReferenceAccumulator:
    """An accumulator with its own window in progress (so 'changes nothing' means something)."""
    target = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    target.accumulate_sum(two_params(), 3.0, grads={"bias": np.array([1.0, -0.0, 2.5])})
    return target


RECORDS = {
    "with_pending": record_with_pending,
    "bound_without_pending": _record_bound_without_pending,
    "finished_window": _record_of_a_finished_window,
    "unbound": _record_unbound,
}


@pytest.mark.parametrize("record_name", sorted(RECORDS))
def test_uncorrupted_records_load(record_name: str) -> None:
    """Control: each test record loads into a busy target (failures below are the corruption's)."""
    target = _busy_target()
    target.load_state_dict(RECORDS[record_name](), two_params())
    assert (
        snapshot_record(target.state_dict()).key() == snapshot_record(RECORDS[record_name]()).key()
    )


@pytest.mark.parametrize("record_name", sorted(RECORDS))
@pytest.mark.parametrize("kind", CORRUPTION_KINDS)
def test_corrupted_record_raises_record_error_naming_the_field_and_changes_nothing(
    record_name: str, kind: str
) -> None:
    """Each applicable corruption makes load_state_dict raise RecordError naming its field, with the
    target accumulator and the input record unchanged."""
    record = RECORDS[record_name]()
    if kind not in applicable_corruptions(record):
        with pytest.raises(CorruptionNotApplicableError, match=kind):
            corrupt_record(record, kind)
        return
    pristine = copy.deepcopy(record)
    corrupted = corrupt_record(record, kind)
    target = _busy_target()
    before = snapshot_record(target.state_dict())
    with pytest.raises(RecordError) as info:
        target.load_state_dict(corrupted, two_params())
    expected_field = corruption_field(record, kind)
    assert expected_field in str(info.value), f"{kind}: {info.value}"
    after = snapshot_record(target.state_dict())
    assert before.differences(after, what="target") == []
    assert record.keys() == pristine.keys()
    assert snapshot_record(record).differences(snapshot_record(pristine), what="record") == []
    assert record["param_shapes"] == pristine["param_shapes"]


def test_applicability_follows_what_the_record_holds() -> None:
    """Pending kinds need a pending buffer, parameter kinds bound parameters, checksum kinds a
    checksum; the rest always apply."""
    pending_kinds = {"pending_unknown_parameter", "pending_wrong_shape", "checksum_mismatch"}
    bound_kinds = {"param_names_wrong", "param_shape_wrong"}
    checksum_kinds = {"checksum_mismatch", "checksum_malformed"}
    assert set(applicable_corruptions(record_with_pending())) == set(CORRUPTION_KINDS)
    assert set(applicable_corruptions(_record_bound_without_pending())) == (
        set(CORRUPTION_KINDS) - pending_kinds
    )
    assert set(applicable_corruptions(_record_unbound())) == (
        set(CORRUPTION_KINDS) - pending_kinds - bound_kinds
    )
    unchecked = {k: v for k, v in record_with_pending().items() if k != "checksum"}
    assert set(applicable_corruptions(unchecked)) == set(CORRUPTION_KINDS) - checksum_kinds


def test_every_kind_documents_a_field_and_unknown_kinds_are_refused() -> None:
    """CORRUPTION_FIELDS covers every kind; an unknown kind raises ValueError naming it."""
    assert set(CORRUPTION_FIELDS) == set(CORRUPTION_KINDS)
    assert all(CORRUPTION_FIELDS[kind] for kind in CORRUPTION_KINDS)
    with pytest.raises(ValueError, match="'melted'"):
        corrupt_record(_record_unbound(), "melted")
    assert corruption_field(record_with_pending(), "pending_wrong_shape") == "weight"


def test_wrong_shape_corruption_keeps_the_values() -> None:
    """pending_wrong_shape only reshapes: same values, a different shape, the input untouched."""
    record = record_with_pending()
    corrupted = corrupt_record(record, "pending_wrong_shape")
    original = record["pending"]["weight"]  # type: ignore[index]
    changed = corrupted["pending"]["weight"]
    assert changed.shape != original.shape and original.shape == (2, 3)
    assert np.array_equal(changed.reshape(-1), original.reshape(-1))


def test_corrupt_record_works_on_torch_tensor_records() -> None:
    """corrupt_record and snapshot_record handle a production-style record with torch buffers."""
    torch = pytest.importorskip("torch")
    buffer = torch.tensor([[0.5, -0.0, 3.0], [1.0, 2.0**-133, -7.0]], dtype=torch.bfloat16)
    record: dict[str, object] = {
        "format_version": 1,
        "dtype": "bfloat16",
        "loss_scale": 4.0,
        "fused": False,
        "issued": 2,
        "zero_weight": 1,
        "total_weight": 5.0,
        "param_names": ["weight", "bias"],
        "param_shapes": [[2, 3], [3]],
        "pending": {"weight": buffer},
    }
    assert tuple(record) == RECORD_KEYS
    snapshot = snapshot_record(record)
    assert_array_bits(
        snapshot.pending[0][1], [0.5, -0.0, 3.0, 1.0, 2.0**-133, -7.0], "torch bf16 pending"
    )
    pristine_buffer = buffer.clone()
    for kind in applicable_corruptions(record):
        corrupted = corrupt_record(record, kind)
        assert corrupted is not record
        for value in corrupted["pending"].values():
            assert isinstance(value, torch.Tensor)
    assert torch.equal(buffer, pristine_buffer) and record["param_shapes"] == [[2, 3], [3]]
    wrong = corrupt_record(record, "pending_wrong_shape")["pending"]["weight"]
    assert tuple(wrong.shape) != (2, 3) and torch.equal(wrong.reshape(-1), buffer.reshape(-1))
    renamed = corrupt_record(record, "param_shape_wrong")
    assert renamed["param_shapes"][0] == [2, 3, 1]
    assert tuple(renamed["pending"]["weight"].shape) == (2, 3, 1)
