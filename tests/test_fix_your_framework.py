"""The "Fix your framework" pages of the loops written without a framework (nanoGPT, pixparse)
run as written: they train, weigh each microbatch by its tokens, skip nothing on clean float
windows and resume a window from its record; the pages' index and the README name only what
exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.docs_support import DOCS
from tests.fix_your_framework import PAGES, blocks, run_page


@pytest.mark.parametrize("page", ["nanogpt.md", "pixparse.md"])
def test_each_page_has_one_block(page: str) -> None:
    """Each page shows its loop as one Python block, built on WeightedGradientsAccumulator."""
    (block,) = blocks(page)
    assert "WeightedGradientsAccumulator(" in block and "accumulate_mean(" in block


def test_nanogpt_loop_runs_and_resumes_mid_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The changed train.py loop trains 3 iterations (every window applied: the bfloat16
    autocast never overflows) and its mid-window checkpoint resumes 2 pending micro-steps whose
    weight is the tokens they held."""
    monkeypatch.chdir(tmp_path)
    namespace = run_page("nanogpt.md", tmp_path)
    state = namespace["resumed"].state
    assert state.issued == 2 and state.total_weight > 0
    assert namespace["scaler"].scale == 2.0**16  # restored, never backed off
    assert "2 micro-steps pending; continue at 2" in capsys.readouterr().out


def test_pixparse_train_step_applies_each_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The changed train_step under float16 autocast, as the page says: the first window
    overflows at 2**16 and is skipped whole (the scale halves), the second is applied; the model
    stays finite."""
    monkeypatch.chdir(tmp_path)
    namespace = run_page("pixparse.md", tmp_path)
    assert namespace["applied"] == [False, True]
    assert namespace["scaler"].scale == 2.0**15
    assert all(torch.isfinite(p).all() for p in namespace["model"].parameters())


def test_the_index_and_the_readme_name_only_integrations_and_rows_that_exist() -> None:
    """Every `+wacc` row the index page's table (and the README's paragraph) names is a built-in
    audit loop, every page it links is there, and every class or function it names in the "what
    you change" column is public in ``wacc_torch.integrations`` (a renamed integration fails
    here, not in a user's hands)."""
    import importlib
    import pkgutil

    import wacc_torch.integrations
    from wacc.audit.adapters import ADAPTERS

    index = (PAGES / "index.md").read_text(encoding="utf-8")
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"`([\w.-]+\+wacc|wacc_torch-\w+)`", index))
    assert rows and rows <= set(ADAPTERS), rows - set(ADAPTERS)
    fixes = {a.fixed_by for a in ADAPTERS.values() if a.fixed_by}
    assert fixes <= rows, f"fixes the index does not list: {fixes - rows}"
    for link in re.findall(r"\]\(([\w-]+\.md)\)", index):
        assert (PAGES / link).is_file(), link
    public: set[str] = set()
    for module in pkgutil.iter_modules(wacc_torch.integrations.__path__):
        if not module.name.startswith("_"):
            loaded = importlib.import_module(f"wacc_torch.integrations.{module.name}")
            public.update(getattr(loaded, "__all__", ()))
    named = {
        name
        for text in (index, readme[readme.index("**Fix your framework.**") :])
        for name in re.findall(r"`([A-Z]\w+)`", text)
        if name.startswith(("Wacc", "TokenWeighted"))
    }
    assert named and named <= public, named - public
