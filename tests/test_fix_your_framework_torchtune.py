"""The torchtune "Fix your framework" page runs as written against the real torchtune (skips
without it; run by `tox -e audit-new`): its config line is the one the `torchtune+wacc` audit row
runs, and its block shows the recipe's count becoming the loss's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fix_your_framework import PAGES, run_page

pytest.importorskip("torchtune", reason="torchtune (with a torchao <= 0.15) is not installed")


def test_the_config_line_is_the_audit_rows() -> None:
    """The page's YAML block sets ``collate_fn`` to exactly the dotted path the
    ``torchtune+wacc`` row hands the recipes."""
    from wacc.audit.adapters.torchtune_wacc import COLLATE

    text = (PAGES / "torchtune.md").read_text(encoding="utf-8")
    (yaml,) = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert yaml.strip() == f"collate_fn: {COLLATE}"


def test_the_block_counts_what_the_loss_averages_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolved as the recipe resolves ``collate_fn``: torchtune's collate counts the
    text-completion row's first label (6 counted for 5 targets), the integration's counts the 5
    targets the shifted loss reads."""
    monkeypatch.chdir(tmp_path)
    counts = run_page("torchtune.md", tmp_path)["counts"]
    assert counts["torchtune.data.padded_collate_sft"] == (6, 5)
    assert counts["wacc_torch.integrations.torchtune.padded_collate_sft"] == (5, 5)
