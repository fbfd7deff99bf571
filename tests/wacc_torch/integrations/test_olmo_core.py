"""``TokenWeightedTrainModule`` on a real OLMo-core ``Transformer`` and ``TransformerTrainModule``
(built by their own constructors, on the CPU): in one process and across two ranks under
OLMo-core's own FSDP (gloo), every ``.grad`` is the gradient of the mean token loss over every
target of every rank's batch.  Skips cleanly where ``olmo_core`` does not import."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core.train.train_module", reason="ai2-olmo-core is not installed")

from olmo_core.train.train_module import TransformerTrainModule  # noqa: E402

from tests.wacc_torch.integrations import olmo_core_worker as worker  # noqa: E402
from wacc_torch.integrations.olmo_core import (  # noqa: E402
    TokenWeightedTrainModule,
    TokenWeightedTransformerTrainModule,
)

ROOT = Path(__file__).resolve().parents[3]


def _reference(
    batches: list[dict[str, torch.Tensor]], weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The gradient of the mean token loss over every target of ``batches`` at ``weights`` (the
    parameters the train module trained: its constructor initializes them): one forward and
    backward of the model over all of them together, its loss sum divided by their count."""
    model = worker.build_model()
    model.load_state_dict(weights)
    input_ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    out = model(
        input_ids, labels=labels, ignore_index=-100, loss_reduction="sum",
        loss_div_factor=(labels != -100).sum(),
    )  # fmt: skip
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return {n: g for n, g in grads.items() if g is not None}


def test_the_ready_class_is_the_mixin_before_transformer_train_module() -> None:
    """``TokenWeightedTransformerTrainModule`` puts the mixin's methods before OLMo-core's."""
    mro = TokenWeightedTransformerTrainModule.__mro__
    assert mro[1:3] == (TokenWeightedTrainModule, TransformerTrainModule)


def test_one_process_window_is_the_batch_token_mean_and_logs_olmo_cores_loss() -> None:
    """In one process (no data parallelism) ``train_batch`` over 3 micro-batches of 7, 7 and 5
    targets leaves the gradient of the batch's mean token loss in ``.grad``, counts its 19
    targets, and records the same ``ce loss`` as OLMo-core's own train module."""
    batch = worker.rank_batch(0)
    module = worker.train_module(TokenWeightedTransformerTrainModule, worker.build_model())
    weights = copy.deepcopy(module.model.state_dict())
    module.train_batch(copy.deepcopy(batch), dry_run=False)
    assert module.window_tokens == 19.0
    want = _reference([batch], weights)
    for name, parameter in module.model.named_parameters():
        torch.testing.assert_close(parameter.grad, want[name], msg=name)
    own = worker.train_module(TransformerTrainModule, worker.build_model())
    own.train_batch(copy.deepcopy(batch), dry_run=False)
    assert module.metrics == own.metrics and "ce loss" in module.metrics


def test_a_batch_without_targets_leaves_no_gradient() -> None:
    """A batch without a single target has no mean to step on: every ``.grad`` stays None and
    ``window_tokens`` is 0 (OLMo-core's own divides by its count, 0: NaN gradients)."""
    module = worker.train_module(TokenWeightedTransformerTrainModule, worker.build_model())
    module.train_batch(worker.rank_batch(0, empty=True), dry_run=True)
    assert module.window_tokens == 0.0
    assert all(p.grad is None for p in module.model.parameters())


@pytest.mark.slow
def test_fsdp_window_across_two_ranks_is_the_token_mean_over_both(tmp_path: Path) -> None:
    """Two ranks (torchrun, gloo) under OLMo-core's FSDP (``dp_config`` fsdp: its own mesh and
    ``parallelize_model``), 19 and 3 targets: both ranks hand their optimizer the same gradient,
    bit for bit, the mean over all 22 targets (OLMo-core alone: the mean of the ranks' means)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(worker.__file__)), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert [r["window_tokens"] for r in ranks] == [22.0, 22.0]
    want = _reference([worker.rank_batch(0), worker.rank_batch(1)], ranks[0]["weights"])
    for name, grad in ranks[0]["gradient"].items():
        torch.testing.assert_close(ranks[1]["gradient"][name], grad, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(grad, want[name], msg=name)


@pytest.fixture
def one_rank_world() -> Iterator[None]:
    """A one-rank gloo world in this process (OLMo-core's mesh needs one); its world mesh and
    the process group are gone afterwards (``build_world_mesh`` allows one per process)."""
    import olmo_core.distributed.parallel as parallel
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        parallel._WORLD_MESH = None
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_world")
def test_ddp_is_refused_before_any_backward() -> None:
    """OLMo-core's DDP (``dp_config`` ddp: torch's ``replicate``, whose all-reduce averages each
    micro-batch's gradient inside the backward) is refused on the first ``train_batch``:
    ``ValueError`` naming it, no forward or backward run, every ``.grad`` still None."""
    from olmo_core.config import DType
    from olmo_core.train.train_module import TransformerDataParallelConfig

    dp_config = TransformerDataParallelConfig(name="ddp", param_dtype=DType.float32)
    module = worker.train_module(
        TokenWeightedTransformerTrainModule, worker.build_model(), dp_config
    )
    with pytest.raises(ValueError, match="dp_config.name='ddp'"):
        module.train_batch(worker.rank_batch(0), dry_run=True)
    assert all(p.grad is None for p in module.model.parameters())
    assert module.window_tokens is None
    del module


def test_a_batch_that_fails_part_way_leaves_nothing_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ``train_batch`` whose second micro-batch's forward raises propagates the error, and the
    next ``train_batch`` (after the ``Trainer``'s ``zero_grads``) is that batch's token mean
    alone: the failed batch's first micro-batch (7 targets) is counted nowhere."""
    module = worker.train_module(TokenWeightedTransformerTrainModule, worker.build_model())
    weights = copy.deepcopy(module.model.state_dict())
    forward = type(module.model).forward
    calls = []

    def failing(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(module.model), "forward", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        module.train_batch(worker.rank_batch(0), dry_run=True)
    module.zero_grads()
    batch = worker.rank_batch(1)
    module.train_batch(copy.deepcopy(batch), dry_run=True)
    assert module.window_tokens == 3.0
    want = _reference([batch], weights)
    for name, parameter in module.model.named_parameters():
        torch.testing.assert_close(parameter.grad, want[name], msg=name)
