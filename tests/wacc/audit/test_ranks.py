"""``wacc audit --world-size N``: loops across real ``torch.distributed`` ranks (gloo, CPU).

One CLI run (a subprocess, as a user runs it) of the plain loop under DDP and of ``wacc_torch``'s
``all_reduce_mean`` path in worlds of two processes on the ``unequal`` rank windows serves the
tests of the table, ``audit.csv`` and the reproducer; the DDP-hook path runs in-process.  The
expected numbers are computed here from the model with torch autograd, independently of the
audit's truth code.
"""

from __future__ import annotations

import ast
import csv
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.typing import NDArray
from torch.nn import functional

from tests.wacc.audit.expected import (
    PRINTED_DIGITS,
    prediction_bound,
    printed_precision,
    rel_l2_tolerance,
    truth_terms,
)
from wacc.audit.adapters import ADAPTERS
from wacc.audit.models import MODEL_KINDS
from wacc.audit.protocol import LoopRun, LoopTask
from wacc.audit.runner import run_audit
from wacc.audit.truth import compute_truth
from wacc.audit.windows import build_window, rank_windows

ROOT = Path(__file__).resolve().parents[3]
WACC = {"wacc", "wacc_torch", "wacc_ref"}
NUMBER = re.compile(r"^rel L2 error of .* accumulation vs exact: (\S+)$", re.M)
# Runs the script with every wacc import refused: it must not need one, even indirectly.
NO_WACC = f"""
import runpy, sys

class NoWacc:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(WACC)}:
            raise ImportError("the reproducer imported " + name)

sys.meta_path.insert(0, NoWacc())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _wacc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "wacc", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip


@dataclass(frozen=True)
class CliRun:
    """The CLI's run across two ranks: its exit, output and audit.csv rows by loop."""

    done: subprocess.CompletedProcess[str]
    rows: dict[str, dict[str, str]]
    repro: Path


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """``wacc audit plain wacc_torch-mean --world-size 2 --windows unequal --repro``."""
    tmp = tmp_path_factory.mktemp("ranks")
    done = _wacc(
        "audit", "plain", "wacc_torch-mean", "--world-size", "2", "--windows", "unequal",
        "--out", str(tmp / "out"), "--repro", str(tmp / "repro"), "--quiet", "--jobs", "2",
        cwd=tmp,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # plain fails across ranks: exit 1
    with (tmp / "out" / "audit.csv").open(newline="", encoding="utf-8") as handle:
        rows = {row["loop"]: row for row in csv.DictReader(handle)}
    return CliRun(done, rows, tmp / "repro")


def _exact_rank_microbatches() -> tuple[list[list[torch.Tensor]], list[int]]:
    """Per rank of the unequal 2-rank windows: the float64 gradient of each microbatch's loss
    sum (torch autograd on a float64 copy of the audit's plain model) and its target tokens."""
    grads, totals = [], []
    for window in rank_windows("unequal", 2):
        model = MODEL_KINDS["plain"].build(torch.float32).to(torch.float64)
        params = list(model.parameters())
        mine = []
        for batch in window.microbatches:
            logits = model(input_ids=batch["input_ids"][None])["logits"][0, :-1]
            loss = functional.cross_entropy(logits, batch["labels"][1:], reduction="sum")
            each = torch.autograd.grad(loss, params, allow_unused=True)
            mine.append(
                torch.cat([
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for p, g in zip(params, each, strict=True)
                ])
            )  # fmt: skip
        grads.append(mine)
        totals.append(sum(window.targets))
    return grads, totals


@dataclass(frozen=True)
class RankPrediction:
    """The plain loop's float64 error across the ranks computed here, and how far the audit's
    numbers may be from it (:mod:`tests.wacc.audit.expected`)."""

    truth: NDArray[np.float64]  # Σ_r Σ_k g_rk / N
    expected: float  # rel L2 of mean_r Σ_k g_rk / T_r
    run_bound: NDArray[np.float64]  # a float64 run of that weighting vs this evaluation
    truth_bound: NDArray[np.float64]  # another float64 evaluation of the truth vs this one


def _rank_prediction() -> RankPrediction:
    """:class:`RankPrediction` from :func:`_exact_rank_microbatches`."""
    grads, totals = _exact_rank_microbatches()
    sums = [torch.stack(mine).sum(0) for mine in grads]
    truth = (sums[0] + sums[1]) / sum(totals)
    equal = (sums[0] / totals[0] + sums[1] / totals[1]) / 2
    per_rank = [[g.numpy() for g in mine] for mine in grads]
    ranks = len(totals)
    return RankPrediction(
        truth=truth.numpy(),
        expected=float((equal - truth).norm() / truth.norm()),
        run_bound=prediction_bound(
            [(1 / (ranks * t), g) for mine, t in zip(per_rank, totals, strict=True) for g in mine],
            "float64",
        ),
        truth_bound=prediction_bound(
            [(1 / sum(totals), g) for mine in per_rank for g in mine], "float64"
        ),
    )


def _agrees(measured: float, want: RankPrediction, printed: int | None = None) -> None:
    """``measured`` (the audit's, another float64 evaluation of the run and of the truth) is
    ``want.expected`` to :func:`tests.wacc.audit.expected.rel_l2_tolerance`, plus half a unit
    of the last of ``printed`` significant digits."""
    tolerance = rel_l2_tolerance(
        want.run_bound, want.truth, measured, want.expected, truth_bound=want.truth_bound
    )
    if printed is not None:  # measured is a number rounded to that many digits
        tolerance += printed_precision(measured, printed)
    assert abs(measured - want.expected) <= tolerance, (measured, want.expected, tolerance)


def test_plain_ddp_fails_as_predicted_from_the_rank_totals(cli: CliRun) -> None:
    """The plain loop under DDP (each rank divides by its own total, DDP averages the ranks)
    fails across two ranks, and its float64 error is the error of a mean of per-rank means
    computed here from the per-rank exact gradients (agreement to float64 rounding:
    :func:`_agrees`), shown beside it."""
    row = cli.rows["plain"]
    assert (row["verdict"], row["world_size"], row["rank_tokens"]) == ("FAIL", "2", "211;17")
    assert row["rank_tokens_counted"] == "211.0;17.0"
    want = _rank_prediction()
    assert want.expected > 1  # the imbalance 211 : 17 makes a large error
    _agrees(float(row["f64_rel_l2"]), want)
    _agrees(float(row["predicted_rel_l2"]), want)
    assert row["ranks_agree"] == "True"
    table = cli.done.stdout
    assert "world size 2" in table and "211;17" in table and "pred. rel L2" in table


def test_wacc_torch_all_reduce_mean_passes_across_ranks(cli: CliRun) -> None:
    """``wacc_torch``'s ``all_reduce_mean`` divides by every rank's tokens: the row passes, every
    rank divided by 228 = 211 + 17, the ranks agree, and no prediction applies."""
    row = cli.rows["wacc_torch-mean"]
    assert (row["verdict"], row["world_size"], row["rank_tokens"]) == ("pass", "2", "211;17")
    assert row["rank_tokens_counted"] == "228.0;228.0"
    assert row["ranks_agree"] == "True" and row["predicted_rel_l2"] == ""
    want = _rank_prediction()
    # Its run and the audit's truth are two float64 evaluations of Σ_r Σ_k g_rk / N.
    measured = float(row["f64_rel_l2"])
    assert measured <= rel_l2_tolerance(want.truth_bound, want.truth, measured)


@pytest.mark.slow
def test_reproducer_runs_under_torchrun_without_wacc(cli: CliRun, tmp_path: Path) -> None:
    """The plain row's reproducer imports only torch and the standard library, frees its loop's
    objects before it destroys the process group, runs under ``python -m torch.distributed.run
    --nproc-per-node 2`` on a CPU (gloo) with every wacc import refused and from a directory
    where wacc is not importable, and prints the row's float64 error on rank 0."""
    (script,) = sorted(cli.repro.glob("*.py"))
    assert script.name == "plain-unequal-ranks2.py"
    tree = ast.parse(script.read_text(encoding="utf-8"))
    roots = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }  # fmt: skip
    assert roots <= {"torch", "contextlib", "gc"}, roots
    # The loop's objects go before the process group: a DDP model left to interpreter exit frees
    # the group there, where gloo can abort a rank (1 run in 10 on 2 busy cores, torch 2.13).
    end = [ast.unparse(statement) for statement in tree.body[-3:]]
    assert end[0].startswith("del ") and "ddp" in re.findall(r"\w+", end[0]), end
    assert end[1:] == ["gc.collect()", "dist.destroy_process_group()"], end
    runner = tmp_path / "no_wacc.py"
    runner.write_text(NO_WACC, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # --standalone: the agent hosts the store on a port it binds itself (a port probed here and
    # passed on could be taken by another test's process before the agent binds it).
    done = subprocess.run(
        [sys.executable, "-I", "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(runner), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (printed,) = NUMBER.findall(done.stdout)
    # Another float64 run and truth than the audit's, printed with PRINTED_DIGITS digits.
    _agrees(float(printed), _rank_prediction(), printed=PRINTED_DIGITS)
    assert "ranks agree: True" in done.stdout


@pytest.mark.slow
def test_ddp_hook_and_fsdp2_pass_across_ranks() -> None:
    """``wacc_torch``'s DDP communication hook (``wacc_torch-sum`` across ranks) and its FSDP2
    window (``wacc_torch-fsdp``) hand every rank the mean over both ranks' tokens: pass, counted
    228 on each rank, ranks agree, the float64 run exact to rounding."""
    loops = [ADAPTERS["wacc_torch-sum"], ADAPTERS["wacc_torch-fsdp"]]
    result = run_audit(loops, [build_window("unequal")], world_size=2, jobs=2)
    (window,) = result.windows
    truth = compute_truth(MODEL_KINDS["plain"], torch.float32, window)
    for cell in result.cells:
        assert cell.status == "ok", cell.status
        assert cell.verdict == "pass" and cell.ranks_agree is True
        assert cell.rank_counted == (228.0, 228.0) and cell.rank_tokens == (211, 17)
        # The run and the truth: two float64 evaluations of Σ_r Σ_k g_rk / N.
        bound = prediction_bound(truth_terms(truth), "float64")
        assert cell.semantic_rel_l2 <= rel_l2_tolerance(bound, truth.gradient, cell.semantic_rel_l2)


def store_probe_loop(task: LoopTask) -> LoopRun:
    """A user loop across ranks that looks at its store before it runs the plain DDP loop: the
    audit hosts it (every rank a client) and holds its port while the world runs."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    assert agent_store == "True", f"TORCHELASTIC_USE_AGENT_STORE is {agent_store!r}: rank 0 hosts"
    port = int(os.environ["MASTER_PORT"])
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            pass
        else:
            raise AssertionError(f"MASTER_PORT {port} is free: another process could take it")
    return ADAPTERS["plain"].run(task)


store_probe_loop.ranks = True  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_audit_hosts_each_worlds_store_and_holds_its_port() -> None:
    """Every rank of a world is a client of a store the audit hosts on a port it holds until the
    world ends (as torchrun's agent does): no other process (another world of a --jobs audit)
    can take the port between its choice and its use, and no rank can join another world's
    store. The loop then runs as usual across the two ranks."""
    from wacc.audit.protocol import user_adapter

    adapter = user_adapter(f"{Path(__file__)}:store_probe_loop")
    result = run_audit([adapter], [build_window("unequal")], world_size=2)
    (cell,) = result.cells
    assert cell.status == "ok", cell.status
    assert cell.verdict == "FAIL" and cell.ranks_agree is True  # the plain loop's, as in the CLI
    assert cell.rank_counted == (211.0, 17.0)


def single_rank_loop(task: LoopTask) -> LoopRun:
    """A user loop that declares no multi-rank path (never run here)."""
    raise AssertionError("a loop without ranks = True must not run at world size 2")


def test_loop_without_ranks_is_a_row_saying_why() -> None:
    """At world size 2 a loop whose adapter has no multi-rank path is a row saying so, and
    nothing of it runs."""
    from wacc.audit.protocol import user_adapter

    adapter = user_adapter(f"{Path(__file__)}:single_rank_loop")
    result = run_audit([adapter], [build_window("unequal")], world_size=2)
    (cell,) = result.cells
    assert cell.verdict.startswith("not run at world size 2: ")
    assert "ranks = True" in cell.verdict and cell.rank_tokens == (211, 17)


@pytest.mark.parametrize("value", ["3", "0", "-2", "two", "2.0", ""])
def test_bad_world_size_is_exit_2_in_one_line(value: str, tmp_path: Path) -> None:
    """``--world-size`` other than 1, 2 or 4: one line on stderr naming the value, exit 2, no
    output folder written."""
    done = _wacc("audit", "plain", "--world-size", value, "--out", "out", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and repr(value) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_world_size_with_a_window_without_rank_windows_is_exit_2(tmp_path: Path) -> None:
    """``--windows longtail --world-size 2``: the rank windows are unequal and equal only; a
    usage error naming the window, exit 2."""
    from wacc.audit.windows import RANK_WINDOW_NAMES
    from wacc.commands.audit import _RANK_WINDOWS

    assert RANK_WINDOW_NAMES == _RANK_WINDOWS  # the command's torch-free copy
    done = _wacc("audit", "plain", "--world-size", "2", "--windows", "longtail", cwd=tmp_path)
    assert done.returncode == 2 and "longtail" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


def test_rank_windows_differ_across_ranks() -> None:
    """The rank windows: every rank K = 4 microbatches, token totals that differ across ranks,
    one rank with a zero-target microbatch, one with very few tokens in its whole window; the
    equal control has the same totals on every rank; a world size without windows raises."""
    for world_size in (2, 4):
        windows = rank_windows("unequal", world_size)
        totals = [w.total_targets for w in windows]
        assert len(windows) == world_size and {len(w.targets) for w in windows} == {4}
        assert len(set(totals)) == world_size
        assert any(0 in w.targets for w in windows) and min(totals) <= 17
        assert len({tuple(w.microbatches[0]["input_ids"].tolist()) for w in windows}) == world_size
        assert {w.total_targets for w in rank_windows("equal", world_size)} == {256}
    with pytest.raises(ValueError, match="3"):
        rank_windows("unequal", 3)
    assert sum(t for t in rank_windows("unequal", 1)[0].targets) == 211
