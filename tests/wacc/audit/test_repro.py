"""``wacc audit --repro``: every reproducer, run on its own without wacc, prints its row's number.

The audit runs in-process on the ``unequal`` window for one loop per template
(:mod:`wacc.audit.repro_templates`) and model family: ``trainer-bert`` and ``trainer-t5`` (Trainer;
the masked and seq2seq families), ``accelerate`` and ``accelerate-variable`` (GPT-2), ``nanogpt``
(the plain model written out), ``pixparse`` (its GradScaler), ``plain`` and, where Lightning is
installed, ``lightning`` and ``lightning-manual``; the mid-window resume of those in
:data:`RESUMED` (one per restart template), no float16 runs (:func:`_lean`). Of the scripts
written, those whose every line another script runs too are not run (:data:`COVERED`); the others
run concurrently (each spends most of its time importing torch and its framework).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.repro_check import (  # noqa: E402
    NUMBER,
    RUNNER,
    WACC,
    imports,
    tolerance,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.protocol import Adapter  # noqa: E402
from wacc.audit.repro import LOST, Reproducer, write_reproducers  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOPS = [
    "trainer-bert", "trainer-t5", "accelerate", "accelerate-variable", "nanogpt", "pixparse",
    "plain",
]  # fmt: skip
try:  # Lightning is an optional extra: its loops run only where it is installed
    import lightning.pytorch  # noqa: F401

    LOOPS += ["lightning", "lightning-manual"]
except ImportError:
    pass
RESUMED = {"plain", "pixparse", "accelerate-variable", "lightning-manual"}  # resume is run
# Written but not run: each is another run script's code with its mid-window restart removed.
COVERED = {"accelerate-variable-unequal.py", "lightning-manual-unequal.py"}
ROOT = Path(__file__).resolve().parents[3]
FRAMEWORKS = {"torch", "transformers", "accelerate", "lightning"}


@dataclass(frozen=True)
class Runs:
    """The audit, every reproducer it wrote, and the runs of those not in :data:`COVERED`."""

    result: AuditResult
    written: list[Reproducer]
    done: dict[str, subprocess.CompletedProcess[str]]  # by file name


def _lean(adapter: Adapter) -> Adapter:
    """The adapter without the runs no reproducer here needs (time): its float16 path, its fixed
    loss scale, and its mid-window resume unless in :data:`RESUMED`.  The cells' runs, whose
    numbers the scripts reproduce, are untouched."""
    skipped = "not run in this test"
    checkpoint = adapter.checkpoint if adapter.name in RESUMED else skipped
    return dataclasses.replace(adapter, fp16=skipped, loss_scale=False, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    result = run_audit([_lean(ADAPTERS[n]) for n in LOOPS], [build_window("unequal")])
    directory = tmp_path_factory.mktemp("repro")
    written, notes = write_reproducers(result, directory)
    assert notes == []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = tmp_path_factory.mktemp("cwd")
    started = {
        r.path.name: subprocess.Popen(
            [sys.executable, "-I", "-c", RUNNER, str(r.path)],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in written
        if r.path.name not in COVERED
    }
    done = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=600)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return Runs(result, written, done)


@pytest.mark.slow
def test_one_reproducer_per_failure(runs: Runs) -> None:
    """A script per FAIL cell, named <loop>-<window>.py, and one per lost mid-window resume
    (<loop>-unequal-resume.py); none for a passing cell or a resume that is not lost."""
    cells, facts = runs.result.cells, runs.result.facts
    fails = {f"{c.adapter}-{c.window}.py" for c in cells if c.verdict == "FAIL"}
    lost = {f"{f.adapter.name}-unequal-resume.py" for f in facts if f.resume == LOST}
    assert {r.path.name for r in runs.written} == fails | lost
    assert "plain-unequal.py" not in fails  # the plain loop passes: no cell script
    assert {
        "plain-unequal-resume.py", "pixparse-unequal-resume.py",
        "accelerate-variable-unequal-resume.py",
    } <= lost  # fmt: skip


@pytest.mark.slow
def test_scripts_import_only_torch_the_framework_and_the_stdlib(runs: Runs) -> None:
    """Statically: every import of every script is torch, a framework or the standard library
    (the runs refuse any wacc import too: see the next test)."""
    allowed = FRAMEWORKS | set(sys.stdlib_module_names)
    for reproducer in runs.written:
        for names in imports(reproducer.path):
            assert {n.split(".")[0] for n in names} <= allowed, (reproducer.path.name, names)


def _tolerance(reproducer: Reproducer) -> float:
    """How far the printed r = ‖F − T‖/‖T‖ may be from the row's: the exact sides differ only in
    the float64 order of the window's K additions, ‖ΔT‖ <= γ_K(float64) ‖Σ_k |g_k|‖ / N, which
    moves r by at most (1 + r) ‖ΔT‖ / (‖T‖ − ‖ΔT‖); the printed 15 significant digits add half a
    unit of the last printed digit (`printed_precision`)."""
    return tolerance(reproducer.loop, build_window(reproducer.window), reproducer.expected)


@pytest.mark.slow
def test_each_script_prints_its_rows_number(runs: Runs) -> None:
    """Run outside wacc (isolated interpreter, PYTHONPATH cleared, a scratch working directory,
    every wacc import refused), each script prints its row's number: a cell's f64 rel L2, a
    resume's resumed rel L2.

    The tolerance is derived from what differs (:func:`_tolerance`). A cell's script repeats the
    audit's float64 run (the same operations on the same weights and data, float32 ones included
    where a model's own loss casts down); a resume script repeats the audit's float32 resumed run,
    whose CPU kernels give the same bits on every run (the audit checks it: ``deterministic``).
    Only the exact side differs, and only in float64 summation order (the script backpropagates the
    sum of the K = 4 microbatch loss sums, the audit sums their gradients): within γ_K(float64) of
    ‖Σ_k |g_k|‖ normwise, and the script prints 15 significant digits. Weights or data rounded
    differently, or one float32 step more or less, move the number by far more (a 2**-24 rounding
    of the part of the gradient it touches; 1.5e-10 relative was seen from T5's float32 layer norm
    when the exact side scaled the loss by 1/N before the backward).
    """
    assert all(c.deterministic for c in runs.result.cells if c.status == "ok")
    assert runs.done
    for reproducer in runs.written:
        run = runs.done.get(reproducer.path.name)
        if run is None:
            continue
        assert run.returncode == 0, (reproducer.path.name, run.stderr[-3000:])
        (printed,) = NUMBER.findall(run.stdout)
        tolerance = _tolerance(reproducer)
        assert abs(float(printed) - reproducer.expected) <= tolerance, (
            reproducer.path.name,
            printed,
            reproducer.expected,
            tolerance,
        )
        assert f"true total {sum(build_window('unequal').targets)}" in run.stdout


def _wacc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "wacc", "audit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_repro_that_is_a_file_is_exit_2(tmp_path: Path) -> None:
    """--repro naming an existing file is a usage error: one line, exit 2, before any run."""
    target = tmp_path / "file"
    target.write_text("x")
    done = _wacc("nanogpt", "--out", str(tmp_path / "out"), "--repro", str(target), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "--repro" in done.stderr and str(target) in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_cli_writes_the_failing_rows_script_and_keeps_exit_1(tmp_path: Path) -> None:
    """``wacc audit nanogpt --windows unequal --repro DIR`` creates DIR (nested), writes the FAIL
    row's script there, says so on stderr and still exits 1 (a failing loop)."""
    repro = tmp_path / "new" / "repro"
    done = _wacc(
        "nanogpt", "--windows", "unequal", "--quiet", "--out", str(tmp_path / "out"),
        "--repro", str(repro), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert sorted(p.name for p in repro.iterdir()) == ["nanogpt-unequal.py"]
    assert f"wrote 1 reproducer to {repro}" in done.stderr


USER_LOOP = '''
import torch

from wacc.audit.protocol import LoopRun


def mean_of_means(task):
    """Each microbatch's mean loss / K; resumed from a state_dict, losing the pending .grad."""
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    task.hook_optimizer(optimizer, model)
    data = task.dataset
    for index in range(len(data)):
        if index == task.checkpoint_after:
            path = task.workdir / "checkpoint.pt"
            torch.save(model.state_dict(), path)
            model = task.build_model()
            model.load_state_dict(torch.load(path, weights_only=True))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            task.hook_optimizer(optimizer, model)
        batch = {k: v[None] for k, v in data[index].items()}
        (model(**batch)["loss"] / task.num_microbatches).backward()
    optimizer.step()
    return LoopRun(counted_tokens=None)


mean_of_means.checkpoint = True
'''


@pytest.mark.slow
def test_a_user_loop_gets_reproducers_that_print_its_rows_numbers(tmp_path: Path) -> None:
    """``wacc audit loops/mine.py:mean_of_means --repro DIR`` (a user's file in a folder) writes a
    script for the FAIL row and one for the lost mid-window resume, each from the LoopTask the
    loop ran; run from another folder, with no wacc import of its own (the user's module imports
    ``LoopRun``), each prints the row's number from audit.csv (f64 rel L2; resumed rel L2), within
    the float64 summation-order tolerance of :func:`_tolerance`."""
    (tmp_path / "loops").mkdir()
    (tmp_path / "loops" / "mine.py").write_text(USER_LOOP, encoding="utf-8")
    repro = tmp_path / "repro"
    done = _wacc(
        "loops/mine.py:mean_of_means", "--windows", "unequal", "--quiet", "--out",
        str(tmp_path / "out"), "--repro", str(repro), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "wrote 2 reproducers" in done.stderr, done.stderr
    assert "no reproducer" not in done.stderr
    (row,) = csv.DictReader((tmp_path / "out" / "audit.csv").read_text("utf-8").splitlines())
    assert row["verdict"] == "FAIL" and row["mid_window_resume"] == LOST, row
    expected = {
        "mine.mean_of_means-unequal.py": float(row["f64_rel_l2"]),
        "mine.mean_of_means-unequal-resume.py": float(row["resumed_rel_l2"]),
    }
    assert sorted(p.name for p in repro.iterdir()) == sorted(expected)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name, number in expected.items():
        script = repro / name
        assert all(n.split(".")[0] not in WACC for names in imports(script) for n in names)
        run = subprocess.run(
            [sys.executable, str(script)], cwd=elsewhere, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, (name, run.stderr[-3000:])
        (printed,) = NUMBER.findall(run.stdout)
        resume = name.endswith("-resume.py")
        reproducer = Reproducer(script, "plain", "unequal", resume, "float32", number)
        assert abs(float(printed) - number) <= _tolerance(reproducer), (name, printed, number)
