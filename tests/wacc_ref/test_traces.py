"""Tests of wacc_ref.traces: snapshots of records and results of either implementation."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

import numpy as np
import pytest

from tests.wacc_ref.scenario_support import (
    record_with_pending,
    two_params,
)
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.traces import (
    RECORD_KEYS,
    buffer_to_float64,
    record_from_snapshot,
    snapshot_record,
)


def test_buffer_to_float64_reads_fractions_and_refuses_unknown_types() -> None:
    """Object arrays of Fractions are rounded once to float64; unknown buffer types raise."""
    third = np.empty(2, dtype=object)
    third[:] = [Fraction(1, 3), Fraction(-5, 2)]
    assert buffer_to_float64(third).tolist() == [1 / 3, -2.5]
    with pytest.raises(TypeError, match="list"):
        buffer_to_float64([1.0, 2.0])
    with pytest.raises(TypeError, match="int64"):
        buffer_to_float64(np.arange(3))


def test_snapshot_order_of_pending_does_not_matter() -> None:
    """Pending buffers are compared by name: the record's allocation order is irrelevant."""
    record = record_with_pending()
    pending: Mapping[str, np.ndarray] = {"weight": np.zeros((2, 3)), "bias": np.ones(3)}
    forward = dict(record, pending=dict(pending))
    backward = dict(record, pending=dict(reversed(list(pending.items()))))
    assert snapshot_record(forward).key() == snapshot_record(backward).key()


def test_record_from_snapshot_round_trips() -> None:
    """A snapshot turned back into a record loads and snapshots to the same bits."""
    record = record_with_pending()
    snapshot = snapshot_record(record)
    rebuilt = record_from_snapshot(snapshot)
    assert tuple(rebuilt) == RECORD_KEYS
    target = ReferenceAccumulator(dtype="bfloat16", loss_scale=4.0)
    target.load_state_dict(rebuilt, two_params())
    assert snapshot_record(target.state_dict()).key() == snapshot.key()
