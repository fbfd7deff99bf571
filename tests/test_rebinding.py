"""Changing the tracked set between windows (gradual unfreezing, adapters on and off, a model
moved or resized): a window with nothing in it (issued == 0) binds to the current trainable
parameters, in wacc_torch and wacc_ref alike; inside a window a change still raises."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import wacc_torch
from tests.wacc_torch.support import DEVICES
from wacc_ref.accumulator import ReferenceAccumulator
from wacc_ref.errors import ParameterMismatchError as ReferenceMismatchError
from wacc_torch.records import CHECKSUM_KEY


class Adapted(nn.Module):
    """A base layer and an adapter that training switches on and off."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.base = nn.Linear(3, 2, device=device)
        self.adapter = nn.Linear(2, 2, bias=False, device=device)


def _trainable(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad}


def _grads(module: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(p, scale) for n, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device", DEVICES)
def test_the_set_changes_between_windows_alike_in_both_packages(device: str) -> None:
    """Freeze, unfreeze and re-freeze across windows: each window binds to the trainable set and
    both packages hold the same state (same record checksum) after every window."""
    module = Adapted(device)
    production = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=2.0)
    reference = ReferenceAccumulator(dtype="float32", loss_scale=2.0)
    schedule = [  # requires_grad of (base, adapter) per window
        (False, True),  # adapter only
        (True, True),  # unfrozen
        (True, False),  # adapter off
    ]
    for window, (base, adapter) in enumerate(schedule):
        module.base.requires_grad_(base)
        module.adapter.requires_grad_(adapter)
        for step in range(2):
            grads = _grads(module, 0.5 + window + step)
            production.accumulate_sum(module, 3 + step, grads=grads)
            reference.accumulate_sum(
                _trainable(module),
                3 + step,
                grads={n: g.cpu().double().numpy() for n, g in grads.items()},
            )
        produced, modelled = production.state_dict(), reference.state_dict()
        assert produced["param_names"] == list(_trainable(module)) == modelled["param_names"]
        assert produced[CHECKSUM_KEY] == modelled[CHECKSUM_KEY], f"window {window}"
        production.finish_mean()
        reference.finish_mean()


def test_a_frozen_parameter_mid_window_is_named_as_frozen() -> None:
    """Freezing inside a window (even one of zero-weight batches only) raises, naming the
    parameter as frozen, and changes nothing; wacc_ref reports it as no longer trainable."""
    module = Adapted()
    production = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    reference = ReferenceAccumulator(dtype="float32", loss_scale=1.0)
    production.accumulate_sum(module, 0, grads={})
    reference.accumulate_sum(_trainable(module), 0, grads={})
    before = production.state_dict()
    module.adapter.requires_grad_(False)
    with pytest.raises(wacc_torch.ParameterMismatchError, match=r"frozen.*'adapter.weight'"):
        production.accumulate_sum(module, 1, grads={})
    with pytest.raises(ReferenceMismatchError, match=r"no longer trainable.*'adapter.weight'"):
        reference.accumulate_sum(_trainable(module), 1, grads={})
    assert production.state_dict()[CHECKSUM_KEY] == before[CHECKSUM_KEY]
    assert reference.state.issued == 1


def test_a_resized_parameter_binds_in_a_new_window_after_a_restore() -> None:
    """A record of an empty (finished) window binds; the next window may bind another shape."""
    module = Adapted()
    accumulator = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    accumulator.accumulate_sum(module, 1, grads=_grads(module, 1.0))
    accumulator.finish_sums()
    restored = wacc_torch.WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    restored.load_state_dict(accumulator.state_dict(), module)
    module.adapter = nn.Linear(2, 5, bias=False)  # resized between windows
    restored.accumulate_sum(module, 1, grads=_grads(module, 1.0))
    assert restored.state_dict()["param_shapes"][-1] == [5, 2]
