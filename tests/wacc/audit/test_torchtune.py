"""torchtune's full-finetune recipe (``FullFinetuneRecipeSingleDevice.train``) driven on the CPU:
runs where torchtune imports (torchtune 0.6.1 needs a torchao that has
``torchao.dtypes.nf4tensor`` and ``int4_weight_only``: 0.15.0 at most), skips cleanly elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchtune", reason="torchtune (with a torchao <= 0.15) is not installed")

from tests.wacc.audit.expected import prediction_bound, rel_l2_tolerance  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.metrics import relative_l2  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import LoopTask  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.truth import compute_truth  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402
from wacc_ref.bounds import TOLERANCES  # noqa: E402

WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS["torchtune"]], [build_window(w) for w in WINDOWS])


@pytest.mark.parametrize("window", WINDOWS)
def test_the_recipe_counts_each_sequences_first_label(result: AuditResult, window: str) -> None:
    """The recipe weights microbatch k's mean loss by its unshifted label count n_k + 1 (its
    loss averages over the n_k shifted targets) and divides by Σ (n_k + 1): the float64 run's
    error is that prediction's, from the truth's per-microbatch gradients, and the count it
    divides by is Σ (n_k + 1) over the labelled microbatches. Tolerance: the recipe's factor
    ``1 / num_tokens`` is a float32 tensor even in the float64 run, which scales the gradient F
    by (1 + δ), |δ| <= 2**-24, and so moves r = ‖F − T‖/‖T‖ by at most 2**-24 ‖F‖/‖T‖ <=
    2**-24 (1 + r) (float32's unit roundoff, wacc_ref.bounds.TOLERANCES); the float64 sums add
    :func:`tests.wacc.audit.expected.rel_l2_tolerance` of the prediction's float64 bound. The
    4 x 64 window weighs every microbatch alike and passes; the others fail."""
    (cell,) = [c for c in result.cells if c.window == window]
    assert cell.status == "ok", cell.status
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(window))
    weights = [n + 1 if n else 0 for n in truth.targets]
    predicted = sum(
        (
            w * g / n
            for w, g, n in zip(weights, truth.microbatch_sums, truth.targets, strict=True)
            if n
        ),
        np.zeros_like(truth.gradient),
    ) / sum(weights)
    r = relative_l2(predicted, truth.gradient)
    terms = [
        (w / (n * sum(weights)), g)
        for w, g, n in zip(weights, truth.microbatch_sums, truth.targets, strict=True)
        if n
    ]
    in_float64 = prediction_bound(terms, "float64")
    factor = TOLERANCES["float32"].unit_roundoff * (1 + r)
    tolerance = factor + rel_l2_tolerance(in_float64, truth.gradient, cell.semantic_rel_l2, r)
    assert abs(cell.semantic_rel_l2 - r) <= tolerance
    assert cell.counted == sum(weights) and cell.finite and cell.deterministic
    assert cell.verdict == ("pass" if window == "equal" else "FAIL")


def test_loop_facts(result: AuditResult) -> None:
    """The recipe reads one batch per backward (1 of 4 read at the first), has no checkpoint
    inside an epoch, no fixed loss scale and no float16 path."""
    (fact,) = result.facts
    assert fact.status == "ok" and fact.version == "0.6.1"
    assert fact.needs_total == "no (1 of 4 read)"
    assert fact.resume.startswith("n/a: the recipe checkpoints at the end of an epoch")
    assert fact.loss_scale == "not settable"


def test_bfloat16_accumulates_in_bfloat16(tmp_path: Path) -> None:
    """``--dtype bfloat16``: the recipe's parameters, and so its accumulated gradients, are
    bfloat16 (no autocast, no loss scaler): the gradient the optimizer gets is bfloat16."""
    task = LoopTask(MODEL_KINDS["plain"], torch.bfloat16, build_window("unequal"), tmp_path)
    ADAPTERS["torchtune"].run(task)
    assert task.captured is not None
    seen = sorted({str(g.dtype) for g in task.captured.values()})
    assert seen == ["torch.bfloat16"]
