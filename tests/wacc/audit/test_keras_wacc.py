"""``keras+wacc`` through Keras 3's real ``model.fit`` on the torch backend (the `keras` extra;
skipped without it): ``TokenWeightedTrainStep`` passes every window where the optimizer's own
``gradient_accumulation_steps`` fails, and keeps the pending gradient across a mid-window
``model.save`` (the record among the model's own variables).  The skip looks for the package
without importing it (an import would pick Keras's default backend, TensorFlow)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed (the `keras` extra)", allow_module_level=True)

from tests.wacc.audit.fixed import (  # noqa: E402
    WINDOWS,
    assert_every_window_passes,
    assert_points_to,
    facts,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.adapters.keras import FLOAT32_WEIGHTS  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOP = "keras+wacc"


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS[LOOP]], [build_window(w) for w in WINDOWS])


def test_every_window_passes_with_the_true_count(result: AuditResult) -> None:
    """The model's train_step weighs each masked mean by its targets and applies once per
    window: a pass on every window with the true count (the float64 run keeps Keras's float32
    mask quotients, said in the note, so it is not float64-exact)."""
    assert_every_window_passes(result, LOOP, exact=False)
    assert FLOAT32_WEIGHTS in facts(result, LOOP).notes


def test_mid_window_resume_and_fixed_loss_scale(result: AuditResult) -> None:
    """`model.save` after 2 of 4 batches and `load_weights` into a fresh model: the record saved
    with the model's own variables makes the step bit-identical; `loss_scale_factor` is divided
    out once."""
    fact = facts(result, LOOP)
    assert fact.resume == "restored (bit-identical)"
    assert fact.loss_scale == "divided out once (bit-identical)"


def test_float16_is_keras_own_limit(result: AuditResult) -> None:
    """mixed_float16 casts Keras variables only: the wrapped torch module computes in float32,
    as in the keras row, so there is no float16 overflow to skip (and the window is applied)."""
    assert facts(result, LOOP).fp16 == "no float16 compute, nothing overflows: applies the window"


def test_the_failing_loop_points_to_its_fix() -> None:
    """The keras row names keras+wacc (registered right after it) and base_optimizer.py's line."""
    assert_points_to("keras", LOOP)
    assert "base_optimizer.py:567" in (ADAPTERS["keras"].cause or "")
