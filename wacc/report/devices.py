"""Per-device evaluation orders: which §6 variant a fused run took, and CPU vs CUDA bits.

* :func:`fused_variants` — for each scenario run with ``fused=True`` on a device, the variants
  of :func:`wacc_ref.oracles.run_reference` (``fma``, ``op_rounded``, ``two_step``) whose whole
  trace it equals bit for bit; ``mixed`` when none does (PyTorch's CPU float16 ``add_`` rounds
  its vectorized body and its scalar tail differently), ``any`` when all coincide.
* :func:`device_differences` — scenarios whose traces differ between two devices, per work dtype
  and implementation (the reproducible order must show none).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from wacc.judge.implementation import load_implementation
from wacc.judge.runner import in_module_order, run_implementation
from wacc.report.corpus import CorpusEntry
from wacc.report.rows import IMPLEMENTATIONS
from wacc_ref.oracles import run_reference, trace_differences

__all__ = ["FUSED_VARIANTS", "device_differences", "fused_variants"]

FUSED_VARIANTS: tuple[str, ...] = ("fma", "op_rounded", "two_step")


def fused_variants(corpus: Sequence[CorpusEntry], device: str) -> dict[str, Counter[str]]:
    """Per work dtype: how many fused scenarios matched each variant (see the module docstring)."""
    implementation = load_implementation(IMPLEMENTATIONS["wacc_torch_fused"])
    counts: dict[str, Counter[str]] = {}
    for entry in corpus:
        scenario = in_module_order(dataclasses.replace(entry.scenario, fused=True))
        if not any(getattr(step, "kind", None) == "mean" for step in scenario.steps):
            continue
        actual, _ = run_implementation(implementation, scenario, device=device)
        matching = [
            variant
            for variant in FUSED_VARIANTS
            if not trace_differences(run_reference(scenario, fused_variant=variant), actual)
        ]
        label = (
            "any" if len(matching) == len(FUSED_VARIANTS)
            else "mixed" if not matching
            else "+".join(matching)
        )  # fmt: skip
        counts.setdefault(scenario.work_dtype, Counter())[label] += 1
    return counts


def device_differences(
    corpus: Sequence[CorpusEntry],
    devices: tuple[str, str],
    *,
    implementations: Mapping[str, str] | None = None,
) -> dict[tuple[str, str], int]:
    """(work dtype, implementation) -> scenarios whose traces differ between the two devices."""
    chosen = implementations or {
        name: IMPLEMENTATIONS[name] for name in ("wacc_torch", "wacc_torch_fused")
    }
    counts: dict[tuple[str, str], int] = {}
    for name, spec in chosen.items():
        implementation = load_implementation(spec)
        for entry in corpus:
            scenario = dataclasses.replace(entry.scenario, fused=implementation.fused)
            first, _ = run_implementation(
                implementation, in_module_order(scenario), device=devices[0]
            )
            second, _ = run_implementation(
                implementation, in_module_order(scenario), device=devices[1]
            )
            key = (scenario.work_dtype, name)
            counts[key] = counts.get(key, 0) + bool(trace_differences(first, second))
    return counts
