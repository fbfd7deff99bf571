"""Speed of the reference model in ``emulated`` mode: element-steps per second (not a test).

One run, every work dtype side by side: ``accumulate_sum``, ``accumulate_mean`` (two-step and
fused FMA emulation) and ``finish_mean`` on one parameter of ``--elements`` float32 gradients of
realistic spread (normal, a few decades), ``--steps`` microbatches of unequal weights. Pin it to one
core for the number the project reports: ``taskset -c 0 python benchmarks/bench_reference.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from wacc_ref import WORK_DTYPES, ReferenceAccumulator


def _rate(elements: int, steps: int, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return elements * steps / (time.perf_counter() - start)


METHODS = ("sum", "mean", "mean fused", "finish_mean")


def emulation_rates(*, elements: int, steps: int) -> dict[str, dict[str, float]]:
    """Element-steps per second of each method (:data:`METHODS`), per work dtype."""
    rng = np.random.default_rng(0)
    params = {"p": (elements,)}
    grads = [
        (rng.standard_normal(elements) * 10.0 ** rng.integers(-3, 3, elements))
        .astype(np.float32)
        .astype(np.float64)
        for _ in range(steps)
    ]
    weights = [1.0, 7.0, 200.0, 3.0] * (steps // 4 + 1)
    table: dict[str, dict[str, float]] = {}
    for dtype in WORK_DTYPES:
        rates = []
        for method, fused in (
            ("accumulate_sum", False),
            ("accumulate_mean", False),
            ("accumulate_mean", True),
        ):
            accumulator = ReferenceAccumulator(dtype=dtype, loss_scale=1024.0, fused=fused)

            def run(acc: ReferenceAccumulator = accumulator, name: str = method) -> None:
                for weight, grad in zip(weights, grads, strict=False):
                    getattr(acc, name)(params, weight, grads={"p": grad})

            rates.append(_rate(elements, steps, run))
        finishing = accumulator  # the fused one holds a full window
        rates.append(_rate(elements, 1, finishing.finish_mean))
        table[dtype] = dict(zip(METHODS, rates, strict=True))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"element-steps per second, {args.elements} elements x {args.steps} microbatches")
    print(f"{'dtype':<10}{'sum':>12}{'mean':>12}{'mean fused':>12}{'finish_mean':>14}")
    for dtype, rates in emulation_rates(elements=args.elements, steps=args.steps).items():
        print(
            f"{dtype:<10}"
            + "".join(f"{rates[m] / 1e6:>11.2f}M" for m in METHODS[:3])
            + f"{rates['finish_mean'] / 1e6:>13.2f}M"
        )


if __name__ == "__main__":
    main()
