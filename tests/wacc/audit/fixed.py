"""What a ``<loop>+wacc`` row must show in the audit (shared by the tests of each integration):
every window a pass with the window's true token count, the mid-window resume restored bit for
bit, and a float16 overflow skipping the whole window while the clean twin is applied."""

from __future__ import annotations

import torch

from tests.wacc.audit.expected import float64_ratio_limit
from wacc.audit.adapters import ADAPTERS
from wacc.audit.models import MODEL_KINDS
from wacc.audit.runner import AuditResult, LoopFacts
from wacc.audit.truth import compute_truth

WINDOWS = ("unequal", "equal", "zero", "longtail")  # every window the audit knows


def assert_every_window_passes(result: AuditResult, loop: str, *, exact: bool = True) -> None:
    """Each window's cell passes (float64 run within the bound, the audited-dtype run within
    it too), divides by the true count, is finite and deterministic; with ``exact``, the
    float64 run carries float64 rounding only (its err/bound within
    :func:`tests.wacc.audit.expected.float64_ratio_limit`)."""
    cells = [c for c in result.cells if c.adapter == loop]
    assert [c.window for c in cells] == list(WINDOWS)
    for cell in cells:
        assert cell.status == "ok", (cell.window, cell.status)
        assert cell.verdict == "pass", (cell.window, cell.semantic_ratio)
        assert cell.ratio <= 1.0, (cell.window, cell.ratio)
        if exact:
            (window,) = [w for w in result.windows if w.name == cell.window]
            model = MODEL_KINDS[ADAPTERS[loop].model]
            truth = compute_truth(model, getattr(torch, result.dtype), window)
            limit = float64_ratio_limit(truth, result.dtype)
            assert cell.semantic_ratio <= limit, (cell.window, cell.semantic_ratio, limit)
        assert cell.counted == cell.true_count, (cell.window, cell.counted)
        assert cell.finite and cell.deterministic


def facts(result: AuditResult, loop: str) -> LoopFacts:
    """The per-loop facts of ``loop``."""
    (fact,) = [f for f in result.facts if f.adapter.name == loop]
    return fact


def assert_points_to(loop: str, fix: str) -> None:
    """The failing loop names its fix (registered right after it) and the source of its cause."""
    names = list(ADAPTERS)
    assert ADAPTERS[loop].fixed_by == fix and names[names.index(loop) + 1] == fix
    cause = ADAPTERS[loop].cause
    assert cause is not None and ADAPTERS[fix].fixed_by is None and ADAPTERS[fix].cause is None
