"""litgpt's full fine-tuning loop (``finetune/full.py`` ``fit``'s accumulation on a real
``lightning.Fabric``), at precision ``32-true`` and ``bf16-mixed``: at world size 1, across two
data-parallel ranks (Fabric's ``DDPStrategy`` in a real ``torch.distributed.run`` world, gloo,
CPU), the reproducers ``--repro`` writes for both, and their ``+wacc`` rows (``fit`` with
``WeightedGradientsAccumulator``) and the docs page that shows them; runs where litgpt imports,
skips cleanly elsewhere."""

from __future__ import annotations

import ast
import csv
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is not installed")

from tests.fix_your_framework import run_page  # noqa: E402
from tests.wacc.audit.expected import (  # noqa: E402
    PRINTED_DIGITS,
    assert_close_to_prediction,
    assert_mean_weighted_error,
    mean_weighted,
    mean_weighted_terms,
    prediction_bound,
    printed_precision,
    rel_l2_tolerance,
    truth_terms,
)
from tests.wacc.audit.fixed import WINDOWS as ALL_WINDOWS  # noqa: E402
from tests.wacc.audit.fixed import assert_every_window_passes, assert_points_to  # noqa: E402
from tests.wacc.audit.ranks_driver import expected, run_world  # noqa: E402
from tests.wacc.audit.test_ranks import NO_WACC, NUMBER, ROOT  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.metrics import relative_l2  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.repro import write_reproducers  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.truth import Truth, compute_truth  # noqa: E402
from wacc.audit.windows import Window, build_window, rank_windows, world_window  # noqa: E402

WINDOWS = ("unequal", "equal")
LOOPS = ("litgpt", "litgpt-bf16-mixed")
FIXES = {loop: f"{loop}+wacc" for loop in LOOPS}
WORLD = 2
# The rounding of each row's float64 run: a float64 Fabric run for 32-true; for bf16-mixed,
# Fabric's MixedPrecision.convert_output rounds the logits to float32 (the adapter's docstring).
ROUNDING = {"litgpt": "float64", "litgpt-bf16-mixed": "float32"}
# What a reproducer may import: torch, the framework (litgpt on lightning) and the stdlib.
ALLOWED = {"torch", "lightning", "litgpt"} | set(sys.stdlib_module_names)


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


def _assert_equal_microbatch_error(
    measured: float, truth: Truth, rounding: str, *, printed: bool = False
) -> None:
    """``measured`` (a float64 run's rel L2 against ``truth``, another float64 evaluation of it)
    is the error of Σ_(r,k) mean_rk / M (every one of the M microbatches of every rank alike) to
    the run's ``rounding`` (:func:`tests.wacc.audit.expected.rel_l2_tolerance`), plus half a unit
    of the last printed digit when ``printed``."""
    weight = 1 / len(truth.targets)
    want = relative_l2(mean_weighted(truth, weight), truth.gradient)
    tolerance = rel_l2_tolerance(
        prediction_bound(mean_weighted_terms(truth, weight), rounding),
        truth.gradient,
        measured,
        want,
        truth_bound=prediction_bound(truth_terms(truth), "float64"),
    )
    if printed:
        tolerance += printed_precision(measured, PRINTED_DIGITS)
    assert abs(measured - want) <= tolerance, (measured, want, tolerance)


def _joined(ranks: tuple[Window, ...]) -> Truth:
    """The truth over every rank's tokens (the audit's: rank 0's microbatches first)."""
    return compute_truth(MODEL_KINDS["plain"], torch.float32, world_window("unequal", ranks))


@pytest.mark.slow
def test_fabric_ddp_hands_every_rank_the_equal_microbatch_gradient() -> None:
    """Across two ranks (Fabric's ``DDPStrategy`` under torchrun: ``no_backward_sync`` =
    ``DDP.no_sync`` for the first K - 1 microbatches, DDP's mean over the ranks at the K-th), each
    rank's ``fabric.backward(loss / gradient_accumulation_iters)`` with K per rank
    (``global_batch_size = K N``): every rank reads its whole window, hands its optimizer the same
    gradient bit for bit, and that gradient is Σ_r Σ_k mean_rk / (N K) to float64 rounding: far
    from the mean over both ranks' tokens (ranks of 211 and 17 tokens, one with a zero-token
    microbatch)."""
    assert ADAPTERS["litgpt"].ranks is True
    results = run_world("wacc.audit.adapters.litgpt:TRUE_32", WORLD)
    assert [r.counted for r in results] == [None, None]
    assert all(r.steps_seen == 1 and r.fetched == [0, 1, 2, 3] for r in results)
    np.testing.assert_array_equal(results[1].gradient, results[0].gradient)
    want = expected("plain", WORLD)
    bound = want.equal_microbatches_bound("float64")
    assert_close_to_prediction(results[0].gradient, want.equal_microbatches, bound)
    assert want.rel(results[0].gradient) > 1


@dataclass(frozen=True)
class RankAudit:
    """``wacc audit`` of the two litgpt rows and their ``+wacc`` rows with ``--world-size 2
    --repro``: its rows by loop, the reproducers it wrote, and what each printed under
    torchrun."""

    rows: dict[str, dict[str, str]]
    scripts: dict[str, Path]
    printed: dict[str, subprocess.CompletedProcess[str]]


def _torchrun(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -I -m torch.distributed.run --nproc-per-node 2 <script>``, every wacc import
    refused, PYTHONPATH cleared, from ``cwd`` (where wacc is not importable)."""
    runner = cwd / f"{script.stem}-no-wacc.py"
    runner.write_text(NO_WACC, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-I", "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(WORLD), str(runner), str(script)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> RankAudit:
    """The CLI across two ranks on ``unequal`` (a subprocess, as a user runs it), then each
    reproducer it wrote under torchrun outside wacc."""
    tmp = tmp_path_factory.mktemp("litgpt-ranks")
    done = subprocess.run(
        [sys.executable, "-m", "wacc", "audit", *LOOPS, *FIXES.values(), "--world-size",
         str(WORLD), "--windows", "unequal", "--out", str(tmp / "out"), "--repro",
         str(tmp / "repro"), "--quiet"],
        cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]  # FAIL rows: exit 1
    with (tmp / "out" / "audit.csv").open(newline="", encoding="utf-8") as handle:
        rows = {row["loop"]: row for row in csv.DictReader(handle)}
    scripts = {loop: tmp / "repro" / f"{loop}-unequal-ranks{WORLD}.py" for loop in LOOPS}
    cwd = tmp_path_factory.mktemp("cwd")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {loop: pool.submit(_torchrun, path, cwd) for loop, path in scripts.items()}
        printed = {loop: future.result() for loop, future in futures.items()}
    return RankAudit(rows, scripts, printed)


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_audit_across_two_ranks_fails_with_the_equal_microbatch_error(
    ranks: RankAudit, loop: str
) -> None:
    """``wacc audit --world-size 2``: each row FAILs, both ranks agree, the rank totals are
    211;17, no rank-equal prediction is given (the loop weighs microbatches, not ranks, alike)
    and the float64 error is the equal-microbatch one over both ranks' 8 microbatches, to the
    row's rounding."""
    row = ranks.rows[loop]
    assert (row["verdict"], row["ranks_agree"], row["world_size"]) == ("FAIL", "True", "2")
    assert row["rank_tokens"] == "211;17" and row["predicted_rel_l2"] == ""
    truth = _joined(rank_windows("unequal", WORLD))
    _assert_equal_microbatch_error(float(row["f64_rel_l2"]), truth, ROUNDING[loop])


def _imports(path: Path) -> set[str]:
    """The top-level modules the script at ``path`` imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    return roots


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_reproducer_across_ranks_prints_the_rows_error(ranks: RankAudit, loop: str) -> None:
    """``<loop>-unequal-ranks2.py`` imports torch, lightning, litgpt and the standard library
    only, runs under ``python -m torch.distributed.run --nproc-per-node 2`` with every wacc import
    refused, frees Fabric before the process group goes, and rank 0 prints the row's float64
    error (the equal-microbatch one, to the row's rounding) with both ranks agreeing."""
    script = ranks.scripts[loop]
    assert _imports(script) <= ALLOWED, _imports(script)
    end = [ast.unparse(s) for s in ast.parse(script.read_text(encoding="utf-8")).body[-3:]]
    assert end[0].startswith("del ") and "fabric" in re.findall(r"\w+", end[0]), end
    done = ranks.printed[loop]
    assert done.returncode == 0, done.stderr[-3000:]
    (printed,) = NUMBER.findall(done.stdout)
    truth = _joined(rank_windows("unequal", WORLD))
    _assert_equal_microbatch_error(float(printed), truth, ROUNDING[loop], printed=True)
    assert "ranks agree: True" in done.stdout


@pytest.mark.slow
def test_reproducer_at_world_size_1_prints_the_rows_error(
    result: AuditResult, tmp_path: Path
) -> None:
    """``--repro`` at world size 1: ``<loop>-unequal.py`` for each FAIL row (none for the passing
    4 x 64 window), importing torch, lightning, litgpt and the standard library only; run on its
    own with every wacc import refused, it prints the row's float64 error (the equal-microbatch
    one, to the row's rounding)."""
    (tmp_path / "repro").mkdir()
    written, notes = write_reproducers(result, tmp_path / "repro")
    assert notes == []
    assert sorted(r.path.name for r in written) == sorted(f"{loop}-unequal.py" for loop in LOOPS)
    runner = tmp_path / "no_wacc.py"
    runner.write_text(NO_WACC, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, build_window("unequal"))
    for reproducer in written:
        assert _imports(reproducer.path) <= ALLOWED, _imports(reproducer.path)
        done = subprocess.run(
            [sys.executable, "-I", str(runner), str(reproducer.path)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        (printed,) = NUMBER.findall(done.stdout)
        rounding = ROUNDING[reproducer.loop]
        _assert_equal_microbatch_error(float(printed), truth, rounding, printed=True)
        _assert_equal_microbatch_error(reproducer.expected, truth, rounding)


@pytest.fixture(scope="module")
def fixed() -> AuditResult:
    """The ``+wacc`` rows on every window the audit knows, at world size 1."""
    return run_audit(
        [ADAPTERS[fix] for fix in FIXES.values()], [build_window(w) for w in ALL_WINDOWS]
    )


def test_fit_with_the_accumulator_passes_every_window(fixed: AuditResult) -> None:
    """``litgpt+wacc`` (``fabric.backward(loss)``, ``accumulate_mean`` with the count
    ``chunked_cross_entropy`` averaged over, ``finish_window(acc).apply_to(model)``): a pass on
    every window, dividing by the window's true count, its float64 run float64-exact."""
    assert_every_window_passes(fixed, "litgpt+wacc")


def test_bf16_mixed_fit_with_the_accumulator_passes_every_window(fixed: AuditResult) -> None:
    """``litgpt-bf16-mixed+wacc``: the verdict (the float64 run, its logits rounded to float32 by
    Fabric) passes on every window with the window's true count; the float32 run carries the
    bfloat16 forward's rounding (no bound covers it), so only the verdict is asserted."""
    cells = [c for c in fixed.cells if c.adapter == "litgpt-bf16-mixed+wacc"]
    assert [c.window for c in cells] == list(ALL_WINDOWS)
    for cell in cells:
        assert (cell.status, cell.verdict) == ("ok", "pass"), (cell.window, cell.semantic_ratio)
        assert cell.counted == cell.true_count and cell.finite and cell.deterministic


@pytest.mark.parametrize(("loop", "fix"), FIXES.items())
def test_the_failing_loop_points_to_its_fix(loop: str, fix: str) -> None:
    """Each litgpt row names its ``+wacc`` row (registered right after it) and its cause."""
    assert_points_to(loop, fix)


@pytest.mark.slow
@pytest.mark.parametrize("fix", FIXES.values())
def test_fix_across_two_ranks_divides_by_every_ranks_tokens(ranks: RankAudit, fix: str) -> None:
    """``wacc audit --world-size 2``: each ``+wacc`` row (``no_backward_sync`` on every
    microbatch, ``finish_window`` = one ``all_reduce_mean`` of the ranks' sums and counts)
    passes, each rank dividing by both ranks' 228 tokens, the ranks agreeing bit for bit; the
    ``32-true`` row's float64 run is the truth to float64 rounding."""
    row = ranks.rows[fix]
    assert (row["verdict"], row["ranks_agree"], row["rank_tokens"]) == ("pass", "True", "211;17")
    assert row["rank_tokens_counted"] == "228.0;228.0"
    if fix == "litgpt+wacc":
        truth = _joined(rank_windows("unequal", WORLD))
        bound = prediction_bound(truth_terms(truth), "float64")
        measured = float(row["f64_rel_l2"])
        assert measured <= rel_l2_tolerance(bound, truth.gradient, measured)


def test_fix_your_framework_page_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/fix-your-framework/litgpt.md's block runs as written on a litgpt ``GPT``: two
    optimizer steps, the last window's weight the targets ``chunked_cross_entropy`` averaged over
    (a sample without targets counting 0)."""
    monkeypatch.chdir(tmp_path)
    namespace = run_page("litgpt.md", tmp_path)
    assert namespace["state"]["step_count"] == 2
    targets = sum(int((d["labels"][1:] != -100).sum()) for d in namespace["data"])
    assert namespace["result"].weight == targets and targets > 0
