"""Run a :class:`wacc_ref.scenario.Scenario` on ``wacc_torch`` and trace it like the reference does.

This is the production half of SPEC §12 oracles 1 and 3: :func:`run_torch` drives a real
``WeightedGradientsAccumulator`` on a real ``nn.Module`` (parameters registered under the
scenario's dotted names), restores through real files (``torch.save`` →
``torch.load(weights_only=True)``) into a fresh accumulator and a fresh module, resolves
asynchronous checkpoints only after the following steps ran, and returns a
:class:`~wacc_ref.scenario.ScenarioTrace` built with the same snapshot functions as
:func:`wacc_ref.scenario.run_reference`, so that :func:`wacc_ref.scenario.trace_differences`
compares the two bit for bit.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import wacc_torch
from wacc_ref.corruption import (
    applicable_corruptions,
    corrupt_record,
)
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    Scenario,
)
from wacc_ref.traces import (
    FinishOutcome,
    RecordSnapshot,
    ScenarioTrace,
    StepOutcome,
    finish_outcome,
    snapshot_record,
)

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def build_module(parameters: Mapping[str, tuple[int, ...]], *, device: torch.device) -> nn.Module:
    """A module whose ``named_parameters()`` are exactly ``parameters`` (dotted names nest)."""
    root = nn.Module()
    for name, shape in parameters.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        owner.register_parameter(leaf, nn.Parameter(torch.zeros(shape, device=device)))
    assert sorted(n for n, _ in root.named_parameters()) == sorted(parameters)
    return root


def in_module_order(scenario: Scenario) -> Scenario:
    """``scenario`` with its parameters listed in the order ``nn.Module`` registers them.

    A module lists its own parameters before its children's, so ``("a.w", "b")`` comes out as
    ``("b", "a.w")``; the record schema keeps registration order, so the reference must see the
    same order to compare records field by field.
    """
    shapes = scenario.params
    module = build_module(shapes, device=torch.device("meta"))
    ordered = tuple((name, shapes[name]) for name, _ in module.named_parameters())
    return dataclasses.replace(scenario, parameters=ordered)


def _gradient_tensor(values: np.ndarray, grad_dtype: str, device: torch.device) -> torch.Tensor:
    # float64 holds every value of every format exactly and the scenario guarantees the values
    # are representable in G, so this conversion is exact whatever PyTorch's rounding path.
    exact = torch.tensor(values, dtype=torch.float64)
    converted = exact.to(TORCH_DTYPES[grad_dtype])
    nan = exact.isnan()  # NaN != NaN: compare NaN positions, and the values elsewhere
    back = converted.double()
    assert torch.equal(back.isnan(), nan) and torch.equal(back[~nan], exact[~nan])
    return converted.to(device)


def run_torch(scenario: Scenario, *, device: torch.device | str = "cpu") -> ScenarioTrace:
    """Run ``scenario`` on ``wacc_torch`` and return its trace (see the module docstring)."""
    device = torch.device(device)
    if list(in_module_order(scenario).params) != list(scenario.params):
        raise ValueError("list the scenario's parameters in module order first: in_module_order()")
    dtype = TORCH_DTYPES[scenario.work_dtype]
    params = scenario.params
    names = list(params)

    def fresh() -> tuple[wacc_torch.WeightedGradientsAccumulator, nn.Module]:
        accumulator = wacc_torch.WeightedGradientsAccumulator(
            dtype=dtype, loss_scale=scenario.loss_scale, fused=scenario.fused
        )
        return accumulator, build_module(params, device=device)

    accumulator, module = fresh()
    # A checkpoint is a handle (async) or a record (sync); it is resolved only when used.
    latest: dict[str, Any] | wacc_torch.StateDictHandle | None = None
    unresolved: dict[int, wacc_torch.StateDictHandle] = {}
    records: dict[int, RecordSnapshot] = {}
    outcomes: list[dict[str, Any]] = []

    def resolve_latest() -> dict[str, Any]:
        nonlocal latest
        assert latest is not None  # Scenario validation: a checkpoint comes first
        if isinstance(latest, wacc_torch.StateDictHandle):
            latest = latest.result()
        return latest

    with tempfile.TemporaryDirectory(prefix="wacc-judge-") as scratch:
        record_file = Path(scratch) / "record.pt"
        for index, step in enumerate(scenario.steps):
            error: str | None = None
            skipped = False
            result: FinishOutcome | None = None
            try:
                if isinstance(step, Accumulate):
                    grads = {
                        name: None
                        if values is None
                        else _gradient_tensor(values, scenario.grad_dtype, device)
                        for name, values in scenario.grad_arrays(step).items()
                    }
                    method = (
                        accumulator.accumulate_sum
                        if step.kind == "sum"
                        else accumulator.accumulate_mean
                    )
                    method(module, step.weight, grads=grads)
                elif isinstance(step, Finish):
                    finished = (
                        accumulator.finish_sums()
                        if step.kind == "sums"
                        else accumulator.finish_mean()
                    )
                    result = finish_outcome(finished, names)
                elif isinstance(step, Checkpoint):
                    if step.asynchronous:
                        handle = accumulator.state_dict_async()
                        unresolved[index] = handle
                        latest = handle
                    else:
                        latest = accumulator.state_dict()
                        records[index] = snapshot_record(latest)
                elif isinstance(step, Restore):
                    record = resolve_latest()
                    wacc_torch.save_record(record, record_file)
                    accumulator, module = fresh()
                    accumulator.load_state_dict(wacc_torch.load_record(record_file), module)
                else:
                    record = resolve_latest()
                    if step.kind in applicable_corruptions(record):
                        accumulator.load_state_dict(corrupt_record(record, step.kind), module)
                    else:
                        skipped = True
            except wacc_torch.WeightedAccumulationError as exc:
                error = type(exc).__name__
            outcomes.append(
                {
                    "index": index,
                    "op": step.op,
                    "error": error,
                    "skipped": skipped,
                    "state": snapshot_record(accumulator.state_dict()),
                    "result": result,
                }
            )
        for index, handle in unresolved.items():
            records[index] = snapshot_record(handle.result())
    return ScenarioTrace(
        outcomes=tuple(StepOutcome(**o, record=records.get(o["index"])) for o in outcomes),
        implementation=f"wacc_torch/{device}",
    )
