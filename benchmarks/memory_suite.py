"""Suite ``memory``: peak gradient memory of one training step per mode (the ``step`` model, fp32).

Each mode runs one warm-up step (AdamW's state exists afterwards), then one step under
:class:`benchmarks.memory.StorageLog`, sampling after every backward, accumulate and finish and in a
``register_post_accumulate_grad_hook`` on every parameter. On CUDA the whole-step peak is also read
from ``torch.cuda.max_memory_allocated`` (a separate step, without the log).
"""

from __future__ import annotations

import torch

from benchmarks import step
from benchmarks.features import held_tensors, pending_buffers
from benchmarks.memory import StorageLog
from benchmarks.results import NOT_AVAILABLE, Row
from benchmarks.settings import Settings
from benchmarks.timing import ratio, synchronize

SUITE = "memory"
TARGETS = {"wacc-zero-copy": 1.0, "wacc-buffered": 2.05}
MIB = 2**20
NOTES = (
    "Bytes (MiB) of one fp32 training step of the `step` model. *Gradient memory*: every storage "
    "that, at some sampling point (after each backward, accumulate and finish, and in a "
    "post-accumulate-grad hook on every parameter), is a parameter's `.grad` or an accumulator "
    "buffer, or that was created while a `wacc_torch` frame was on the Python stack (the "
    "accumulator's transients, inside its autograd hooks too). Autograd's own incoming gradient "
    "(before `AccumulateGrad` adds it) is counted in no mode. Peak = maximum over time of the live "
    "bytes of those storages, from a `TorchDispatchMode` that logs each storage an op creates and "
    "its release. The whole-step peak counts every storage created during the step (activations "
    "included; parameters and optimizer state existed before). The work tensor and arenas the "
    "accumulator kept from the warm-up window count as live from the start. `wacc-buffered "
    "disposable` is `wacc-buffered` with `accumulate_mean(..., disposable=True)` (the product "
    "written into each `.grad` taken: no work tensor). Ratio = mode / `plain`. Missing "
    f"modes read {NOT_AVAILABLE}."
)


def _logged_step(trainer: step.Trainer) -> StorageLog:
    log = StorageLog()
    parameters = list(trainer.model.parameters())

    def sample() -> None:
        accumulator = trainer.accumulator
        pending = {} if accumulator is None else pending_buffers(accumulator)
        log.mark([p.grad for p in parameters] + list(pending.values()))

    trainer.after = sample
    hooks = [p.register_post_accumulate_grad_hook(lambda p: log.mark([p.grad])) for p in parameters]
    if trainer.accumulator is not None:
        log.held(held_tensors(trainer.accumulator))  # kept from the warm-up window
    try:
        with log:
            trainer.step()
    finally:
        for hook in hooks:
            hook.remove()
        trainer.after = step._nothing
    return log


def _cuda_peak(trainer: step.Trainer, device: torch.device) -> int:
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    trainer.step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def run(settings: Settings) -> list[Row]:
    config = step.QUICK if settings.quick else step.FULL
    rows: list[Row] = []
    for device in settings.devices:
        batches = step.make_batches(config, device)
        figures: dict[str, dict[str, float | None]] = {}
        modes = (*step.available_modes(), step.DISPOSABLE)
        parameter_bytes = 0
        for mode in (*step.MODES, step.DISPOSABLE):
            cases: dict[str, float | None] = {}
            figures[mode] = cases
            if mode not in modes:
                continue
            model = step.make_model(config, device)
            parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            trainer = step.Trainer(mode, model, batches, 1.0, False)
            trainer.step()  # warm-up: the optimizer's state exists from here on
            log = _logged_step(trainer)
            cases["peak gradient memory"] = log.peak(gradient_only=True)
            cases["whole-step peak, all tensors"] = log.peak(gradient_only=False)
            if device.type == "cuda":
                cases["whole-step peak, max_memory_allocated"] = _cuda_peak(trainer, device)
        rows.append(
            Row(SUITE, "parameters", "model", "float32", str(device), parameter_bytes / MIB, "MiB")
        )
        for case in figures["plain"]:
            floor = figures["plain"][case]
            assert floor is not None
            for mode in (*step.MODES, step.DISPOSABLE):
                value = figures[mode].get(case)
                rows.append(
                    Row(
                        suite=SUITE,
                        case=case,
                        mode=mode,
                        dtype="float32",
                        device=str(device),
                        value=None if value is None else value / MIB,
                        unit="MiB",
                        ratio=None if value is None else ratio(value, floor),
                        floor="" if mode == "plain" else "plain",
                        target=TARGETS.get(mode) if case == "peak gradient memory" else None,
                    )
                )
    return rows
