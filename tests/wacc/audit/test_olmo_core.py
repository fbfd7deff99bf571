"""OLMo-core's ``TransformerTrainModule.train_batch`` driven on the CPU at world size 1 (its
``loss_div_factor`` path): runs where ``olmo_core`` imports, skips cleanly elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core.train.train_module", reason="ai2-olmo-core is not installed")

from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.adapters.olmo_core import _Transformer  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import LoopTask  # noqa: E402
from wacc.audit.runner import run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402


def test_train_batch_divides_every_micro_batch_by_the_batch_count() -> None:
    """On the unequal and zero-target windows the float64 run is within the float32 bound and
    the count divided by is the window's: ``batch_num_tokens_for_loss`` over the shifted labels
    (a sequence's first token is no target), one count for the whole rank batch."""
    windows = [build_window(w) for w in ("unequal", "zero")]
    result = run_audit([ADAPTERS["olmo-core"]], windows)
    for cell, window in zip(result.cells, windows, strict=True):
        assert cell.status == "ok", cell.status
        assert cell.counted == window.total_targets
        assert cell.verdict == "pass" and cell.deterministic


def test_each_micro_batch_gets_the_same_divide_factor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``split_batch`` makes one micro-batch per sequence (``rank_microbatch_size`` = L), and
    every micro-batch's forward is handed the same ``loss_div_factor``, the batch's count."""
    seen: list[_Transformer] = []
    init = _Transformer.__init__

    def spy(self: _Transformer, model: torch.nn.Module) -> None:
        init(self, model)
        seen.append(self)

    monkeypatch.setattr(_Transformer, "__init__", spy)
    window = build_window("unequal")
    task = LoopTask(MODEL_KINDS["plain"], torch.float32, window, tmp_path)
    ADAPTERS["olmo-core"].run(task)
    (wrapped,) = seen
    assert wrapped.divisors == [float(window.total_targets)] * len(window.microbatches)
