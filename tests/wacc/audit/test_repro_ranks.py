"""``wacc audit --world-size 2 --repro`` for the framework loops: each FAIL row across ranks gets
``<loop>-<window>-ranks2.py``, a script that ``python -m torch.distributed.run --nproc-per-node 2``
runs on a CPU (gloo) outside wacc, each rank building its own window, and that prints the row's
float64 error on rank 0 (:mod:`wacc.audit.repro_templates`: the loop's ``ranks`` text).

Here: ``accelerate``'s documented loop (the ``frameworks`` extra, in the normal suite); the
other framework rows are :mod:`tests.wacc.audit.test_repro_ranks_extras`'s (tox -e
audit-extras).  The audit runs the loops across two ranks on the ``unequal`` window (ranks of
211 and 17 target tokens), writes their reproducers, and each script runs under
``torch.distributed.run`` in an isolated interpreter with every wacc import refused.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.test_repro import NUMBER, RUNNER, imports, tolerance  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.repro import Reproducer, write_reproducers  # noqa: E402
from wacc.audit.repro_templates import LOOPS as TEMPLATES  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOPS = ["accelerate"]
WORLD = 2


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RankRuns:
    return rank_runs(LOOPS, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_script_across_ranks_prints_its_rows_number(runs: RankRuns, loop: str) -> None:
    """:func:`check_prints_its_rows_number` for ``loop``."""
    check_prints_its_rows_number(runs, loop)


def _keywords(text: str) -> set[tuple[str, str]]:
    """(called name, keyword) of every keyword argument in the script text ``text``, but those
    of ``os.environ.update`` (a one-process run's world, which torchrun gives across ranks)."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) != "os.environ.update":
            found |= {(ast.unparse(node.func), k.arg) for k in node.keywords if k.arg}
    return found


def test_each_ranks_text_keeps_every_option_of_its_one_process_run() -> None:
    """A loop's text across ranks is its one-process code path with the data-parallel options
    added: every keyword argument the one-process text passes, it passes too (none lost to a
    comment or a rewrite)."""
    checked = 0
    for name, template in TEMPLATES.items():
        if template.ranks is None:
            continue
        lost = _keywords(template.body) - _keywords(template.ranks)
        assert not lost, (name, sorted(lost))
        checked += 1
    assert checked >= 14  # every trainer-* row, accelerate, lightning, deepspeed, nanogpt, plain
