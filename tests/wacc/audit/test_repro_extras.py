"""``wacc audit --repro`` for the loops of the extras CI does not install: ``keras``,
``deepspeed``, ``peft-lora-gpt2``, ``trl-sft`` and ``trl-sft-packing`` (their templates in
:mod:`wacc.audit.repro_templates`), each where its framework imports (the adapter's own check:
Keras only on the torch backend), as :mod:`tests.wacc.audit.test_repro` does for the others.

The audit runs in-process on the ``unequal`` window for the installed ones (no float16 runs, no
mid-window resume: none of these loops loses its pending gradient), writes their reproducers, and
runs each script two at a time (each spends seconds of CPU in its framework) outside wacc.  Where
PEFT is installed, the model a LoRA script builds is checked against the audit's directly.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.wacc.audit.test_repro import NUMBER, RUNNER, _lean, _tolerance, imports  # noqa: E402
from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.models import MODEL_KINDS  # noqa: E402
from wacc.audit.repro import Reproducer, _model, write_reproducers  # noqa: E402
from wacc.audit.repro_templates import LOOPS as TEMPLATES  # noqa: E402
from wacc.audit.runner import AuditResult, run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

LOOPS = ["keras", "deepspeed", "peft-lora-gpt2", "trl-sft", "trl-sft-packing"]


@functools.cache
def _missing(loop: str) -> str | None:
    """Why ``loop`` does not run here: its adapter's own availability check (None: it runs).
    Asked when a test runs, not at collection (it imports the framework)."""
    return ADAPTERS[loop].unavailable()


@dataclass(frozen=True)
class Runs:
    """The audit of the installed loops, the reproducers it wrote (and its notes), their runs."""

    result: AuditResult
    written: dict[str, Reproducer]  # by loop
    notes: list[str]
    done: dict[str, subprocess.CompletedProcess[str]]  # by loop


def _run(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-I", "-c", RUNNER, str(path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    installed = [loop for loop in LOOPS if _missing(loop) is None]
    if not installed:
        pytest.skip(f"none of {LOOPS} is installed")
    result = run_audit([_lean(ADAPTERS[n]) for n in installed], [build_window("unequal")])
    directory = tmp_path_factory.mktemp("repro")
    written, notes = write_reproducers(result, directory)
    cwd = tmp_path_factory.mktemp("cwd")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {r.loop: pool.submit(_run, r.path, cwd) for r in written}
        done = {loop: future.result() for loop, future in futures.items()}
    return Runs(result, {r.loop: r for r in written}, notes, done)


def _installed(loop: str) -> None:
    if _missing(loop) is not None:
        pytest.skip(f"{loop}: {_missing(loop)}")


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_a_failing_row_gets_its_script(runs: Runs, loop: str) -> None:
    """The loop's unequal row FAILs, and it gets <loop>-unequal.py (no "no reproducer" note)."""
    _installed(loop)
    (cell,) = [c for c in runs.result.cells if c.adapter == loop]
    assert cell.verdict == "FAIL"
    assert runs.notes == []
    assert runs.written[loop].path.name == f"{loop}-unequal.py"
    assert not runs.written[loop].resume
    # The header says how the loop cuts the window when not one microbatch per sequence.
    header = ast.get_docstring(ast.parse(runs.written[loop].path.read_text(encoding="utf-8")))
    assert header is not None
    flowing = " ".join(header.split())  # the header is wrapped at 96 columns
    assert ("Packing puts the window's sequences into fewer rows" in flowing) == (
        loop == "trl-sft-packing"
    )


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_script_imports_only_torch_its_framework_and_the_stdlib(runs: Runs, loop: str) -> None:
    """Statically: every import of the script is torch, a distribution its header names (the
    framework and the libraries it is used with) or the standard library."""
    _installed(loop)
    allowed = {"torch", *TEMPLATES[loop].distributions, *sys.stdlib_module_names}
    for names in imports(runs.written[loop].path):
        assert {n.split(".")[0] for n in names} <= allowed, names


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_script_prints_its_rows_number(runs: Runs, loop: str) -> None:
    """Run outside wacc (isolated interpreter, PYTHONPATH cleared, a scratch working directory,
    every wacc import refused), the script prints its row's f64 rel L2 within the derived
    tolerance of :func:`tests.wacc.audit.test_repro._tolerance` (the exact sides differ only in
    the float64 order of K additions; 15 digits printed), the window's true total and, for a loop
    that divides by a count, the count the audit saw.

    The script repeats the audit's float64 run: the same weights (LoRA's drawn from torch's RNG
    reseeded as wacc does), data and operations, bfloat16 ones included (TRL's default bf16 casts
    the fused LM head's matmul to bfloat16 even for float64 weights; CPU kernels give the same bits
    on every run, which the audit checks: ``deterministic``), and Keras's float32 loss weights.
    """
    _installed(loop)
    (cell,) = [c for c in runs.result.cells if c.adapter == loop]
    assert cell.deterministic
    reproducer, run = runs.written[loop], runs.done[loop]
    assert run.returncode == 0, run.stderr[-3000:]
    (printed,) = NUMBER.findall(run.stdout)
    tolerance = _tolerance(reproducer)
    assert abs(float(printed) - reproducer.expected) <= tolerance, (
        printed,
        reproducer.expected,
        tolerance,
    )
    assert f"true total {sum(build_window('unequal').targets)}" in run.stdout
    if cell.counted is not None:
        assert re.search(rf"num_items_in_batch {int(cell.counted)}\b", run.stdout)


@pytest.mark.parametrize("kind", ["lora-gpt2", "lora-llama"])
def test_a_lora_scripts_model_is_the_audits(kind: str) -> None:
    """The ``build_model`` a script defines for a LoRA model kind makes the audit's model bit for
    bit, whatever torch's RNG state before the call: the same parameter names, values and trainable
    set (the base from wacc's seed, the adapters from the RNG reseeded, as wacc draws them)."""
    pytest.importorskip("peft")
    imports, source = _model(MODEL_KINDS[kind], "float32")
    namespace = {"torch": torch, "DTYPE": torch.float32}
    # PEFT's and transformers' deprecation notices (wacc.audit.models silences them too).
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(7)  # another state: the script's build_model must seed itself
        exec("\n".join([*imports, source]), namespace)
        built = dict(namespace["build_model"]().named_parameters())
    audit = dict(MODEL_KINDS[kind].build(torch.float32).named_parameters())
    assert list(built) == list(audit)
    assert all(torch.equal(built[n], audit[n]) for n in audit)
    assert {n for n, p in built.items() if p.requires_grad} == {
        n for n, p in audit.items() if p.requires_grad
    }
