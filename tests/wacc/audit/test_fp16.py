"""The audit's float16 overflow column: the spike mechanism and the measured outcome per loop."""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from wacc.audit.adapters import ADAPTERS
from wacc.audit.models import MODEL_KINDS, add_spike
from wacc.audit.protocol import user_adapter
from wacc.audit.runner import Fp16Run, _fp16_fact, _Runner
from wacc.audit.windows import SPIKE_MICROBATCH, SPIKE_TOKEN, build_fp16_window


def _kinds() -> list[str]:
    """The model kinds this install can build: transformers' models need the frameworks extra,
    the LoRA models peft too (the hf-extras extra)."""
    if importlib.util.find_spec("transformers") is None:
        return ["plain"]
    lora = importlib.util.find_spec("peft") is not None
    return [kind for kind in MODEL_KINDS if lora or not kind.startswith("lora-")]


@pytest.mark.parametrize("kind", _kinds())
def test_spike_token_overflows_float16_and_nothing_else(kind: str) -> None:
    """Under float16 autocast the spiked model's logits are non-finite in the spike microbatch
    only; in float32 the same spiked model is finite everywhere; the clean twin never overflows;
    the spike leaves the parameters as built (every model family, on its own microbatches)."""
    spec = MODEL_KINDS[kind]
    model = spec.build(torch.float32)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    probe = add_spike(model)
    spiked, clean = build_fp16_window(spike=True), build_fp16_window(spike=False)
    assert [bool((mb["input_ids"] == SPIKE_TOKEN).any()) for mb in spiked.microbatches] == [
        k == SPIKE_MICROBATCH for k in range(len(spiked.microbatches))
    ]
    for window in (spiked, clean):
        for k, mb in enumerate(window.microbatches):
            batch = {name: value[None] for name, value in spec.prepare(mb).items()}
            with torch.no_grad():
                with torch.autocast("cpu", dtype=torch.float16):
                    half = spec.loss_family.logits(model, batch)
                full = spec.loss_family.logits(model, batch)
            overflow = window is spiked and k == SPIKE_MICROBATCH
            assert half.dtype == torch.float16
            assert bool(torch.isfinite(half).all()) is not overflow, (window.name, k)
            assert bool(torch.isfinite(full).all())
    assert probe.float16_logits and probe.spike_overflowed and not probe.other_overflowed
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, reference[name])


@pytest.fixture(scope="module")
def runner() -> Iterator[_Runner]:
    with tempfile.TemporaryDirectory(prefix="wacc-audit-test-") as tmp:
        yield _Runner(torch.float32, Path(tmp), lambda: None)


@pytest.mark.parametrize("loop", ["plain", "wacc_torch-mean", "wacc_torch-sum"])
def test_scaler_loops_skip_the_overflowing_window(runner: _Runner, loop: str) -> None:
    """plain (GradScaler) and wacc_torch (WindowLossScaler): the spiked window leaves every
    parameter unchanged and halves the scale; the clean twin is applied (finite, changed) at the
    same scale, so the skip is the spike's."""
    adapter = ADAPTERS[loop]
    clean = runner.fp16(adapter, build_fp16_window(spike=False))
    spiked = runner.fp16(adapter, build_fp16_window(spike=True))
    assert clean.float16 and clean.finite and clean.changed and not clean.other_overflowed
    assert clean.loss_scales is not None and clean.loss_scales[0] == clean.loss_scales[1]
    assert spiked.spike_overflowed and spiked.finite and not spiked.changed
    assert not bool(spiked.delta.any())
    assert spiked.loss_scales is not None
    before, after = spiked.loss_scales
    assert after == before / 2
    assert _fp16_fact(runner, adapter) == f"skips the whole window (scale {before:g} -> {after:g})"


def test_outcome_strings() -> None:
    """A non-finite parameter reads "applies non-finite gradients", unchanged parameters "skips
    the whole window" with the scale, a finite change "applies the window"."""
    base = dict(delta=torch.zeros(1), note="", float16=True, spike_overflowed=True,
                other_overflowed=False)  # fmt: skip
    nan = Fp16Run(changed=True, finite=False, loss_scales=None, **base)  # type: ignore[arg-type]
    kept = Fp16Run(changed=False, finite=True, loss_scales=(8.0, 8.0), **base)  # type: ignore[arg-type]
    moved = Fp16Run(changed=True, finite=True, loss_scales=None, **base)  # type: ignore[arg-type]
    assert nan.outcome() == "applies non-finite gradients"
    assert kept.outcome() == "skips the whole window (scale 8 -> 8, not backed off)"
    assert moved.outcome() == "applies the window"


def test_user_loop_without_the_attribute_is_not_settable(runner: _Runner) -> None:
    """A module:function loop that declares no fp16 gets "not settable" and is never run in
    float16; one that declares it is run (here: a loop with no scaler that steps anyway)."""
    plain_loop = user_adapter("tests.wacc.audit.loops:equal_weighting")
    assert plain_loop.fp16 == "not settable"
    assert _fp16_fact(runner, plain_loop) == "not settable"
    declared = user_adapter("tests.wacc.audit.loops:fp16_no_scaler")
    assert declared.fp16 is None
    fact = _fp16_fact(runner, declared)
    assert fact == "applies non-finite gradients (no loss scaler)"


def test_builtin_loops_declare_a_float16_path() -> None:
    """Every built-in adapter that runs here runs its float16 path (timm as far as its adapter
    goes), except the frameworks new to the audit, which have none on the CPU and say so; the
    rows that never run say why instead."""
    without = {"torchtune", "torchtune+wacc", "torchtitan", "litgpt", "litgpt+wacc",
               "litgpt-bf16-mixed", "litgpt-bf16-mixed+wacc", "olmo-core",
               "olmo-core+wacc"}  # fmt: skip
    # Rows audited for another reason, whose float16 path is measured on a sibling row.
    elsewhere = {
        "wacc_torch-fsdp": "no float16 mode",  # wacc_torch-mean and -sum: the same window
    }
    runs = [a for a in ADAPTERS.values()
            if a.unsupported is None and a.name not in without | set(elsewhere)]  # fmt: skip
    assert all(adapter.fp16 is None for adapter in runs), [a.name for a in runs if a.fp16]
    assert all(str(ADAPTERS[name].fp16).startswith("no float16 path") for name in without)
    assert {name: ADAPTERS[name].fp16 for name in elsewhere} == elsewhere
    assert all(a.unavailable() == f"not run: {a.unsupported}" for a in ADAPTERS.values()
               if a.unsupported is not None)  # fmt: skip
