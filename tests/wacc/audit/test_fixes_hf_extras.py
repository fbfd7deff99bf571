"""``peft-lora-gpt2+wacc``: PEFT LoRA on GPT-2 under ``WaccTrainer``, run by the audit's own
runner on a window the ``peft-lora-gpt2`` row fails (it counts 215 tokens for 211): the
adapters' gradient is the token mean, divided by the true count, resumed bit for bit from the
step checkpoint, and its float16 path skips an overflowing window whole (needs the
``hf-extras`` extra: ``tox -e audit-extras``)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from tests.wacc.audit.test_fixes_hf import REPLAYED, SKIPPED  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402


def test_lora_gpt2_wacc_row_divides_by_the_true_count() -> None:
    """On ``unequal`` (211 targets) the LoRA row with ``WaccTrainer`` passes with 211 counted,
    resumes bit-identically from ``checkpoint-1`` and skips the float16 overflow window whole."""
    result = run_audit([ADAPTERS["peft-lora-gpt2+wacc"]], [build_window("unequal")])
    (cell,) = result.cells
    (fact,) = result.facts
    assert cell.verdict == "pass", (cell.semantic_ratio, cell.status)
    assert cell.counted == cell.true_count == 211 and cell.deterministic
    assert fact.resume == REPLAYED
    assert fact.fp16 == SKIPPED
