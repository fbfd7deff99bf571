"""The "Fix your framework" page of OLMo-core runs as written against the real framework (skips
without ai2-olmo-core; run by `tox -e audit-new`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.fix_your_framework import run_page


def test_olmo_core_train_module_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's ``TrainModule`` is built by OLMo-core's own constructor; one ``train_batch``
    (the ``Trainer`` it reports metrics to stood in for) over 2 sequences of 7 and 3 targets, one
    per micro-batch, leaves the gradient of their mean in ``.grad``: ``window_tokens`` is 10."""
    pytest.importorskip("olmo_core.train.train_module", reason="ai2-olmo-core is not installed")
    monkeypatch.chdir(tmp_path)
    namespace = run_page("olmo-core.md", tmp_path)
    module = namespace["train_module"]
    module._trainer = SimpleNamespace(
        record_metric=lambda *_, **__: None, record_ce_loss=lambda *_, **__: None
    )
    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(input_ids, -100)
    labels[0, :7], labels[1, :3] = input_ids[0, 1:], input_ids[1, 1:4]
    batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
    module.train_batch(batch, dry_run=False)
    assert module.window_tokens == 10.0
    assert all(p.grad is not None and p.grad.isfinite().all() for p in module.model.parameters())
