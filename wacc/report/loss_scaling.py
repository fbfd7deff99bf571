"""The dynamic loss scaling sweep behind the report's loss-scaling figure (issue 17).

Two real training loops run the same windows of microbatches through a real backward that
casts through a half-precision dtype G (float16 or bfloat16), as autocast does: a float32
parameter is cast to G, back to float32, and multiplied by the microbatch's gradient ``g``, so
the backward hands ``round_G(S·g)`` to the float32 ``.grad`` — an overflow in G becomes inf.

* ``wacc_torch``: a :class:`WindowLossScaler` sets one scale per window
  (``set_loss_scale``), each microbatch's mean loss is scaled by ``S`` and accumulated with its
  token count as weight, ``finish_mean`` divides once, and ``update(found_inf)`` skips a window
  that overflowed and sets the next scale.
* ``GradScaler``: the common loop, ``loss / accum_steps`` scaled by ``torch.amp.GradScaler``
  (backward into ``.grad``), ``unscale_``, ``step`` (skipped on inf) and ``update``.

Both scalers start at the same scale with the same growth interval, so their decisions differ
only by what the loops do: the common loop's backward sees ``S / accum_steps`` (less overflow,
more underflow) and weighs every microbatch equally, whatever its token count.

The data is heavy-tailed in two ways: each element has a fixed magnitude drawn log-uniformly over
seven decades (10^-9 to 10^-2: small gradients underflow G at a low scale), and each microbatch
multiplies it by a Student-t draw with 2 degrees of freedom (infinite variance: spikes overflow G
at a high scale). Token counts are 1 + a Pareto(1.2) draw times 8 (a long tail of lengths).
The truth of a window is the exact token-weighted mean of its microbatches' float32 gradients
(rational arithmetic, rounded once to float64); the error of an accepted window is the median
over its elements of ``|result - exact| / |exact|``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import nn

from wacc_torch import WeightedGradientsAccumulator, WindowLossScaler

__all__ = [
    "GRAD_DTYPES",
    "INIT_SCALES",
    "LOOPS",
    "WINDOW_LENGTHS",
    "ScalingPoint",
    "loss_scaling_sweep",
]

LOOPS: tuple[str, ...] = ("wacc_torch", "GradScaler")
GRAD_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
INIT_SCALES: tuple[float, ...] = tuple(2.0**k for k in range(0, 25, 4))
WINDOW_LENGTHS: tuple[int, ...] = (1, 4, 16)
GROWTH_INTERVAL = 20  # clean windows before the scale grows (GradScaler's default 2000 never
# grows within a sweep of ~100 windows, which would show the backoff alone)
_ELEMENTS = 64


@dataclass(frozen=True)
class ScalingPoint:
    """One loop run over ``windows`` windows from one initial scale."""

    loop: str
    grad_dtype: str
    init_scale: float
    window_length: int
    windows: int
    skipped: int
    median_error: float  # over every element of every accepted window; nan when none accepted

    @property
    def skipped_share(self) -> float:
        return self.skipped / self.windows


@dataclass(frozen=True)
class _Microbatch:
    tokens: int
    gradient: np.ndarray  # float32: the gradient of the microbatch's mean token loss


def _windows(window_length: int, windows: int, seed: int) -> list[list[_Microbatch]]:
    rng = np.random.default_rng(seed)
    magnitudes = 10.0 ** rng.uniform(-9.0, -2.0, _ELEMENTS)
    out = []
    for _ in range(windows):
        window = []
        for _ in range(window_length):
            tokens = 1 + int(8 * rng.pareto(1.2))
            gradient = (magnitudes * rng.standard_t(2.0, _ELEMENTS)).astype(np.float32)
            window.append(_Microbatch(tokens, gradient))
        out.append(window)
    return out


def _exact_mean(window: Sequence[_Microbatch]) -> list[float]:
    """The token-weighted mean of the window's gradients, exact, rounded once to float64."""
    total = sum(m.tokens for m in window)
    sums = [Fraction(0)] * _ELEMENTS
    for microbatch in window:
        for i, value in enumerate(microbatch.gradient.tolist()):
            sums[i] += microbatch.tokens * Fraction(value)
    return [float(s / total) for s in sums]


def _relative_errors(result: torch.Tensor, exact: Sequence[float]) -> list[float]:
    values = result.detach().to(torch.float64).tolist()
    return [abs(r - x) / abs(x) for r, x in zip(values, exact, strict=True) if x != 0.0]


class _Model(nn.Module):
    """One float32 parameter; its forward casts through G as autocast would."""

    def __init__(self, grad_dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(_ELEMENTS))
        self.grad_dtype = grad_dtype

    def loss(self, gradient: np.ndarray) -> torch.Tensor:
        """A loss whose gradient w.r.t. ``weight`` (at 1) is ``gradient``, backward through G."""
        return (self.weight.to(self.grad_dtype).float() * torch.from_numpy(gradient)).sum()


def _run_wacc(model: _Model, data: list[list[_Microbatch]], init_scale: float) -> list[object]:
    scaler = WindowLossScaler(init_scale, growth_interval=GROWTH_INTERVAL)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=scaler.scale)
    results: list[object] = []
    for window in data:
        accumulator.set_loss_scale(scaler.scale)
        for microbatch in window:
            model.weight.grad = None
            (scaler.scale * model.loss(microbatch.gradient)).backward()
            accumulator.accumulate_mean(model, microbatch.tokens)
        result = accumulator.finish_mean()
        applied = scaler.update(result.found_inf)
        results.append(result.grads["weight"] if applied else None)
    return results


def _run_grad_scaler(
    model: _Model, data: list[list[_Microbatch]], init_scale: float
) -> list[object]:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weight stays at 1
    results: list[object] = []
    for window in data:
        optimizer.zero_grad(set_to_none=True)
        for microbatch in window:
            loss = model.loss(microbatch.gradient) / len(window)  # `loss /= accum_steps`
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        before = scaler.get_scale()
        scaler.step(optimizer)  # skipped when the unscaled gradients hold an inf or NaN
        scaler.update()
        skipped = scaler.get_scale() < before  # GradScaler backs off exactly when it skipped
        grad = model.weight.grad
        results.append(None if skipped or grad is None else grad.clone())
    return results


def loss_scaling_sweep(
    *,
    grad_dtypes: Sequence[str] = GRAD_DTYPES,
    init_scales: Sequence[float] = INIT_SCALES,
    window_lengths: Sequence[int] = WINDOW_LENGTHS,
    windows: int = 60,
    seed: int = 0,
) -> list[ScalingPoint]:
    """Every loop x G x initial scale x window length, on the same data for every loop and
    scale (one draw per window length)."""
    points = []
    for length in window_lengths:
        data = _windows(length, windows, seed * 1_000 + length)
        exact = [_exact_mean(window) for window in data]
        for dtype_name in grad_dtypes:
            grad_dtype = getattr(torch, dtype_name)
            for init_scale in init_scales:
                for loop in LOOPS:
                    model = _Model(grad_dtype)
                    run = _run_wacc if loop == "wacc_torch" else _run_grad_scaler
                    results = run(model, data, init_scale)
                    errors: list[float] = []
                    for result, truth in zip(results, exact, strict=True):
                        if isinstance(result, torch.Tensor):
                            errors += _relative_errors(result, truth)
                    points.append(
                        ScalingPoint(
                            loop=loop,
                            grad_dtype=dtype_name,
                            init_scale=init_scale,
                            window_length=length,
                            windows=windows,
                            skipped=sum(r is None for r in results),
                            median_error=statistics.median(errors) if errors else math.nan,
                        )
                    )
    return points
