"""The README's usage examples run as written (the training loop, then the DDP block on 1 rank)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def _block(marker: str) -> str:
    """The one Python block of the README that contains ``marker``."""
    (block,) = [block for block in _python_blocks() if marker in block]
    return block


def test_readme_has_the_usage_examples() -> None:
    """The README shows a training loop, a data-parallel block, an accumulator of your own for
    ``wacc check``, a reference block and the DDP communication-hook block, each exactly once."""
    for marker in (
        "save_record(",
        "all_reduce_mean(",
        "def make(dtype",
        "ReferenceAccumulator(",
        "WeightedAllReduceHook(",
    ):
        _block(marker)


def test_training_loop_example_runs_and_resumes_mid_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loop example trains two windows and its mid-window record resumes with 2 issued."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(_block("save_record("), str(README), "exec"), namespace)
    assert (tmp_path / "accumulator.pt").exists()
    state = namespace["resumed"].state
    assert (state.issued, state.zero_weight, state.total_weight) == (2, 0, 8.0)
    assert "issued=2" in capsys.readouterr().out


def test_data_parallel_example_runs_on_one_gloo_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a one-rank gloo group the DDP block reduces and applies a finite mean gradient."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(_block("save_record("), str(README), "exec"), namespace)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        namespace["ddp_model"] = torch.nn.parallel.DistributedDataParallel(namespace["model"])
        exec(compile(_block("all_reduce_mean("), str(README), "exec"), namespace)
        result = namespace["global_mean"]
        assert result.normalized and result.weight == 1.0 + 50.0  # rank 0: 1 + 50 tokens
        assert all(torch.isfinite(g).all() for g in result.grads.values() if g is not None)
    finally:
        dist.destroy_process_group()


def test_reference_example_prints_what_its_comments_say(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference block's printed values are the ones its comments derive by hand."""
    namespace: dict[str, Any] = {}
    exec(compile(_block("ReferenceAccumulator("), str(README), "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["inf", "1.0"]
    assert lines[2] == str(np.array([3 * 2.0**-13, 2.0**-13]))


def test_check_your_own_accumulator_example_passes_as_written(tmp_path: Path) -> None:
    """The README's my_accumulator.py passes the first ``wacc check`` command it shows (exit 0)."""
    (tmp_path / "my_accumulator.py").write_text(_block("def make(dtype"), encoding="utf-8")
    commands = re.findall(r"^wacc check my_accumulator\.py:make[^#\n]*", README.read_text(), re.M)
    assert commands, "the README shows no wacc check of my_accumulator.py"
    args = commands[0].split()[1:] + ["--examples", "10", "--quiet"]
    result = subprocess.run(
        [sys.executable, "-m", "wacc", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_comm_hook_example_runs_on_one_gloo_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a one-rank gloo group the comm-hook block leaves a finite mean gradient in every .grad
    and reports the window's weight (3 + 40 + 9 tokens) and its three microbatches."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    exec(compile(_block("save_record("), str(README), "exec"), namespace)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        namespace["ddp_model"] = torch.nn.parallel.DistributedDataParallel(namespace["model"])
        exec(compile(_block("WeightedAllReduceHook("), str(README), "exec"), namespace)
        result = namespace["hook"].result
        assert result.normalized and result.weight == 3.0 + 40.0 + 9.0 and result.issued == 3
        grads = [p.grad for p in namespace["model"].parameters()]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    finally:
        dist.destroy_process_group()


def test_quickstart_is_two_commands_install_and_report_then_the_tests() -> None:
    """The Quickstart block is exactly two commands: install + ``wacc report``, then pytest."""
    text = README.read_text(encoding="utf-8")
    quickstart = text.split("## Quickstart", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quickstart, flags=re.S)
    assert block is not None
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) == 2
    assert commands[0].startswith("pip install torch==2.13.0 && ") and commands[0].endswith(
        "&& wacc report"
    )
    assert commands[1] == "python -m pytest"
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert "\npython -m pytest\n" in ci and "wacc gate" in ci


def test_readme_points_nowhere_outside_the_repository() -> None:
    """Every relative link of the README names a file of the repository."""
    text = README.read_text(encoding="utf-8")
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (README.parent / target).exists(), target
