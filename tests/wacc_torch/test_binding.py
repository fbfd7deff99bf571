"""semantics §3: the tracked parameter set a window binds to, what a binding derives from it, and
the messages of the refusals of a module that cannot be bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wacc_torch import ParameterMismatchError, WeightedGradientsAccumulator
from wacc_torch._binding import binding_of, tracked_parameters


@pytest.mark.parametrize(
    ("devices", "on_cpu"),
    [
        pytest.param(("cpu", "cpu"), True, id="all-cpu"),
        pytest.param(("meta", "meta"), False, id="all-meta"),
        pytest.param(("meta", "cpu"), True, id="meta-and-cpu"),
    ],
)
def test_binding_records_whether_any_tracked_parameter_is_on_the_cpu(
    devices: tuple[str, str], on_cpu: bool
) -> None:
    """A binding's ``on_cpu`` is True exactly when some tracked parameter lives on the CPU."""
    module = nn.Module()
    module.a = nn.Parameter(torch.zeros(3, device=devices[0]))
    module.b = nn.Parameter(torch.zeros(2, 2, device=devices[1]))
    binding = binding_of(tracked_parameters(module))
    assert binding.names == ("a", "b")
    assert binding.on_cpu is on_cpu


@pytest.mark.parametrize(
    ("module", "error", "named"),
    [
        pytest.param("not a module", TypeError, r"got str$", id="str"),
        pytest.param(nn.ReLU(), ParameterMismatchError, r"\(ReLU\)", id="no-parameters"),
    ],
)
def test_a_module_that_cannot_be_bound_is_refused_naming_its_type(
    module: object, error: type[Exception], named: str
) -> None:
    """A non-module, or a module with no requires_grad parameter, is refused by a message that
    names the type of what was passed."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    with pytest.raises(error, match=named):
        accumulator.accumulate_sum(module, 1)  # type: ignore[arg-type]


def test_a_submodule_dict_replaced_wholesale_mid_window_is_read_anew() -> None:
    """Replacing a module's ``_modules`` dict wholesale (same names, same shapes) within a window
    rebinds the call to the new submodule's parameters: its gradients are the ones added."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 1))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float64, loss_scale=1.0)
    # loss = sum(w . x + b): d/dw = x, d/db = 1, exact in every dtype.
    model(torch.tensor([[1.0, 2.0]])).sum().backward()
    accumulator.accumulate_sum(model, 1)
    model._modules = {"0": nn.Linear(2, 1)}  # the old layer keeps its .grad (x = [1, 2])
    model(torch.tensor([[3.0, 5.0]])).sum().backward()
    accumulator.accumulate_sum(model, 1)
    grads = accumulator.finish_sums().grads
    expected = {"0.weight": [[4.0, 7.0]], "0.bias": [2.0]}
    assert grads.keys() == expected.keys()
    for name, values in expected.items():
        grad = grads[name]
        assert grad is not None
        assert torch.equal(grad, torch.tensor(values, dtype=torch.float64)), name
