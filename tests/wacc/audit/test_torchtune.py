"""torchtune's full-finetune recipe (``FullFinetuneRecipeSingleDevice.train``) driven on the CPU,
and across two ranks its distributed recipe (``FullFinetuneRecipeDistributed.train``, FSDP2 on
gloo), with the reproducers ``--repro`` writes for both: runs where torchtune imports (torchtune
0.6.1 needs a torchao that has ``torchao.dtypes.nf4tensor`` and ``int4_weight_only``: 0.15.0 at
most), skips cleanly elsewhere."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray

pytest.importorskip("torchtune", reason="torchtune (with a torchao <= 0.15) is not installed")

from tests.wacc.audit import fixed  # noqa: E402
from tests.wacc.audit.expected import (  # noqa: E402
    assert_close_to_prediction,
    prediction_bound,
    rel_l2_tolerance,
)
from tests.wacc.audit.repro_check import (  # noqa: E402
    NUMBER,
    RUNNER,
    WACC,
    check_prints_its_rows_number,
    imports,
    rank_runs,
    tolerance,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.metrics import relative_l2  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.protocol import LoopTask  # noqa: E402
from wacc.audit.repro import write_reproducers  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.truth import Truth, compute_truth  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402
from wacc_ref.bounds import TOLERANCES  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WINDOWS = ("unequal", "equal", "zero")


@pytest.fixture(scope="module")
def result() -> AuditResult:
    return run_audit([ADAPTERS["torchtune"]], [build_window(w) for w in WINDOWS])


@pytest.mark.parametrize("window", WINDOWS)
def test_the_recipe_counts_each_sequences_first_label(result: AuditResult, window: str) -> None:
    """The recipe weights microbatch k's mean loss by its unshifted label count n_k + 1 (its
    loss averages over the n_k shifted targets) and divides by Σ (n_k + 1): the float64 run's
    error is that prediction's (:func:`_assert_weighted_by`). The 4 x 64 window weighs every
    microbatch alike and passes; the others fail."""
    (cell,) = [c for c in result.cells if c.window == window]
    _assert_weighted_by(cell, lambda n: n + 1 if n else 0)
    assert cell.verdict == ("pass" if window == "equal" else "FAIL")


def _assert_weighted_by(cell: Any, weight: Callable[[int], int]) -> None:
    """The cell's float64 run weights microbatch k's mean loss by ``weight(n_k)`` (``n_k`` its
    shifted targets) and divides by Σ weight(n_k): its error against the truth is that
    prediction's, from the truth's per-microbatch gradients, and the count it divides by is
    Σ weight(n_k). Tolerance: the recipe's factor ``1 / num_tokens`` is a float32 tensor even
    in the float64 run, which scales the gradient F by (1 + δ), |δ| <= 2**-24, and so moves r =
    ‖F − T‖/‖T‖ by at most 2**-24 ‖F‖/‖T‖ <= 2**-24 (1 + r) (float32's unit roundoff,
    wacc_ref.bounds.TOLERANCES); the float64 sums add
    :func:`tests.wacc.audit.expected.rel_l2_tolerance` of the prediction's float64 bound."""
    assert cell.status == "ok", cell.status
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window(cell.window))
    weights = [weight(n) for n in truth.targets]
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


def test_loop_facts(result: AuditResult) -> None:
    """The recipe reads one batch per backward (1 of 4 read at the first), has no checkpoint
    inside an epoch, no fixed loss scale and no float16 path."""
    (fact,) = result.facts
    assert fact.status == "ok" and fact.version == "0.6.1"
    assert fact.needs_total == "no (1 of 4 read)"
    assert fact.resume.startswith("n/a: the recipe checkpoints at the end of an epoch")
    assert fact.loss_scale == "not settable"


@pytest.fixture(scope="module")
def fix_result() -> AuditResult:
    return run_audit([ADAPTERS["torchtune+wacc"]], [build_window(w) for w in fixed.WINDOWS])


@pytest.mark.parametrize("window", fixed.WINDOWS)
def test_the_collate_makes_the_recipe_count_its_targets(
    fix_result: AuditResult, window: str
) -> None:
    """``collate_fn: wacc_torch.integrations.torchtune.padded_collate_sft`` (the ``torchtune+wacc``
    row, the same recipe drive): the recipe's own count becomes each microbatch's shifted targets
    n_k, so it weights each mean by n_k and divides by Σ n_k, the true count: the float64 run
    is the truth but for the recipe's float32 factor (:func:`_assert_weighted_by`, prediction =
    truth), and every window passes, the longtail one included."""
    (cell,) = [c for c in fix_result.cells if c.window == window]
    _assert_weighted_by(cell, lambda n: n)
    assert cell.counted == cell.true_count and cell.verdict == "pass"


def test_the_fix_row_passes_and_is_pointed_to(fix_result: AuditResult) -> None:
    """The ``torchtune+wacc`` row passes every window with the window's true count (the shared
    check of every ``+wacc`` row; not ``exact``: the recipe's ``1 / num_tokens`` is float32 in
    the float64 run too), keeps the ``torchtune`` row's facts (one batch read per backward, no
    checkpoint inside an epoch), and the ``torchtune`` row names it as its fix, right after it."""
    fixed.assert_every_window_passes(fix_result, "torchtune+wacc", exact=False)
    fact = fixed.facts(fix_result, "torchtune+wacc")
    assert fact.status == "ok" and fact.needs_total == "no (1 of 4 read)"
    assert fact.resume.startswith("n/a: the recipe checkpoints at the end of an epoch")
    fixed.assert_points_to("torchtune", "torchtune+wacc")


@pytest.mark.slow
def test_the_fix_row_passes_in_bfloat16() -> None:
    """``--dtype bfloat16`` (the recipe's ``dtype: bf16``: bfloat16 parameters and accumulated
    gradients, no scaler): with the collate's count the ``torchtune+wacc`` row passes every
    window, its bfloat16 run within bfloat16's bound and its float64 run the truth but for the
    float32 factor, dividing by the true count; the ``torchtune`` row's count still fails the
    ``unequal`` window in bfloat16 too."""
    windows = [build_window(w) for w in fixed.WINDOWS]
    both = run_audit([ADAPTERS["torchtune"], ADAPTERS["torchtune+wacc"]], windows,
                     dtype="bfloat16")  # fmt: skip
    fixed.assert_every_window_passes(both, "torchtune+wacc", exact=False)
    (own,) = [c for c in both.cells if c.adapter == "torchtune" and c.window == "unequal"]
    assert own.verdict == "FAIL" and own.counted == own.true_count + 4


def test_bfloat16_accumulates_in_bfloat16(tmp_path: Path) -> None:
    """``--dtype bfloat16``: the recipe's parameters, and so its accumulated gradients, are
    bfloat16 (no autocast, no loss scaler): the gradient the optimizer gets is bfloat16."""
    task = LoopTask(MODEL_KINDS["plain"], torch.bfloat16, build_window("unequal"), tmp_path)
    ADAPTERS["torchtune"].run(task)
    assert task.captured is not None
    seen = sorted({str(g.dtype) for g in task.captured.values()})
    assert seen == ["torch.bfloat16"]


def _first_label_prediction(
    truths: Sequence[Truth], weight: Callable[[int], int] = lambda n: n + 1 if n else 0
) -> tuple[NDArray[np.float64], list[tuple[float, NDArray[np.float64]]], int]:
    """What the recipe computes over every rank's microbatches together: microbatch ``(r, k)``'s
    mean loss weighted by its count ``weight(n_rk)`` (default: its unshifted label count ``n_rk +
    1``, 0 for a zero-target one), divided by the all-reduced ``Σ_r Σ_k weight(n_rk)``; its terms
    ``(w, g)`` and that count."""
    weights = [(weight(n), g, n) for t in truths
               for g, n in zip(t.microbatch_sums, t.targets, strict=True)]  # fmt: skip
    total = sum(w for w, _, _ in weights)
    terms = [(w / (n * total), g) for w, g, n in weights if n]
    return sum((w * g for w, g in terms), np.zeros_like(truths[0].gradient)), terms, total


def _two_ranks_weigh_by(
    spec: str, weight: Callable[[int], int] = lambda n: n + 1 if n else 0
) -> tuple[Any, list[Any], int]:
    """The loop ``spec`` in a real 2-rank world on the ``plain`` model's rank windows: both ranks
    divide by the all-reduced count and hand their optimizer the same gradient, rank 0's the
    prediction of :func:`_first_label_prediction` with ``weight`` to the bound of
    :func:`test_the_distributed_recipe_counts_every_ranks_tokens`; (expected, results, count)."""
    from tests.wacc.audit.ranks_driver import expected, run_world

    results = run_world(spec, 2)
    want = expected("plain", 2)
    prediction, terms, total = _first_label_prediction(want.truths, weight)
    assert [r.counted for r in results] == [total, total]
    assert all(r.steps_seen == 1 and r.fetched == [0, 1, 2, 3] for r in results)
    np.testing.assert_array_equal(results[1].gradient, results[0].gradient)
    bound = prediction_bound(terms, "float64")
    bound = bound + TOLERANCES["float32"].unit_roundoff * np.abs(prediction)
    assert_close_to_prediction(results[0].gradient, prediction, bound)
    return want, results, total


@pytest.mark.slow
def test_the_distributed_recipe_counts_every_ranks_tokens() -> None:
    """``FullFinetuneRecipeDistributed`` in a real 2-rank torchrun world (gloo, CPU; FSDP2 through
    ``training.shard_model``), ranks holding 211 and 17 tokens (one zero-target microbatch): the
    recipe all-reduces ``num_tokens`` and scales the FSDP-averaged gradient by ``world_size /
    num_tokens``, so every rank hands its optimizer the same gradient, weighted over both ranks'
    tokens together, not rank by rank: the truth but for the recipe's first-label count (each
    sequence weighs ``n + 1``: 235 counted for 228), to rounding. Bound: the float64 sums'
    :func:`tests.wacc.audit.expected.prediction_bound`, plus the factor ``world_size /
    num_tokens``, a float32 tensor even in the float64 run (relative 2**-24 of every element,
    float32's unit roundoff). A loop that weighed the ranks alike would be ~2.3 off the truth."""
    assert ADAPTERS["torchtune"].ranks is True
    want, results, total = _two_ranks_weigh_by("wacc.audit.adapters.torchtune:ADAPTER")
    assert total == sum(want.rank_tokens) + 7  # one per labelled sequence: 4 + 3
    # Not the rank-equal weighting: its error is an order of magnitude above this one's.
    assert want.rel(results[0].gradient) < want.predicted_equal_ranks / 10


@pytest.mark.slow
def test_the_distributed_recipe_with_the_collate_weighs_every_target() -> None:
    """``torchtune+wacc`` in a real 2-rank torchrun world (the distributed recipe, FSDP2 on
    gloo, ``collate_fn`` the integration's; ranks holding 211 and 17 tokens, one zero-target
    microbatch): the all-reduced count is the 228 targets of both ranks, not 235, and both ranks
    hand their optimizer the same gradient, the truth to rounding (bound as in
    :func:`test_the_distributed_recipe_counts_every_ranks_tokens`, prediction = every target
    weighed alike)."""
    want, _, total = _two_ranks_weigh_by("wacc.audit.adapters.torchtune_wacc:ADAPTER", lambda n: n)
    assert total == sum(want.rank_tokens) == 228


@pytest.mark.slow
def test_the_audit_across_two_ranks(tmp_path: Path) -> None:
    """``wacc audit torchtune --world-size 2`` (the CLI, as a user runs it): the rank windows'
    row is a FAIL (the first-label count, 235 counted for 228 targets), the same count on both
    ranks, the ranks agreeing, and no rank-equal prediction (the recipe weighs every token of
    every rank alike)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", "torchtune", "--world-size", "2", "--windows",
         "unequal", "--out", str(tmp_path / "out"), "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    with (tmp_path / "out" / "audit.csv").open(newline="", encoding="utf-8") as handle:
        (row,) = [r for r in csv.DictReader(handle) if r["loop"] == "torchtune"]
    assert (row["world_size"], row["rank_tokens"]) == ("2", "211;17")
    assert (row["status"], row["verdict"]) == ("ok", "FAIL")
    assert row["rank_tokens_counted"] == "235.0;235.0" and row["ranks_agree"] == "True"
    assert row["predicted_rel_l2"] == ""


@pytest.mark.slow
def test_a_failing_rows_script_prints_its_number(result: AuditResult, tmp_path: Path) -> None:
    """``--repro`` on the failing rows (``unequal``, ``zero``): each gets
    ``torchtune-<window>.py``, which imports no wacc, loads the single-device recipe from
    torchtune's ``recipes`` folder, runs its ``train()`` outside wacc (isolated interpreter,
    PYTHONPATH cleared, every wacc import refused) and prints the row's float64 error within
    :func:`tests.wacc.audit.repro_check.tolerance` and the count the audit saw."""
    (tmp_path / "repro").mkdir()
    written, notes = write_reproducers(result, tmp_path / "repro")
    assert not [n for n in notes if n.startswith("torchtune")], notes
    scripts = {r.window: r for r in written}
    assert sorted(scripts) == ["unequal", "zero"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for window, reproducer in scripts.items():
        assert not any(n.split(".")[0] in WACC for names in imports(reproducer.path) for n in names)
        done = subprocess.run(
            [sys.executable, "-I", "-c", RUNNER, str(reproducer.path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        (printed,) = NUMBER.findall(done.stdout)
        want = reproducer.expected
        assert abs(float(printed) - want) <= tolerance("torchtune", build_window(window), want)
        (cell,) = [c for c in result.cells if c.window == window]
        assert f"num_tokens {int(cell.counted or 0)} " in done.stdout


@pytest.mark.slow
def test_the_script_across_ranks_prints_its_number(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """``--world-size 2 --repro``: the ``unequal`` row's ``torchtune-unequal-ranks2.py`` drives
    the distributed recipe's ``train()`` (FSDP2 through ``training.shard_model``, its sampler over
    every rank's microbatches) under ``torch.distributed.run`` outside wacc, and rank 0 prints the
    row's float64 error, the ranks agreeing
    (:func:`tests.wacc.audit.repro_check.check_prints_its_rows_number`)."""
    runs = rank_runs(["torchtune"], tmp_path_factory)
    check_prints_its_rows_number(runs, "torchtune")
    assert "all-reduced num_tokens 235 " in runs.done["torchtune"].stdout
