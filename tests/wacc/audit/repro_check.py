"""What the reproducer tests share, importable without any framework (the frameworks' own test
files use it where transformers is absent): the runner that refuses every wacc import, the line a
script prints its number on, the modules a script imports, the tolerance on the printed number,
and the 2-rank audit + torchrun runs of the scripts across ranks."""

from __future__ import annotations

import ast
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

from tests.wacc.audit.expected import PRINTED_DIGITS, printed_precision
from wacc.audit.adapters import ADAPTERS
from wacc.audit.models import MODEL_KINDS
from wacc.audit.repro import Reproducer, write_reproducers
from wacc.audit.runner import AuditResult, run_audit
from wacc.audit.truth import compute_truth
from wacc.audit.windows import Window, build_window
from wacc_ref.bounds import gamma

WORLD = 2
WACC = {"wacc", "wacc_torch", "wacc_ref"}
# Runs the script with every wacc import refused: it must not need one, even indirectly.
RUNNER = f"""
import runpy, sys

class NoWacc:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(WACC)}:
            raise ImportError("the reproducer imported " + name)

sys.meta_path.insert(0, NoWacc())
runpy.run_path(sys.argv[1], run_name="__main__")
"""
NUMBER = re.compile(r"^rel L2 error of .* accumulation vs exact: (\S+)$", re.M)


def imports(path: Path) -> list[list[str]]:
    """The modules each import statement of the script at ``path`` names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.append([alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom):
            found.append([node.module or ""])
    return found


def tolerance(loop: str, window: Window, r: float) -> float:
    """How far a script's printed r = ‖F − T‖/‖T‖ may be from the row ``loop`` / ``window``'s
    number ``r`` (across ranks: ``window`` is every rank's microbatches joined, the truth's
    window): the exact sides differ only in the float64 order of the window's K additions,
    ‖ΔT‖ <= γ_K(float64) ‖Σ_k |g_k|‖ / N, which moves r by at most (1 + r) ‖ΔT‖ / (‖T‖ − ‖ΔT‖);
    the printed 15 significant digits add half a unit of the last printed digit
    (`printed_precision`)."""
    truth = compute_truth(MODEL_KINDS[ADAPTERS[loop].model], torch.float32, window)
    k = len(truth.microbatch_sums)
    spread = np.linalg.norm(sum(np.abs(g) for g in truth.microbatch_sums)) / sum(truth.targets)
    moved = gamma(k, "float64") * spread
    exact = float(np.linalg.norm(truth.gradient))
    return float((1 + r) * moved / (exact - moved)) + printed_precision(r, PRINTED_DIGITS)


@dataclass(frozen=True)
class RankRuns:
    """The audit across ranks, the reproducers it wrote (by loop), its notes, their runs."""

    result: AuditResult
    written: dict[str, Reproducer]
    notes: list[str]
    done: dict[str, subprocess.CompletedProcess[str]]


def _torchrun(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -I -m torch.distributed.run --nproc-per-node 2 <script>``, every wacc import
    refused, PYTHONPATH cleared, in ``cwd`` (where wacc is not importable)."""
    runner = cwd / f"{path.stem}-no-wacc.py"
    runner.write_text(RUNNER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # --standalone: the agent hosts the store on a port it binds itself (a port probed here and
    # passed on could be taken by another test's process before the agent binds it).
    return subprocess.run(
        [sys.executable, "-I", "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(WORLD), str(runner), str(path)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def rank_runs(loops: list[str], tmp_path_factory: pytest.TempPathFactory) -> RankRuns:
    """Audit ``loops`` across two ranks on ``unequal``, write their reproducers and run each
    under ``torch.distributed.run`` (two scripts at a time).  One world at a time (``jobs=1``):
    with two at once the GPT-2 rows were seen off (wacc audit --jobs 2, reported)."""
    result = run_audit(
        [ADAPTERS[n] for n in loops], [build_window("unequal")], isolate=True, jobs=1,
        world_size=WORLD,
    )  # fmt: skip
    written, notes = write_reproducers(result, tmp_path_factory.mktemp("repro"))
    cwd = tmp_path_factory.mktemp("cwd")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {r.loop: pool.submit(_torchrun, r.path, cwd) for r in written}
        done = {loop: future.result() for loop, future in futures.items()}
    return RankRuns(result, {r.loop: r for r in written}, notes, done)


def check_prints_its_rows_number(runs: RankRuns, loop: str) -> None:
    """The row FAILs across ranks, its script is ``<loop>-unequal-ranks2.py`` (no note), imports
    no wacc, runs under torchrun, and rank 0 prints the row's f64 rel L2 within the float64
    summation-order tolerance (:func:`tests.wacc.audit.test_repro.tolerance` over every rank's
    microbatches), every rank holding the same gradient."""
    (cell,) = [c for c in runs.result.cells if c.adapter == loop]
    assert cell.verdict == "FAIL", cell.status
    assert not [n for n in runs.notes if n.startswith(f"{loop} /")], runs.notes
    reproducer = runs.written[loop]
    assert reproducer.path.name == f"{loop}-unequal-ranks{WORLD}.py"
    assert not any(n.split(".")[0] in {"wacc", "wacc_torch", "wacc_ref"}
                   for names in imports(reproducer.path) for n in names)  # fmt: skip
    done = runs.done[loop]
    assert done.returncode == 0, done.stderr[-3000:]
    (printed,) = NUMBER.findall(done.stdout)
    (joined,) = runs.result.windows  # every rank's microbatches: the truth's window
    expected = cell.semantic_rel_l2
    assert abs(float(printed) - expected) <= tolerance(loop, joined, expected), (printed, expected)
    assert "ranks agree: True" in done.stdout
