"""transformers.Trainer and accelerate audited for real on tiny models (needs the extra)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import AuditResult, Cell, run_audit  # noqa: E402
from wacc.audit.windows import IGNORE_INDEX, build_window  # noqa: E402

LOOPS = ("trainer-hub", "trainer-llama", "trainer-plain", "accelerate", "accelerate-variable")
WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[n] for n in LOOPS], [build_window(w) for w in WINDOWS])


def _cell(result: AuditResult, loop: str, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.adapter == loop and c.window == window]
    assert cell.status == "ok", cell.status
    return cell


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["accelerate", "trainer-plain"])
def test_equal_weighting_flagged_on_unequal_passes_equal(result: AuditResult, loop: str) -> None:
    """The documented accumulate() loop and Trainer with a plain nn.Module weigh microbatches
    equally: FAIL on 1/7/200/3, pass on the 4x64 control."""
    assert _cell(result, loop, "unequal").verdict == "FAIL"
    assert _cell(result, loop, "unequal").counted is None
    assert _cell(result, loop, "equal").verdict == "pass"


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["trainer-hub", "trainer-llama", "accelerate-variable"])
@pytest.mark.parametrize("window", WINDOWS)
def test_count_decides_the_verdict(result: AuditResult, loop: str, window: str) -> None:
    """The loops that prefetch a window count pass exactly when their count is the true one
    (the shifted labels), and that count is either the true or the unshifted one."""
    cell = _cell(result, loop, window)
    microbatches = build_window(window).microbatches
    unshifted = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in microbatches)
    assert cell.counted in (cell.true_count, unshifted)
    assert (cell.verdict == "pass") == (cell.counted == cell.true_count)
    assert cell.finite and cell.deterministic


@pytest.mark.slow
def test_framework_facts(result: AuditResult) -> None:
    """Trainer reads the window first, has no mid-window checkpoint and on resume replays the
    window bit-identically; accelerate's save_state/load_state loses the pending gradient; no
    fixed loss scale anywhere."""
    facts = {f.adapter.name: f for f in result.facts}
    for name in ("trainer-hub", "trainer-llama", "trainer-plain", "accelerate-variable"):
        assert facts[name].needs_total == "yes"
    assert facts["accelerate"].needs_total.startswith("no")
    for name in ("trainer-hub", "trainer-plain"):
        replay = "no mid-window checkpoint; resume replays the window (bit-identical)"
        assert facts[name].resume == replay
        assert facts[name].resume_rel_l2 == _cell(result, name, "unequal").rel_l2
    for name in ("accelerate", "accelerate-variable"):
        assert facts[name].resume == "pending gradient lost"
        assert facts[name].resume_rel_l2 != _cell(result, name, "unequal").rel_l2
    assert all(f.loss_scale == "not settable" for f in result.facts)
    assert facts["trainer-llama"].truth_casts  # Llama's RMSNorm runs in float32


@pytest.mark.slow
def test_fp16_off_gpu_is_float32_without_a_scaler(result: AuditResult) -> None:
    """TrainingArguments(fp16=True) and Accelerator(mixed_precision="fp16") on CPU: accelerate
    makes no GradScaler and no float16 autocast, so the spike never overflows and the window is
    applied (measured: logits never float16, parameters changed and finite)."""
    expected = "no float16 compute, nothing overflows: applies the window (no GradScaler off-GPU)"
    for fact in result.facts:
        assert fact.fp16 == expected, fact.adapter.name
