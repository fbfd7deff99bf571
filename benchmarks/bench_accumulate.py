"""Time and memory of one accumulate call, side by side (not a test).

Modes, per work dtype D, on a mid-size MLP with float32 gradients:

* ``baseline``      ``p.grad.add_(g)`` per parameter: what autograd's own accumulation costs;
* ``sum``           ``accumulate_sum`` (convert, then add);
* ``mean``          ``accumulate_mean`` in the default reproducible order (multiply, then add);
* ``mean-fused``    ``accumulate_mean`` with ``fused=True`` (one ``add_(c, alpha=w_D)``).

Prints the time per call, its ratio to the baseline, and the peak extra memory of the first call
of a window (the lazily allocated buffers plus temporaries) relative to the parameter bytes.
CPU peak memory counts the bytes of every tensor storage that an ATen op creates during the call
while it is alive (a ``TorchDispatchMode``; process RSS is useless here: malloc keeps freed
pages); CUDA peak memory is ``torch.cuda.max_memory_allocated``.

Run: ``python benchmarks/bench_accumulate.py [--width 1024] [--layers 4] [--repeats 10]``
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from wacc_torch import WeightedGradientsAccumulator


def _model(width: int, layers: int, device: str) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*blocks).to(device)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_times(
    calls: dict[str, Callable[[], None]], device: str, repeats: int
) -> dict[str, float]:
    """Median seconds per call of each mode, the modes interleaved round-robin.

    Interleaving spreads noise from other processes sharing the machine over all modes alike.
    """
    for call in calls.values():
        call()  # warm-up (also allocates the buffers)
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, call in calls.items():
            _synchronize(device)
            start = time.perf_counter()
            call()
            _synchronize(device)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(values) for label, values in times.items()}


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of tensors that ops create (not views of their inputs) while alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.untyped_storage().data_ptr() in inputs:
                continue  # in place, or a view of an input
            size = tensor.untyped_storage().nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._free, size)
        return out


def _peak_extra_bytes(call: Callable[[], None], device: str) -> int:
    """Peak memory above the state before ``call`` while it runs once."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with _LiveBytes() as tracker:
        call()
    return tracker.peak


def _bench(device: str, dtype: torch.dtype, width: int, layers: int, repeats: int) -> None:
    model = _model(width, layers, device)
    parameters = dict(model.named_parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in parameters.values())
    generator = torch.Generator(device=device).manual_seed(0)
    grads = {
        name: torch.randn(p.shape, generator=generator, device=device)
        for name, p in parameters.items()
    }
    for p in parameters.values():
        p.grad = torch.zeros_like(p)

    def baseline() -> None:
        for name, p in parameters.items():
            assert p.grad is not None
            p.grad.add_(grads[name])

    def make(kind: str, fused: bool) -> Callable[[], None]:
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=1.0, fused=fused)
        accumulate = accumulator.accumulate_sum if kind == "sum" else accumulator.accumulate_mean

        def call() -> None:
            accumulate(model, 3, grads=grads)

        return call

    modes = {"sum": ("sum", False), "mean": ("mean", False), "mean-fused": ("mean", True)}
    peaks = {label: _peak_extra_bytes(make(*mode), device) for label, mode in modes.items()}
    gc.collect()
    calls = {"baseline": baseline} | {label: make(*mode) for label, mode in modes.items()}
    medians = _median_times(calls, device, repeats)
    print(
        f"\n{device}, D={str(dtype).removeprefix('torch.')}, float32 grads, "
        f"{sum(p.numel() for p in parameters.values()) / 1e6:.1f}M parameters "
        f"({parameter_bytes / 2**20:.0f} MiB), median of {repeats} interleaved calls per mode"
    )
    print(f"  {'mode':<12}{'ms/call':>10}{'x baseline':>12}{'peak extra / param bytes':>28}")
    for label, seconds in medians.items():
        peak = "(in place)" if label == "baseline" else f"{peaks[label] / parameter_bytes:.2f}"
        ratio = seconds / medians["baseline"]
        print(f"  {label:<12}{seconds * 1e3:>10.2f}{ratio:>12.2f}{peak:>28}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16):
            _bench(device, dtype, args.width, args.layers, args.repeats)


if __name__ == "__main__":
    main()
