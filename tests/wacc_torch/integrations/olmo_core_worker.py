"""A test helper: a real OLMo-core ``Transformer`` and train module on the CPU, each rank's batch,
and (run as ``python -m torch.distributed.run --nproc-per-node=2 olmo_core_worker.py OUT``) one
rank of a two-process gloo world that trains one batch through
``TokenWeightedTransformerTrainModule`` under OLMo-core's own FSDP (its ``TransformerTrainModule.
__init__``: ``build_world_mesh`` and ``parallelize_model``) and saves the whole gradient it hands
its optimizer and the weights it started from (``torch.save``; read back with
``weights_only=True``)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

SEQ_LEN = 8
VOCAB = 64
# Per rank, the targets of each of its 3 sequences (one micro-batch each): rank 0 holds 19, rank
# 1 holds 3 with a sequence without targets; equal weighting of the ranks is far off.
RANK_TARGETS = ((7, 7, 5), (1, 0, 2))


def build_model() -> nn.Module:
    """A one-block llama-like OLMo-core ``Transformer`` in float32, the same weights each time."""
    from olmo_core.nn.transformer import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig.llama_like(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2)
    model: nn.Module = config.build(init_device="cpu")
    return model


def rank_batch(rank: int, *, empty: bool = False) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s ``[3, SEQ_LEN]`` batch, labels shifted as ``get_labels`` shifts them, the
    targets past each sequence's count ignored (``empty``: none kept)."""
    generator = torch.Generator().manual_seed(11 + rank)
    input_ids = torch.randint(0, VOCAB, (len(RANK_TARGETS[rank]), SEQ_LEN), generator=generator)
    labels = torch.full_like(input_ids, -100)
    for row, targets in enumerate(RANK_TARGETS[rank]):
        if not empty:
            labels[row, :targets] = input_ids[row, 1 : targets + 1]
    return {"input_ids": input_ids, "labels": labels}


def train_module(module_class: Any, model: nn.Module, dp_config: Any = None) -> Any:
    """``module_class(model, ...)`` built by its own ``__init__``, one sequence per micro-batch,
    with a stand-in for the ``Trainer`` it reports its metrics to (``metrics``: name -> value)."""
    from olmo_core.optim import AdamWConfig

    module = module_class(
        model=model, optim=AdamWConfig(lr=1e-3), rank_microbatch_size=SEQ_LEN,
        max_sequence_length=SEQ_LEN, device=torch.device("cpu"), dp_config=dp_config,
    )  # fmt: skip
    metrics: dict[str, float] = {}

    def record(name: str, value: torch.Tensor, *_: Any, **__: Any) -> None:
        metrics[name] = float(value)

    module._trainer = SimpleNamespace(
        record_metric=record, record_ce_loss=lambda value, **_: record("ce loss", value)
    )
    module.metrics = metrics
    return module


def main(out: Path) -> None:
    """One rank's batch through the mixin under OLMo-core's FSDP; saves the whole gradient."""
    import torch.distributed as dist
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.distributed.utils import init_distributed
    from olmo_core.train.train_module import TransformerDataParallelConfig

    from wacc_torch.integrations.olmo_core import TokenWeightedTransformerTrainModule

    init_distributed(backend="gloo")
    rank = dist.get_rank()
    dp_config = TransformerDataParallelConfig(
        name=DataParallelType.fsdp, param_dtype=DType.float32, reduce_dtype=DType.float32
    )
    module = train_module(TokenWeightedTransformerTrainModule, build_model(), dp_config)
    # The parameters its constructor initialized, whole: the test's reference starts from them.
    weights = {n: p.full_tensor() for n, p in module.model.named_parameters()}
    module.train_batch(rank_batch(rank), dry_run=False)
    gradient = {n: p.grad.full_tensor() for n, p in module.model.named_parameters()}
    torch.save(
        {"gradient": gradient, "weights": weights, "window_tokens": module.window_tokens},
        out / f"rank{rank}.pt",
    )
    del module  # the FSDP model holds the process group (teardown rule)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
