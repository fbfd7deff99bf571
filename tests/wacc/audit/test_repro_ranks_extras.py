"""``wacc audit --world-size 2 --repro`` for the framework rows that fail across ranks, beside
:mod:`tests.wacc.audit.test_repro_ranks`'s ``accelerate``: the Trainer's rows (GPT-2 with
``average_tokens_across_devices`` on and off, Llama with it off, BERT, T5, a plain module),
``accelerate-variable``, Lightning's two paths and DeepSpeed at ZeRO 0 and 1, each where its
framework imports (tox -e audit-extras installs them).  Each row's script runs under
``torch.distributed.run --nproc-per-node 2`` outside wacc and prints the row's float64 error on
rank 0 (:func:`tests.wacc.audit.test_repro_ranks.check_prints_its_rows_number`).
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
# This file is tox -e audit-extras's (the extras installed together): without them its Trainer
# rows would add minutes to the normal suite, where test_repro_ranks runs accelerate's.
pytest.importorskip("lightning")

from tests.wacc.audit.test_repro_ranks import (  # noqa: E402
    RankRuns,
    check_prints_its_rows_number,
    rank_runs,
)
from wacc.audit.adapters import ADAPTERS  # noqa: E402

LOOPS = [
    "trainer-hub", "trainer-hub-ranktok", "trainer-llama-ranktok", "trainer-bert", "trainer-t5",
    "trainer-plain", "accelerate-variable", "lightning", "lightning-manual", "deepspeed",
    "deepspeed-zero1", "pixparse", "peft-lora-gpt2",
]  # fmt: skip


@functools.cache
def _missing(loop: str) -> str | None:
    """Why ``loop`` does not run here (its adapter's own check; None: it runs)."""
    return ADAPTERS[loop].unavailable()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> RankRuns:
    installed = [loop for loop in LOOPS if _missing(loop) is None]
    if not installed:
        pytest.skip(f"none of {LOOPS} is installed")
    return rank_runs(installed, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_script_across_ranks_prints_its_rows_number(runs: RankRuns, loop: str) -> None:
    """:func:`~tests.wacc.audit.test_repro_ranks.check_prints_its_rows_number` for ``loop``,
    where its framework is installed."""
    if _missing(loop) is not None:
        pytest.skip(f"{loop}: {_missing(loop)}")
    check_prints_its_rows_number(runs, loop)
