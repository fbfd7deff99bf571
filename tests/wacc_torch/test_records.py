"""§9: records — content, copies, file round trips, validation of every field, from_pending."""

from __future__ import annotations

import copy
import math
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.wacc_torch.support import (
    DEVICES,
    WORK_DTYPE_PARAMS,
    TwoLayer,
    assert_bitwise_equal,
    assert_records_equal,
    assert_unchanged,
    tracked_shapes,
)
from wacc_torch import (
    FORMAT_VERSION,
    AccumulatorState,
    ParameterMismatchError,
    RecordError,
    WeightedGradientsAccumulator,
    load_record,
    save_record,
)
from wacc_torch.records import CHECKSUM_KEY, RECORD_KEYS, record_checksum_of

SCALE = 2.0**4


def _filled(
    module: nn.Module, *, dtype: torch.dtype = torch.float32, fused: bool = False
) -> WeightedGradientsAccumulator:
    """An accumulator mid-window: 3 issued, 1 zero-weight, buffers for two of four parameters."""
    shapes = tracked_shapes(module)
    device = next(module.parameters()).device
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=SCALE, fused=fused)
    accumulator.accumulate_mean(
        module, 3, grads={"first.weight": torch.full(shapes["first.weight"], 0.75, device=device)}
    )
    accumulator.accumulate_sum(module, 0, grads={})
    accumulator.accumulate_sum(
        module, 5, grads={"second.bias": torch.tensor([1.5, -2.0], device=device)}
    )
    return accumulator


def test_record_has_exactly_the_documented_keys_and_plain_types() -> None:
    """state_dict holds the schema's keys, plain Python values and CPU tensors of dtype D."""
    module = TwoLayer()
    record = _filled(module, dtype=torch.bfloat16).state_dict()
    assert tuple(record) == (*RECORD_KEYS, CHECKSUM_KEY)
    assert record["format_version"] == FORMAT_VERSION == 1
    assert type(record[CHECKSUM_KEY]) is str
    assert record["dtype"] == "bfloat16" and record["loss_scale"] == SCALE
    assert record["fused"] is False
    assert (record["issued"], record["zero_weight"], record["total_weight"]) == (3, 1, 8.0)
    assert all(type(record[key]) is int for key in ("format_version", "issued", "zero_weight"))
    assert type(record["total_weight"]) is float and type(record["loss_scale"]) is float
    assert record["param_names"] == list(tracked_shapes(module))
    assert record["param_shapes"] == [list(shape) for shape in tracked_shapes(module).values()]
    assert set(record["pending"]) == {"first.weight", "second.bias"}
    for buffer in record["pending"].values():
        assert buffer.device.type == "cpu" and buffer.dtype == torch.bfloat16
    documented = WeightedGradientsAccumulator.state_dict.__doc__ or ""
    assert all(f"``{key}``" in documented for key in (*RECORD_KEYS, CHECKSUM_KEY))


@pytest.mark.parametrize("device", DEVICES)
def test_record_is_a_copy(device: str) -> None:
    """Accumulating after state_dict (or state_dict_async) does not change the record taken."""
    module = TwoLayer(device)
    accumulator = _filled(module)
    record = accumulator.state_dict()
    handle = accumulator.state_dict_async()
    frozen = copy.deepcopy(record)
    shapes = tracked_shapes(module)
    accumulator.accumulate_sum(
        module, 1, grads={name: torch.ones(s, device=device) for name, s in shapes.items()}
    )
    accumulator.finish_mean()
    assert_records_equal(record, frozen)
    assert_records_equal(handle.result(), frozen)


@pytest.mark.parametrize("device", DEVICES)
def test_record_buffers_are_cpu_tensors_whatever_the_device(device: str) -> None:
    """§9: the record's pending buffers are CPU tensors of dtype D, from state_dict() and from
    state_dict_async().result() alike, also when the parameters (and buffers) are on a GPU."""
    accumulator = _filled(TwoLayer(device), dtype=torch.float16)
    for record in (accumulator.state_dict(), accumulator.state_dict_async().result()):
        assert set(record["pending"]) == {"first.weight", "second.bias"}
        for buffer in record["pending"].values():
            assert (buffer.device.type, buffer.dtype) == ("cpu", torch.float16)


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_record_file_round_trip_is_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    """save_record then load_record (weights_only torch.load) gives the same record, bitwise."""
    module = TwoLayer()
    record = _filled(module, dtype=dtype).state_dict()
    record["pending"]["second.bias"][0] = float("inf")  # overflowed values survive too
    save_record(record, tmp_path / "record.pt")
    assert_records_equal(load_record(tmp_path / "record.pt"), record)
    raw = torch.load(tmp_path / "record.pt", map_location="cpu", weights_only=True)
    assert_records_equal(raw, record)


def test_record_before_any_accumulate_loads_into_any_module() -> None:
    """A record taken before anything was accumulated binds nothing and loads into any module."""
    empty = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE).state_dict()
    assert empty["param_names"] == [] and empty["pending"] == {}
    for module in (TwoLayer(), nn.Linear(2, 9), nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 3))):
        target = _filled(TwoLayer())
        target.load_state_dict(empty, module)
        assert_records_equal(target.state_dict(), empty)
        # The next accumulate binds the module it is given.
        target.accumulate_sum(module, 0)
        assert target.state_dict()["param_names"] == list(tracked_shapes(module))


@pytest.mark.parametrize("device", DEVICES)
def test_load_restores_buffers_on_the_module_device_without_aliasing(device: str) -> None:
    """Loaded buffers live on the module's device and are copies of the record's tensors."""
    record = _filled(TwoLayer()).state_dict()
    module = TwoLayer(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    accumulator.load_state_dict(record, module)
    expected = copy.deepcopy(record)
    for buffer in record["pending"].values():
        buffer.fill_(123.0)
    assert_records_equal(accumulator.state_dict(), expected)
    sums = accumulator.finish_sums()
    for name, buffer in sums.grads.items():
        if buffer is not None:
            assert buffer.device.type == torch.device(device).type, name


def test_pending_buffers_with_inf_and_nan_are_accepted() -> None:
    """A pending buffer may hold inf or NaN (overflow, NaN gradients): the record loads as is."""
    module = TwoLayer()
    record = _filled(module, dtype=torch.float16).state_dict()
    record["pending"]["second.bias"] = torch.tensor(
        [float("inf"), float("nan")], dtype=torch.float16
    )
    record[CHECKSUM_KEY] = record_checksum_of(record)  # edited on purpose: sealed again
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=SCALE)
    accumulator.load_state_dict(record, TwoLayer())
    assert_records_equal(accumulator.state_dict(), record)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        del record[key]

    return mutate


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        record[key] = value

    return mutate


def _set_pending(name: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        record["pending"][name] = value

    return mutate


def _set_counters(
    issued: object, zero_weight: object, total_weight: object
) -> Callable[[dict[str, Any]], None]:
    def mutate(record: dict[str, Any]) -> None:
        record.update(issued=issued, zero_weight=zero_weight, total_weight=total_weight)

    return mutate


def _no_positive_batches_but_pending(record: dict[str, Any]) -> None:
    record.update(issued=2, zero_weight=2, total_weight=0.0)


_NAMES = ["first.weight", "first.bias", "second.weight", "second.bias"]
_SHAPES = [[3, 4], [3], [2, 3], [2]]

BAD_RECORDS: list[Any] = [
    pytest.param(_set("extra", 1), "extra", id="unknown-key"),
    *(pytest.param(_drop(key), key, id=f"missing-{key}") for key in RECORD_KEYS),
    pytest.param(_set("format_version", 2), "format_version", id="version-2"),
    pytest.param(_set("format_version", True), "format_version", id="version-bool"),
    pytest.param(_set("format_version", "1"), "format_version", id="version-str"),
    pytest.param(_set("dtype", "float16"), "dtype", id="dtype-other"),
    pytest.param(_set("dtype", "torch.float32"), "dtype", id="dtype-prefixed"),
    pytest.param(_set("dtype", "int8"), "dtype", id="dtype-int8"),
    pytest.param(_set("dtype", torch.float32), "dtype", id="dtype-not-str"),
    pytest.param(_set("loss_scale", SCALE * 2), "loss_scale", id="scale-other"),
    pytest.param(_set("loss_scale", float("nan")), "loss_scale", id="scale-nan"),
    pytest.param(_set("loss_scale", "16.0"), "loss_scale", id="scale-str"),
    pytest.param(_set("fused", True), "fused", id="fused-other"),
    pytest.param(_set("fused", 0), "fused", id="fused-int"),
    pytest.param(_set("issued", -1), "issued", id="issued-negative"),
    pytest.param(_set("issued", True), "issued", id="issued-bool"),
    pytest.param(_set("issued", 3.0), "issued", id="issued-float"),
    pytest.param(_set("zero_weight", -1), "zero_weight", id="zero-weight-negative"),
    pytest.param(_set("zero_weight", 4), "zero_weight", id="zero-weight-above-issued"),
    pytest.param(_set("zero_weight", False), "zero_weight", id="zero-weight-bool"),
    pytest.param(_set("total_weight", -8.0), "total_weight", id="weight-negative"),
    pytest.param(_set("total_weight", float("nan")), "total_weight", id="weight-nan"),
    pytest.param(_set("total_weight", float("inf")), "total_weight", id="weight-inf"),
    pytest.param(_set("total_weight", True), "total_weight", id="weight-bool"),
    pytest.param(_set("total_weight", "8.0"), "total_weight", id="weight-str"),
    pytest.param(_set("total_weight", 2**53 + 1), "total_weight", id="weight-int-not-float64"),
    pytest.param(_set("total_weight", 10**400), "total_weight", id="weight-int-overflow"),
    pytest.param(_set("total_weight", 0.0), "total_weight", id="weight-zero-after-positive"),
    pytest.param(_set_counters(2, 2, 8.0), "total_weight", id="weight-without-positive-batch"),
    pytest.param(_no_positive_batches_but_pending, "pending", id="pending-without-positive-batch"),
    pytest.param(
        _set("param_names", ["first.weight", "first.bias", "second.weight"]),
        "param_names",
        id="names-missing-one",
    ),
    pytest.param(_set("param_names", [*_NAMES[:3], "other"]), "param_names", id="names-unknown"),
    pytest.param(
        _set("param_names", [*_NAMES[:3], "first.weight"]), "param_names", id="names-duplicate"
    ),
    pytest.param(_set("param_names", [1, 2, 3, 4]), "param_names", id="names-not-str"),
    pytest.param(_set("param_names", "first.weight"), "param_names", id="names-a-str"),
    pytest.param(
        _set("param_shapes", [[3, 4], [3], [2, 3], [3]]), "param_shapes", id="shape-differs"
    ),
    pytest.param(_set("param_shapes", _SHAPES[:3]), "param_shapes", id="shapes-too-few"),
    pytest.param(
        _set("param_shapes", [[3, 4], [3], [2, 3], [-2]]), "param_shapes", id="shape-negative"
    ),
    pytest.param(
        _set("param_shapes", [[3, 4], [3], [2, 3], [True, True]]), "param_shapes", id="shape-bool"
    ),
    pytest.param(_set("param_shapes", [[3, 4], [3], [2, 3], "2"]), "param_shapes", id="shape-str"),
    pytest.param(_set("pending", [1]), "pending", id="pending-not-dict"),
    pytest.param(_set_pending("other", torch.zeros(2)), "pending", id="pending-unknown-name"),
    pytest.param(_set_pending("second.bias", [1.5, -2.0]), "pending", id="pending-not-tensor"),
    pytest.param(
        _set_pending("second.bias", torch.zeros(2, dtype=torch.float64)),
        "pending",
        id="pending-dtype",
    ),
    pytest.param(_set_pending("second.bias", torch.zeros(3)), "pending", id="pending-shape"),
    pytest.param(
        _set_pending("second.bias", torch.zeros(2).to_sparse()), "pending", id="pending-sparse"
    ),
    pytest.param(
        _set_pending("first.bias", torch.zeros(3, dtype=torch.int64)), "pending", id="pending-int"
    ),
    pytest.param(
        _set_pending("second.bias", torch.zeros(2, device="meta")), "pending", id="pending-meta"
    ),
]


@pytest.mark.parametrize(("mutate", "field"), BAD_RECORDS)
def test_bad_record_field_raises_record_error_and_changes_nothing(
    mutate: Callable[[dict[str, Any]], None], field: str
) -> None:
    """Each malformed or mismatching field raises RecordError naming it and changes nothing."""
    module = TwoLayer()
    record = _filled(module).state_dict()
    mutate(record)
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    shapes = tracked_shapes(module)
    target.accumulate_sum(module, 2, grads={name: torch.full(s, 0.5) for name, s in shapes.items()})
    for parameter in module.parameters():
        parameter.grad = torch.full_like(parameter, 9.0)
    before = target.state_dict()
    with pytest.raises(RecordError, match=field):
        target.load_state_dict(record, module)
    assert_unchanged(target, before)
    assert all(bool((p.grad == 9.0).all()) for p in module.parameters() if p.grad is not None)


def test_record_for_another_module_is_refused() -> None:
    """A record bound to other parameter names or shapes raises RecordError naming the field."""
    record = _filled(TwoLayer()).state_dict()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    before = accumulator.state_dict()
    with pytest.raises(RecordError, match="param_names"):
        accumulator.load_state_dict(record, nn.Linear(4, 3))
    wider = TwoLayer()
    wider.second = nn.Linear(3, 5)
    with pytest.raises(RecordError, match=r"param_shapes.*second.weight"):
        accumulator.load_state_dict(record, wider)
    assert_unchanged(accumulator, before)


def test_module_without_trainable_parameters_is_refused_before_the_record() -> None:
    """Loading into a module with no requires_grad parameter raises ParameterMismatchError."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    empty = accumulator.state_dict()
    frozen = nn.Linear(2, 2).requires_grad_(False)
    for module in (nn.Module(), frozen):
        with pytest.raises(ParameterMismatchError, match="no requires_grad parameter"):
            accumulator.load_state_dict(empty, module)
    assert_unchanged(accumulator, empty)


def test_unbound_record_with_issued_batches_is_refused() -> None:
    """A record that binds no parameters but counts issued batches raises RecordError('issued')."""
    record = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE).state_dict()
    record.update(issued=1, zero_weight=1)
    accumulator = _filled(TwoLayer())
    before = accumulator.state_dict()
    with pytest.raises(RecordError, match="issued"):
        accumulator.load_state_dict(record, TwoLayer())
    assert_unchanged(accumulator, before)


def test_non_mapping_record_is_refused() -> None:
    """A record that is not a dict raises RecordError."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    with pytest.raises(RecordError, match="list"):
        accumulator.load_state_dict([1, 2], TwoLayer())  # type: ignore[arg-type]


class _CodeRunningPayload:
    """Unpickling this calls ``open(marker, "w")``: it would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_record_file_with_code_running_pickle_is_refused(tmp_path: Path) -> None:
    """load_record refuses a pickle payload that would run code (RecordError) and runs nothing."""
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "pending": _CodeRunningPayload(marker)}, path)
    with pytest.raises(RecordError, match="evil.pt"):
        load_record(path)
    assert not marker.exists()
    # Control: the payload is live, an unrestricted load would have created the marker.
    control = tmp_path / "control"
    torch.save(_CodeRunningPayload(control), tmp_path / "control.pt")
    handle = torch.load(tmp_path / "control.pt", weights_only=False)
    handle.close()
    assert control.exists()


def test_record_file_that_is_not_a_record_is_refused(tmp_path: Path) -> None:
    """A file holding a list, or bytes that are no torch archive, raises RecordError."""
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(RecordError, match="list"):
        load_record(tmp_path / "list.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RecordError, match="junk.pt"):
        load_record(tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError):
        load_record(tmp_path / "absent.pt")


def test_damaged_record_file_is_refused(tmp_path: Path) -> None:
    """A record file with a damaged pickle or a truncated archive raises RecordError naming it."""
    path = tmp_path / "record.pt"
    save_record(_filled(TwoLayer()).state_dict(), path)
    intact = path.read_bytes()
    # A key of the pickled dict made invalid UTF-8 (same length: the archive stays readable),
    # and the archive cut in half.
    assert intact.count(b"param_names") == 1
    damaged = {
        "bad-utf8.pt": intact.replace(b"param_names", b"param\xffnames"),
        "truncated.pt": intact[: len(intact) // 2],
    }
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(RecordError, match=name):
            load_record(tmp_path / name)


def _batch(
    accumulator: WeightedGradientsAccumulator, module: nn.Module, x: torch.Tensor, scale: float
) -> None:
    """One microbatch of ``len(x)`` tokens, a real backward of ``scale`` times its loss sum, in
    the accumulator's mode (buffered: accumulate_sum after; zero-copy: inside a block)."""
    if accumulator.state.zero_copy:
        with accumulator.microbatch(module, weight=len(x), kind="sum"):
            (scale * module(x).sum()).backward()
    else:
        (scale * module(x).sum()).backward()
        accumulator.accumulate_sum(module, len(x))


@pytest.mark.parametrize("zero_copy", [False, True], ids=["buffered", "zero_copy"])
def test_a_record_of_an_empty_window_loads_at_any_loss_scale_and_keeps_the_accumulators(
    tmp_path: Path, zero_copy: bool
) -> None:
    """A record of an empty window (issued == 0: after a finish, bound to a module) taken at one
    scale loads, through a real file, into an accumulator at another: nothing of the window was
    scaled. The accumulator keeps its own scale; its next window gives the bits of an
    accumulator that never stopped, run at that scale. A record whose window issued a batch
    (one of zero weight included) is still refused at another scale, and an empty record whose
    loss_scale is no loss scale of D is refused naming the field, nothing changed."""
    module = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x = torch.randn(5, 4)
    source = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=4.0, zero_copy=zero_copy)
    _batch(source, module, x[:3], 4.0)
    source.finish_mean()
    module.zero_grad(set_to_none=True)  # as a loop does after its step
    save_record(source.state_dict(), tmp_path / "empty.pt")
    record = load_record(tmp_path / "empty.pt")
    assert record["issued"] == 0 and record["param_names"] and record["loss_scale"] == 4.0

    def next_window(accumulator: WeightedGradientsAccumulator) -> list[torch.Tensor]:
        _batch(accumulator, module, x[:2], 8.0)
        _batch(accumulator, module, x, 8.0)
        grads = accumulator.finish_mean().grads
        finished = [g.clone() for g in grads.values() if g is not None]
        module.zero_grad(set_to_none=True)
        return finished

    resumed = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=8.0, zero_copy=zero_copy)
    resumed.load_state_dict(record, module)
    assert resumed.state.loss_scale == 8.0 and resumed.state.issued == 0
    never_stopped = WeightedGradientsAccumulator(
        dtype=torch.float32, loss_scale=8.0, zero_copy=zero_copy
    )
    got, expected = next_window(resumed), next_window(never_stopped)
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected, strict=True):
        assert_bitwise_equal(a, b, "the window after the resume")

    # One zero-weight batch is a batch of the window: that record keeps its scale.
    zero = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=4.0, zero_copy=zero_copy)
    _batch(zero, module, x[:0], 4.0)
    other = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=8.0, zero_copy=zero_copy)
    with pytest.raises(RecordError, match=r"loss_scale.*4\.0.*8\.0"):
        other.load_state_dict(zero.state_dict(), module)
    for bad in (-4.0, 0.0, math.inf, 1 + 2**-30, "4.0"):
        with pytest.raises(RecordError, match=f"loss_scale.*{re.escape(str(bad))}"):
            other.load_state_dict({**record, "loss_scale": bad}, module)
    assert other.state.issued == 0 and other.state.loss_scale == 8.0


@pytest.mark.parametrize("zero_copy", [False, True], ids=["buffered", "zero_copy"])
def test_a_record_with_pending_sums_is_refused_onto_meta_parameters(zero_copy: bool) -> None:
    """A record holding a window's sums (a real backward of a Linear) loaded into a fresh
    accumulator for the same module built on device="meta" raises ParameterMismatchError naming
    the parameter and the meta device, and nothing changes: on the meta device the sums would be
    dropped, and finish_mean would hand over meta tensors with found_inf=False. The record of a
    window with no pending buffer still loads there (it holds no values)."""
    module = nn.Linear(4, 3)
    source = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    (SCALE * module(torch.randn(5, 4)).sum()).backward()
    source.accumulate_sum(module, 5)
    record = source.state_dict()
    meta = nn.Linear(4, 3, device="meta")
    target = WeightedGradientsAccumulator(
        dtype=torch.float32, loss_scale=SCALE, zero_copy=zero_copy
    )
    before = target.state_dict()
    with pytest.raises(ParameterMismatchError, match=r"parameter 'weight' is on the meta device"):
        target.load_state_dict(record, meta)
    assert_unchanged(target, before)
    assert all(parameter.grad is None for parameter in meta.parameters())
    source.finish_sums()
    target.load_state_dict(source.state_dict(), meta)  # bound, issued == 0, nothing pending
    assert target.state.issued == 0


def test_record_file_truncated_anywhere_or_with_a_damaged_end_record_is_refused(
    tmp_path: Path,
) -> None:
    """A real record file (a Linear(64, 64) window after a real backward, well past torch's
    4096-byte first read) cut at a stride of offsets, at every offset of its first and last 100
    bytes and of the 100 after byte 4096, or with its zip end record's signature damaged, raises
    RecordError naming the file every time: torch's zip reader answers part of this damage with
    OSError (EINVAL), which is not a missing file. A missing file still raises
    FileNotFoundError."""
    module = nn.Linear(64, 64)
    module(torch.randn(3, 64)).sum().backward()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    accumulator.accumulate_sum(module, 3)
    path = tmp_path / "record.pt"
    save_record(accumulator.state_dict(), path)
    intact = path.read_bytes()
    assert len(intact) > 4096 + 100
    cuts = (
        set(range(0, len(intact), 61))
        | set(range(100))
        | set(range(4096, 4196))
        | set(range(len(intact) - 100, len(intact)))
    )
    damaged = {f"cut-{cut}.pt": intact[:cut] for cut in sorted(cuts)}
    # The zip end-of-central-directory record's signature, each byte flipped (zip64's end
    # records are not read for an archive this small: damaging them changes nothing).
    end = intact.rfind(b"PK\x05\x06")
    assert end > 0, "the archive has no end-of-central-directory record"
    for offset in range(end, end + 4):
        content = bytearray(intact)
        content[offset] ^= 0xFF
        damaged[f"end-{offset}.pt"] = bytes(content)
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(RecordError, match=re.escape(name)):
            load_record(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        load_record(tmp_path / "absent.pt")
    assert_records_equal(load_record(path), accumulator.state_dict())


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_async_equals_state_dict(device: str) -> None:
    """state_dict_async().result() holds the same record as state_dict() at the call."""
    module = TwoLayer(device)
    accumulator = _filled(module, dtype=torch.float16)
    expected = accumulator.state_dict()
    handle = accumulator.state_dict_async()
    shapes = tracked_shapes(module)
    accumulator.accumulate_sum(
        module, 1, grads={name: torch.ones(s, device=device) for name, s in shapes.items()}
    )
    assert_records_equal(handle.result(), expected)
    assert handle.done()


@pytest.mark.parametrize("device", DEVICES)
def test_from_pending_continues_like_the_original(device: str) -> None:
    """from_pending with the original's counters and buffers continues to the same result."""
    module = TwoLayer(device)
    original = _filled(module, dtype=torch.bfloat16)
    record = original.state_dict()
    pending = {name: buffer.to(device) for name, buffer in record["pending"].items()}
    restored = WeightedGradientsAccumulator.from_pending(TwoLayer(device), pending, original.state)
    assert_records_equal(restored.state_dict(), record)
    shapes = tracked_shapes(module)
    for accumulator in (original, restored):
        accumulator.accumulate_mean(
            module,
            1001,
            grads={name: torch.full(s, 0.375, device=device) for name, s in shapes.items()},
        )
    expected, actual = original.finish_mean(), restored.finish_mean()
    for name in shapes:
        assert_bitwise_equal(actual.grads[name], expected.grads[name], name)


def test_from_pending_checks_buffers_and_counters() -> None:
    """from_pending refuses unknown names, wrong dtype/shape/device and inconsistent counters."""
    module = TwoLayer()
    state = AccumulatorState(
        dtype=torch.float32,
        loss_scale=SCALE,
        issued=2,
        zero_weight=1,
        total_weight=3.0,
        fused=False,
    )
    good = torch.zeros(2)
    cases: list[tuple[dict[str, Any], AccumulatorState, type[Exception], str]] = [
        ({"other": good}, state, ParameterMismatchError, "'other'"),
        ({"second.bias": good.double()}, state, ParameterMismatchError, "float64"),
        ({"second.bias": torch.zeros(3)}, state, ParameterMismatchError, r"\[3\]"),
        ({"second.bias": torch.zeros(2, device="meta")}, state, ParameterMismatchError, "meta"),
        (
            {"second.bias": good},
            AccumulatorState(torch.float32, SCALE, 2, 3, 3.0, False),
            RecordError,
            "zero_weight",
        ),
        (
            {"second.bias": good},
            AccumulatorState(torch.float32, SCALE, 2, 2, 0.0, False),
            RecordError,
            "pending",
        ),
        (
            {},
            AccumulatorState(torch.float32, SCALE, 1, 0, -1.0, False),
            RecordError,
            "total_weight",
        ),
    ]
    for pending, bad_state, error, message in cases:
        with pytest.raises(error, match=message):
            WeightedGradientsAccumulator.from_pending(module, pending, bad_state)
    with pytest.raises(TypeError, match="AccumulatorState"):
        WeightedGradientsAccumulator.from_pending(module, {}, {"issued": 0})  # type: ignore[arg-type]


def test_state_dict_async_without_checksum_has_no_checksum() -> None:
    """state_dict_async(checksum=False).result() leaves the checksum out, like state_dict."""
    accumulator = _filled(TwoLayer())
    expected = accumulator.state_dict(checksum=False)
    record = accumulator.state_dict_async(checksum=False).result()
    assert CHECKSUM_KEY not in record
    assert_records_equal(record, expected)


def test_record_file_without_a_str_keyed_dict_is_refused_naming_what_it_holds(
    tmp_path: Path,
) -> None:
    """A file holding an empty list, or a dict with a non-str key, raises RecordError whose
    message names the file and the type it holds."""
    for name, content in (("empty.pt", []), ("int_keys.pt", {1: torch.zeros(1)})):
        path = tmp_path / name
        torch.save(content, path)
        with pytest.raises(RecordError) as caught:
            load_record(path)
        assert str(caught.value) == (
            f"record file {str(path)!r} does not hold a dict with str keys "
            f"(got {type(content).__name__})"
        )


def test_record_file_written_from_a_cuda_device_loads_onto_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose tensors were saved from a CUDA device (location tag "cuda:0") loads with
    every tensor on the CPU, whether or not this machine has CUDA."""
    record = _filled(TwoLayer()).state_dict()
    with monkeypatch.context() as patch:
        # What torch.save writes for tensors that lived on the first GPU.
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save_record(record, tmp_path / "from_gpu.pt")
    loaded = load_record(tmp_path / "from_gpu.pt")
    assert all(buffer.device.type == "cpu" for buffer in loaded["pending"].values())
    assert_records_equal(loaded, record)


def test_record_file_with_code_is_refused_even_if_the_environment_relaxes_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD (which turns off torch.load's weights_only default)
    does not make load_record run a pickle payload: it still refuses it as unpicklable."""
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "pending": _CodeRunningPayload(marker)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RecordError, match="evil.pt") as caught:
        load_record(path)
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()


def test_a_non_bool_checksum_flag_is_refused_naming_it() -> None:
    """state_dict and state_dict_async refuse a checksum flag that is not a bool, naming it."""
    accumulator = _filled(TwoLayer())
    for call in (accumulator.state_dict, accumulator.state_dict_async):
        with pytest.raises(TypeError) as caught:
            call(checksum="yes")  # type: ignore[arg-type]
        assert str(caught.value) == "checksum must be a bool, got 'yes'"


@pytest.mark.parametrize("checksum", [True, False], ids=["checksum", "no-checksum"])
def test_a_snapshot_of_meta_buffers_is_refused_like_state_dict(checksum: bool) -> None:
    """A window whose pending buffers are on the meta device holds no values, so no record of
    CPU tensors (semantics §9) can be made of it: state_dict_async(...).result() raises the
    same error as state_dict() instead of returning a record of meta tensors (a copy of a
    non-CUDA buffer must be a CPU tensor, like state_dict's). The error is the accumulator's
    RecordError naming the parameter, not torch's bare NotImplementedError, and the window is
    unchanged: it still finishes."""
    module = TwoLayer("meta")
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    accumulator.accumulate_sum(module, 5, grads={"second.bias": torch.ones(2, device="meta")})
    before = accumulator.state
    with pytest.raises(RecordError, match=r"'second\.bias'.*meta device") as from_state_dict:
        accumulator.state_dict(checksum=checksum)
    with pytest.raises(RecordError) as from_async:
        accumulator.state_dict_async(checksum=checksum)
    assert str(from_async.value) == str(from_state_dict.value)
    assert accumulator.state == before
    assert accumulator.finish_sums().grads["second.bias"].device.type == "meta"


def _resealed(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its checksum recomputed (edited on purpose: only the field check can
    refuse it)."""
    record[CHECKSUM_KEY] = record_checksum_of(record)
    return record


def test_one_positive_batch_with_a_zero_total_weight_is_refused() -> None:
    """After a single positive-weight batch W > 0 (semantics §9: "if some batch had positive
    weight, then W > 0"): a sealed record with issued=1, zero_weight=0 and total_weight 0.0
    raises RecordError naming total_weight, and the target is unchanged."""
    module = TwoLayer()
    source = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    source.accumulate_sum(module, 2, grads={"second.bias": torch.tensor([1.5, -2.0])})
    record = source.state_dict()
    assert (record["issued"], record["zero_weight"]) == (1, 0)
    record["total_weight"] = 0.0
    _resealed(record)
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    before = target.state_dict()
    with pytest.raises(RecordError, match=r"total_weight.*\b0\.0\b"):
        target.load_state_dict(record, TwoLayer())
    assert_unchanged(target, before)


@pytest.mark.parametrize(
    ("index", "entry"),
    [
        pytest.param(3, [2.0], id="float-size"),
        pytest.param(3, 2, id="int-not-a-list"),
        pytest.param(1, [-3], id="negative-size"),
        pytest.param(0, {3: 4}, id="dict"),
    ],
)
def test_bad_param_shapes_entry_is_named_by_index_and_value(index: int, entry: object) -> None:
    """An entry of param_shapes that is not a list of non-negative ints (a float size equal to
    the parameter's, a bare int, a negative size, a dict) raises RecordError naming the field,
    the entry's index and the entry itself (semantics §9: shapes are lists of non-negative
    ints)."""
    record = _filled(TwoLayer()).state_dict()
    record["param_shapes"][index] = entry
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    before = target.state_dict()
    pattern = rf"'param_shapes'\[{index}\].*{re.escape(repr(entry))}"
    with pytest.raises(RecordError, match=pattern):
        target.load_state_dict(record, TwoLayer())
    assert_unchanged(target, before)


class _WithEmpty(nn.Module):
    """A parameter with no elements (shape [2, 0]) next to an ordinary one."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(2, 0))
        self.bias = nn.Parameter(torch.zeros(3))


def test_a_parameter_with_no_elements_round_trips_through_a_record() -> None:
    """A size of 0 is a non-negative int (semantics §9): a window with a pending buffer of
    shape [2, 0] gives a sealed record listing that shape, and the record loads into a fresh
    accumulator, which then finishes to the same sums as the original."""
    original = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    grads = {"empty": torch.zeros(2, 0), "bias": torch.tensor([1.0, -0.5, 0.25])}
    original.accumulate_sum(_WithEmpty(), 3, grads=grads)
    record = original.state_dict()
    assert record["param_shapes"] == [[2, 0], [3]]
    assert record["pending"]["empty"].shape == (2, 0)
    assert record[CHECKSUM_KEY] == record_checksum_of(record)
    restored = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    restored.load_state_dict(record, _WithEmpty())
    assert_records_equal(restored.state_dict(), record)
    expected, actual = original.finish_sums(), restored.finish_sums()
    assert actual.grads["empty"].shape == (2, 0)
    assert_bitwise_equal(actual.grads["bias"], expected.grads["bias"], "bias")


@pytest.mark.parametrize(
    "names", [pytest.param(4, id="int"), pytest.param(dict.fromkeys(_NAMES), id="dict")]
)
def test_param_names_that_is_not_a_list_is_refused_naming_it(names: object) -> None:
    """param_names must be a list of str (semantics §9): an int, or a dict whose keys are
    exactly the module's names, raises RecordError naming the field and the value."""
    record = _filled(TwoLayer()).state_dict()
    record["param_names"] = names
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    before = target.state_dict()
    with pytest.raises(RecordError, match=rf"'param_names'.*{re.escape(repr(names))}"):
        target.load_state_dict(record, TwoLayer())
    assert_unchanged(target, before)


def test_param_names_with_a_name_the_module_lacks_is_refused_naming_it() -> None:
    """A record listing every parameter of the module plus one it lacks (with a shape for it)
    does not bind exactly the module's parameters (semantics §9): RecordError naming
    param_names and the missing name."""
    record = _filled(TwoLayer()).state_dict()
    record["param_names"] = [*_NAMES, "third.weight"]
    record["param_shapes"] = [*_SHAPES, [1]]
    _resealed(record)
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    before = target.state_dict()
    with pytest.raises(RecordError, match=r"param_names.*'third\.weight'"):
        target.load_state_dict(record, TwoLayer())
    assert_unchanged(target, before)


def test_an_unknown_dtype_is_refused_naming_it_and_the_work_dtypes() -> None:
    """A record dtype that is no work dtype raises RecordError naming the field, the value and
    each of the four work dtypes of semantics §2 as a word of its own."""
    record = _filled(TwoLayer()).state_dict()
    record["dtype"] = "int8"
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    with pytest.raises(RecordError, match=r"'dtype'.*'int8'") as caught:
        target.load_state_dict(record, TwoLayer())
    for name in ("float64", "float32", "float16", "bfloat16"):
        assert re.search(rf"(?<![\w.]){name}(?!\w)", str(caught.value)), name


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        pytest.param(_set("pending", [1]), r"'pending'.*\blist\b", id="pending-a-list"),
        pytest.param(
            _set_pending("second.bias", [1.5, -2.0]),
            r"'pending'\['second\.bias'\].*\blist\b",
            id="buffer-a-list",
        ),
        pytest.param(
            _set_pending("second.bias", (1.5, -2.0)),
            r"'pending'\['second\.bias'\].*\btuple\b",
            id="buffer-a-tuple",
        ),
    ],
)
def test_a_pending_of_the_wrong_type_is_refused_naming_the_type(
    mutate: Callable[[dict[str, Any]], None], pattern: str
) -> None:
    """A pending that is not a dict, or a pending buffer that is not a tensor, raises
    RecordError naming the field (and the buffer's name) and the type it got."""
    record = _filled(TwoLayer()).state_dict()
    mutate(record)
    target = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    with pytest.raises(RecordError, match=pattern):
        target.load_state_dict(record, TwoLayer())


@pytest.mark.parametrize("device", DEVICES)
def test_the_checksum_does_not_depend_on_the_buffers_device(device: str) -> None:
    """The checksum hashes values, not where they live (semantics §9 Reading): the record's
    pending buffers moved to ``device`` give the same checksum, and the moved record loads
    (its checksum verified) into a module on that device."""
    record = _filled(TwoLayer()).state_dict()
    moved = {**record, "pending": {k: v.to(device) for k, v in record["pending"].items()}}
    assert record_checksum_of(moved) == record[CHECKSUM_KEY]
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=SCALE)
    accumulator.load_state_dict(moved, TwoLayer(device))
    assert_records_equal(accumulator.state_dict(), record)
