"""Keras 3 on the torch backend audited through ``model.fit`` with ``SGD(
gradient_accumulation_steps=K)`` over the plain causal LM in a ``TorchModuleWrapper`` (the `keras`
extra; skipped without it, where the audit shows a "not installed" row).

The skip looks for the package without importing it: ``pytest.importorskip("keras")`` would import
Keras on its default backend (TensorFlow, absent here), fail, and skip the file every time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

if importlib.util.find_spec("keras") is None:
    pytest.skip("keras is not installed (the `keras` extra)", allow_module_level=True)

from tests.wacc.audit.expected import (  # noqa: E402
    assert_rel_l2_matches,
    mean_weighted_error,
    prediction_bound,
    rel_l2_tolerance,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.adapters.keras import _fit, _quiet, import_keras, resume  # noqa: E402
from wacc.audit.metrics import relative_l2  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import LoopTask  # noqa: E402
from wacc.audit.runner import AuditResult, Cell, run_audit  # noqa: E402
from wacc.audit.truth import Truth, compute_truth  # noqa: E402
from wacc.audit.windows import Window, build_fp16_window, build_window  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def audit() -> tuple[AuditResult, list[str], str | None]:
    """The audit, run from an empty working directory (returned: what it left there, and
    ``KERAS_BACKEND`` afterwards)."""
    with tempfile.TemporaryDirectory(prefix="wacc-keras-cwd-") as cwd:
        before = Path.cwd()
        os.chdir(cwd)
        try:
            result = run_audit([ADAPTERS["keras"]], [build_window(w) for w in WINDOWS])
        finally:
            os.chdir(before)
        return result, sorted(os.listdir(cwd)), os.environ.get("KERAS_BACKEND")


def _cell(result: AuditResult, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.window == window]
    assert cell.status == "ok", cell.status
    return cell


def _task(window: str, workdir: Path, **options: object) -> LoopTask:
    return LoopTask(model_spec=MODEL_KINDS["plain"], dtype=torch.float32,
                    window=build_window(window), workdir=workdir, **options)  # type: ignore[arg-type]  # fmt: skip


def keras_weighted(truth: Truth, window: Window) -> NDArray[np.float64]:
    """``Σ_k c_k S_k / K`` from the float64 per-microbatch sums ``S_k``: Keras's masked mean
    weighs microbatch k's token losses by ``f32(T_k / n_k)`` (``apply_mask``) and its sum by
    ``f32(1 / T_k)`` (``reduce_values``), ``T_k`` its label positions, ``n_k`` its targets, both
    quotients in float32 (``divide_no_nan`` takes its dtype from ``dtypes.result_type``, which
    turns float64 into float32); a microbatch without targets weighs 0; the optimizer divides the
    sum of the K gradients by K."""
    total = np.zeros_like(truth.gradient)
    for c, g in keras_terms(truth, window):
        total += c * g
    return total / len(truth.targets)


def keras_terms(truth: Truth, window: Window) -> list[tuple[float, NDArray[np.float64]]]:
    """The terms ``(c_k, S_k)`` of :func:`keras_weighted` before its division by K (the
    microbatches with targets)."""
    terms = []
    for k, n in enumerate(truth.targets):
        positions = np.float32(window.microbatches[k]["labels"].shape[-1] - 1)
        if n:
            c = float(positions / np.float32(n)) * float(np.float32(1) / positions)
            terms.append((c, truth.microbatch_sums[k]))
    return terms


def keras_bound(truth: Truth, window: Window, dtype: str) -> NDArray[np.float64]:
    """How far a run in ``dtype`` may be from :func:`keras_weighted` (``prediction_bound`` of
    its terms ``c_k / K``)."""
    k = len(truth.targets)
    return prediction_bound([(c / k, g) for c, g in keras_terms(truth, window)], dtype)


@pytest.mark.parametrize("window", WINDOWS)
def test_each_microbatch_weighs_the_same(
    audit: tuple[AuditResult, list[str], str | None], window: str
) -> None:
    """Keras's loss is each microbatch's masked mean and the optimizer averages the K gradients
    (`(g + acc_g) / steps`): Σ_k mean_k / K, the mean's weights rounded to float32
    (:func:`keras_weighted`). The float64 run's error is that prediction's to float64 rounding
    (:func:`tests.wacc.audit.expected.rel_l2_tolerance`; on the unequal window the float64
    weights 1/n_k miss it by more: the float32 rounding is Keras's):
    FAIL on the unequal and zero-target windows, exact to rounding on the 4x64 control (the
    float32 run within the float32 bound too); Keras never divides by a window count."""
    result, _, _ = audit
    cell = _cell(result, window)
    built = build_window(window)
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, built)
    predicted = relative_l2(keras_weighted(truth, built), truth.gradient)
    in_float64 = keras_bound(truth, built, "float64")
    assert_rel_l2_matches(cell.semantic_rel_l2, predicted, in_float64, truth.gradient)
    if window == "unequal":
        weights_in_float64 = mean_weighted_error(truth, 1 / len(truth.targets))
        tolerance = rel_l2_tolerance(in_float64, truth.gradient, weights_in_float64, predicted)
        assert abs(weights_in_float64 - predicted) > tolerance
    assert cell.counted is None and cell.finite and cell.deterministic
    if window == "equal":
        assert cell.verdict == "pass" and cell.ratio <= 1.0
        in_float32 = keras_bound(truth, built, "float32")
        assert_rel_l2_matches(cell.rel_l2, predicted, in_float32, truth.gradient)
    else:
        assert cell.verdict == "FAIL" and cell.semantic_rel_l2 > 0.5


def test_mid_window_save_keeps_the_pending_window(
    audit: tuple[AuditResult, list[str], str | None],
) -> None:
    """`model.save` after 2 of 4 microbatches, a fresh model compiled and its optimizer built,
    `load_weights`, the last 2 microbatches: the optimizer's iteration counter and gradient
    accumulators come back, so the step is the uninterrupted one, bit for bit (its error is the
    unequal cell's, which is Σ_k mean_k / 4's); the fixed `loss_scale_factor` divides out
    exactly."""
    result, _, _ = audit
    (fact,) = result.facts
    cell = _cell(result, "unequal")
    assert fact.resume == "restored (bit-identical)"
    assert fact.resume_rel_l2 == cell.rel_l2
    built = build_window("unequal")
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, built)
    predicted = relative_l2(keras_weighted(truth, built), truth.gradient)
    bound = keras_bound(truth, built, "float32")
    assert_rel_l2_matches(fact.resume_rel_l2, predicted, bound, truth.gradient)
    assert fact.loss_scale == "divided out once (bit-identical)"
    assert fact.needs_total == "no (1 of 4 read)"


def _uninterrupted(tmp_path: Path) -> dict[str, torch.Tensor]:
    task = _task("unequal", tmp_path)
    ADAPTERS["keras"].run(task)
    assert task.captured is not None and task.steps_seen == 1
    return task.captured


def test_save_weights_keeps_the_pending_window_too(tmp_path: Path) -> None:
    """`model.save_weights` (`.weights.h5`) writes the same optimizer variables: resumed through
    it, the step is the uninterrupted one, bit for bit."""
    task = _task("unequal", tmp_path, checkpoint_after=2)
    with _quiet(None):
        model = resume(task, save_weights=True)
        _fit(model, task, 2)
    assert task.captured is not None and task.steps_seen == 1
    expected = _uninterrupted(tmp_path / "twin")
    assert task.captured.keys() == expected.keys()
    assert all(torch.equal(task.captured[n], expected[n]) for n in expected)


def test_loading_into_an_unbuilt_optimizer_loses_the_window(tmp_path: Path) -> None:
    """Without `model.optimizer.build(...)` before `load_weights`, Keras has no optimizer
    variables to load into: it warns and skips them, the counter starts again at 0 and the last
    2 microbatches of the window end in no step at all."""
    keras = import_keras()
    task = _task("unequal", tmp_path, checkpoint_after=2)
    with keras.device("cpu"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = resume(task, build_optimizer=False)
        _fit(model, task, 2)
    skipped = [w for w in caught if "Skipping variable loading for optimizer" in str(w.message)]
    assert len(skipped) == 1
    assert task.captured is None and task.steps_seen == 0
    assert int(model.optimizer._iterations.value) == 2


def test_recorded_gradient_is_the_one_applied(tmp_path: Path) -> None:
    """At a learning rate of 1 (the float16 run's), the parameters move by exactly minus the
    recorded gradient: the hook records what the update step applies, nothing else."""
    window = build_fp16_window(spike=False)
    task = LoopTask(model_spec=MODEL_KINDS["plain"], dtype=torch.float32, window=window,
                    workdir=tmp_path, fp16=True)  # fmt: skip
    ADAPTERS["keras"].run(task)
    assert task.captured is not None and task.steps_seen == 1
    fresh = dict(MODEL_KINDS["plain"].build(torch.float32).named_parameters())
    after = dict(task.models[-1].named_parameters())
    for name, gradient in task.captured.items():
        assert torch.equal(after[name].detach(), fresh[name].detach() - gradient), name


def test_fp16_is_float32_under_a_dynamic_loss_scale_optimizer(
    tmp_path: Path, audit: tuple[AuditResult, list[str], str | None]
) -> None:
    """The `mixed_float16` policy makes `compile` wrap SGD in `LossScaleOptimizer` (dynamic,
    2**15), but the wrapped torch module reads its own float32 parameters: no float16 logits,
    the spike does not overflow, the window is applied and the scale stays; the global policy
    is back to float32 afterwards."""
    result, _, _ = audit
    assert result.facts[0].fp16 == "no float16 compute, nothing overflows: applies the window"
    task = LoopTask(model_spec=MODEL_KINDS["plain"], dtype=torch.float32,
                    window=build_fp16_window(spike=True), workdir=tmp_path, fp16=True)  # fmt: skip
    run = ADAPTERS["keras"].run(task)
    assert run.loss_scales == (2.0**15, 2.0**15)
    assert task.spikes and not any(s.float16_logits for s in task.spikes)
    assert import_keras().mixed_precision.global_policy().name == "float32"


def test_loss_scale_optimizer_drops_an_overflowing_microbatch() -> None:
    """`LossScaleOptimizer` checks each microbatch's gradient: a non-finite one halves the scale
    and is not handed to the inner optimizer, whose accumulation counter stands still, so a
    window of K microbatches with one overflow makes no step (the window ends a microbatch
    late). Driven through `optimizer.apply` as `train_step` calls it."""
    keras = import_keras()
    with keras.device("cpu"):
        variable = keras.Variable(torch.zeros(2))
        inner = keras.optimizers.SGD(learning_rate=1.0, gradient_accumulation_steps=4)
        optimizer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
        optimizer.build([variable])
        grads = [torch.ones(2), torch.tensor([float("inf"), 1.0]), torch.ones(2), torch.ones(2)]
        for grad in grads:  # each scaled by the scale of its loss, as `scale_loss` does
            optimizer.apply([grad * float(optimizer.dynamic_scale.value)], [variable])
        assert float(optimizer.dynamic_scale.value) == 2.0
        assert int(inner._iterations.value) == 3 and not bool(variable.value.any())
        optimizer.apply([torch.full((2,), 3.0) * 2.0], [variable])  # the next window's first
        # Σ of the 3 finite gradients and the next window's, / 4: (1 + 1 + 1 + 3) / 4.
        assert torch.equal(variable.value.detach(), torch.tensor([-1.5, -1.5]))


def test_nothing_is_left_behind(audit: tuple[AuditResult, list[str], str | None]) -> None:
    """No file outside the task's workdir, and ``KERAS_BACKEND`` as it was before the audit."""
    _, left, backend = audit
    assert left == []
    assert backend == os.environ.get("KERAS_BACKEND")


_PROBE = """
import json, os, sys
first = sys.argv[1]
if first == "import":
    try:
        import keras  # on the backend KERAS_BACKEND names (numpy: its import needs scipy)
    except ImportError:
        pass  # half-imported: its backend config is loaded and fixed all the same
from wacc.audit.adapters import ADAPTERS
from wacc.audit.runner import run_audit
from wacc.audit.windows import build_window
result = run_audit([ADAPTERS["keras"]], [build_window("equal")])
print(json.dumps({"status": result.cells[0].status,
                  "imported": any(m.split(".")[0] == "keras" for m in sys.modules),
                  "env": os.environ.get("KERAS_BACKEND")}))
"""


@pytest.mark.parametrize("first", ["import", "env"])
def test_another_backend_is_a_row_not_a_switch(first: str) -> None:
    """Keras reads KERAS_BACKEND once per process: with Keras already imported on another
    backend (numpy; an import that failed for want of scipy still fixes it), or KERAS_BACKEND
    naming one, the audit gives a "not importable" row saying so, imports nothing and leaves the
    variable alone."""
    env = {**os.environ, "KERAS_BACKEND": "numpy", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _PROBE, first], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if first == "import":
        assert seen["status"] == (
            "not importable: keras already imported with the numpy backend "
            "(read once per process): run the audit in a new process"
        )
    else:
        assert seen["status"] == (
            "not importable: KERAS_BACKEND=numpy: this loop needs the torch backend"
        )
    assert seen["imported"] == (first == "import") and seen["env"] == "numpy"
