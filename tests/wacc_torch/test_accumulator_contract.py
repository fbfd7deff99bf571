"""The public contract of WeightedGradientsAccumulator as a training loop sees it: its repr, and
``from_pending`` (restoring a window from buffers the caller already holds) with the exact
messages of its refusals and the memory checks behind them."""

from __future__ import annotations

import copy
import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.wacc_torch.support import (
    assert_bitwise_equal,
    assert_matches_reference,
    assert_records_equal,
    grads_snapshot,
    one_parameter,
    tracked_shapes,
)
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_torch import (
    AccumulatorState,
    InvalidWeightError,
    ParameterMismatchError,
    WeightedGradientsAccumulator,
    ZeroCopyError,
)

SCALE = 8.0


def _state(
    dtype: torch.dtype = torch.float32,
    *,
    issued: int = 1,
    total_weight: float = 2.0,
    fused: bool = False,
    zero_copy: bool = False,
) -> AccumulatorState:
    """Counters of a window with ``issued`` positive-weight batches (none of weight 0)."""
    return AccumulatorState(
        dtype=dtype,
        loss_scale=1.0,
        issued=issued,
        zero_weight=0,
        total_weight=total_weight,
        fused=fused,
        zero_copy=zero_copy,
    )


def _backward(model: nn.Linear, tokens: int, generator: torch.Generator) -> None:
    """One microbatch of ``tokens`` samples: the scaled mean MSE loss, backward into .grad."""
    inputs = torch.randn(tokens, model.in_features, generator=generator)
    targets = torch.randn(tokens, model.out_features, generator=generator)
    loss = nn.functional.mse_loss(model(inputs), targets)
    (SCALE * loss).backward()


# ------------------------------------------------------------------------------------- repr
def test_repr_shows_the_options_and_the_window_counters() -> None:
    """repr(acc) names the class, every option and the live counters (W with full repr), and
    goes back to zero counters after finish; a subclass shows its own name."""
    model = nn.Linear(3, 2)
    acc = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1024.0)
    assert repr(acc) == (
        "WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1024.0, fused=False, "
        "zero_copy=False, issued=0, zero_weight=0, total_weight=0.0)"
    )
    for weight in (0.1, 0, 0.2):
        model(torch.ones(1, 3)).sum().backward()
        acc.accumulate_sum(model, weight)
    assert repr(0.1 + 0.2) == "0.30000000000000004"  # W = round_64(0.1 + 0.2), shown exactly
    assert repr(acc) == (
        "WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1024.0, fused=False, "
        "zero_copy=False, issued=3, zero_weight=1, total_weight=0.30000000000000004)"
    )
    acc.finish_sums()
    assert repr(acc).endswith("issued=0, zero_weight=0, total_weight=0.0)")

    class Tuned(WeightedGradientsAccumulator):
        """A user's subclass."""

    zero_copy = Tuned(dtype=torch.float32, loss_scale=0.5, fused=True, zero_copy=True)
    assert repr(zero_copy) == (
        "Tuned(dtype=torch.float32, loss_scale=0.5, fused=True, zero_copy=True, issued=0, "
        "zero_weight=0, total_weight=0.0)"
    )


# ----------------------------------------------------------------------- from_pending: values
def test_from_pending_resumes_a_training_window_like_the_reference() -> None:
    """A window of real backward passes, interrupted and resumed through from_pending (state and
    copies of the pending buffers), ends with the reference model's bits for the whole window;
    the restored accumulator has the original's record and repr."""
    generator = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    model = nn.Linear(4, 2)
    shapes = {name: tuple(shape) for name, shape in tracked_shapes(model).items()}
    acc = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=SCALE)
    reference = ReferenceAccumulator(dtype="bfloat16", loss_scale=SCALE)

    def step(accumulator: WeightedGradientsAccumulator, module: nn.Linear, tokens: int) -> None:
        _backward(module, tokens, generator)
        handed_in = {
            name: grad.double().numpy()
            for name, p in module.named_parameters()
            if (grad := p.grad) is not None
        }
        accumulator.accumulate_mean(module, tokens)
        reference.accumulate_mean(shapes, tokens, grads=handed_in)

    for tokens in (3, 1001):
        step(acc, model, tokens)
    record = acc.state_dict()
    pending = {name: buffer.clone() for name, buffer in record["pending"].items()}
    resumed_model = copy.deepcopy(model)
    resumed = WeightedGradientsAccumulator.from_pending(resumed_model, pending, acc.state)
    assert_records_equal(resumed.state_dict(), record)
    assert repr(resumed) == repr(acc)
    for tokens in (5, 2):
        step(resumed, resumed_model, tokens)
    result, expected = resumed.finish_mean(), reference.finish_mean()
    assert result.weight == expected.weight == 3.0 + 1000.0 + 5.0 + 2.0  # bf16: 1001 -> 1000
    assert result.issued == 4 and result.normalized
    for name in shapes:
        assert_matches_reference(result.grads[name], expected.grads[name], name)


def test_from_pending_keeps_the_fused_option() -> None:
    """The accumulator from_pending builds uses state.fused: it reports it, records it, and a
    later mean step is the one-pass step (here 2**-11 + 2**-24, not the two-step 2**-11)."""
    module = one_parameter("cpu", (64,))
    original = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0, fused=True)
    original.accumulate_mean(module, 1, grads={"weight": torch.full((64,), -1.0)})
    pending = {"weight": original.state_dict()["pending"]["weight"]}
    resumed = WeightedGradientsAccumulator.from_pending(module, pending, original.state)
    assert resumed.state.fused is True
    assert resumed.state_dict()["fused"] is True
    assert "fused=True" in repr(resumed)
    # c = w = 1 + 2**-12: one pass gives -1 + c*w exactly (see test_accumulate_mean).
    for accumulator in (original, resumed):
        accumulator.accumulate_mean(
            module, 1.0 + 2.0**-12, grads={"weight": torch.full((64,), 1.0 + 2.0**-12)}
        )
    expected, actual = original.finish_sums(), resumed.finish_sums()
    assert_bitwise_equal(actual.grads["weight"], expected.grads["weight"], "weight")
    sums = actual.grads["weight"]
    assert sums is not None and set(sums.tolist()) == {2.0**-11 + 2.0**-24}


def test_from_pending_adopts_the_callers_buffers_by_byte_range() -> None:
    """Buffers that sit side by side in one storage are adopted whatever their order (a buffer
    ending exactly where another begins shares no byte), and are accumulated into in place;
    buffers without memory (meta device: a dry run of a restore) are adopted too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    storage = torch.zeros(15)
    # The weight's elements 3..14 follow the bias's 0..2 directly; the bias comes second.
    pending = {"weight": storage[3:15].view(3, 4), "bias": storage[0:3]}
    acc = WeightedGradientsAccumulator.from_pending(model, pending, _state())
    grads = {"weight": torch.full((3, 4), 0.5), "bias": torch.tensor([1.0, 2.0, 3.0])}
    acc.accumulate_sum(model, 4, grads=grads)
    assert storage.tolist() == [1.0, 2.0, 3.0] + [0.5] * 12
    assert acc.state.total_weight == 6.0

    meta = nn.Linear(3, 2, device="meta")
    buffers = {"weight": torch.zeros(2, 3, device="meta"), "bias": torch.zeros(2, device="meta")}
    adopted = WeightedGradientsAccumulator.from_pending(meta, buffers, _state())
    assert (adopted.state.issued, adopted.state.total_weight) == (1, 2.0)


# --------------------------------------------------------------------- from_pending: refusals
def test_from_pending_refuses_bad_arguments_naming_them() -> None:
    """Each bad argument raises its own class with an exact message naming the value, and the
    module's parameters and .grad are left as they were."""
    module = one_parameter("cpu", (1,))  # one element: still memory of its own
    module.table = nn.Parameter(torch.zeros(3))
    weight = module.get_parameter("weight")
    weight.grad = torch.full((1,), 3.0)
    before_grads = grads_snapshot(module)
    before_weights = {name: p.detach().clone() for name, p in module.named_parameters()}
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        ({}, {"issued": 1}, TypeError, "state must be an AccumulatorState, got dict"),
        (
            {},
            _state(zero_copy=True),
            ZeroCopyError,
            "from_pending() adopts buffers for the buffered mode; restore a zero-copy "
            "accumulator with load_state_dict() (it puts the buffers into .grad)",
        ),
        (
            [("weight", torch.zeros(1))],
            _state(),
            TypeError,
            "pending must be a mapping, got list",
        ),
        (
            {"weight": [0.0]},
            _state(),
            ParameterMismatchError,
            "pending buffer 'weight' must be a dense tensor, got list (layout None)",
        ),
        (
            {"weight": torch.zeros(1).to_sparse()},
            _state(),
            ParameterMismatchError,
            "pending buffer 'weight' must be a dense tensor, got Tensor (layout torch.sparse_coo)",
        ),
        (
            {"table": torch.zeros(()).expand(3)},
            _state(),
            ParameterMismatchError,
            "pending buffer 'table' has overlapping memory (shape [3], strides [0]): it cannot "
            "be updated in place element by element",
        ),
        (
            {"weight": weight.detach()},
            _state(),
            ParameterMismatchError,
            "pending buffer 'weight' shares the memory of parameter 'weight': accumulating into "
            "it would change that tensor too",
        ),
        (
            {"weight": weight.grad},
            _state(),
            ParameterMismatchError,
            "pending buffer 'weight' shares the memory of parameter 'weight''s .grad: "
            "accumulating into it would change that tensor too",
        ),
    ]
    for pending, state, error, message in cases:
        with pytest.raises(error) as caught:
            WeightedGradientsAccumulator.from_pending(module, pending, state)
        assert type(caught.value) is error
        assert str(caught.value) == message
    for name, parameter in module.named_parameters():
        assert_bitwise_equal(parameter.detach(), before_weights[name], name)
        assert_bitwise_equal(parameter.grad, before_grads[name], f"{name}.grad")


def test_from_pending_refuses_interleaved_strided_buffers() -> None:
    """A strided buffer spans from its first to its last element: another buffer placed in its
    gaps but overlapping one of its elements is refused, naming both (adding into one would
    change the other)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    storage = torch.zeros(30)
    # The bias takes elements 0, 2, 4; the weight starts at element 4.
    pending = {"bias": storage[0:6:2], "weight": storage[4:16].view(3, 4)}
    with pytest.raises(ParameterMismatchError) as caught:
        WeightedGradientsAccumulator.from_pending(model, pending, _state())
    assert str(caught.value) == (
        "pending buffer 'weight' shares the memory of pending buffer 'bias': accumulating into "
        "it would change that tensor too"
    )
    assert not bool(storage.any())
    # A transposed (strided, fully used) weight next to the bias is fine.
    apart = {"bias": storage[0:6:2], "weight": storage[6:18].view(4, 3).t()}
    acc = WeightedGradientsAccumulator.from_pending(model, apart, _state())
    acc.accumulate_sum(model, 1, grads={"weight": torch.ones(3, 4), "bias": torch.ones(3)})
    assert storage.tolist() == [1.0, 0.0] * 3 + [1.0] * 12 + [0.0] * 12


def test_from_pending_through_a_zero_copy_subclass_names_the_call() -> None:
    """A subclass whose constructor makes zero-copy accumulators cannot adopt buffers:
    from_pending raises ZeroCopyError naming from_pending() and the way to add gradients."""

    class ZeroCopyByDefault(WeightedGradientsAccumulator):
        """A user's subclass that defaults to the zero-copy mode."""

        def __init__(self, *, dtype: torch.dtype, loss_scale: float, fused: bool = False) -> None:
            super().__init__(dtype=dtype, loss_scale=loss_scale, fused=fused, zero_copy=True)

    module = one_parameter("cpu", (2,))
    state = _state(issued=0, total_weight=0.0)
    with pytest.raises(ZeroCopyError) as caught:
        ZeroCopyByDefault.from_pending(module, {}, state)
    assert str(caught.value) == (
        "from_pending() on a zero-copy accumulator: its buffers are the parameters' .grad, so "
        "gradients are added by `with acc.microbatch(module, weight=w, kind=...)`"
    )
    weight = module.get_parameter("weight")
    assert np.all(weight.detach().numpy() == 0.0) and weight.grad is None


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("weight", ["abc", [1.0]], ids=["str", "list"])
def test_a_weight_that_is_not_a_number_is_refused_naming_the_argument(
    weight: object, *, mean: bool
) -> None:
    """A weight of a type the module does not read raises InvalidWeightError whose message
    names the argument (``weight``), the value and its type, and the window is unchanged."""
    module = one_parameter("cpu", (2,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    method = accumulator.accumulate_mean if mean else accumulator.accumulate_sum
    pattern = rf"^weight must be a .*got {re.escape(repr(weight))} of type {type(weight).__name__}$"
    with pytest.raises(InvalidWeightError, match=pattern):
        method(module, weight, grads={"weight": torch.ones(2)})  # type: ignore[arg-type]
    assert accumulator.state.issued == 0
