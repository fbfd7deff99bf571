"""``wacc_torch.integrations.accelerate``: ``WaccAccumulation``'s refusals and its checkpoint
object (the loops themselves run in tests/wacc/audit/test_fixes_hf.py; needs the ``frameworks``
extra)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from wacc_torch import RecordError, WindowLossScaler  # noqa: E402
from wacc_torch.integrations.accelerate import WaccAccumulation, count_tokens  # noqa: E402


def _accelerator() -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)  # a script of its own
    GradientState._reset_state()
    return Accelerator(gradient_accumulation_steps=2, cpu=True)


def test_a_loss_scaler_without_fp16_is_refused() -> None:
    """loss_scaler= without mixed_precision="fp16": ValueError naming why."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="mixed_precision is not fp16"):
        WaccAccumulation(_accelerator(), model, loss_scaler=WindowLossScaler())


def test_the_checkpoint_object_keeps_the_pending_window() -> None:
    """``state_dict`` mid-window holds the pending microbatch; a window of another model's
    parameters is refused by ``load_state_dict`` (RecordError), which leaves the window alone."""
    accelerator = _accelerator()
    model = torch.nn.Linear(3, 5)
    wacc = WaccAccumulation(accelerator, model)
    labels = torch.tensor([[1, -100, 2, 3]])  # targets after the shift: 2 and 3
    with accelerator.accumulate(model):
        loss = model(torch.ones(1, 3)).square().mean()
        assert wacc.backward(loss, count_tokens(labels, shift=True)) is None  # not the last
    state = wacc.state_dict()
    assert state["record"]["issued"] == 1 and state["record"]["total_weight"] == 2.0
    other = WaccAccumulation(accelerator, torch.nn.Linear(3, 4))
    with pytest.raises(RecordError):
        other.load_state_dict(state)
    assert other.window.pending == 0
