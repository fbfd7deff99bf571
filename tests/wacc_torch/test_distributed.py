"""wacc_torch.distributed against real torch.distributed: gloo on CPU, two and four spawned ranks.

One spawned job per world size (one process group) runs every scenario in turn and saves what each
rank saw; the tests below judge those results in this process, against one accumulator fed all the
microbatches of every rank and against the reference model.  With two ranks, rank 0 gets the
microbatches with counts 1 and 7, rank 1 those with counts 200 and 3 (semantics §1's example); with
four ranks the ranks hold different numbers of microbatches (``RANK_COUNTS``).  With two ranks
every reduced element is one rounding ``round_D(a + b)``; with four the association order is
the backend's, so those results are judged against the error bound, and every rank against rank 0
bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wacc_ref.accumulator import ReferenceAccumulator, ReferenceState
from wacc_ref.arith import add_rounded
from wacc_ref.bounds import TOLERANCES, window_error_bound
from wacc_ref.formats import FORMATS, WORK_DTYPES, Format, conv_to, round_to
from wacc_torch.accumulator import AccumulatedGradients, WeightedGradientsAccumulator
from wacc_torch.distributed import (
    ProcessGroupUnavailableError,
    all_reduce_mean,
    all_reduce_sums,
)

from .distributed.bounds import reduced_mean_bound
from .distributed.spawn import COLLECTIVE_TIMEOUT, init_rank, load_results, run_job, save_result

WORLD_SIZES = (2, 4)
# Per world size, the token counts of the microbatches each rank accumulates (§1's example,
# split unevenly; with four ranks also unequal microbatch counts per rank).
RANK_COUNTS: Mapping[int, Mapping[int, tuple[int, ...]]] = {
    2: {0: (1, 7), 1: (200, 3)},
    4: {0: (1, 7), 1: (200,), 2: (3, 1), 3: (7,)},
}
CUDA_WORLD_SIZE = 2
# Power-of-two loss scales (exact in every work dtype); small enough that 200 loss-scaled
# cross-entropy gradients stay finite in float16.
EXACT_LOSS_SCALE = 2.0**10
MODEL_LOSS_SCALE = 2.0**6
MODES = ("sum", "mean")
DTYPES: Mapping[str, torch.dtype] = {name: getattr(torch, name) for name in WORK_DTYPES}
IN_FEATURES, OUT_FEATURES = 4, 3


# ----------------------------------------------------------------------------------------------
# Inputs (built here, in the judge process, and handed to the ranks through a file)
# ----------------------------------------------------------------------------------------------


def _linear(in_features: int = IN_FEATURES, out_features: int = OUT_FEATURES) -> nn.Module:
    return nn.Linear(in_features, out_features)


def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(IN_FEATURES, OUT_FEATURES), nn.Linear(OUT_FEATURES, 2))


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _exact_sum_grads(
    shapes: Mapping[str, tuple[int, ...]], generator: torch.Generator
) -> dict[str, torch.Tensor | None]:
    """Multiples of 1/4 in [-4, 4]: any sum of up to six has at most 7 significant bits, so every
    partial sum is exact in every work dtype (bfloat16 has 8) and the association order of the
    reduction cannot matter."""
    return {
        name: torch.randint(-16, 17, shape, generator=generator).to(torch.float32) / 4
        for name, shape in shapes.items()
    }


def _exact_mean_grads(
    shapes: Mapping[str, tuple[int, ...]], count: int, generator: torch.Generator
) -> dict[str, torch.Tensor | None]:
    """Values in {-1, 0, 1} * 2**-e with e chosen so that g * count is 0 or ± one of 1, 7/8,
    25/32, 3/4 (multiples of 1/32): the products and all their partial sums (at most six terms,
    below 8 in magnitude) have at most 8 significant bits, so they are exact in every work
    dtype (bfloat16 has 8)."""
    exponent = {1: 0, 7: 3, 200: 8, 3: 2}[count]
    return {
        name: torch.randint(-1, 2, shape, generator=generator).to(torch.float32) * 2.0**-exponent
        for name, shape in shapes.items()
    }


def _rounding_values(dtype: torch.dtype, count: int, generator: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype`` spread over many binades, so that a + b rounds, plus specials
    (±0, ±inf, NaN, the largest finite value for overflow, the smallest subnormal)."""
    fmt = FORMATS[str(dtype).removeprefix("torch.")]
    normal = torch.randn(count, generator=generator, dtype=torch.float64)
    exponents = torch.randint(-12, 13, (count,), generator=generator).to(torch.float64)
    values = (normal * torch.exp2(exponents)).to(dtype)
    specials = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, fmt.max_finite, fmt.min_subnormal],
        dtype=torch.float64,
    ).to(dtype)
    picks = torch.randint(0, len(specials), (count,), generator=generator)
    special_here = torch.rand(count, generator=generator) < 0.15
    return torch.where(special_here, specials[picks], values)


def _build_inputs(world_size: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(20240611)
    linear_shapes = _shapes(_linear())
    counts_of = RANK_COUNTS[world_size]
    inputs: dict[str, Any] = {"world_size": world_size, "counts": dict(counts_of)}
    for mode in MODES:
        inputs[f"exact/{mode}"] = {
            rank: [
                (
                    float(count),
                    _exact_sum_grads(linear_shapes, generator)
                    if mode == "sum"
                    else _exact_mean_grads(linear_shapes, count, generator),
                )
                for count in counts
            ]
            for rank, counts in counts_of.items()
        }
    # Real cross-entropy batches: features and class targets, one batch per count.
    inputs["model/init"] = {k: v.detach().clone() for k, v in _linear().state_dict().items()}
    inputs["model/batches"] = {
        rank: [
            (
                torch.randn(count, IN_FEATURES, generator=generator),
                torch.randint(0, OUT_FEATURES, (count,), generator=generator),
            )
            for count in counts
        ]
        for rank, counts in counts_of.items()
    }
    wide_shapes = {"weight": (8, 8), "bias": (8,)}
    inputs["rounding"] = {
        name: {
            rank: {
                pname: _rounding_values(dtype, math.prod(shape), generator).reshape(shape)
                for pname, shape in wide_shapes.items()
            }
            for rank in counts_of
        }
        for name, dtype in DTYPES.items()
    }
    # Presence: "0.weight" on every rank, "0.bias" on rank 1 only, "1.weight" on rank 0 only,
    # "1.bias" nowhere.
    two_shapes = _shapes(_two_layers())
    present_on = {"0.weight": set(counts_of), "0.bias": {1}, "1.weight": {0}, "1.bias": set()}
    inputs["presence"] = {
        rank: [
            (
                float(count),
                {
                    name: grad if rank in present_on[name] else None
                    for name, grad in _exact_sum_grads(two_shapes, generator).items()
                },
            )
            for count in counts
        ]
        for rank, counts in counts_of.items()
    }
    return inputs


# ----------------------------------------------------------------------------------------------
# The ranks (run in spawned processes)
# ----------------------------------------------------------------------------------------------


def _pack(result: AccumulatedGradients) -> dict[str, Any]:
    return {
        "grads": dict(result.grads),
        "weight": result.weight,
        "loss_scale": result.loss_scale,
        "issued": result.issued,
        "zero_weight": result.zero_weight,
        "normalized": result.normalized,
    }


def _captured(call: Callable[[], AccumulatedGradients]) -> dict[str, Any]:
    """Run one collective call; record its result or the class and message of what it raised."""
    try:
        return {"result": _pack(call())}
    except Exception as error:  # noqa: BLE001 - the judge compares classes across ranks
        return {"error": type(error).__name__, "message": str(error)}


def _accumulated(
    module: nn.Module,
    microbatches: list[tuple[float, dict[str, torch.Tensor | None]]],
    *,
    dtype: torch.dtype,
    loss_scale: float,
    mode: str,
) -> WeightedGradientsAccumulator:
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)
    for weight, grads in microbatches:
        if mode == "sum":
            accumulator.accumulate_sum(module, weight, grads=grads)
        else:
            accumulator.accumulate_mean(module, weight, grads=grads)
    return accumulator


def _scenario_errors(rank: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Inputs that differ across ranks (or are bad on one rank): every rank must raise."""
    one_batch = inputs["exact/sum"][0][:1]
    float32 = torch.float32
    out: dict[str, Any] = {}

    scale = EXACT_LOSS_SCALE * (1 if rank == 0 else 2)
    sums = _accumulated(_linear(), one_batch, dtype=float32, loss_scale=scale, mode="sum")
    out["loss_scale_mismatch"] = _captured(lambda: all_reduce_mean(sums.finish_sums()))

    dtype = float32 if rank == 0 else torch.bfloat16
    sums = _accumulated(_linear(), one_batch, dtype=dtype, loss_scale=EXACT_LOSS_SCALE, mode="sum")
    out["dtype_mismatch"] = _captured(lambda: all_reduce_mean(sums.finish_sums()))

    if rank == 0:
        module, batches = _linear(), one_batch
    else:
        module, batches = _two_layers(), inputs["presence"][1][:1]
    sums = _accumulated(module, batches, dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum")
    out["names_mismatch"] = _captured(lambda: all_reduce_mean(sums.finish_sums()))

    module = _linear() if rank == 0 else _linear(IN_FEATURES + 1)
    grads: dict[str, torch.Tensor | None] = {
        n: torch.ones(p.shape) for n, p in module.named_parameters()
    }
    sums = _accumulated(
        module, [(1.0, grads)], dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    )
    out["shape_mismatch"] = _captured(lambda: all_reduce_mean(sums.finish_sums()))

    sums = _accumulated(
        _linear(), one_batch, dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    )
    finished = sums.finish_mean() if rank == 0 else sums.finish_sums()
    out["normalized_input"] = _captured(partial(all_reduce_sums, finished))

    sums = _accumulated(
        _linear(), one_batch, dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    )
    local = sums.finish_sums()
    not_sums: Any = local if rank == 0 else dict(local.grads)
    out["wrong_type"] = _captured(partial(all_reduce_sums, not_sums))

    # Rank 1's accumulator never accumulated: it tracks no parameter at all.
    if rank == 0:
        unbound = _accumulated(
            _linear(), one_batch, dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
        ).finish_sums()
    else:
        unbound = WeightedGradientsAccumulator(
            dtype=float32, loss_scale=EXACT_LOSS_SCALE
        ).finish_sums()
    out["unbound_rank"] = _captured(partial(all_reduce_mean, unbound))

    # A hand-built input whose weight is no weight on one rank: True (a bool), or negative.
    local = _accumulated(
        _linear(), one_batch, dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    ).finish_sums()
    for label, bad_weight in (("bool_weight", True), ("negative_weight", -1.0)):
        doctored = dataclasses.replace(local, weight=bad_weight) if rank == 1 else local
        out[label] = _captured(partial(all_reduce_mean, doctored))

    # Only zero-weight microbatches on every rank: a mean is undefined, the sums are not.
    module = _linear()
    accumulator = _accumulated(
        module, [(0.0, {})], dtype=float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    )
    zero = accumulator.finish_sums()
    out["zero_global_weight/mean"] = _captured(partial(all_reduce_mean, zero))
    out["zero_global_weight/kept"] = _pack(zero)  # what the caller still holds after the raise
    out["zero_global_weight/sums"] = _captured(partial(all_reduce_sums, zero))
    # The next window of the same accumulator, in the same process group, works.
    for weight, grads in one_batch:
        accumulator.accumulate_sum(module, weight, grads=grads)
    out["zero_global_weight/next_window"] = _captured(
        partial(all_reduce_mean, accumulator.finish_sums())
    )
    return out


def _scenario_exact(rank: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        for name, dtype in DTYPES.items():
            accumulator = _accumulated(
                _linear(),
                inputs[f"exact/{mode}"][rank],
                dtype=dtype,
                loss_scale=EXACT_LOSS_SCALE,
                mode=mode,
            )
            local = accumulator.finish_sums()
            local_grads = dict(local.grads)
            before = {n: None if g is None else g.clone() for n, g in local_grads.items()}
            out[f"{mode}/{name}"] = {
                "sums": _captured(partial(all_reduce_sums, local)),
                "mean": _captured(partial(all_reduce_mean, local)),
                "local": _pack(local),
                "local_before": before,
                "same_objects": all(local.grads[n] is g for n, g in local_grads.items())
                and local.grads.keys() == local_grads.keys(),
            }
    return out


def _scenario_model(rank: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Real cross-entropy gradients of an nn.Linear, taken from .grad by the accumulator."""
    out: dict[str, Any] = {}
    for mode in MODES:
        for name, dtype in DTYPES.items():
            model = _linear()
            model.load_state_dict(inputs["model/init"])
            accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=MODEL_LOSS_SCALE)
            handed_in = []
            for features, targets in inputs["model/batches"][rank]:
                reduction = "sum" if mode == "sum" else "mean"
                loss = F.cross_entropy(model(features), targets, reduction=reduction)
                (MODEL_LOSS_SCALE * loss).backward()
                handed_in.append(
                    {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                )
                weight = float(len(targets))
                if mode == "sum":
                    accumulator.accumulate_sum(model, weight)
                else:
                    accumulator.accumulate_mean(model, weight)
            local = accumulator.finish_sums()
            out[f"{mode}/{name}"] = {
                "mean": _captured(partial(all_reduce_mean, local)),
                "local": _pack(local),
                "handed_in": handed_in,
            }
    return out


def _scenario_rounding(rank: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, dtype in DTYPES.items():
        module = nn.Linear(8, 8)
        grads = inputs["rounding"][name][rank]
        accumulator = _accumulated(
            module, [(1.0, grads)], dtype=dtype, loss_scale=EXACT_LOSS_SCALE, mode="sum"
        )
        local = accumulator.finish_sums()
        out[name] = {"local": _pack(local), "sums": _captured(partial(all_reduce_sums, local))}
    return out


def _scenario_presence(rank: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    local = _accumulated(
        _two_layers(),
        inputs["presence"][rank],
        dtype=torch.bfloat16,
        loss_scale=EXACT_LOSS_SCALE,
        mode="sum",
    ).finish_sums()
    out["presence"] = {
        "sums": _captured(partial(all_reduce_sums, local)),
        "mean": _captured(partial(all_reduce_mean, local)),
    }
    # Rank 1 only saw zero-weight microbatches: it holds no buffer at all, yet joins the reduction.
    batches = inputs["exact/sum"][0] if rank == 0 else [(0.0, {})]
    local = _accumulated(
        _linear(), batches, dtype=torch.float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    ).finish_sums()
    out["zero_weight_rank"] = {"mean": _captured(partial(all_reduce_mean, local))}
    return out


_SCENARIOS: Mapping[str, Callable[[int, Mapping[str, Any]], dict[str, Any]]] = {
    # The error scenarios run first: the later ones show the group is still usable after them.
    "errors": _scenario_errors,
    "exact": _scenario_exact,
    "model": _scenario_model,
    "rounding": _scenario_rounding,
    "presence": _scenario_presence,
}


def _rank_main(rank: int, world_size: int, init_file: str, inputs_file: str, out_dir: str) -> None:
    """Entry point of one spawned rank."""
    init_rank(rank, world_size, init_file)
    try:
        inputs = torch.load(inputs_file, weights_only=True)
        results = {name: scenario(rank, inputs) for name, scenario in _SCENARIOS.items()}
        save_result(out_dir, rank, results)
    finally:
        dist.destroy_process_group()


def _on_device(
    microbatches: list[tuple[float, dict[str, torch.Tensor | None]]], device: torch.device
) -> list[tuple[float, dict[str, torch.Tensor | None]]]:
    return [
        (weight, {n: None if g is None else g.to(device) for n, g in grads.items()})
        for weight, grads in microbatches
    ]


def _to_cpu(result: Mapping[str, Any]) -> dict[str, Any]:
    """A captured result with its tensors moved to the CPU and their devices recorded."""
    if "result" not in result:
        return dict(result)
    packed = dict(result["result"])
    grads = packed["grads"]
    packed["devices"] = {n: None if g is None else str(g.device) for n, g in grads.items()}
    packed["grads"] = {n: None if g is None else g.cpu() for n, g in grads.items()}
    return {"result": packed}


def _cuda_rank_main(
    rank: int, world_size: int, init_file: str, backend: str, inputs_file: str, out_dir: str
) -> None:
    """Entry point of one spawned rank of the CUDA job: NCCL with a GPU per rank, or gloo with
    both ranks on one GPU."""
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        inputs = torch.load(inputs_file, weights_only=True)
        results: dict[str, Any] = {}
        for mode in MODES:
            for name, dtype in DTYPES.items():
                local = _accumulated(
                    _linear().to(device),
                    _on_device(inputs[f"exact/{mode}"][rank], device),
                    dtype=dtype,
                    loss_scale=EXACT_LOSS_SCALE,
                    mode=mode,
                ).finish_sums()
                results[f"{mode}/{name}"] = {
                    "sums": _to_cpu(_captured(partial(all_reduce_sums, local))),
                    "mean": _to_cpu(_captured(partial(all_reduce_mean, local))),
                }
        # Rank 1 holds no buffer at all: its zeros must be made on its GPU.
        batches = inputs["exact/sum"][0] if rank == 0 else [(0.0, {})]
        local = _accumulated(
            _linear().to(device),
            _on_device(batches, device),
            dtype=torch.float32,
            loss_scale=EXACT_LOSS_SCALE,
            mode="sum",
        ).finish_sums()
        results["zero_weight_rank"] = _to_cpu(_captured(partial(all_reduce_mean, local)))
        save_result(out_dir, rank, results)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def world_size(request: pytest.FixtureRequest) -> int:
    """How many ranks the module's job runs (each world size is one job)."""
    size: int = request.param
    return size


@pytest.fixture(scope="module")
def inputs(world_size: int) -> dict[str, Any]:
    """The inputs of every scenario (deterministic: built from a fixed seed)."""
    return _build_inputs(world_size)


@pytest.fixture(scope="module")
def rank_results(inputs: Mapping[str, Any], world_size: int) -> Iterator[list[dict[str, Any]]]:
    """Run the gloo job once per world size for the whole module; each rank's saved results."""
    with tempfile.TemporaryDirectory(prefix="wacc-dist-") as tmp:
        work_dir = Path(tmp)
        inputs_file = work_dir / "inputs.pt"
        torch.save(inputs, inputs_file)
        run_job(
            _rank_main,
            (str(inputs_file), str(work_dir)),
            world_size=world_size,
            work_dir=work_dir,
        )
        yield load_results(work_dir, world_size)


# ----------------------------------------------------------------------------------------------
# Judging helpers
# ----------------------------------------------------------------------------------------------

_BITS_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _hex(tensor: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in tensor.detach().double().reshape(-1).tolist()]


def _assert_bits_equal(
    actual: torch.Tensor | None, expected: torch.Tensor | None, what: str
) -> None:
    """Same dtype, shape, NaN positions and bit patterns elsewhere (±0 told apart)."""
    if actual is None or expected is None:
        assert actual is None and expected is None, f"{what}: {actual!r} vs expected {expected!r}"
        return
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    actual, expected = actual.cpu(), expected.cpu()
    nan_actual, nan_expected = actual.isnan(), expected.isnan()
    bits = _BITS_DTYPES[actual.element_size()]
    same = torch.equal(nan_actual, nan_expected) and torch.equal(
        actual.masked_fill(nan_actual, 0).view(bits),
        expected.masked_fill(nan_expected, 0).view(bits),
    )
    assert same, f"{what}:\n actual   {_hex(actual)}\n expected {_hex(expected)}"


def _assert_same_result(
    actual: Mapping[str, Any], expected: AccumulatedGradients, what: str
) -> None:
    for field in ("weight", "loss_scale", "issued", "zero_weight", "normalized"):
        assert actual[field] == getattr(expected, field), (
            f"{what}: {field} {actual[field]!r} vs expected {getattr(expected, field)!r}"
        )
    assert list(actual["grads"]) == list(expected.grads), f"{what}: parameter names"
    for name, grad in expected.grads.items():
        _assert_bits_equal(actual["grads"][name], grad, f"{what}, {name!r}")


def _single_accumulator(
    module: nn.Module,
    per_rank: Mapping[int, list[tuple[float, dict[str, torch.Tensor | None]]]],
    *,
    dtype: torch.dtype,
    loss_scale: float,
    mode: str,
) -> WeightedGradientsAccumulator:
    """One accumulator fed every rank's microbatches, rank 0's first."""
    everything = [batch for rank in sorted(per_rank) for batch in per_rank[rank]]
    return _accumulated(module, everything, dtype=dtype, loss_scale=loss_scale, mode=mode)


def _result(rank_result: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    assert "result" in rank_result, (
        f"{what} raised {rank_result.get('error')}: {rank_result.get('message')}"
    )
    result: Mapping[str, Any] = rank_result["result"]
    return result


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_no_process_group_raises_locally() -> None:
    """Without an initialized process group both helpers raise ProcessGroupUnavailableError."""
    assert not dist.is_initialized()
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    accumulator.accumulate_sum(_linear(), 1.0, grads={"weight": torch.ones(3, 4)})
    sums = accumulator.finish_sums()
    for helper in (all_reduce_sums, all_reduce_mean):
        with pytest.raises(ProcessGroupUnavailableError, match="not initialized"):
            helper(sums)
    assert issubclass(ProcessGroupUnavailableError, ValueError)


@pytest.mark.parametrize("dtype_name", WORK_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_exact_windows_reduce_bit_for_bit(
    rank_results: list[dict[str, Any]], inputs: Mapping[str, Any], mode: str, dtype_name: str
) -> None:
    """With exactly summable gradients, the reduced sums and mean equal one accumulator's
    finish_sums / finish_mean over all four microbatches bit for bit, on every rank."""
    dtype = DTYPES[dtype_name]
    per_rank = inputs[f"exact/{mode}"]
    expected_sums = _single_accumulator(
        _linear(), per_rank, dtype=dtype, loss_scale=EXACT_LOSS_SCALE, mode=mode
    ).finish_sums()
    expected_mean = _single_accumulator(
        _linear(), per_rank, dtype=dtype, loss_scale=EXACT_LOSS_SCALE, mode=mode
    ).finish_mean()
    for rank, results in enumerate(rank_results):
        got = results["exact"][f"{mode}/{dtype_name}"]
        what = f"{mode}/{dtype_name} rank {rank}"
        _assert_same_result(_result(got["sums"], what), expected_sums, f"{what} all_reduce_sums")
        _assert_same_result(_result(got["mean"], what), expected_mean, f"{what} all_reduce_mean")


@pytest.mark.parametrize("dtype_name", WORK_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_input_is_not_mutated(
    rank_results: list[dict[str, Any]], mode: str, dtype_name: str
) -> None:
    """Both helpers leave the local AccumulatedGradients (its tensors, their values) unchanged."""
    for rank, results in enumerate(rank_results):
        got = results["exact"][f"{mode}/{dtype_name}"]
        assert got["same_objects"], f"rank {rank}: the input's grads mapping was changed"
        for name, before in got["local_before"].items():
            _assert_bits_equal(got["local"]["grads"][name], before, f"rank {rank} {name!r}")
        assert got["local"]["normalized"] is False


def _model_windows(
    rank_results: list[dict[str, Any]], key: str
) -> list[list[dict[str, npt.NDArray[np.float64]]]]:
    """Per rank, the gradients each microbatch handed in (exactly, as float64 arrays)."""
    return [
        [
            {name: grad.double().numpy() for name, grad in grads.items()}
            for grads in results["model"][key]["handed_in"]
        ]
        for results in rank_results
    ]


def _reference_reduced_mean(
    windows: list[list[dict[str, npt.NDArray[np.float64]]]],
    *,
    counts: Mapping[int, tuple[int, ...]],
    mode: str,
    dtype_name: str,
) -> tuple[
    list[dict[str, npt.NDArray[np.float64] | None]], dict[str, npt.NDArray[np.float64]] | None
]:
    """The reference model's emulation of the distributed computation: each rank's window
    (§5/§6), the two-rank SUM as one rounding round_D(buf_0 + buf_1), the global weight as the
    correctly rounded float64 sum of the rank weights, then finish_mean's division (semantics §8).
    Returns each rank's finish_sums buffers and the reduced mean (None for more than two ranks,
    whose association order is the backend's)."""
    params = _shapes(_linear())
    local_sums = []
    weights = []
    for rank, window in enumerate(windows):
        reference = ReferenceAccumulator(dtype=dtype_name, loss_scale=MODEL_LOSS_SCALE)
        for count, grads in zip(counts[rank], window, strict=True):
            accumulate = reference.accumulate_sum if mode == "sum" else reference.accumulate_mean
            accumulate(params, float(count), grads=grads)
        finished = reference.finish_sums()
        local_sums.append(finished.grads)
        weights.append(finished.weight)
    if len(windows) != 2:
        return local_sums, None
    reduced: dict[str, npt.ArrayLike] = {}
    for name in params:
        first, second = (sums[name] for sums in local_sums)
        assert first is not None and second is not None
        reduced[name] = add_rounded(first, second, dtype_name)
    state = ReferenceState(
        dtype=dtype_name,
        loss_scale=MODEL_LOSS_SCALE,
        issued=sum(len(c) for c in counts.values()),
        zero_weight=0,
        total_weight=round_to(sum((Fraction(w) for w in weights), Fraction(0)), "float64"),
        fused=False,
    )
    mean = ReferenceAccumulator.from_pending(params, reduced, state).finish_mean()
    grads = {name: grad for name, grad in mean.grads.items() if grad is not None}
    assert grads.keys() == params.keys()
    return local_sums, grads


@pytest.mark.parametrize("dtype_name", WORK_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_model_gradients_match_reference_emulation(
    rank_results: list[dict[str, Any]], inputs: Mapping[str, Any], mode: str, dtype_name: str
) -> None:
    """For real cross-entropy gradients of an nn.Linear, each rank's sums, and with two ranks the
    reduced mean, equal the reference model's step-by-step emulation bit for bit, on every rank."""
    key = f"{mode}/{dtype_name}"
    counts = inputs["counts"]
    local_sums, expected_mean = _reference_reduced_mean(
        _model_windows(rank_results, key), counts=counts, mode=mode, dtype_name=dtype_name
    )
    dtype = DTYPES[dtype_name]
    for rank, results in enumerate(rank_results):
        got = results["model"][key]
        for name, expected in local_sums[rank].items():
            assert expected is not None
            _assert_bits_equal(
                got["local"]["grads"][name],
                torch.from_numpy(expected).to(dtype),
                f"{key} rank {rank} finish_sums {name!r}",
            )
        reduced = _result(got["mean"], key)
        issued = sum(len(c) for c in counts.values())
        assert reduced["normalized"] is True and reduced["issued"] == issued
        for name, expected in (expected_mean or {}).items():
            _assert_bits_equal(
                reduced["grads"][name],
                torch.from_numpy(expected).to(dtype),
                f"{key} rank {rank} all_reduce_mean {name!r}",
            )


@pytest.mark.parametrize("dtype_name", WORK_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_model_gradients_within_error_bound(
    rank_results: list[dict[str, Any]], inputs: Mapping[str, Any], mode: str, dtype_name: str
) -> None:
    """For real cross-entropy gradients of an nn.Linear, the reduced mean is within the error
    bound (derived from the operation sequence) of the exact Σ_k c_k / S / W."""
    assert MODEL_LOSS_SCALE > 1 and math.log2(MODEL_LOSS_SCALE).is_integer()  # the bound's premise
    key = f"{mode}/{dtype_name}"
    counts = inputs["counts"]
    windows = _model_windows(rank_results, key)
    effective = [
        [Fraction(c if mode == "sum" else conv_to(float(c), dtype_name)) for c in counts[r]]
        for r in range(len(rank_results))
    ]
    exact_weight = sum((w for ws in effective for w in ws), Fraction(0))
    # c_k = g_k for sums, g_k * w_D for means (semantics §12.2).
    multipliers = [[w if mode == "mean" else Fraction(1) for w in ws] for ws in effective]
    reduced = _result(rank_results[0]["model"][key]["mean"], key)
    assert reduced["weight"] == exact_weight  # small integers: every weight sum is exact
    weight_op = Fraction(round_to(reduced["weight"], TOLERANCES[dtype_name].op_dtype))
    worst = Fraction(0)
    for name in _shapes(_linear()):
        rank_bounds = [
            window_error_bound(
                kind=mode,
                grads=[grads[name] for grads in window],
                weights=[float(c) for c in counts[rank]],
                dtype=dtype_name,
                loss_scale=MODEL_LOSS_SCALE,
                normalized=False,
            ).reshape(-1)
            for rank, window in enumerate(windows)
        ]
        got = reduced["grads"][name].double().reshape(-1).tolist()
        buffers = [
            results["model"][key]["local"]["grads"][name].double().reshape(-1).tolist()
            for results in rank_results
        ]
        contributions = [
            [grads[name].reshape(-1).tolist() for grads in window] for window in windows
        ]
        for index, value in enumerate(got):
            exact_sum = sum(
                (
                    Fraction(grads[index]) * weight
                    for rank in range(len(rank_results))
                    for grads, weight in zip(contributions[rank], multipliers[rank], strict=True)
                ),
                Fraction(0),
            )
            assert all(math.isfinite(b[index]) for b in rank_bounds), (
                f"{key} {name}[{index}]: no bound applies {[b[index] for b in rank_bounds]}"
            )
            bound = reduced_mean_bound(
                exact_sum=exact_sum,
                rank_sum_bounds=[Fraction(float(b[index])) for b in rank_bounds],
                rank_buffers_abs=sum((abs(Fraction(b[index])) for b in buffers), Fraction(0)),
                exact_weight=exact_weight,
                weight_op=weight_op,
                loss_scale=MODEL_LOSS_SCALE,
                dtype_name=dtype_name,
            )
            exact = exact_sum / (Fraction(MODEL_LOSS_SCALE) * exact_weight)
            error = abs(Fraction(value) - exact)
            assert error <= bound, (
                f"{key} {name}[{index}]: got {value.hex()}, exact {float(exact)!r}, "
                f"error {float(error)!r} > bound {float(bound)!r}"
            )
            worst = max(worst, error / bound)
    print(f"{key}: worst error/bound {float(worst):.3g}")


def _reference_sum(a: float, b: float, fmt: Format) -> float:
    """round_F(a + b) for two values of ``fmt``: the exact sum rounded by the reference model;
    IEEE float64 arithmetic for specials and exact zeros (same outcome, sign of zero included,
    as in every work dtype)."""
    if not (math.isfinite(a) and math.isfinite(b)) or a + b == 0:
        return a + b
    return round_to(Fraction(a) + Fraction(b), fmt)


@pytest.mark.parametrize("world_size", [2], indirect=True, ids=["world2"])
@pytest.mark.parametrize("dtype_name", WORK_DTYPES)
def test_two_rank_sum_is_one_rounding_in_the_work_dtype(
    rank_results: list[dict[str, Any]], dtype_name: str, world_size: int
) -> None:
    """The reduction of two ranks' buffers is round_D(a + b) per element (reference rounding),
    specials (±0, ±inf, NaN, overflow, subnormals) included."""
    fmt = FORMATS[dtype_name]
    local = [r["rounding"][dtype_name]["local"]["grads"] for r in rank_results]
    inexact = 0
    for rank, results in enumerate(rank_results):
        reduced = _result(results["rounding"][dtype_name]["sums"], f"rounding {dtype_name}")
        for name, got in reduced["grads"].items():
            pairs = list(
                zip(
                    local[0][name].double().reshape(-1).tolist(),
                    local[1][name].double().reshape(-1).tolist(),
                    strict=True,
                )
            )
            expected_values = [_reference_sum(a, b, fmt) for a, b in pairs]
            inexact += sum(
                math.isfinite(a) and math.isfinite(b) and Fraction(a) + Fraction(b) != Fraction(e)
                for (a, b), e in zip(pairs, expected_values, strict=True)
                if math.isfinite(e)
            )
            expected = torch.tensor(expected_values, dtype=torch.float64).to(DTYPES[dtype_name])
            _assert_bits_equal(
                got.reshape(-1), expected, f"rank {rank} {dtype_name} {name!r} round_D(a + b)"
            )
    # The inputs must exercise rounding, or this test could not tell one rounding from another.
    assert inexact > 0, f"{dtype_name}: no pair of inputs has an inexact sum"


def test_presence_mask(rank_results: list[dict[str, Any]], inputs: Mapping[str, Any]) -> None:
    """Buffers present on one rank only are reduced with zeros elsewhere; a parameter without a
    buffer on any rank stays None; the result equals one accumulator's, bit for bit."""
    per_rank = inputs["presence"]
    kwargs: dict[str, Any] = {
        "dtype": torch.bfloat16,
        "loss_scale": EXACT_LOSS_SCALE,
        "mode": "sum",
    }
    expected_sums = _single_accumulator(_two_layers(), per_rank, **kwargs).finish_sums()
    expected_mean = _single_accumulator(_two_layers(), per_rank, **kwargs).finish_mean()
    assert expected_mean.grads["1.bias"] is None
    assert all(expected_mean.grads[n] is not None for n in ("0.weight", "0.bias", "1.weight"))
    for rank, results in enumerate(rank_results):
        got = results["presence"]["presence"]
        _assert_same_result(_result(got["sums"], "presence"), expected_sums, f"rank {rank} sums")
        _assert_same_result(_result(got["mean"], "presence"), expected_mean, f"rank {rank} mean")


def test_rank_with_only_zero_weight_batches(
    rank_results: list[dict[str, Any]], inputs: Mapping[str, Any]
) -> None:
    """Ranks holding no buffer at all (only zero-weight microbatches) still join: the result is
    rank 0's window normalized by the global weight, with the zero-weight batches counted."""
    others = len(rank_results) - 1
    per_rank = {0: inputs["exact/sum"][0], **{r: [(0.0, {})] for r in range(1, others + 1)}}
    expected = _single_accumulator(
        _linear(), per_rank, dtype=torch.float32, loss_scale=EXACT_LOSS_SCALE, mode="sum"
    ).finish_mean()
    assert expected.zero_weight == others and expected.issued == 2 + others
    for rank, results in enumerate(rank_results):
        got = _result(results["presence"]["zero_weight_rank"]["mean"], "zero-weight rank")
        _assert_same_result(got, expected, f"rank {rank}")


@pytest.mark.parametrize(
    ("scenario", "error", "needles"),
    [
        ("loss_scale_mismatch", "InvalidLossScaleError", ("1024.0", "2048.0")),
        ("dtype_mismatch", "ParameterMismatchError", ("float32", "bfloat16")),
        ("names_mismatch", "ParameterMismatchError", ("0.weight", "'weight'")),
        ("shape_mismatch", "ParameterMismatchError", ("'weight'", "[3, 4]", "[3, 5]")),
        ("normalized_input", "WeightedAccumulationError", ("rank 0", "normalized=True")),
        ("wrong_type", "TypeError", ("rank 1", "dict")),
        ("unbound_rank", "ParameterMismatchError", ("rank 1 tracks no parameter", "'weight'")),
        ("zero_global_weight/mean", "ZeroTotalWeightError", ("weight is 0",)),
        ("bool_weight", "InvalidWeightError", ("rank 1", "True")),
        ("negative_weight", "InvalidWeightError", ("rank 1", "-1.0")),
    ],
)
def test_bad_input_raises_on_every_rank(
    rank_results: list[dict[str, Any]], scenario: str, error: str, needles: tuple[str, ...]
) -> None:
    """An input that is bad or inconsistent on any rank makes every rank raise the same error
    class with the same message naming the offending values (and nobody hangs)."""
    outcomes = [results["errors"][scenario] for results in rank_results]
    for rank, outcome in enumerate(outcomes):
        assert outcome.get("error") == error, f"rank {rank} in {scenario}: {outcome}"
        for needle in needles:
            assert needle in outcome["message"], f"rank {rank}: {needle!r} not in {outcome}"
    assert all(outcome["message"] == outcomes[0]["message"] for outcome in outcomes)


def test_zero_global_weight_sums_reduce(rank_results: list[dict[str, Any]]) -> None:
    """all_reduce_sums of windows with only zero-weight batches gives W = 0, all grads None and
    the summed counters (only the mean is undefined)."""
    ranks = len(rank_results)
    for rank, results in enumerate(rank_results):
        got = _result(results["errors"]["zero_global_weight/sums"], "zero weight sums")
        assert got["weight"] == 0.0 and got["issued"] == ranks and got["zero_weight"] == ranks
        assert got["normalized"] is False
        assert set(got["grads"]) == {"weight", "bias"}, f"rank {rank}: {got}"
        assert all(g is None for g in got["grads"].values()), f"rank {rank}: {got}"


def test_zero_global_weight_loses_nothing_and_next_window_works(
    rank_results: list[dict[str, Any]], inputs: Mapping[str, Any]
) -> None:
    """After every rank raised ZeroTotalWeightError, each rank still holds its window (counters
    and the all-None sums) and the accumulator's next window reduces to the right mean."""
    ranks = len(rank_results)
    expected = _single_accumulator(
        _linear(),
        {rank: inputs["exact/sum"][0][:1] for rank in range(ranks)},
        dtype=torch.float32,
        loss_scale=EXACT_LOSS_SCALE,
        mode="sum",
    ).finish_mean()
    for rank, results in enumerate(rank_results):
        errors = results["errors"]
        assert errors["zero_global_weight/mean"].get("error") == "ZeroTotalWeightError"
        kept = errors["zero_global_weight/kept"]
        assert (kept["issued"], kept["zero_weight"], kept["weight"]) == (1, 1, 0.0), kept
        assert set(kept["grads"]) == {"weight", "bias"}, kept
        got = _result(errors["zero_global_weight/next_window"], f"rank {rank} next window")
        _assert_same_result(got, expected, f"rank {rank} next window")


def test_every_rank_gets_rank_zeros_result_bit_for_bit(
    rank_results: list[dict[str, Any]],
) -> None:
    """Every reduced result (sums and means of every scenario) is bit-identical on every rank,
    whatever association order the backend uses."""

    def reduced(results: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
        for key, entry in results["exact"].items():
            yield f"exact {key} sums", entry["sums"]
            yield f"exact {key} mean", entry["mean"]
        for key, entry in results["model"].items():
            yield f"model {key} mean", entry["mean"]
        for key, entry in results["rounding"].items():
            yield f"rounding {key} sums", entry["sums"]
        for key, entry in results["presence"].items():
            for which, outcome in entry.items():
                yield f"presence {key} {which}", outcome

    first = dict(reduced(rank_results[0]))
    assert len(first) == 2 * len(MODES) * len(DTYPES) + len(MODES) * len(DTYPES) + len(DTYPES) + 3
    for rank, results in enumerate(rank_results[1:], start=1):
        for what, outcome in reduced(results):
            got, want = _result(outcome, what), _result(first[what], what)
            for field in ("weight", "loss_scale", "issued", "zero_weight", "normalized"):
                assert got[field] == want[field], f"rank {rank} {what}: {field}"
            assert list(got["grads"]) == list(want["grads"]), f"rank {rank} {what}: names"
            for name, grad in want["grads"].items():
                _assert_bits_equal(got["grads"][name], grad, f"rank {rank} {what} {name!r}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reduction_bit_for_bit() -> None:
    """On CUDA (NCCL with a GPU per rank, else gloo with both ranks on one GPU) the reduced sums
    and mean equal one CUDA accumulator's finish_sums / finish_mean bit for bit, on the GPU."""
    inputs = _build_inputs(CUDA_WORLD_SIZE)
    backend = "nccl" if torch.cuda.device_count() >= CUDA_WORLD_SIZE else "gloo"
    device = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory(prefix="wacc-dist-cuda-") as tmp:
        work_dir = Path(tmp)
        inputs_file = work_dir / "inputs.pt"
        torch.save(inputs, inputs_file)
        run_job(
            _cuda_rank_main,
            (backend, str(inputs_file), str(work_dir)),
            world_size=CUDA_WORLD_SIZE,
            work_dir=work_dir,
        )
        rank_results = load_results(work_dir, CUDA_WORLD_SIZE)
    cases: list[tuple[str, Mapping[int, Any], torch.dtype, str]] = [
        (f"{mode}/{name}", inputs[f"exact/{mode}"], dtype, mode)
        for mode in MODES
        for name, dtype in DTYPES.items()
    ]
    zero_weight_ranks = {r: [(0.0, {})] for r in range(1, CUDA_WORLD_SIZE)}
    cases.append(
        (
            "zero_weight_rank",
            {0: inputs["exact/sum"][0], **zero_weight_ranks},
            torch.float32,
            "sum",
        )
    )
    for key, per_rank, dtype, mode in cases:
        on_device = {rank: _on_device(batches, device) for rank, batches in per_rank.items()}
        expected = {
            "sums": _single_accumulator(
                _linear().to(device), on_device, dtype=dtype, loss_scale=EXACT_LOSS_SCALE, mode=mode
            ).finish_sums(),
            "mean": _single_accumulator(
                _linear().to(device), on_device, dtype=dtype, loss_scale=EXACT_LOSS_SCALE, mode=mode
            ).finish_mean(),
        }
        for rank, results in enumerate(rank_results):
            outcomes = {"mean": results[key]} if key == "zero_weight_rank" else dict(results[key])
            for which, outcome in outcomes.items():
                what = f"{backend} {key} {which} rank {rank}"
                got = _result(outcome, what)
                assert all(d is None or d.startswith("cuda") for d in got["devices"].values()), (
                    f"{what}: devices {got['devices']}"
                )
                _assert_same_result(got, expected[which], what)
