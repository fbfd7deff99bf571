"""The documentation's usage examples run as written (the training loop, then the DDP block on 1
rank): each block is read from the docs/ page that shows it, the Quickstart from the README."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.docs_support import DOCS, README, quickstart
from tests.wacc_torch.support import assert_bitwise_equal
from wacc_torch import WeightedGradientsAccumulator

# Where each example lives: the page a reader meets it on (marker -> page).
PAGES = {
    "save_record(": "accumulator.md",
    "all_reduce_mean(": "data-parallel.md",
    "def make(dtype": "check.md",
    "ReferenceAccumulator(": "reference-model.md",
    "WeightedAllReduceHook(": "data-parallel.md",
    "zero_copy=True": "zero-copy.md",
    "WindowLossScaler(": "loss-scaling.md",
}


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def _page(marker: str) -> Path:
    return DOCS / PAGES[marker]


def _block(marker: str) -> str:
    """The one Python block of the marker's page that contains ``marker``."""
    (block,) = [block for block in _python_blocks(_page(marker)) if marker in block]
    return block


def _exec(marker: str, namespace: dict[str, Any]) -> None:
    """Run the marker's block in ``namespace``; a traceback names its page."""
    exec(compile(_block(marker), str(_page(marker)), "exec"), namespace)


def test_readme_has_the_usage_examples() -> None:
    """The docs show a training loop, a data-parallel block, an accumulator of your own for
    ``wacc check``, a reference block, the DDP communication-hook block, the zero-copy loop and
    the loss-scaling loop, each exactly once in all of docs/ (on its page)."""
    every_block = [b for page in sorted(DOCS.glob("*.md")) for b in _python_blocks(page)]
    for marker in PAGES:
        _block(marker)
        assert sum(marker in block for block in every_block) == 1, marker


def test_dynamic_loss_scaling_example_skips_overflowing_windows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The WindowLossScaler loop runs as written: every window it skips had found_inf, every
    window it applied had none, its scales are what a fresh scaler gives for those decisions,
    the run both skips and applies (the spiked window among the skipped), and the model stays
    finite."""
    from wacc_torch import WindowLossScaler

    namespace: dict[str, Any] = {}
    _exec("WindowLossScaler(", namespace)
    lines = re.findall(
        r"^window (\d+): S=(\S+) found_inf=(True|False) applied=(True|False)$",
        capsys.readouterr().out,
        flags=re.M,
    )
    assert [int(step) for step, *_ in lines] == list(range(len(namespace["windows"])))
    replay = WindowLossScaler(growth_interval=2)
    for _, scale, found, applied in lines:
        assert float(scale) == replay.scale
        assert (applied == "True") == (found == "False") == replay.update(found == "True")
    decisions = [applied == "True" for *_, applied in lines]
    assert any(decisions) and not all(decisions) and not decisions[6]
    assert all(torch.isfinite(p).all() for p in namespace["model"].parameters())


def test_training_loop_example_runs_and_resumes_mid_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The loop example trains two windows and its mid-window record resumes with 2 issued."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    _exec("save_record(", namespace)
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
    _exec("save_record(", namespace)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        namespace["ddp_model"] = torch.nn.parallel.DistributedDataParallel(namespace["model"])
        _exec("all_reduce_mean(", namespace)
        result = namespace["global_mean"]
        assert result.normalized and result.weight == 1.0 + 50.0  # rank 0: 1 + 50 tokens
        assert all(torch.isfinite(g).all() for g in result.grads.values() if g is not None)
    finally:
        dist.destroy_process_group()


def test_zero_copy_example_steps_with_the_buffered_modes_mean(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The zero-copy loop's optimizer steps on the token-weighted mean of its four microbatches,
    bit for bit what the buffered accumulator gives for the same data, and leaves .grad empty."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    initial: dict[str, torch.Tensor] = {}
    stepped: dict[str, torch.Tensor] = {}
    cross_entropy, sgd_step = F.cross_entropy, torch.optim.SGD.step

    def record_forward(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if isinstance(module, torch.nn.Sequential):  # the example's model, not its layers
            if not initial:  # the parameters before the first forward
                initial.update({k: v.clone() for k, v in module.state_dict().items()})
            seen.append((args[0], torch.empty(0)))  # its targets come with the loss

    def record_targets(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen[-1] = (seen[-1][0], targets)
        return cross_entropy(logits, targets)

    def record_step(optimizer: torch.optim.SGD, *args: Any, **kwargs: Any) -> Any:
        for group in optimizer.param_groups:
            stepped.update({str(i): p.grad.clone() for i, p in enumerate(group["params"])})
        return sgd_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", record_targets)
    monkeypatch.setattr(torch.optim.SGD, "step", record_step)
    namespace: dict[str, Any] = {}
    handle = torch.nn.modules.module.register_module_forward_pre_hook(record_forward)
    try:
        _exec("zero_copy=True", namespace)
    finally:
        handle.remove()
        monkeypatch.undo()
    model = namespace["model"]
    assert [len(targets) for _, targets in seen] == [1, 7, 200, 3]
    assert all(p.grad is None for p in model.parameters())
    assert namespace["accumulator"].state.issued == 0

    replay = copy.deepcopy(model)
    replay.load_state_dict(initial)
    buffered = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=namespace["LOSS_SCALE"])
    for inputs, targets in seen:
        (namespace["LOSS_SCALE"] * F.cross_entropy(replay(inputs), targets)).backward()
        buffered.accumulate_mean(replay, targets.numel())
    expected = buffered.finish_mean()
    assert expected.weight == 211.0
    for index, (name, _) in enumerate(replay.named_parameters()):
        assert_bitwise_equal(stepped[str(index)], expected.grads[name], name)


def test_reference_example_prints_what_its_comments_say(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference block's printed values are the ones its comments derive by hand."""
    namespace: dict[str, Any] = {}
    _exec("ReferenceAccumulator(", namespace)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["inf", "1.0"]
    assert lines[2] == str(np.array([3 * 2.0**-13, 2.0**-13]))


def test_check_your_own_accumulator_example_passes_as_written(tmp_path: Path) -> None:
    """The check page's my_accumulator.py passes the first ``wacc check`` command it shows
    (exit 0)."""
    (tmp_path / "my_accumulator.py").write_text(_block("def make(dtype"), encoding="utf-8")
    page = _page("def make(dtype").read_text(encoding="utf-8")
    commands = re.findall(r"^wacc check my_accumulator\.py:make[^#\n]*", page, re.M)
    assert commands, "the check page shows no wacc check of my_accumulator.py"
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
    _exec("save_record(", namespace)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        namespace["ddp_model"] = torch.nn.parallel.DistributedDataParallel(namespace["model"])
        _exec("WeightedAllReduceHook(", namespace)
        result = namespace["hook"].result
        assert result.normalized and result.weight == 3.0 + 40.0 + 9.0 and result.issued == 3
        grads = [p.grad for p in namespace["model"].parameters()]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    finally:
        dist.destroy_process_group()


def test_quickstart_is_two_commands_install_and_report_then_the_tests() -> None:
    """The README's Quickstart block is exactly two commands: install + ``wacc report --quick``
    (the main job, short enough for CI to run as written), then pytest on every core; the docs'
    home page shows the same block."""
    block = quickstart(README)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    commands = [c for c in commands if c]
    assert commands == [
        'pip install torch==2.13.0 && pip install -e ".[dev]" && wacc report --quick',
        "python -m pytest -n auto --dist loadfile",
    ]
    assert quickstart(DOCS / "index.md") == block


def _workflow() -> dict[str, Any]:
    import yaml

    (block,) = re.findall(
        r"```yaml\n(# \.github/workflows/numerics\.yml.*?)```",
        (DOCS / "gate.md").read_text(encoding="utf-8"), flags=re.S,
    )  # fmt: skip
    workflow: dict[str, Any] = yaml.safe_load(block)
    return workflow


def test_the_ci_recipe_for_other_repositories_keeps_its_promises() -> None:
    """The gate page's workflow for another project: shards that all finish (fail-fast false), a
    merge job that runs when one failed (if: always()) and appends the summary to
    $GITHUB_STEP_SUMMARY, replay files and results uploaded even from a failed shard, wacc
    installed from a git URL, a committed baseline named; every wacc command line in it is
    accepted by wacc's own parser."""
    from wacc.cli import build_parser

    jobs = _workflow()["jobs"]
    shard, merge = jobs["gate-shard"], jobs["gate"]
    assert shard["strategy"]["fail-fast"] is False
    assert merge["if"] == "always()" and merge["needs"] == "gate-shard"
    runs = [step.get("run", "") for job in (shard, merge) for step in job["steps"]]
    assert any("git+https://" in run for run in runs)
    assert any('>> "$GITHUB_STEP_SUMMARY"' in run for run in runs)
    uploads = [s for s in shard["steps"] if s.get("uses", "").startswith("actions/upload")]
    assert (
        uploads and uploads[0]["if"] == "always()" and "gate-replays/" in uploads[0]["with"]["path"]
    )
    commands = [
        run.replace("${{ matrix.shard }}", "1").split()
        for run in runs
        if run.startswith("wacc gate")
    ]
    assert len(commands) == 2 and any("--baseline" in c for c in commands)
    for argv in commands:
        build_parser().parse_args(argv[1:])  # exits 2 on an option wacc does not have
