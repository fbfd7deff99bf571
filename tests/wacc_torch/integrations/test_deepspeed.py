"""``TokenWeightedEngine`` on DeepSpeed's real ZeRO 1 engine (CPU, one process; the `deepspeed`
extra, skipped without it): the window's token-weighted mean reaches the partitioned optimizer
exactly as a plain ``torch.optim`` loop over ``WeightedGradientsAccumulator`` gets it, and an
engine that would average the ranks is refused with the config key that fixes it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("deepspeed")

from wacc.audit.adapters.deepspeed import _world  # noqa: E402
from wacc_torch import WeightedGradientsAccumulator  # noqa: E402
from wacc_torch.integrations.deepspeed import TokenWeightedEngine  # noqa: E402

TOKENS = (1, 7, 16, 0)  # unequal microbatches, the last without a target
LR = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64))


def _microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    batches = []
    for tokens in TOKENS:
        inputs = torch.randint(0, 64, (1, 16), generator=generator)
        labels = torch.randint(0, 64, (1, 16), generator=generator)
        labels[0, tokens:] = -100
        batches.append((inputs, labels))
    return batches


def _loss(model: Any, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())  # a MEAN (NaN at 0)


def _engine(deepspeed: Any, model: nn.Module, **options: Any) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,  # SGD is off ZeRO's tested list
        "gradient_clipping": 0.0,
        **options,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def test_zero1_steps_on_the_token_weighted_mean() -> None:
    """One window through a ZeRO 1 engine built with "gradient_allreduce_op": "sum": the
    parameters after its step are bit-identical to a plain SGD step on
    ``WeightedGradientsAccumulator``'s token-weighted mean of the same microbatches (the
    zero-target microbatch's NaN never read)."""
    plain = _model()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    for inputs, labels in _microbatches():
        _loss(plain, inputs, labels).backward()
        accumulator.accumulate_mean(plain, int((labels != -100).sum()))
    accumulator.finish_mean().apply_to(plain)
    torch.optim.SGD(plain.parameters(), lr=LR).step()

    with _world(torch.float32) as deepspeed:
        model = _model()
        engine = _engine(deepspeed, model, gradient_allreduce_op="sum")
        weighted = TokenWeightedEngine(engine)
        for inputs, labels in _microbatches():
            weighted.backward(_loss(engine, inputs, labels), tokens=(labels != -100).sum())
        result = weighted.step()
    assert result.weight == sum(TOKENS) and engine.global_steps == 1
    for (name, want), got in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(got.detach(), want.detach()), name


def test_zero1_averaging_engine_is_refused() -> None:
    """A ZeRO 1 engine with DeepSpeed's default "gradient_allreduce_op" ("mean") would divide
    the window by the world size: ValueError naming the key and "sum", the engine untouched."""
    with _world(torch.float32) as deepspeed:
        engine = _engine(deepspeed, _model())
        with pytest.raises(ValueError, match='"gradient_allreduce_op": "sum"'):
            TokenWeightedEngine(engine)
        assert engine.enable_backward_allreduce is True


def test_zero2_is_refused_with_its_stage() -> None:
    """ZeRO 2 reduces and partitions gradients inside every backward: ValueError naming stage 2
    and the stages the wrapper takes."""
    with _world(torch.float32) as deepspeed:
        engine = _engine(deepspeed, _model(), zero_optimization={"stage": 2},
                         gradient_allreduce_op="sum")  # fmt: skip
        with pytest.raises(ValueError, match="ZeRO stage 2 .* ZeRO stage 0 or 1"):
            TokenWeightedEngine(engine)
