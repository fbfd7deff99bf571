"""litgpt's full fine-tuning loop (``finetune/full.py`` ``fit``'s accumulation on a real
``lightning.Fabric``), at precision ``32-true`` and ``bf16-mixed``: runs where litgpt imports,
skips cleanly elsewhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is not installed")

from tests.wacc.audit.expected import assert_mean_weighted_error  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.truth import compute_truth  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

WINDOWS = ("unequal", "equal")


@pytest.fixture(scope="module")
def result() -> AuditResult:
    adapters = [ADAPTERS["litgpt"], ADAPTERS["litgpt-bf16-mixed"]]
    return run_audit(adapters, [build_window(w) for w in WINDOWS])


@pytest.mark.parametrize("window", WINDOWS)
def test_loss_over_accumulation_iters_weighs_microbatches_equally(
    result: AuditResult, window: str
) -> None:
    """``32-true``: the loop hands the optimizer Σ_k mean_k / K (``chunked_cross_entropy``'s
    mean over the microbatch's targets divided by ``gradient_accumulation_iters``): its float64
    run's error is that prediction's to float64 rounding; FAIL on the unequal window, pass on
    4 x 64."""
    (cell,) = [c for c in result.cells if c.adapter == "litgpt" and c.window == window]
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(window))
    assert_mean_weighted_error(cell.semantic_rel_l2, truth, 1 / len(truth.targets), "float64")
    assert cell.counted is None and cell.deterministic
    assert cell.verdict == ("pass" if window == "equal" else "FAIL")


def test_bf16_mixed_is_the_same_weighting_rounded_in_bfloat16(result: AuditResult) -> None:
    """``bf16-mixed`` (Fabric's CPU autocast to bfloat16) has the same verdicts, and on the 4 x 64
    window, where the weighting is right, its float32 run is far above the float32 bound (the
    bfloat16 forward) while the verdict, taken on the float64 run, passes."""
    cells = {(c.adapter, c.window): c for c in result.cells}
    for window in WINDOWS:
        assert cells["litgpt-bf16-mixed", window].verdict == cells["litgpt", window].verdict
    equal = cells["litgpt-bf16-mixed", "equal"]
    assert equal.verdict == "pass" and equal.ratio > 100 and cells["litgpt", "equal"].ratio <= 1
