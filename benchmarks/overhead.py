"""Suite ``overhead``: the accumulator's Python overhead on 500 tensors of 16 float32 elements.

Floor: one bare ``torch._foreach_add_(bufs, grads)`` over the same 500 tensors. Modes, each one
call of a window already under way (its buffers allocated by the warm-up):

- ``accumulate_sum``/``accumulate_mean`` with ``grads=mapping`` (the gradients handed in);
- the same through ``.grad`` (the gradients set on the parameters untimed before each sample,
  read and cleared by the call); ``set .grad`` times the 500 assignments alone, apart.
"""

from __future__ import annotations

import torch

from benchmarks.results import Row
from benchmarks.settings import Settings
from benchmarks.tensors import ManyParameters, gradients
from benchmarks.timing import Timed, interleaved_medians, ratio
from wacc_torch import WeightedGradientsAccumulator

SUITE = "overhead"
TARGETS = {"accumulate_sum (grads=)": 2.0, "accumulate_mean (grads=)": 3.0}
FLOOR = "torch._foreach_add_"
NOTES = (
    "Median seconds per call on 500 float32 tensors of 16 elements (D = float32); ratio = mode / "
    "one bare `torch._foreach_add_(bufs, grads)` over the same list. The `.grad` rows set the "
    "500 `.grad` untimed before each call; `set .grad` is the cost of those assignments, "
    "measured apart."
)


def _measure(device: torch.device, *, count: int, repeats: int) -> list[Row]:
    model = ManyParameters(count=count, shape=(16,), dtype=torch.float32, device=device)
    grads = gradients(model, dtype=torch.float32)
    parameters = list(model.parameters())
    grad_list = list(grads.values())
    bufs = [torch.zeros_like(g) for g in grad_list]
    accumulators = {
        name: WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
        for name in ("sum", "mean", "sum-grad", "mean-grad")
    }

    def set_grads() -> None:
        for parameter, grad in zip(parameters, grad_list, strict=True):
            parameter.grad = grad

    def clear_grads() -> None:
        for parameter in parameters:
            parameter.grad = None

    modes = {
        FLOOR: Timed(lambda: torch._foreach_add_(bufs, grad_list)),
        "accumulate_sum (grads=)": Timed(
            lambda: accumulators["sum"].accumulate_sum(model, 3, grads=grads)
        ),
        "accumulate_mean (grads=)": Timed(
            lambda: accumulators["mean"].accumulate_mean(model, 3, grads=grads)
        ),
        "accumulate_sum (.grad)": Timed(
            lambda: accumulators["sum-grad"].accumulate_sum(model, 3), setup=set_grads
        ),
        "accumulate_mean (.grad)": Timed(
            lambda: accumulators["mean-grad"].accumulate_mean(model, 3), setup=set_grads
        ),
        "set .grad": Timed(set_grads, setup=clear_grads),
    }
    medians = interleaved_medians(modes, device=device, repeats=repeats)
    clear_grads()
    floor = medians[FLOOR]
    rows = []
    for mode, seconds in medians.items():
        rows.append(
            Row(
                suite=SUITE,
                case=f"{count} x 16 elements",
                mode=mode,
                dtype="float32",
                device=str(device),
                value=seconds * 1e6,
                unit="us",
                ratio=ratio(seconds, floor),
                floor="" if mode == FLOOR else FLOOR,
                target=TARGETS.get(mode),
            )
        )
    return rows


def run(settings: Settings) -> list[Row]:
    count = 50 if settings.quick else 500
    repeats = settings.repeats_or(200)
    rows: list[Row] = []
    for device in settings.devices:
        rows += _measure(device, count=count, repeats=repeats)
    return rows
