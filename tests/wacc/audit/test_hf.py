"""PEFT LoRA under `transformers.Trainer` and TRL's `SFTTrainer` (padding, packing), audited
through their real code paths (the `hf-extras` extra; skipped without it, where the audit shows
"not installed" rows)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("trl")

from tests.wacc.audit.expected import assert_rel_l2_matches, prediction_bound  # noqa: E402
from wacc.audit.adapters import ADAPTERS, trl_sft  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import Adapter, LoopRun, LoopTask  # noqa: E402
from wacc.audit.runner import AuditResult, Cell, run_audit  # noqa: E402
from wacc.audit.truth import compute_truth  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

PEFT = ("peft-lora-gpt2", "peft-lora-llama")
WINDOWS = ("unequal", "equal", "zero")
FLOAT32_ACCURATE = "float32"  # a float64 run whose model casts its loss to float32 (GPT-2, Llama)


def _packing_fp32(task: LoopTask) -> LoopRun:
    return trl_sft._run(task, packing=True, bf16=False)


# The packing path with bf16 off: what packing alone does to the weighting (a test-only loop).
PACKING_FP32 = dataclasses.replace(trl_sft.PACKING, name="trl-sft-packing-fp32", run=_packing_fp32)


def _cell(result: AuditResult, loop: str, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.adapter == loop and c.window == window]
    assert cell.status == "ok", cell.status
    return cell


def _audit(adapters: list[Adapter], windows: tuple[str, ...]) -> tuple[AuditResult, list[str]]:
    """The audit, run from an empty working directory (returned: what it left there)."""
    with tempfile.TemporaryDirectory(prefix="wacc-hf-cwd-") as cwd:
        before = Path.cwd()
        os.chdir(cwd)
        try:
            result = run_audit(adapters, [build_window(w) for w in windows])
        finally:
            os.chdir(before)
        return result, sorted(os.listdir(cwd))


@pytest.mark.parametrize("kind", ["lora-gpt2", "lora-llama"])
def test_lora_truth_is_the_adapters_gradient_and_both_factors_move(kind: str) -> None:
    """The truth of a LoRA model is over exactly its trainable parameters (the lora_A / lora_B
    factors; the base is frozen), and with init_lora_weights=False every factor has a nonzero
    gradient; PEFT's default init (B = 0) would make every A gradient exactly zero."""
    spec = MODEL_KINDS[kind]
    truth = compute_truth(spec, torch.float32, build_window("unequal"))
    model = spec.build(torch.float32)
    trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
    assert truth.names == trainable and len(trainable) < len(list(model.parameters()))
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    sizes = [p.numel() for n, p in model.named_parameters() if p.requires_grad]
    parts = np.split(truth.gradient, np.cumsum(sizes)[:-1])
    assert all(np.abs(part).max() > 0 for part in parts)

    from peft import LoraConfig, get_peft_model

    base = MODEL_KINDS[kind.removeprefix("lora-")].build(torch.float64)
    config = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_dropout=0.0, fan_in_fan_out=kind == "lora-gpt2"
    )
    with warnings.catch_warnings():  # PEFT's deprecation notices
        warnings.simplefilter("ignore")
        default = get_peft_model(base, config)
    batch = {k: v[None] for k, v in spec.prepare(build_window("unequal").microbatches[2]).items()}
    family = spec.loss_family
    family.loss_sum(family.logits(default, batch), batch["labels"]).backward()
    grads = {n: p.grad for n, p in default.named_parameters() if p.requires_grad}
    assert set(grads) == set(trainable)
    assert all((g is None or not g.any()) == (".lora_A." in n) for n, g in grads.items())


@pytest.fixture(scope="module")
def peft_audit() -> tuple[AuditResult, list[str]]:
    return _audit([ADAPTERS[n] for n in PEFT], WINDOWS)


@pytest.mark.slow  # 2 loops x 3 windows through Trainer (~50 s on 2 cores)
@pytest.mark.parametrize("window", WINDOWS)
def test_lora_llama_counts_the_true_tokens(
    peft_audit: tuple[AuditResult, list[str]], window: str
) -> None:
    """LoRA on LlamaForCausalLM: Trainer inspects the base model, whose loss_type maps to
    ForCausalLMLoss, counts the shifted labels (the true count) and the adapters' float64
    gradient is within the float32 bound."""
    cell = _cell(peft_audit[0], "peft-lora-llama", window)
    assert cell.counted == cell.true_count
    assert cell.verdict == "pass" and cell.finite and cell.deterministic


@pytest.mark.slow
@pytest.mark.parametrize("window", WINDOWS)
def test_lora_gpt2_divides_by_the_unshifted_count(
    peft_audit: tuple[AuditResult, list[str]], window: str
) -> None:
    """LoRA on GPT2LMHeadModel: GPT-2's loss_type is unset, so Trainer counts the unshifted
    labels, N' = Σ_k (n_k + 1) over microbatches with targets, while the loss shifts them: the
    adapters get the truth times N / N', relative error 1 - N / N' (to float32 accuracy: GPT-2's
    own loss casts to float32), a FAIL."""
    cell = _cell(peft_audit[0], "peft-lora-gpt2", window)
    targets = build_window(window).targets
    unshifted = sum(n + 1 for n in targets if n)
    assert cell.counted == unshifted and cell.true_count == sum(targets)
    predicted = 1 - sum(targets) / unshifted
    truth = compute_truth(
        MODEL_KINDS[ADAPTERS["peft-lora-gpt2"].model], torch.float32, build_window(window)
    )
    # The adapters' gradient is Σ_k g_k / N' (truth times N / N') to float32 rounding.
    bound = prediction_bound([(1 / unshifted, g) for g in truth.microbatch_sums], FLOAT32_ACCURATE)
    assert_rel_l2_matches(cell.semantic_rel_l2, predicted, bound, truth.gradient)
    assert cell.verdict == "FAIL"


@pytest.mark.slow
def test_lora_facts(peft_audit: tuple[AuditResult, list[str]]) -> None:
    """Both LoRA loops read the window first, resume from checkpoint-1 by replaying the window
    bit-identically (Trainer saves and reloads the adapter), have no fixed loss scale and no
    float16 compute off-GPU, and leave nothing in the working directory."""
    result, left = peft_audit
    replay = "no mid-window checkpoint; resume replays the window (bit-identical)"
    for fact in result.facts:
        assert fact.needs_total == "yes" and fact.resume == replay
        assert fact.loss_scale == "not settable"
        assert fact.fp16.startswith("no float16 compute")
    assert left == []


def test_sft_config_defaults_to_bf16() -> None:
    """SFTConfig's default precision is bf16 (`bf16 = not fp16` when unset), also on CPU."""
    from trl import SFTConfig

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TrainingArguments' deprecation notices
        config = SFTConfig(output_dir=out, use_cpu=True, report_to="none")
    assert config.bf16 is True and config.fp16 is False


def test_packing_makes_fewer_longer_microbatches() -> None:
    """With max_length = the window's longest sequence, TRL's BFD packing makes P rows,
    1 < P < K, every target of the window kept: the packed rows are what is accumulated."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    window = build_window("unequal")
    task = LoopTask(MODEL_KINDS["llama"], torch.float32, window, Path("."))
    rows = trl_sft._rows(task, packing=True)
    width = max(len(ids) for ids in rows["input_ids"])
    packed = pack_dataset(Dataset.from_dict(rows), width, "bfd")
    assert 1 < len(packed) < len(window.microbatches)
    labels = [label for row in packed["labels"] for label in row]
    kept = sum(1 for label in labels if label != -100)
    assert kept == window.total_targets + sum(1 for n in window.targets if n)  # + position 0s


@pytest.fixture(scope="module")
def trl_audit() -> tuple[AuditResult, list[str]]:
    loops = [ADAPTERS["trl-sft-fp32"], ADAPTERS["trl-sft"], ADAPTERS["trl-sft-packing"]]
    return _audit([*loops, PACKING_FP32], ("unequal", "zero"))


@pytest.mark.slow  # 4 loops x 2 windows through SFTTrainer (~60 s on 2 cores)
@pytest.mark.parametrize("loop", ["trl-sft-fp32", "trl-sft-packing-fp32"])
@pytest.mark.parametrize("window", ["unequal", "zero"])
def test_sft_in_float32_divides_by_the_true_count(
    trl_audit: tuple[AuditResult, list[str]], loop: str, window: str
) -> None:
    """With bf16 off, SFTTrainer's loss (Σ -log_probs / num_items_in_batch, Trainer's shifted
    count) is the window's token mean, padded or packed (packed sequences neither see each other
    nor lose a target): within the float32 bound."""
    cell = _cell(trl_audit[0], loop, window)
    assert cell.counted == cell.true_count
    assert cell.verdict == "pass" and cell.finite and cell.deterministic


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["trl-sft", "trl-sft-packing"])
@pytest.mark.parametrize("window", ["unequal", "zero"])
def test_sft_default_precision_rounds_the_head_to_bf16(
    trl_audit: tuple[AuditResult, list[str]], loop: str, window: str
) -> None:
    """With SFTConfig's defaults (bf16 autocast, also on CPU) the count is still the true one,
    but TRL's fused LM head computes in the autocast dtype even on the float64 copy
    (ChunkedLogProbFunction: compute_dtype = torch.get_autocast_dtype(...)): the float64 run
    is bfloat16-accurate, not float32-accurate (error above 2**-16, below 2**-7), a FAIL."""
    cell = _cell(trl_audit[0], loop, window)
    assert cell.counted == cell.true_count
    assert 2.0**-16 < cell.semantic_rel_l2 < 2.0**-7
    assert cell.verdict == "FAIL"


@pytest.mark.slow
def test_sft_facts(trl_audit: tuple[AuditResult, list[str]]) -> None:
    """SFTTrainer prepares the whole dataset before training (read first); with padding it
    resumes by replaying the window bit-identically; packing has no resume row (two packed
    copies mix); no float16 compute off-GPU; nothing left in the working directory."""
    result, left = trl_audit
    facts = {f.adapter.name: f for f in result.facts}
    assert all(f.needs_total == "yes" for f in facts.values())
    replay = "no mid-window checkpoint; resume replays the window (bit-identical)"
    assert facts["trl-sft"].resume == facts["trl-sft-fp32"].resume == replay
    assert facts["trl-sft-packing"].resume.startswith("n/a: ")
    assert all(f.fp16.startswith("no float16 compute") for f in facts.values())
    assert left == []
