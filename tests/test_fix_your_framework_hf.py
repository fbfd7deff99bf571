"""The "Fix your framework" sections for Hugging Face (docs/fix-your-framework/transformers.md and
accelerate.md): every Python block runs as written, on the audit's tiny models and windows, and
does what the text around it says (needs the ``frameworks`` extra; TRL's block the
``hf-extras``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.docs_support import DOCS  # noqa: E402
from wacc.audit.models import MODEL_KINDS, add_spike  # noqa: E402
from wacc.audit.windows import Window, build_fp16_window, build_window  # noqa: E402

PAGES = DOCS / "fix-your-framework"
TRANSFORMERS = PAGES / "transformers.md"
ACCELERATE = PAGES / "accelerate.md"
# Each block of each page, by a marker only it holds (the page's blocks are these, no more).
MARKERS = {
    TRANSFORMERS: ("# was: Trainer(...)", "shift_labels=True", "class WaccSFTTrainer", "resumed =",
                   "fp16=True"),
    ACCELERATE: ("register_for_checkpointing", "last=index"),
}  # fmt: skip


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def _run(page: Path, marker: str, namespace: dict[str, Any]) -> None:
    (block,) = [b for b in _blocks(page) if marker in b]
    exec(compile(block, str(page), "exec"), namespace)


def _dataset(kind: str, window: Window) -> list[dict[str, torch.Tensor]]:
    return [MODEL_KINDS[kind].prepare(mb) for mb in window.microbatches]


def _model(kind: str = "gpt2") -> torch.nn.Module:
    return MODEL_KINDS[kind].build(torch.float32)


def test_each_block_is_run_by_a_test() -> None:
    """The pages hold exactly the blocks these tests run, each once."""
    for page, markers in MARKERS.items():
        blocks = _blocks(page)
        assert len(blocks) == len(markers), page
        assert all(sum(m in b for b in blocks) == 1 for m in markers), page


def test_trainer_blocks_divide_by_the_true_count_and_checkpoint_the_window(
    tmp_path: Path,
) -> None:
    """``WaccTrainer`` trains two windows of GPT-2 dividing by the true target count (211, where
    the Trainer counts 215), writes ``wacc_window.pt`` into each checkpoint, and the resume block
    starts from the last one; the plain module with ``shift_labels=True`` counts 211 too."""
    window = build_window("unequal")
    namespace: dict[str, Any] = {
        "output_dir": str(tmp_path / "run"), "model": _model(),
        "train_dataset": _dataset("gpt2", window),
    }  # fmt: skip
    _run(TRANSFORMERS, "# was: Trainer(...)", namespace)
    assert namespace["trainer"].window_tokens == window.total_targets == 211
    for step in (1, 2):
        saved = tmp_path / "run" / f"checkpoint-{step}" / "wacc_window.pt"
        state = torch.load(saved, weights_only=True)
        assert state["record"]["issued"] == 0  # the Trainer saves between windows
    _run(TRANSFORMERS, "resumed =", namespace)
    assert namespace["resumed"].state.global_step == 2
    namespace["my_module"] = _model("plain")
    namespace["train_dataset"] = _dataset("plain", window)
    _run(TRANSFORMERS, "shift_labels=True", namespace)
    namespace["trainer"].train()
    assert namespace["trainer"].window_tokens == 211


@pytest.mark.parametrize("spike", [False, True])
def test_trainer_fp16_block_skips_an_overflowing_window_whole(tmp_path: Path, spike: bool) -> None:
    """On CPU the float16 block applies a clean window at scale 4096 and skips the window whose
    float16 logits overflow, parameters unchanged, backing the scale off to 2048."""
    model = _model()
    probe = add_spike(model)
    before = [p.detach().clone() for p in model.parameters()]
    namespace: dict[str, Any] = {
        "output_dir": str(tmp_path), "model": model,
        "train_dataset": _dataset("gpt2", build_fp16_window(spike=spike)),
    }  # fmt: skip
    from transformers import TrainingArguments

    from wacc_torch.integrations.transformers import WaccTrainer

    # What the page's first block imported (the blocks are read in order).
    namespace.update(TrainingArguments=TrainingArguments, WaccTrainer=WaccTrainer)
    _run(TRANSFORMERS, "fp16=True", namespace)
    assert probe.float16_logits and probe.spike_overflowed == spike
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert unchanged == spike
    assert namespace["trainer"].wacc.loss_scaler.scale == (2048.0 if spike else 4096.0)


def test_sft_trainer_block_counts_the_true_targets(tmp_path: Path) -> None:
    """TRL's ``SFTTrainer`` with the mixin (``bf16=False``) divides by the true count."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig

    from wacc.audit.adapters.trl_sft import _quiet, _tokenizer

    namespace: dict[str, Any] = {}
    _run(TRANSFORMERS, "class WaccSFTTrainer", namespace)
    window = build_window("unequal")
    rows = _dataset("llama", window)
    with _quiet():  # TRL's and transformers' deprecation warnings about their own defaults
        data = Dataset.from_dict(
            {k: [r[k].tolist() for r in rows] for k in ("input_ids", "labels")}
        )
        config = SFTConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=4,
            max_steps=1, use_cpu=True, report_to="none", bf16=False, save_strategy="no",
        )  # fmt: skip
        trainer = namespace["WaccSFTTrainer"](
            model=_model("llama"), args=config, train_dataset=data, processing_class=_tokenizer()
        )
        trainer.train()
    assert trainer.window_tokens == window.total_targets


def test_accelerate_blocks_divide_by_the_true_count(tmp_path: Path) -> None:
    """The ``accumulate()`` block steps once per window of four, dividing by each window's true
    count; the variable-size block (the same objects) divides by its window's."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a script of its own: no state
    GradientState._reset_state()  # left by a Trainer run before (end_of_dataloader set)
    first, second = build_window("unequal"), build_window("longtail")
    batches = [{k: v[None] for k, v in mb.items()} for mb in first.microbatches]
    batches += [{k: v[None] for k, v in mb.items()} for mb in second.microbatches[:4]]
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    namespace: dict[str, Any] = {"model": model, "optimizer": optimizer, "batches": batches}
    _run(ACCELERATE, "register_for_checkpointing", namespace)
    assert len(steps) == 2
    assert namespace["wacc"].window_tokens == sum(second.targets[:4])
    namespace["window"] = batches[:4]
    _run(ACCELERATE, "last=index", namespace)
    assert len(steps) == 3 and namespace["wacc"].window_tokens == first.total_targets
