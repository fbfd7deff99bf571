"""The pixparse loop (``loss /= accum_steps`` with timm's ``NativeScaler``), run without timm: the
stand-in for the timm row, whose torchvision does not import beside the CPU torch here."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.wacc.audit.expected import assert_mean_weighted_error
from wacc.audit.adapters import ADAPTERS
from wacc.audit.adapters.timm import NativeScaler
from wacc.audit.models import MODEL_KINDS
from wacc.audit.runner import AuditResult, Cell, run_audit
from wacc.audit.truth import compute_truth
from wacc.audit.windows import build_window

WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS["pixparse"]], [build_window(w) for w in WINDOWS])


def _cell(result: AuditResult, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.window == window]
    assert cell.status == "ok", cell.status
    return cell


@pytest.mark.parametrize("window", WINDOWS)
def test_loss_over_accum_steps_weighs_microbatches_equally(
    result: AuditResult, window: str
) -> None:
    """``loss /= accum_steps`` hands the optimizer Σ_k mean_k / K (the scaler's S is divided out
    by its step): the float64 run's error is that prediction's to float64 rounding, FAIL on
    the unequal and zero-target windows, a pass on the 4 x 64 control."""
    cell = _cell(result, window)
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(window))
    assert_mean_weighted_error(cell.semantic_rel_l2, truth, 1 / len(truth.targets), "float64")
    assert cell.counted is None and cell.finite and cell.deterministic
    if window == "equal":
        assert cell.verdict == "pass" and cell.ratio <= 1.0
    else:
        assert cell.verdict == "FAIL" and cell.semantic_rel_l2 > 0.5


def test_a_checkpoint_of_model_and_scaler_loses_the_pending_gradient(result: AuditResult) -> None:
    """The loop saves the model's and the scaler's state after 2 of 4 microbatches; neither
    holds ``.grad``, so the resumed step has only microbatches 2 and 3: (g_2/n_2 + g_3/n_3) / 4
    (measured error = that prediction's to float32 rounding, float32 run); its float16 path's
    GradScaler skips the window whose one microbatch overflows and halves the scale."""
    (fact,) = result.facts
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window("unequal"))
    assert fact.resume == "pending gradient lost"
    assert_mean_weighted_error(fact.resume_rel_l2, truth, 1 / 4, "float32", microbatches=(2, 3))
    assert fact.loss_scale == "not settable"
    assert fact.fp16 == "skips the whole window (scale 65536 -> 32768)"


def test_the_restated_scaler_steps_only_on_need_update() -> None:
    """``NativeScaler(loss, optimizer, need_update=False)`` only accumulates the scaled
    gradient; with ``need_update=True`` the optimizer steps on the unscaled sum (SGD, lr 1:
    the parameter moves by minus the sum of the losses' gradients)."""
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = NativeScaler(device="cpu")
    scaler((weight * 3.0).sum(), optimizer, need_update=False)
    assert torch.equal(weight.detach(), torch.tensor([1.0, 2.0]))
    assert weight.grad is not None and torch.equal(weight.grad, torch.full((2,), 3.0 * 2**16))
    scaler((weight * 5.0).sum(), optimizer, need_update=True)
    assert torch.equal(weight.detach(), torch.tensor([1.0 - 8.0, 2.0 - 8.0]))


def test_the_stand_in_states_what_it_restates() -> None:
    """The stand-in names the timm code it restates, and its scaler keeps timm's interface
    (the pixparse call passes ``parameters=`` and ``need_update=``)."""
    adapter = ADAPTERS["pixparse"]
    assert "timm.utils.NativeScaler" in adapter.checked and adapter.requires == ("torch",)
    parameters = inspect.signature(NativeScaler.__call__).parameters
    assert {"loss", "optimizer", "parameters", "create_graph", "need_update"} <= set(parameters)
    assert NativeScaler.state_dict_key == "amp_scaler"
