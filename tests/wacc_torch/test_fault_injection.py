"""Prepare, then commit: a failing tensor operation before the commit phase changes nothing.

Every public mutating call of ``wacc_torch`` is run once under a torch function mode that counts
the tensor operations (factories, conversions, kernels, attribute reads and writes) it performs
before its commit phase (``wacc_torch._commit.COMMIT``), then once per such operation with
that operation raising. Each time the accumulator's record, every pending buffer's bits, every
``.grad`` (identity and bits) and every tensor handed in must be exactly as before, and the call
must re-raise the fault (nothing swallows it). Once a commit phase has begun, only operations
that cannot fail on validated inputs may run: in-place kernels into our own buffers, views of
preallocated work tensors, attribute reads and ``.grad`` assignments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import wacc_torch._commit
from tests.wacc_torch.support import (
    TwoLayer,
    assert_bitwise_equal,
    assert_records_equal,
)
from wacc_torch import (
    AccumulatedGradients,
    WeightedGradientsAccumulator,
    all_reduce_mean,
    all_reduce_sums,
    normalize_sums,
)

# Operations a commit phase may run: none allocates memory or can meet an invalid input.
COMMIT_OPERATIONS = frozenset(
    {
        "add_",
        "mul_",
        "div_",
        "copy_",
        "mul",  # torch.mul(grad, w_D, out=work): into a preallocated work tensor
        "div",  # torch.div(g, S, out=g or a preallocated output)
        "view",
        "narrow",
        "grad.__set__",
        "_set_grad_enabled",  # torch.no_grad() around the commit: a thread-local flag
        "device.__get__",  # attribute reads: no kernel, no allocation
        "dtype.__get__",
        "shape.__get__",
        # found_inf (wacc_torch._finite): reductions into slots allocated in the prepare phase,
        # then one value read back; the last two run over a few values per piece.
        "aminmax",
        "sub",
        "sum",
        "item",
    }
)


# Operations that set a thread-local flag and cannot fail (torch.no_grad() entered and left).
INFALLIBLE = frozenset({"_set_grad_enabled"})


class InjectedFault(RuntimeError):
    """What an injected operation raises (a RuntimeError, like an out-of-memory error)."""


def _operation_name(func: Callable[..., Any]) -> str:
    name = getattr(func, "__name__", repr(func))
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    return f"{owner}.{name}" if name in ("__get__", "__set__") and owner else name


class FaultInjector(TorchFunctionMode):
    """Counts prepare-phase operations; the one numbered ``fail_at`` raises InjectedFault."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.prepared = 0
        self.committing = False
        self.commit_operations: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.committing:
            self.commit_operations.append(_operation_name(func))
        elif _operation_name(func) in INFALLIBLE:
            pass  # not a fault site: injecting one would leave the thread's flag flipped
        else:
            index = self.prepared
            self.prepared += 1
            if index == self.fail_at:
                raise InjectedFault(f"injected fault at operation {index} ({func})")
        return func(*args, **(kwargs or {}))


class _CommitMarker:
    """Stands in for wacc_torch._commit.COMMIT: from the first commit on, the call is
    committing (sticky: whatever follows the first write must not fail either)."""

    def __init__(self, injector: FaultInjector) -> None:
        self._injector = injector

    def __enter__(self) -> None:
        self._injector.committing = True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None


@dataclass
class Case:
    """A fresh accumulator, module and call; ``inputs`` are tensors the call must not change."""

    accumulator: WeightedGradientsAccumulator
    module: nn.Module
    call: Callable[[], object]
    inputs: list[torch.Tensor]


def _busy(
    module: nn.Module, *, dtype: torch.dtype, fused: bool = False
) -> WeightedGradientsAccumulator:
    """A window with one buffer allocated (first.weight) and one positive batch."""
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=4.0, fused=fused)
    accumulator.accumulate_sum(module, 3, grads={"first.weight": torch.full((3, 4), 0.75)})
    return accumulator


def _module() -> nn.Module:
    """TwoLayer with a bfloat16 first.bias, so that its .grad is bf16 (a conversion for D)."""
    module = TwoLayer()
    module.first.bias = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    return module


def _set_grads(module: nn.Module) -> None:
    # Mixed dtypes: a conversion for some, none for others; second.weight stays None.
    module.first.weight.grad = torch.linspace(-2.0, 2.0, 12).reshape(3, 4)
    module.first.bias.grad = torch.tensor([1.0, -0.5, 3.0], dtype=torch.bfloat16)
    module.second.bias.grad = torch.tensor([0.25, 8.0])


def _accumulate(
    method: str,
    *,
    dtype: torch.dtype,
    fused: bool = False,
    weight: float = 2.0,
    mapping: bool = False,
) -> Callable[[], Case]:
    def make() -> Case:
        module = _module()
        accumulator = _busy(module, dtype=dtype, fused=fused)
        _set_grads(module)
        grads = None
        if mapping:
            grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
            for parameter in module.parameters():
                parameter.grad = None
        call = getattr(accumulator, method)
        inputs = [] if grads is None else [g for g in grads.values() if g is not None]
        return Case(accumulator, module, lambda: call(module, weight, grads=grads), inputs)

    return make


def _finish(method: str) -> Callable[[], Case]:
    def make() -> Case:
        module = _module()
        accumulator = _busy(module, dtype=torch.bfloat16)
        return Case(accumulator, module, getattr(accumulator, method), [])

    return make


def _load_state_dict() -> Case:
    module = _module()
    source = _busy(_module(), dtype=torch.float16)
    source.accumulate_mean(
        _module(), 5, grads={"second.bias": torch.tensor([1.0, 2.0]), "first.bias": None}
    )
    record = source.state_dict()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=4.0)
    accumulator.accumulate_sum(module, 1, grads={"second.weight": torch.ones(2, 3)})
    _set_grads(module)
    return Case(
        accumulator,
        module,
        lambda: accumulator.load_state_dict(record, module),
        list(record["pending"].values()),
    )


def _from_pending() -> Case:
    module = _module()
    template = _busy(module, dtype=torch.float32)
    state = template.state
    pending = {"first.weight": torch.full((3, 4), 0.75), "second.bias": torch.zeros(2)}
    _set_grads(module)

    def call() -> object:
        return WeightedGradientsAccumulator.from_pending(module, pending, state)

    return Case(template, module, call, list(pending.values()))


def _apply_to() -> Case:
    module = _module()
    accumulator = _busy(module, dtype=torch.bfloat16)
    accumulator.accumulate_sum(module, 1, grads={"second.bias": torch.ones(2)})
    result = accumulator.finish_mean()
    _set_grads(module)
    return Case(accumulator, module, lambda: result.apply_to(module), [])


def _normalize_in_place() -> Case:
    module = _module()
    accumulator = _busy(module, dtype=torch.float32)
    sums = {
        "a": torch.tensor([6.0, -3.0, 1e-30]),
        "b": None,
        "c": torch.tensor([1.5, 65504.0], dtype=torch.float16),
        "d": torch.tensor([[2.0, 4.0]], dtype=torch.bfloat16),
    }
    tensors = [t for t in sums.values() if t is not None]

    def call() -> object:
        return normalize_sums(sums, loss_scale=2.0, total_weight=torch.tensor(3.0), in_place=True)

    return Case(accumulator, module, call, tensors)


CASES: dict[str, Callable[[], Case]] = {
    "accumulate_sum/bfloat16/.grad": _accumulate("accumulate_sum", dtype=torch.bfloat16),
    "accumulate_sum/float32/mapping": _accumulate(
        "accumulate_sum", dtype=torch.float32, mapping=True
    ),
    "accumulate_sum/zero-weight": _accumulate("accumulate_sum", dtype=torch.float32, weight=0.0),
    "accumulate_mean/float32": _accumulate("accumulate_mean", dtype=torch.float32),
    "accumulate_mean/float16/mapping": _accumulate(
        "accumulate_mean", dtype=torch.float16, mapping=True
    ),
    "accumulate_mean/bfloat16/fused": _accumulate(
        "accumulate_mean", dtype=torch.bfloat16, fused=True
    ),
    "finish_sums": _finish("finish_sums"),
    "finish_mean": _finish("finish_mean"),
    "load_state_dict": _load_state_dict,
    "from_pending": _from_pending,
    "AccumulatedGradients.apply_to": _apply_to,
    "normalize_sums(in_place=True)": _normalize_in_place,
}


@dataclass
class Snapshot:
    record: dict[str, Any]
    grads: dict[str, tuple[int, torch.Tensor] | None]
    inputs: list[torch.Tensor]


def _snapshot(case: Case) -> Snapshot:
    return Snapshot(
        record=case.accumulator.state_dict(),
        grads={
            name: None if p.grad is None else (id(p.grad), p.grad.detach().clone())
            for name, p in case.module.named_parameters()
        },
        inputs=[tensor.detach().clone() for tensor in case.inputs],
    )


def _assert_same(before: Snapshot, case: Case, what: str) -> None:
    assert_records_equal(case.accumulator.state_dict(), before.record)
    for name, p in case.module.named_parameters():
        expected = before.grads[name]
        if expected is None:
            assert p.grad is None, f"{what}: {name}.grad appeared"
            continue
        assert p.grad is not None and id(p.grad) == expected[0], f"{what}: {name}.grad replaced"
        assert_bitwise_equal(p.grad, expected[1], f"{what}: {name}.grad")
    for index, (tensor, copy) in enumerate(zip(case.inputs, before.inputs, strict=True)):
        assert_bitwise_equal(tensor, copy, f"{what}: input {index}")


def _run(case: Case, injector: FaultInjector, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(wacc_torch._commit, "COMMIT", _CommitMarker(injector))
        with injector:
            case.call()


@pytest.mark.parametrize("name", list(CASES))
def test_every_prepare_operation_can_fail_without_changing_anything(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failing any one prepare-phase tensor operation re-raises and leaves everything as it was."""
    make = CASES[name]
    counter = FaultInjector()
    _run(make(), counter, monkeypatch)
    assert counter.committing, f"{name}: no commit phase was entered"
    unexpected = sorted(set(counter.commit_operations) - COMMIT_OPERATIONS)
    assert not unexpected, f"{name}: commit phase runs operations that may fail: {unexpected}"
    assert counter.prepared > 0 or name == "finish_sums", f"{name}: no prepare operation seen"
    for fail_at in range(counter.prepared):
        case = make()
        before = _snapshot(case)
        with pytest.raises(InjectedFault):
            _run(case, FaultInjector(fail_at), monkeypatch)
        _assert_same(before, case, f"{name}, operation {fail_at} failed")


def test_the_injector_sees_a_commit_that_fails() -> None:
    """The harness can fail: a fault injected INSIDE a commit phase does change the state."""
    case = _accumulate("accumulate_sum", dtype=torch.bfloat16)()
    before = _snapshot(case)

    class FailingAdd(TorchFunctionMode):
        def __torch_function__(
            self,
            func: Callable[..., Any],
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            if _operation_name(func) == "add_" and self.seen:
                raise InjectedFault("second add_")
            self.seen = self.seen or _operation_name(func) == "add_"
            return func(*args, **(kwargs or {}))

    mode = FailingAdd()
    mode.seen = False
    with mode, pytest.raises(InjectedFault):
        case.call()
    with pytest.raises(AssertionError):
        _assert_same(before, case, "a commit that failed half-way")


@pytest.mark.parametrize("helper", [all_reduce_sums, all_reduce_mean], ids=lambda f: f.__name__)
def test_distributed_helpers_never_write_the_callers_tensors(
    helper: Callable[[AccumulatedGradients], AccumulatedGradients], one_rank_group: None
) -> None:
    """all_reduce_sums / all_reduce_mean reduce a copy: failing any one of their tensor
    operations in turn re-raises and leaves the caller's sums bit for bit as they were."""

    def make() -> AccumulatedGradients:
        module = _module()
        accumulator = _busy(module, dtype=torch.bfloat16)
        accumulator.accumulate_mean(module, 2, grads={"second.bias": torch.tensor([1.0, -3.0])})
        return accumulator.finish_sums()

    counter, sums = FaultInjector(), make()
    with counter:
        helper(sums)
    assert counter.prepared > 0
    for fail_at in range(counter.prepared):
        sums = make()
        before = {name: None if g is None else g.clone() for name, g in sums.grads.items()}
        with pytest.raises(InjectedFault), FaultInjector(fail_at):
            helper(sums)
        for name, grad in sums.grads.items():
            expected = before[name]
            assert (grad is None) == (expected is None), name
            if grad is not None and expected is not None:
                assert_bitwise_equal(grad, expected, f"operation {fail_at} failed: {name}")
