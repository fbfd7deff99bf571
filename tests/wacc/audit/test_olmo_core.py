"""OLMo-core's ``TransformerTrainModule.train_batch`` driven on the CPU at world size 1 (its
``loss_div_factor`` path) and across two data-parallel ranks under its own FSDP (gloo, CPU):
runs where ``olmo_core`` imports, skips cleanly elsewhere."""

from __future__ import annotations

import ast
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("olmo_core.train.train_module", reason="ai2-olmo-core is not installed")

from tests.wacc.audit.expected import (  # noqa: E402
    PRINTED_DIGITS,
    assert_close_to_prediction,
    assert_rel_l2_matches,
    prediction_bound,
    printed_precision,
    rel_l2_tolerance,
    truth_terms,
)
from tests.wacc.audit.fixed import WINDOWS, assert_every_window_passes, assert_points_to  # noqa: E402
from tests.wacc.audit.ranks_driver import expected, run_world  # noqa: E402
from tests.wacc.audit.test_ranks import NO_WACC, NUMBER, ROOT  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.adapters.olmo_core import _Transformer  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import LoopTask  # noqa: E402
from wacc.audit.runner import run_audit  # noqa: E402
from wacc.audit.truth import compute_truth  # noqa: E402
from wacc.audit.windows import build_window, rank_windows, world_window  # noqa: E402
from wacc.commands.audit import _BUILTIN  # noqa: E402


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


WORLD = 2
# A float64 run through OLMo-core's own loss (``cross_entropy_loss``: ``logits.float()``, a cast
# down to float32) is float32-accurate only.
FLOAT32_LOSS = "float32"


@pytest.mark.slow
def test_fsdp_averages_rank_local_token_means() -> None:
    """Across two ranks (a torchrun world, gloo) each rank divides by its own
    ``batch_num_tokens_for_loss`` (211 and 17) and OLMo-core's FSDP (``Transformer.apply_fsdp``)
    averages the ranks' gradients: every rank hands its optimizer mean_r Σ_k g_rk / T_r, the
    same gradient bit for bit, to the float32 rounding of OLMo-core's loss; its error against the
    truth (every rank's tokens together) is the one predicted from the per-rank totals, a FAIL."""
    assert ADAPTERS["olmo-core"].ranks is True
    results = run_world("wacc.audit.adapters.olmo_core:ADAPTER", WORLD)
    assert all(r.steps_seen == 1 and r.fetched == [0, 1, 2, 3] for r in results)
    np.testing.assert_array_equal(results[1].gradient, results[0].gradient)
    want = expected("plain", WORLD)
    assert [r.counted for r in results] == list(want.rank_tokens) == [211, 17]
    bound = want.divided_by_bound(want.rank_tokens, FLOAT32_LOSS)
    assert_close_to_prediction(results[0].gradient, want.equal_ranks, bound)
    assert_rel_l2_matches(
        want.rel(results[0].gradient), want.predicted_equal_ranks, bound, want.truth
    )
    assert want.predicted_equal_ranks > 1  # a FAIL, not a rounding


@pytest.mark.slow
def test_audit_row_across_two_ranks_and_its_reproducer(tmp_path: Path) -> None:
    """``wacc audit olmo-core --world-size 2 --repro`` (the CLI as a subprocess, the ``unequal``
    rank windows): the row FAILs (exit 1), counts 211 and 17 on the ranks, the ranks agree, and its
    float64 error equals the ``predicted_rel_l2`` printed beside it, to the float32 rounding of
    OLMo-core's loss.  Its reproducer imports no wacc, frees the FSDP model before the process
    group goes, runs under ``python -m torch.distributed.run --nproc-per-node 2`` (gloo) with
    every wacc import refused, and rank 0 prints the row's float64 error: the same float64 run,
    its exact side another float64 summation order, printed to PRINTED_DIGITS digits."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    repro = tmp_path / "repro"
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", "olmo-core", "--world-size", "2", "--windows",
         "unequal", "--out", str(tmp_path / "out"), "--repro", str(repro), "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    with (tmp_path / "out" / "audit.csv").open(newline="", encoding="utf-8") as handle:
        (row,) = csv.DictReader(handle)
    assert (row["loop"], row["verdict"], row["world_size"]) == ("olmo-core", "FAIL", "2")
    assert (row["rank_tokens"], row["rank_tokens_counted"]) == ("211;17", "211.0;17.0")
    assert row["ranks_agree"] == "True"
    # The audit's own rank windows: the row's truth and prediction computed here from them.
    windows = rank_windows("unequal", WORLD)
    want = expected("plain", WORLD, windows=windows)
    assert want.rank_tokens == (211, 17)
    bound = want.divided_by_bound(want.rank_tokens, FLOAT32_LOSS)
    measured = float(row["f64_rel_l2"])
    assert_rel_l2_matches(measured, float(row["predicted_rel_l2"]), bound, want.truth)
    assert_rel_l2_matches(measured, want.predicted_equal_ranks, bound, want.truth)
    assert want.predicted_equal_ranks > 1

    (script,) = sorted(repro.glob("*.py"))
    assert script.name == "olmo-core-unequal-ranks2.py"
    tree = ast.parse(script.read_text(encoding="utf-8"))
    roots = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }  # fmt: skip
    assert not roots & {"wacc", "wacc_torch", "wacc_ref"} and "olmo_core" in roots, roots
    end = [ast.unparse(statement) for statement in tree.body[-3:]]
    assert end[0].startswith("del ") and "wrapped" in re.findall(r"\w+", end[0]), end
    assert end[1:] == ["gc.collect()", "dist.destroy_process_group()"], end
    runner = tmp_path / "no_wacc.py"
    runner.write_text(NO_WACC, encoding="utf-8")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [sys.executable, "-I", "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(WORLD), str(runner), str(script)],
        cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    (printed,) = NUMBER.findall(ran.stdout)
    assert "ranks agree: True" in ran.stdout
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, world_window("unequal", windows))
    summed = prediction_bound(truth_terms(truth), "float64")
    tolerance = rel_l2_tolerance(summed, truth.gradient, measured, truth_bound=summed)
    tolerance += printed_precision(measured, PRINTED_DIGITS)
    assert abs(float(printed) - measured) <= tolerance, (printed, measured, tolerance)


def test_wacc_row_follows_olmo_core_and_is_named_its_fix() -> None:
    """``olmo-core+wacc`` comes right after ``olmo-core`` in the adapters and in the CLI's
    built-in order, and ``olmo-core``'s row names it as its fix."""
    assert_points_to("olmo-core", "olmo-core+wacc")
    assert _BUILTIN[_BUILTIN.index("olmo-core") + 1] == "olmo-core+wacc"
    assert ADAPTERS["olmo-core+wacc"].ranks is True


def test_wacc_row_passes_every_window_in_one_process() -> None:
    """``olmo-core+wacc`` at world size 1 (``TokenWeightedTrainModule`` on OLMo-core's own
    ``train_batch``, a ``TokenWindow``): every window passes, deterministic, with its true count
    (not float64-exact: OLMo-core's loss casts the logits to float32 in the float64 run too)."""
    result = run_audit([ADAPTERS["olmo-core+wacc"]], [build_window(w) for w in WINDOWS])
    assert_every_window_passes(result, "olmo-core+wacc", exact=False)


@pytest.mark.slow
def test_wacc_row_passes_across_two_ranks() -> None:
    """``olmo-core+wacc`` across two ranks under OLMo-core's FSDP (``FSDPWeightedWindow``: one
    summed reduce-scatter, then the global count): pass on the unequal rank windows (211 and 17
    targets), both ranks counting all 228, their gradients equal; the float64 run is the truth to
    the float32 rounding of OLMo-core's loss (where ``olmo-core`` FAILs at 2.32)."""
    result = run_audit(
        [ADAPTERS["olmo-core+wacc"]], [build_window("unequal")], world_size=2, jobs=2
    )
    (window,) = result.windows
    (cell,) = result.cells
    assert cell.status == "ok", cell.status
    assert cell.verdict == "pass" and cell.ranks_agree is True
    assert cell.rank_tokens == (211, 17) and cell.rank_counted == (228.0, 228.0)
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, window)
    bound = prediction_bound(truth_terms(truth), FLOAT32_LOSS)
    assert cell.semantic_rel_l2 <= rel_l2_tolerance(bound, truth.gradient, cell.semantic_rel_l2)
