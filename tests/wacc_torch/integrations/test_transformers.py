"""``wacc_torch.integrations.transformers``: what ``WaccTrainer`` adds to a real ``Trainer`` run
beyond the audit's rows (tests/wacc/audit/test_fixes_hf.py): which labels it counts, the loss it
logs, the float16 scaler carried through the Trainer's checkpoint, and its refusals (needs the
``frameworks`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import TrainingArguments  # noqa: E402

from wacc.audit.models import MODEL_KINDS, add_spike  # noqa: E402
from wacc.audit.windows import Window, build_fp16_window, build_window  # noqa: E402
from wacc_torch import WindowLossScaler  # noqa: E402
from wacc_torch.integrations.transformers import WaccTrainer, shifts_labels  # noqa: E402


def _args(tmp_path: Path, **options: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=4,
        max_steps=1, learning_rate=0.0, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, train_sampling_strategy="sequential",
    )  # fmt: skip
    return TrainingArguments(**{**base, **options})


def _data(kind: str, window: Window) -> list[dict[str, torch.Tensor]]:
    return [MODEL_KINDS[kind].prepare(mb) for mb in window.microbatches]


@pytest.mark.parametrize(("kind", "shifted"), [("gpt2", True), ("llama", True), ("bert", False),
                                               ("t5", False)])  # fmt: skip
def test_the_shift_is_read_from_the_model_class(kind: str, shifted: bool) -> None:
    """Causal LMs' losses read labels[..., 1:]; a masked LM's and a seq2seq model's do not."""
    assert shifts_labels(MODEL_KINDS[kind].build(torch.float32)) is shifted


def test_a_model_of_unknown_kind_must_say_its_shift(tmp_path: Path) -> None:
    """A plain module: ValueError naming its class and shift_labels, before any training."""
    model = MODEL_KINDS["plain"].build(torch.float32)
    with pytest.raises(ValueError, match=r"TinyCausalLM's loss reads: pass shift_labels=True"):
        WaccTrainer(model=model, args=_args(tmp_path), train_dataset=[])


def test_the_logged_loss_is_the_windows_token_mean(tmp_path: Path) -> None:
    """The Trainer logs the window's token-mean loss (Σ n_k mean_k / N, to its 4 digits), not the
    mean of the microbatch means."""
    window = build_window("unequal")
    model = MODEL_KINDS["plain"].build(torch.float32)
    data = _data("plain", window)
    with torch.no_grad():
        means = [float(model(input_ids=b["input_ids"][None], labels=b["labels"][None])["loss"])
                 for b in data]  # fmt: skip
    token_mean = sum(m * n for m, n in zip(means, window.targets, strict=True))
    token_mean /= window.total_targets
    args = _args(tmp_path, logging_strategy="steps", logging_steps=1)
    trainer = WaccTrainer(model=model, args=args, train_dataset=data, shift_labels=True)
    trainer.train()
    (logged,) = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == pytest.approx(token_mean, abs=5e-5)
    assert abs(sum(means) / len(means) - token_mean) > 1e-2  # what the Trainer would log


def test_a_skipped_windows_scale_survives_the_checkpoint(tmp_path: Path) -> None:
    """After the float16 overflow window is skipped (scale 4096 -> 2048), checkpoint-1 holds the
    scaler's state, and a fresh WaccTrainer resuming from it continues at 2048."""
    model = MODEL_KINDS["gpt2"].build(torch.float32)
    add_spike(model)
    data = _data("gpt2", build_fp16_window(spike=True))
    args = _args(tmp_path, fp16=True, learning_rate=1.0, save_strategy="steps", save_steps=1)
    trainer = WaccTrainer(model=model, args=args, train_dataset=data,
                          loss_scaler=WindowLossScaler(init_scale=2.0**12))  # fmt: skip
    trainer.train()
    assert trainer.wacc.applied is False and trainer.wacc.loss_scale == 2048.0
    fresh = MODEL_KINDS["gpt2"].build(torch.float32)
    resumed = WaccTrainer(model=fresh, args=args, train_dataset=data,
                          loss_scaler=WindowLossScaler(init_scale=2.0**12))  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.wacc.loss_scale == 2048.0


def test_a_loss_scaler_without_the_cpu_float16_path_is_refused(tmp_path: Path) -> None:
    """loss_scaler= with fp16 off: ValueError saying it is for the CPU float16 path."""
    model = MODEL_KINDS["gpt2"].build(torch.float32)
    with pytest.raises(ValueError, match="CPU float16 path only \\(fp16 is off here\\)"):
        WaccTrainer(model=model, args=_args(tmp_path), train_dataset=[],
                    loss_scaler=WindowLossScaler())  # fmt: skip
