"""The window every framework integration shares (``wacc_torch.integrations._token_window``):
token-weighted mean, zero-target and overflowing windows, its checkpoint record, and the
integrations' optional imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.wacc_torch.backward_bounds import Terms, embedding_terms, head_terms, window_bound
from tests.wacc_torch.support import assert_bitwise_equal
from wacc_torch import RecordError, WindowLossScaler
from wacc_torch.integrations._token_window import TokenWindow, count_tokens

IGNORE = -100


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 11)).double()


def _microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three rows of unequal target counts (4, 0, 1): ids and per-position labels."""
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [2, 4, 6, 8, 10]])
    labels = ids.clone()
    labels[1] = IGNORE  # no target at all
    labels[2, :4] = IGNORE
    labels[0, 4] = IGNORE
    return [(ids[k : k + 1], labels[k : k + 1]) for k in range(3)]


def _mean_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE)


def _run(
    window: TokenWindow, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    for ids, labels in batches:
        (_mean_loss(model, ids, labels) * window.loss_scale).backward()
        window.add(model, count_tokens(labels, shift=False))
    return window.finish(model)


def test_window_hands_over_the_token_weighted_mean() -> None:
    """Means of microbatches with 4, 0 and 1 targets give the gradient of the whole window's token
    mean (one backward over every row; the zero-target row's NaN mean is never read), W = 5."""
    model, batches = _model(), _microbatches()
    window = TokenWindow()
    assert _run(window, model, batches) is True
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    _mean_loss(model, ids, labels).backward()
    assert window.window_tokens == 5.0
    bound = _bound(model, batches)
    for name, parameter in model.named_parameters():
        error = (got[name] - parameter.grad).abs()
        assert bool((error <= bound[name]).all()), (
            f"{name}: error/bound = {float((error / bound[name]).max())}"
        )


def _bound(
    model: nn.Sequential, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The float64 bound of ``tests/wacc_torch/backward_bounds.py`` for the window (one batch
    per microbatch) plus the one for the full-batch backward it is compared with."""
    embedding, head = model[0], model[1]
    assert isinstance(embedding, nn.Embedding) and isinstance(head, nn.Linear)

    def terms(ids: torch.Tensor, labels: torch.Tensor) -> Terms:
        rows = embedding.weight.detach()[ids.reshape(-1)]
        parameters, inputs = head_terms(
            head.weight, head.bias, rows, labels.reshape(-1), "float64", ignore_index=IGNORE
        )
        table = embedding_terms(inputs, ids.reshape(-1), embedding.num_embeddings, "float64")
        return {"0.weight": table, "1.weight": parameters["weight"], "1.bias": parameters["bias"]}

    ids = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    windowed = window_bound([terms(*b) for b in batches], 5.0, "float64")
    full = window_bound([terms(ids, labels)], 5.0, "float64")
    return {name: windowed[name] + full[name] for name in windowed}


def test_window_without_targets_steps_nothing() -> None:
    """A window of zero-target microbatches has no mean: finish says no step, .grad stays None."""
    model, batches = _model(), _microbatches()
    window = TokenWindow()
    assert _run(window, model, [batches[1], batches[1]]) is False
    assert window.window_tokens == 0.0 and window.applied is False
    assert all(p.grad is None for p in model.parameters())
    assert _run(window, model, batches) is True  # the next window starts clean


def test_overflowing_window_is_skipped_whole_and_the_scale_backs_off() -> None:
    """One inf gradient in the window: finish says no step, every .grad stays None (an SGD step
    changes nothing), and the scaler halves its scale for the next window."""
    model, batches = _model(), _microbatches()
    window = TokenWindow(loss_scaler=WindowLossScaler(init_scale=2.0**8))
    head = model[1]
    assert isinstance(head, nn.Linear)
    hook = head.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = [p.detach().clone() for p in model.parameters()]
    assert _run(window, model, batches[:1]) is False
    hook.remove()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert window.loss_scale == 2.0**7
    assert _run(window, model, batches) is True  # the next window, at the new scale, applies


def test_mid_window_record_resumes_bit_for_bit(tmp_path: Path) -> None:
    """The window's state saved after one microbatch (torch.save, torch.load weights_only) and
    loaded into a fresh TokenWindow ends with the uninterrupted gradient, bit for bit, and the
    scaler's state comes back with it."""
    batches = _microbatches()
    model = _model()
    straight = TokenWindow(loss_scaler=WindowLossScaler(init_scale=2.0**4))
    _run(straight, model, batches)
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model = _model()
    first = TokenWindow(loss_scaler=WindowLossScaler(init_scale=2.0**4))
    (_mean_loss(model, *batches[0]) * first.loss_scale).backward()
    first.add(model, count_tokens(batches[0][1], shift=False))
    torch.save(first.state_dict(), tmp_path / "window.pt")
    model = _model()
    resumed = TokenWindow(loss_scaler=WindowLossScaler(init_scale=2.0**4))
    resumed.load_state_dict(torch.load(tmp_path / "window.pt", weights_only=True), model)
    assert resumed.pending == 1
    assert _run(resumed, model, batches[1:]) is True
    for name, parameter in model.named_parameters():
        assert_bitwise_equal(parameter.grad, expected[name], name)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"format_version": 2}, "format_version 2"),
        ({"scaler": None}, "has no loss scaler"),
        ({"extra": 1}, "keys"),
        ({"record": {"dtype": "float13"}}, "float13"),
    ],
)
def test_bad_window_state_raises_and_changes_nothing(
    change: dict[str, object], fragment: str
) -> None:
    """A damaged window state is a RecordError naming what is wrong; the window keeps its
    pending microbatch and its scale."""
    model, batches = _model(), _microbatches()
    window = TokenWindow(loss_scaler=WindowLossScaler(init_scale=2.0**4))
    (_mean_loss(model, *batches[0]) * window.loss_scale).backward()
    window.add(model, 4)
    state = {**window.state_dict(), "scaler": {**window.state_dict()["scaler"], "scale": 2.0}}
    with pytest.raises(RecordError, match=fragment):
        window.load_state_dict({**state, **change}, model)
    assert window.pending == 1 and window.loss_scale == 2.0**4


def test_integrations_import_their_framework_only_on_use() -> None:
    """``import wacc_torch`` and the integration modules import no framework; with transformers
    and accelerate unimportable, using an integration is one ImportError naming the extra."""
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None; sys.modules['accelerate'] = None\n"
        "import wacc_torch, wacc_torch.integrations\n"
        "import wacc_torch.integrations.transformers as t\n"
        "import wacc_torch.integrations.accelerate as a\n"
        "for use in (lambda: t.WaccTrainer, lambda: a.WaccAccumulation(None, None)):\n"
        "    try:\n"
        "        use()\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert "needs 'transformers'" in lines[0] and "wacc[frameworks]" in lines[0]
    assert "needs 'accelerate'" in lines[1] and "wacc[frameworks]" in lines[1]
    plain = (
        "import sys, wacc_torch\n"
        "sys.exit('transformers' in sys.modules or 'accelerate' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", plain], check=False).returncode == 0
