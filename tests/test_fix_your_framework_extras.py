"""The "Fix your framework" pages of Lightning, DeepSpeed and Keras run as written against the
real frameworks (each test skips without its extra; run by `tox -e audit-extras`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fix_your_framework import PAGES, blocks, run_page


# Lightning 2.6.6's own use of a torch pytree API that torch 2.13 deprecates.
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning")
def test_lightning_callback_and_manual_recipe_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback's Trainer steps twice over 8 batches (K = 4), its last window's mean
    divided by that window's tokens (12 + 0 + 9 + 5 = 26); the manual recipe steps twice too."""
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    namespace = run_page("lightning.md", tmp_path)
    assert namespace["trainer"].global_step == 2
    assert namespace["weighting"].window_tokens == 26.0
    assert namespace["manual"].global_step == 2


def test_deepspeed_engine_runs_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a one-process CPU world (what the `deepspeed` launcher would set up), the wrapped
    engine steps once per window, each mean divided by the window's 27 tokens, and its
    mid-window checkpoint carries a record of the 2 pending microbatches; the ZeRO 1 block does
    the same on a ZeRO 1 engine, its checkpoint next to ZeRO's partitioned optimizer state."""
    pytest.importorskip("deepspeed")
    from wacc.audit.adapters.deepspeed import _world

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__fix_your_framework__"}
    page = str(PAGES / "deepspeed.md")
    with _world(torch.float32):
        from wacc_torch.integrations.deepspeed import RECORD_KEY, TokenWeightedEngine

        stages = {0: "checkpoints", 1: "checkpoints-zero1"}
        for block, (stage, directory) in zip(blocks("deepspeed.md"), stages.items(), strict=True):
            exec(compile(block, page, "exec"), namespace)
            engine = namespace["engine"]
            assert engine.zero_optimization_stage() == stage
            assert engine.global_steps == 2 and namespace["result"].weight == 27.0
            fresh = TokenWeightedEngine(engine)
            _, client_state = fresh.load_checkpoint(directory)
            assert RECORD_KEY not in client_state
            assert fresh.accumulator.state.issued == 2
            assert fresh.accumulator.state.total_weight == 8


def test_keras_train_step_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the torch backend the model applies twice over 8 batches (steps = 4), the last window's
    mean divided by its 26 targets."""
    if importlib.util.find_spec("keras") is None:  # an import would pick TensorFlow
        pytest.skip("keras is not installed (the `keras` extra)")
    from wacc.audit.adapters.keras import import_keras

    import_keras()  # the torch backend for this process, before the page imports keras
    monkeypatch.chdir(tmp_path)
    namespace = run_page("keras.md", tmp_path)
    assert int(namespace["model"].optimizer.iterations.value) == 2
    assert namespace["model"].window_tokens == 26.0
