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


FLOAT16 = {"torch_autocast": {"enabled": True, "dtype": "fp16"}, "gradient_allreduce_op": "sum"}
OVERFLOW = 2.0**20  # times one microbatch's loss: its scaled float16 gradient is inf
# Times every other loss: at GradScaler's initial 65536 a one-target mean's float16 gradient
# (up to about the scale itself) would overflow float16's 65504 on its own.
CLEAN = 2.0**-8


def _window(weighted: TokenWeightedEngine, engine: Any, *, overflow: bool) -> None:
    """One window of ``_microbatches()`` through ``weighted``, the third loss times ``OVERFLOW``
    when ``overflow`` and every other one times ``CLEAN``, then its step."""
    for index, (inputs, labels) in enumerate(_microbatches()):
        factor = OVERFLOW if overflow and index == 2 else CLEAN
        weighted.backward(_loss(engine, inputs, labels) * factor, tokens=(labels != -100).sum())
    weighted.step()


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_zero1_float16_overflow_skips_the_window_and_backs_off() -> None:
    """ZeRO 1 under torch_autocast float16: a window with an overflowing microbatch leaves every
    parameter unchanged and halves the ZeRO optimizer's GradScaler scale, as its update() would;
    the next, clean window is applied and keeps the halved scale (growth restarts from 0)."""
    with _world(torch.float32) as deepspeed:
        model = _model()
        engine = _engine(deepspeed, model, **FLOAT16)
        scaler = engine.optimizer.torch_autocast_gradscaler
        weighted = TokenWeightedEngine(engine)
        start, before = scaler.get_scale(), _snapshot(model)
        _window(weighted, engine, overflow=True)
        assert engine.optimizer.overflow and _unchanged(model, before)
        assert scaler.get_scale() == start * scaler.get_backoff_factor()
        assert scaler.state_dict()["_growth_tracker"] == 0
        _window(weighted, engine, overflow=False)
        assert not engine.optimizer.overflow and not _unchanged(model, before)
        assert scaler.get_scale() == start * scaler.get_backoff_factor()


def test_zero1_float16_deepspeed_alone_never_backs_off() -> None:
    """Why the wrapper backs off: DeepSpeed's own ZeRO 1 step, given the same overflowing
    gradient, skips it (parameters unchanged) but returns before its GradScaler's update()
    (stage_1_and_2.py:3043-3050), so the scale stays where it was."""
    with _world(torch.float32) as deepspeed:
        model = _model()
        engine = _engine(deepspeed, model, **FLOAT16)
        scaler = engine.optimizer.torch_autocast_gradscaler
        start, before = scaler.get_scale(), _snapshot(model)
        inputs, labels = _microbatches()[2]
        engine.backward(_loss(engine, inputs, labels) * OVERFLOW)
        engine.step()
        assert engine.optimizer.overflow and _unchanged(model, before)
        assert scaler.get_scale() == start


def test_zero1_float16_step_that_backs_off_itself_is_backed_off_once() -> None:
    """A DeepSpeed whose ZeRO 1 step updates its scaler on an overflow (here: its step wrapped
    to do so) is left alone: the window's scale is backed off once, not twice."""
    with _world(torch.float32) as deepspeed:
        model = _model()
        engine = _engine(deepspeed, model, **FLOAT16)
        zero, scaler = engine.optimizer, engine.optimizer.torch_autocast_gradscaler
        step = zero.step

        def updating_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            if zero.overflow:
                scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            return out

        zero.step = updating_step
        start = scaler.get_scale()
        _window(TokenWeightedEngine(engine), engine, overflow=True)
        assert scaler.get_scale() == start * scaler.get_backoff_factor()
