"""Suite ``large``: memory-bound passes over ~40 M parameters in 50 tensors.

Floor: one ``torch._foreach_add_(bufs, grads, alpha=w)`` over the same tensors (one read of each
buffer and gradient, one write of each buffer). Every accumulate is one call of a window already
under way; ``finish_mean`` is timed alone, each sample after a fresh window was filled (untimed).
``state_dict`` is compared with a plain copy of the buffers to the CPU
(``b.detach().to("cpu", copy=True)``: on the CPU ``b.cpu()`` would not copy at all). On CUDA the
achieved bandwidth of each fp32 pass is compared with a device-to-device copy of the same buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.bandwidth import bandwidth_rows
from benchmarks.features import has_checksum_option, pending_buffers
from benchmarks.results import Row
from benchmarks.settings import Settings
from benchmarks.tensors import ManyParameters, gradients
from benchmarks.timing import Timed, interleaved_medians, ratio
from wacc_torch import WeightedGradientsAccumulator

SUITE = "large"
FLOOR = "_foreach_add_(alpha=w)"
COPY = "copy to cpu"
# Whole passes over the buffers each timed call must make (benchmarks.bandwidth).
TRAFFIC = {FLOOR: 3, "accumulate_sum": 3, "accumulate_mean": 3, "finish_mean": 2}
WEIGHT = 3.0
NOTES = (
    "Median seconds per call on 50 tensors (about 40 M parameters); ratio = mode / one "
    "`torch._foreach_add_(bufs, grads, alpha=w)` over the same tensors, measured in the same "
    "run (dtype = gradient dtype -> buffer dtype D). `finish_mean` is timed alone, after a "
    "fresh window was filled. `state_dict` is compared with `{n: b.detach().to('cpu', "
    "copy=True)}` of the same buffers. GB/s rows (CUDA only) count the bytes a pass must move "
    "(read buffer and gradient, write buffer; `finish_mean`: read and write the buffer) and "
    "compare with a device-to-device copy of the buffers."
)


def _shape(quick: bool) -> tuple[int, int]:
    return (20, 50) if quick else (1000, 800)


def _row(
    mode: str,
    dtype: str,
    device: torch.device,
    seconds: float | None,
    floor: float,
    *,
    floor_name: str,
    target: float | None,
    case: str,
) -> Row:
    return Row(
        suite=SUITE,
        case=case,
        mode=mode,
        dtype=dtype,
        device=str(device),
        value=None if seconds is None else seconds * 1e3,
        unit="ms",
        ratio=None if seconds is None else ratio(seconds, floor),
        floor=floor_name,
        target=target,
    )


def _accumulate_group(
    device: torch.device,
    grad_dtype: torch.dtype,
    work_dtype: torch.dtype,
    repeats: int,
    *,
    quick: bool,
) -> list[Row]:
    """The floor, sum and mean (and, for fp32 -> fp32, finish_mean and state_dict) side by side."""
    shape = _shape(quick)
    count = 50
    model = ManyParameters(count=count, shape=shape, dtype=work_dtype, device=device)
    grads = gradients(model, dtype=grad_dtype)
    grad_list = list(grads.values())
    bufs = [torch.zeros(shape, dtype=work_dtype, device=device) for _ in range(count)]
    main = grad_dtype == work_dtype == torch.float32
    sums = WeightedGradientsAccumulator(dtype=work_dtype, loss_scale=1.0)
    means = WeightedGradientsAccumulator(dtype=work_dtype, loss_scale=1.0)
    modes: dict[str, Timed] = {
        FLOOR: Timed(lambda: torch._foreach_add_(bufs, grad_list, alpha=WEIGHT)),
        "accumulate_sum": Timed(lambda: sums.accumulate_sum(model, WEIGHT, grads=grads)),
        "accumulate_mean": Timed(lambda: means.accumulate_mean(model, WEIGHT, grads=grads)),
    }
    if main:
        finishing = WeightedGradientsAccumulator(dtype=work_dtype, loss_scale=1.0)
        modes["finish_mean"] = Timed(
            finishing.finish_mean,
            setup=lambda: finishing.accumulate_mean(model, WEIGHT, grads=grads),
        )
    case = f"{count} x {shape[0] * shape[1]} elements"
    name = f"{str(grad_dtype).removeprefix('torch.')}->{str(work_dtype).removeprefix('torch.')}"
    medians = interleaved_medians(modes, device=device, repeats=repeats)
    floor = medians[FLOOR]
    targets = {"accumulate_sum": 1.05, "accumulate_mean": 1.15, "finish_mean": 1.0}
    rows = [
        _row(
            mode,
            name,
            device,
            seconds,
            floor,
            floor_name="" if mode == FLOOR else FLOOR,
            target=targets.get(mode) if main else None,
            case=case,
        )
        for mode, seconds in medians.items()
    ]
    if main:
        rows += _state_dict_rows(device, sums, repeats, case=f"{case}: record")
        if device.type == "cuda":
            rows += bandwidth_rows(
                SUITE, f"{case}: bandwidth", device, bufs, medians, TRAFFIC, repeats
            )
    return rows


def _state_dict_rows(
    device: torch.device, accumulator: WeightedGradientsAccumulator, repeats: int, *, case: str
) -> list[Row]:
    buffers = pending_buffers(accumulator)

    def copy() -> None:
        {name: b.detach().to("cpu", copy=True) for name, b in buffers.items()}

    modes: dict[str, Timed] = {
        COPY: Timed(copy),
        "state_dict()": Timed(accumulator.state_dict),
    }
    if has_checksum_option():
        state_dict: Callable[..., object] = accumulator.state_dict
        modes["state_dict(checksum=False)"] = Timed(lambda: state_dict(checksum=False))
    medians: dict[str, float | None] = dict(
        interleaved_medians(modes, device=device, repeats=repeats)
    )
    medians.setdefault("state_dict(checksum=False)", None)  # not available: an n/a row
    floor = medians[COPY]
    assert floor is not None
    return [
        _row(
            mode,
            "float32",
            device,
            seconds,
            floor,
            case=case,
            floor_name="" if mode == COPY else COPY,
            target=None if mode == COPY else 1.1,
        )
        for mode, seconds in medians.items()
    ]


def run(settings: Settings) -> list[Row]:
    repeats = settings.repeats_or(7)
    rows: list[Row] = []
    for device in settings.devices:
        for grad_dtype, work_dtype in (
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.float32),
            (torch.bfloat16, torch.bfloat16),
        ):
            rows += _accumulate_group(device, grad_dtype, work_dtype, repeats, quick=settings.quick)
    return rows
