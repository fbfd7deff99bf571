"""wacc_torch.ddp_hook.WeightedAllReduceHook on real DDP models, 2 and 4 spawned gloo ranks.

One job per world size runs every scenario: the hook against the ``no_sync`` + helper path on
an MLP with real cross-entropy gradients (sums and means, work dtypes float32, bfloat16 and
float16 under float32 parameters), a globally zero window, a bad weight on one rank, the
collectives one step makes on a 100-tensor model, and a synchronized backward without arming.

The in-process tests at the end (a real single-process gloo group) check the same contract where
one rank suffices: the gradients, every refusal's class and message (naming the caller and the
value) with nothing changed, and which process group the hook talks on.
"""

from __future__ import annotations

import functools
import inspect
import math
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from wacc_torch import (
    WeightedGradientsAccumulator,
    all_reduce_mean,
    ddp_hook,
)
from wacc_torch.ddp_hook import WeightedAllReduceHook, _bucket_gradient
from wacc_torch.distributed import ProcessGroupUnavailableError
from wacc_torch.errors import (
    InvalidWeightError,
    UnsupportedEnvironmentError,
    WeightedAccumulationError,
    ZeroCopyError,
    ZeroTotalWeightError,
)

from .distributed.spawn import init_rank, load_results, run_job, save_result
from .support import (
    assert_bitwise_equal,
    assert_unchanged,
    flushing_subnormals,
    grads_snapshot,
)

REPOSITORY = Path(__file__).resolve().parents[2]
LOSS_SCALE = 2.0**5
# (work dtype, mode) pairs judged against the helper path; parameters are float32.
CASES = (
    (torch.float32, "sum"),
    (torch.float32, "mean"),
    (torch.bfloat16, "mean"),
    (torch.float16, "sum"),
)
# Token counts of each rank's microbatches (unequal counts and lengths across ranks).
COUNTS: Mapping[int, Mapping[int, tuple[int, ...]]] = {
    2: {0: (3, 11), 1: (40, 1, 6)},
    4: {0: (3, 11), 1: (40, 1, 6), 2: (9,), 3: (2, 2)},
}
FEATURES, CLASSES = 8, 5
TENSORS_MODEL_LAYERS = 50  # 50 Linear layers: 100 parameter tensors


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, mode: str) -> torch.Tensor:
    return LOSS_SCALE * F.cross_entropy(model(x), y, reduction=mode)


def _accumulate(
    accumulator: WeightedGradientsAccumulator, module: nn.Module, weight: float, *, mode: str
) -> None:
    if mode == "sum":
        accumulator.accumulate_sum(module, weight)
    else:
        accumulator.accumulate_mean(module, weight)


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()
    }


def _helper_step(
    model: DistributedDataParallel, batches: list[tuple[torch.Tensor, torch.Tensor]], **kwargs: Any
) -> dict[str, torch.Tensor | None]:
    mode, dtype = kwargs["mode"], kwargs["dtype"]
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
    with model.no_sync():
        for x, y in batches:
            _loss(model, x, y, mode=mode).backward()
            _accumulate(accumulator, model.module, float(len(y)), mode=mode)
    all_reduce_mean(accumulator.finish_sums()).apply_to(model.module)
    return _grads(model.module)


def _hook_step(
    model: DistributedDataParallel,
    hook: WeightedAllReduceHook,
    accumulator: WeightedGradientsAccumulator,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    mode: str,
) -> dict[str, torch.Tensor | None]:
    *earlier, (x_last, y_last) = batches
    with model.no_sync():
        for x, y in earlier:
            _loss(model, x, y, mode=mode).backward()
            _accumulate(accumulator, model.module, float(len(y)), mode=mode)
    loss = _loss(model, x_last, y_last, mode=mode)
    (hook.last_microbatch_sum if mode == "sum" else hook.last_microbatch_mean)(float(len(y_last)))
    loss.backward()
    return _grads(model.module)


def _batches(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(count, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (count,), generator=generator),
        )
        for count in COUNTS[world_size][rank]
    ]


def _captured(call: Callable[[], object]) -> dict[str, Any]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the judge compares classes across ranks
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def _scenario_against_helper(
    rank: int, world_size: int, device: torch.device | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batches = [(x.to(device), y.to(device)) for x, y in _batches(rank, world_size)]
    device_ids = None if device is None else [device]

    def ddp() -> DistributedDataParallel:
        return DistributedDataParallel(_mlp().to(device), device_ids=device_ids)

    for dtype, mode in CASES:
        key = f"{str(dtype).removeprefix('torch.')}/{mode}"
        helper_grads = _helper_step(ddp(), batches, mode=mode, dtype=dtype)
        model = ddp()
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
        hook = WeightedAllReduceHook(model, accumulator)
        hook_grads = _hook_step(model, hook, accumulator, batches, mode=mode)
        assert hook.result is not None
        out[key] = {
            "helper": helper_grads,
            "hook": hook_grads,
            "result": (hook.result.weight, hook.result.issued, hook.result.zero_weight),
            "left": accumulator.state.issued,
        }
    return out


def _scenario_refusals(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = DistributedDataParallel(_mlp())
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    hook = WeightedAllReduceHook(model, accumulator)
    x, y = torch.randn(0, FEATURES), torch.zeros(0, dtype=torch.long)
    # Every rank's window has only zero-token microbatches.
    with model.no_sync():
        _loss(model, x, y, mode="sum").backward()
        accumulator.accumulate_sum(model.module, 0.0)
    loss = _loss(model, x, y, mode="sum")
    out["zero_weight"] = _captured(lambda: hook.last_microbatch_sum(0.0))
    out["zero_weight/state"] = accumulator.state.issued, accumulator.state.zero_weight
    del loss  # the window's last backward is skipped: nothing to synchronize
    # The same window continues and completes with a positive weight on rank 0.
    batches = _batches(rank, world_size)[:1]
    weight = float(len(batches[0][1])) if rank == 0 else 0.0
    loss = _loss(model, *batches[0], mode="sum")
    hook.last_microbatch_sum(weight)
    loss.backward()
    assert hook.result is not None
    out["after_zero"] = (hook.result.weight, hook.result.issued, hook.result.zero_weight)
    # A bad weight on the last rank only.
    with model.no_sync():
        _loss(model, *batches[0], mode="sum").backward()
        accumulator.accumulate_sum(model.module, 1.0)
    loss = _loss(model, *batches[0], mode="sum")
    bad = -1.0 if rank == world_size - 1 else 2.0
    out["bad_weight"] = _captured(lambda: hook.last_microbatch_sum(bad))
    out["bad_weight/state"] = accumulator.state.issued, accumulator.state.total_weight
    return out


class _Counter:
    """Counts the collectives this process's Python code issues, and their payload bytes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._originals = (dist.all_reduce, dist.all_gather_object)

    def __enter__(self) -> _Counter:
        all_reduce, all_gather_object = self._originals

        def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(("all_reduce", tensor.numel() * tensor.element_size()))
            return all_reduce(tensor, *args, **kwargs)

        def counted_all_gather_object(output: list[Any], obj: Any, *args: Any, **kw: Any) -> Any:
            self.calls.append(("all_gather_object", len(pickle.dumps(obj))))
            return all_gather_object(output, obj, *args, **kw)

        dist.all_reduce = counted_all_reduce  # type: ignore[assignment]
        dist.all_gather_object = counted_all_gather_object  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather_object = self._originals  # type: ignore[assignment]


def _many_tensors() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(*(nn.Linear(FEATURES, FEATURES) for _ in range(TENSORS_MODEL_LAYERS)))


def _scenario_collectives(rank: int, world_size: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(n, FEATURES, generator=generator),) for n in (2, 5, 3)]

    def loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().sum()

    out: dict[str, Any] = {}
    model = DistributedDataParallel(_many_tensors())
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    with _Counter() as counter:
        with model.no_sync():
            for (x,) in batches:
                loss(model, x).backward()
                accumulator.accumulate_sum(model.module, float(len(x)))
        all_reduce_mean(accumulator.finish_sums()).apply_to(model.module)
    out["helper"] = counter.calls
    model = DistributedDataParallel(_many_tensors())
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    hook = WeightedAllReduceHook(model, accumulator)
    with _Counter() as counter:
        with model.no_sync():
            for (x,) in batches[:-1]:
                loss(model, x).backward()
                accumulator.accumulate_sum(model.module, float(len(x)))
        last = loss(model, batches[-1][0])
        hook.last_microbatch_sum(float(len(batches[-1][0])))
        last.backward()
    out["hook"] = counter.calls
    out["tensors"] = len(list(model.parameters()))
    out["elements"] = sum(p.numel() for p in model.parameters())
    return out


def _scenario_disagreements(rank: int, world_size: int) -> dict[str, Any]:
    """The last rank's window differs from the others' in its loss scale, its work dtype or its
    parameters' device type (moved to "meta" after DDP's construction); nothing else differs."""
    last = world_size - 1
    setups = {
        "loss_scale": (torch.float32, 2 * LOSS_SCALE if rank == last else LOSS_SCALE, "cpu"),
        "dtype": (torch.bfloat16 if rank == last else torch.float32, LOSS_SCALE, "cpu"),
        "device_type": (torch.float32, LOSS_SCALE, "meta" if rank == last else "cpu"),
    }
    out: dict[str, Any] = {}
    for key, (dtype, loss_scale, device) in setups.items():
        model = DistributedDataParallel(_mlp())
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)
        hook = WeightedAllReduceHook(model, accumulator)
        model.module.to(device)
        out[key] = _captured(functools.partial(hook.last_microbatch_sum, 1.0))
    return out


def _scenario_unarmed(rank: int, world_size: int) -> dict[str, Any]:
    model = DistributedDataParallel(_mlp())
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    WeightedAllReduceHook(model, accumulator)
    x, y = _batches(rank, world_size)[0]
    return {"unarmed": _captured(lambda: _loss(model, x, y, mode="sum").backward())}


def _rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    init_rank(rank, world_size, init_file)
    try:
        results = {
            "against_helper": _scenario_against_helper(rank, world_size),
            "refusals": _scenario_refusals(rank, world_size),
            "collectives": _scenario_collectives(rank, world_size),
            "disagreements": _scenario_disagreements(rank, world_size),
            # Last: a backward that raised leaves this DDP model's reducer mid-iteration.
            "unarmed": _scenario_unarmed(rank, world_size),
        }
        save_result(out_dir, rank, results)
    finally:
        dist.destroy_process_group()


def _cuda_rank_main(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """NCCL with a GPU per rank, else gloo with every rank on GPU 0."""
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    device = torch.device("cuda", rank if backend == "nccl" else 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        results = _scenario_against_helper(rank, world_size, device)
        for entry in results.values():
            for path in ("helper", "hook"):
                entry[path] = {n: None if g is None else g.cpu() for n, g in entry[path].items()}
        save_result(out_dir, rank, {"against_helper": results, "backend": backend})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hook_grads_equal_helper_bit_for_bit_on_cuda() -> None:
    """On CUDA (NCCL with a GPU per rank, else gloo on one GPU), two ranks: the hook's .grad
    equals the no_sync + helper path's bit for bit, for every case."""
    with tempfile.TemporaryDirectory(prefix="wacc-hook-cuda-") as tmp:
        work_dir = Path(tmp)
        run_job(_cuda_rank_main, (str(work_dir),), world_size=2, work_dir=work_dir)
        rank_results = load_results(work_dir, 2)
    for rank, results in enumerate(rank_results):
        for case, got in results["against_helper"].items():
            for name, grad in got["helper"].items():
                what = f"{results['backend']} rank {rank} {case} {name}"
                assert_bitwise_equal(got["hook"][name], grad, what)


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"world{n}")
def world_size(request: pytest.FixtureRequest) -> int:
    """How many ranks the job runs."""
    size: int = request.param
    return size


@pytest.fixture(scope="module")
def rank_results(world_size: int) -> Iterator[list[dict[str, Any]]]:
    """Run every scenario once per world size; each rank's records."""
    with tempfile.TemporaryDirectory(prefix="wacc-hook-") as tmp:
        work_dir = Path(tmp)
        run_job(_rank_main, (str(work_dir),), world_size=world_size, work_dir=work_dir)
        yield load_results(work_dir, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2], indirect=True, ids=["world2"])
@pytest.mark.parametrize("case", [f"{str(d).removeprefix('torch.')}/{m}" for d, m in CASES])
def test_hook_grads_equal_helper_bit_for_bit_on_two_ranks(
    rank_results: list[dict[str, Any]], case: str, world_size: int
) -> None:
    """With two ranks, the .grad the hook leaves equals no_sync + all_reduce_mean + apply_to bit
    for bit (sums and means; float32, bfloat16 and float16 buffers under float32 parameters)."""
    for rank, results in enumerate(rank_results):
        got = results["against_helper"][case]
        assert set(got["hook"]) == set(got["helper"])
        for name, grad in got["helper"].items():
            assert_bitwise_equal(got["hook"][name], grad, f"rank {rank} {case} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("case", [f"{str(d).removeprefix('torch.')}/{m}" for d, m in CASES])
def test_hook_result_and_ranks_agree(
    rank_results: list[dict[str, Any]], world_size: int, case: str
) -> None:
    """Every rank gets the same .grad bit for bit, the global weight and counters, and the
    accumulator starts a new, empty window."""
    counts = [c for rank in sorted(COUNTS[world_size]) for c in COUNTS[world_size][rank]]
    dtype_name, mode = case.split("/")
    # Means count w_D; these small integers are exact in every work dtype.
    expected = (float(sum(counts)), len(counts), 0)
    first = rank_results[0]["against_helper"][case]["hook"]
    for rank, results in enumerate(rank_results):
        got = results["against_helper"][case]
        assert tuple(got["result"]) == expected, f"rank {rank} {case} ({mode}, {dtype_name})"
        assert got["left"] == 0
        for name, grad in first.items():
            assert_bitwise_equal(got["hook"][name], grad, f"rank {rank} vs rank 0 {name}")


@pytest.mark.slow
def test_zero_global_weight_raises_everywhere_and_loses_nothing(
    rank_results: list[dict[str, Any]], world_size: int
) -> None:
    """A window whose global weight is 0 makes last_microbatch_sum raise ZeroTotalWeightError on
    every rank, the accumulator keeps the window, and the window then completes."""
    for results in rank_results:
        refusals = results["refusals"]
        assert refusals["zero_weight"]["error"] == "ZeroTotalWeightError", refusals
        assert refusals["zero_weight/state"] == (1, 1)
        # The kept zero-weight microbatch plus the last one of every rank.
        tokens = float(COUNTS[world_size][0][0])
        assert refusals["after_zero"] == (tokens, 2 * world_size, 2 * world_size - 1)


@pytest.mark.slow
def test_bad_weight_on_one_rank_raises_everywhere(
    rank_results: list[dict[str, Any]], world_size: int
) -> None:
    """A negative weight on the last rank makes every rank raise InvalidWeightError naming that
    rank and the value, with every accumulator unchanged."""
    culprit = world_size - 1
    for results in rank_results:
        outcome = results["refusals"]["bad_weight"]
        assert outcome["error"] == "InvalidWeightError", outcome
        assert f"rank {culprit} of {world_size}" in outcome["message"]
        assert "-1.0" in outcome["message"]
        assert results["refusals"]["bad_weight/state"] == (1, 1.0)


@pytest.mark.slow
def test_ranks_disagreeing_on_scale_dtype_or_device_type_raise_everywhere(
    rank_results: list[dict[str, Any]], world_size: int
) -> None:
    """When one rank's window has another loss scale, work dtype or parameter device type,
    last_microbatch_sum raises on every rank, before any gradient moves: InvalidLossScaleError
    naming both scales and ranks, or ParameterMismatchError listing every rank's dtype or
    device type."""
    last = world_size - 1

    def listed(value: Callable[[int], str]) -> str:
        return ", ".join(f"rank {rank}: {value(rank)}" for rank in range(world_size))

    expected = {
        "loss_scale": {
            "error": "InvalidLossScaleError",
            "message": f"last_microbatch_sum: loss scale {2 * LOSS_SCALE!r} on rank {last} "
            f"differs from {LOSS_SCALE!r} on rank 0; S must be the same on every rank",
        },
        "dtype": {
            "error": "ParameterMismatchError",
            "message": "last_microbatch_sum: the work dtype differs across ranks: "
            + listed(lambda rank: "bfloat16" if rank == last else "float32"),
        },
        "device_type": {
            "error": "ParameterMismatchError",
            "message": "last_microbatch_sum: the buffers' device type differs across ranks: "
            + listed(lambda rank: "meta" if rank == last else "cpu"),
        },
    }
    for rank, results in enumerate(rank_results):
        assert results["disagreements"] == expected, f"rank {rank}"


@pytest.mark.slow
def test_unarmed_synchronized_backward_raises(rank_results: list[dict[str, Any]]) -> None:
    """A backward outside no_sync() without last_microbatch_* raises on every rank instead of
    letting DDP average it."""
    for rank, results in enumerate(rank_results):
        outcome = results["unarmed"]["unarmed"]
        assert outcome["error"] is not None, f"rank {rank}: no error"
        assert "last_microbatch_sum" in outcome["message"], outcome


@pytest.mark.slow
def test_collectives_and_bytes_per_step(rank_results: list[dict[str, Any]]) -> None:
    """For a 100-tensor model, one window costs the helper one metadata exchange and one
    all-reduce of every buffer, and the hook one metadata exchange and one all-reduce per DDP
    bucket carrying the same bytes (float32 buffers: 4 bytes per element)."""
    for results in rank_results:
        got = results["collectives"]
        assert got["tensors"] == 2 * TENSORS_MODEL_LAYERS
        payload = 4 * got["elements"]
        for path in ("helper", "hook"):
            calls = got[path]
            kinds = [kind for kind, _ in calls]
            assert kinds.count("all_gather_object") == 1, (path, calls)
            assert kinds[0] == "all_gather_object", (path, calls)
            reduced = [size for kind, size in calls if kind == "all_reduce"]
            assert sum(reduced) == payload, (path, calls)
        assert len([k for k, _ in got["helper"] if k == "all_reduce"]) == 1
        print(
            f"100-tensor model, {got['elements']} elements: helper {got['helper']}, "
            f"hook {got['hook']}"
        )


_GROUP_LIFETIME_SCRIPT = """
import torch.distributed as dist
from tests.wacc_torch.support import hooked_window_weight

for _ in range({windows}):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert hooked_window_weight(1, mean=False) == 2.0
    dist.destroy_process_group()
print("done")
"""


@pytest.mark.slow
def test_a_hooked_model_outliving_its_group_never_aborts_the_process() -> None:
    """A hooked DDP model dropped after a window (the group destroyed, a new one made: a
    notebook, a test suite, a job that re-forms its group) never takes the process down.

    Before: the hook's all-reduce callback held the hook, and through it the process group, so
    the group's last reference could die in the group's own worker thread, whose destructor
    joins itself: ``std::system_error: Resource deadlock avoided`` and SIGABRT, about once in
    25 windows.  120 windows in a fresh interpreter fail that code with probability ~0.99.
    """
    completed = subprocess.run(
        [sys.executable, "-c", _GROUP_LIFETIME_SCRIPT.format(windows=120)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPOSITORY,
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "done", (
        f"exit {completed.returncode}\n{completed.stderr[-2000:]}"
    )


# ------------------------------------------------------------ in-process: one real gloo rank
ONE_RANK_COUNTS = (3, 11, 6)  # the last microbatch is armed with the hook


class _GroupSpy:
    """Records the ``group`` argument of every ``all_reduce`` and ``all_gather_object`` that
    this process's Python code issues (the originals still run)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self._originals = (dist.all_reduce, dist.all_gather_object)

    def __enter__(self) -> _GroupSpy:
        def spying(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
            signature = inspect.signature(original)

            def spy(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs)
                self.calls.append((kind, bound.arguments.get("group")))
                return original(*args, **kwargs)

            return spy

        all_reduce, all_gather_object = self._originals
        dist.all_reduce = spying("all_reduce", all_reduce)  # type: ignore[assignment]
        dist.all_gather_object = spying("all_gather_object", all_gather_object)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather_object = self._originals  # type: ignore[assignment]


def _one_rank_batches(
    counts: tuple[int, ...] = ONE_RANK_COUNTS, *, seed: int = 7
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded microbatches of ``counts`` rows (features and class labels)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(count, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (count,), generator=generator),
        )
        for count in counts
    ]


def _hooked(
    dtype: torch.dtype = torch.float32, **kwargs: Any
) -> tuple[DistributedDataParallel, WeightedAllReduceHook, WeightedGradientsAccumulator]:
    model = DistributedDataParallel(_mlp())
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
    return model, WeightedAllReduceHook(model, accumulator, **kwargs), accumulator


def _earlier_microbatch(
    model: DistributedDataParallel, accumulator: WeightedGradientsAccumulator, weight: float
) -> torch.Tensor:
    """One microbatch under no_sync() counted with ``weight``; returns the next (last) loss."""
    x, y = _one_rank_batches()[0]
    with model.no_sync():
        _loss(model, x, y, mode="sum").backward()
        accumulator.accumulate_sum(model.module, weight)
    return _loss(model, x, y, mode="sum")


@pytest.mark.parametrize(
    ("dtype", "mode"),
    [(torch.float32, "sum"), (torch.float32, "mean"), (torch.bfloat16, "mean")],
    ids=["float32/sum", "float32/mean", "bfloat16/mean"],
)
def test_one_rank_hook_equals_the_helper_path_and_starts_a_new_window(
    one_rank_group: None, dtype: torch.dtype, mode: str
) -> None:
    """On one rank, the .grad the hook leaves equals no_sync + accumulate_* + all_reduce_mean +
    apply_to bit for bit (the last microbatch's mean weighted by its own token count, not 1);
    result holds the same normalized buffers, the window's weight and counters, and the
    accumulator starts a new, empty window."""
    batches = _one_rank_batches()
    helper_grads = _helper_step(DistributedDataParallel(_mlp()), batches, mode=mode, dtype=dtype)
    reference = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE)
    plain = _mlp()
    for x, y in batches:
        _loss(plain, x, y, mode=mode).backward()
        _accumulate(reference, plain, float(len(y)), mode=mode)
    expected = all_reduce_mean(reference.finish_sums())

    model, hook, accumulator = _hooked(dtype)
    hook_grads = _hook_step(model, hook, accumulator, batches, mode=mode)
    for name, grad in helper_grads.items():
        assert_bitwise_equal(hook_grads[name], grad, f"{mode} .grad of {name}")
    result = hook.result
    assert result is not None
    assert result.normalized is True
    assert (result.weight, result.issued, result.zero_weight) == (
        float(sum(ONE_RANK_COUNTS)),
        len(ONE_RANK_COUNTS),
        0,
    )
    assert result.loss_scale == LOSS_SCALE
    assert set(result.grads) == set(expected.grads)
    for name, grad in expected.grads.items():
        assert_bitwise_equal(result.grads[name], grad, f"{mode} result of {name}")
    assert (accumulator.state.issued, accumulator.state.total_weight) == (0, 0.0)


@pytest.mark.parametrize(
    ("mean", "earlier", "weight", "error", "message"),
    [
        (
            False,
            2.0,
            -1.0,
            InvalidWeightError,
            "last_microbatch_sum: weight must be finite and >= 0, got -1.0",
        ),
        (
            True,
            2.0,
            float("nan"),
            InvalidWeightError,
            "last_microbatch_mean: weight must be finite and >= 0, got nan",
        ),
        (
            True,
            2.0,
            1e-50,
            InvalidWeightError,
            "last_microbatch_mean: weight 1e-50 does not survive the work dtype torch.float32: "
            "it converts to 0.0",
        ),
    ],
    ids=["sum-negative", "mean-nan", "mean-underflows-D"],
)
def test_a_bad_last_weight_raises_the_callers_error_and_loses_nothing(
    one_rank_group: None,
    mean: bool,
    earlier: float,
    weight: float,
    error: type[Exception],
    message: str,
) -> None:
    """A bad weight given to last_microbatch_sum/_mean raises (through the collective verdict)
    exactly its class, with a message naming this rank, the caller and the value; the previous
    window's result is cleared, the accumulator and .grad are unchanged, and the window then
    completes with a good weight, the earlier microbatch included."""
    model, hook, accumulator = _hooked()
    _hook_step(model, hook, accumulator, _one_rank_batches(), mode="sum")
    assert hook.result is not None
    loss = _earlier_microbatch(model, accumulator, earlier)
    record, grads = accumulator.state_dict(), grads_snapshot(model.module)
    arm = hook.last_microbatch_mean if mean else hook.last_microbatch_sum
    with pytest.raises(error) as raised:
        arm(weight)
    assert type(raised.value) is error
    assert str(raised.value) == f"rank 0 of 1: {message} (raised on every rank)"
    assert hook.result is None
    assert_unchanged(accumulator, record, model.module, grads)
    arm(3.0)
    loss.backward()
    assert hook.result is not None
    assert (hook.result.weight, hook.result.issued) == (earlier + 3.0, 2)


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_a_window_of_zero_global_weight_is_refused_by_the_arming_call(
    one_rank_group: None, mean: bool
) -> None:
    """A window whose weights are all 0 makes last_microbatch_* raise ZeroTotalWeightError
    naming the caller and the per-rank weights, before the backward; nothing changes and the
    window completes once a positive weight arrives (the zero-weight microbatches counted)."""
    model, hook, accumulator = _hooked()
    loss = _earlier_microbatch(model, accumulator, 0.0)
    record, grads = accumulator.state_dict(), grads_snapshot(model.module)
    caller = "last_microbatch_mean" if mean else "last_microbatch_sum"
    arm = getattr(hook, caller)
    with pytest.raises(ZeroTotalWeightError) as raised:
        arm(0)
    assert str(raised.value) == (
        f"{caller}: the global weight is 0 (weights per rank: [0.0]); nothing to normalize"
    )
    assert hook.result is None
    assert_unchanged(accumulator, record, model.module, grads)
    arm(5)
    loss.backward()
    assert hook.result is not None
    assert (hook.result.weight, hook.result.issued, hook.result.zero_weight) == (5.0, 2, 1)


def test_parameters_on_two_device_types_are_refused_before_any_gradient_moves(
    one_rank_group: None,
) -> None:
    """A module whose tracked parameters live on two device types (the hook's buffers must share
    DDP's one device) is refused by last_microbatch_sum with WeightedAccumulationError naming
    the caller and the device types, the accumulator unchanged."""
    model, hook, accumulator = _hooked()
    _earlier_microbatch(model, accumulator, 2.0)
    model.module[2].bias = nn.Parameter(torch.zeros(CLASSES, device="meta"))
    record = accumulator.state_dict()
    with pytest.raises(WeightedAccumulationError) as raised:
        hook.last_microbatch_sum(1.0)
    assert type(raised.value) is WeightedAccumulationError
    assert str(raised.value) == (
        "rank 0 of 1: last_microbatch_sum: the parameters must be on one device type, got "
        "['cpu', 'meta'] (raised on every rank)"
    )
    assert_unchanged(accumulator, record)


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_flushed_subnormals_are_refused_by_the_arming_call(
    one_rank_group: None, mean: bool
) -> None:
    """With flush-to-zero on in the calling thread, last_microbatch_* (whose weight arithmetic
    runs on the host) raise UnsupportedEnvironmentError naming the caller, nothing changed; with
    gradual underflow back, the window completes."""
    model, hook, accumulator = _hooked()
    loss = _earlier_microbatch(model, accumulator, 2.0)
    record = accumulator.state_dict()
    caller = "last_microbatch_mean" if mean else "last_microbatch_sum"
    with flushing_subnormals():
        with pytest.raises(UnsupportedEnvironmentError) as raised:
            getattr(hook, caller)(1.0)
    # The caller is named once (the check's message already starts with it).
    assert str(raised.value).startswith(
        f"rank 0 of 1: {caller}: the CPU flushes subnormals to zero"
    ), str(raised.value)
    assert_unchanged(accumulator, record)
    getattr(hook, caller)(1.0)
    loss.backward()
    assert hook.result is not None and hook.result.issued == 2


def test_the_hook_talks_only_on_its_group(one_rank_group: None) -> None:
    """Every collective of a window (the metadata exchange and each bucket's all-reduce) goes to
    the group given to the hook, never to the default group (which would deadlock a job whose
    data-parallel group is a subgroup); a group this process is not a member of is refused
    locally with ProcessGroupUnavailableError naming the caller and the group."""
    group = dist.new_group([0])
    model, hook, accumulator = _hooked(group=group)
    with _GroupSpy() as spy:
        _hook_step(model, hook, accumulator, _one_rank_batches(), mode="mean")
    assert hook.result is not None
    kinds = [kind for kind, _ in spy.calls]
    assert kinds[0] == "all_gather_object" and kinds.count("all_gather_object") == 1, kinds
    assert "all_reduce" in kinds
    assert all(used is group for _, used in spy.calls), spy.calls

    outsider = dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives a non-member rank
    model, hook, accumulator = _hooked(group=outsider)  # type: ignore[arg-type]
    loss = _earlier_microbatch(model, accumulator, 2.0)
    record = accumulator.state_dict()
    for caller in ("last_microbatch_sum", "last_microbatch_mean"):
        with pytest.raises(ProcessGroupUnavailableError) as raised:
            getattr(hook, caller)(1.0)
        assert str(raised.value) == (
            f"{caller}: this process (global rank 0) is not a member of the given process "
            f"group {outsider!r}"
        )
    assert_unchanged(accumulator, record)
    del loss


def test_bad_constructor_arguments_are_refused_naming_what_was_given(
    one_rank_group: None,
) -> None:
    """WeightedAllReduceHook refuses a model that is not DDP and an accumulator that is not a
    WeightedGradientsAccumulator with TypeError naming the type it got, and a zero-copy
    accumulator with ZeroCopyError explaining what to do instead."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    with pytest.raises(TypeError) as raised:
        WeightedAllReduceHook(_mlp(), accumulator)  # type: ignore[arg-type]
    assert str(raised.value) == "model must be a DistributedDataParallel, got Sequential"
    model = DistributedDataParallel(_mlp())
    with pytest.raises(TypeError) as raised:
        WeightedAllReduceHook(model, "accumulator")  # type: ignore[arg-type]
    assert str(raised.value) == "accumulator must be a WeightedGradientsAccumulator, got str"
    zero_copy = WeightedGradientsAccumulator(
        dtype=torch.float32, loss_scale=LOSS_SCALE, zero_copy=True
    )
    with pytest.raises(ZeroCopyError) as zero_copy_raised:
        WeightedAllReduceHook(model, zero_copy)
    assert str(zero_copy_raised.value) == (
        "WeightedAllReduceHook needs a buffered accumulator: its last microbatch is a plain DDP "
        "backward, which would add into the zero-copy window's .grad. With zero_copy=True run "
        "every microbatch in `with ddp.no_sync(), acc.microbatch(...)` and reduce with "
        "wacc_torch.all_reduce_mean"
    )


UNARMED_MESSAGE = (
    "WeightedAllReduceHook: a backward synchronized gradients (outside no_sync()) without "
    "last_microbatch_sum/_mean() first; DDP would average it by the world size, which is the "
    "error this hook exists to avoid"
)


def test_a_synchronized_backward_before_arming_or_after_a_window_raises(
    one_rank_group: None,
) -> None:
    """A new hook has no result, and a backward outside no_sync() without last_microbatch_*
    raises WeightedAccumulationError (not an averaged .grad), both on a new hook and after a
    completed window (whose result stays readable)."""
    x, y = _one_rank_batches()[0]
    model, hook, _ = _hooked()
    assert hook.result is None
    with pytest.raises(WeightedAccumulationError) as raised:
        _loss(model, x, y, mode="sum").backward()
    assert type(raised.value) is WeightedAccumulationError
    assert str(raised.value) == UNARMED_MESSAGE

    model, hook, accumulator = _hooked()
    _hook_step(model, hook, accumulator, _one_rank_batches(), mode="sum")
    result = hook.result
    assert result is not None
    with pytest.raises(WeightedAccumulationError) as raised:
        _loss(model, x, y, mode="sum").backward()
    assert type(raised.value) is WeightedAccumulationError
    assert str(raised.value) == UNARMED_MESSAGE
    assert hook.result is result


def test_flushed_subnormals_in_the_backward_are_refused_taking_nothing(
    one_rank_group: None,
) -> None:
    """Flush-to-zero switched on after arming, in the thread that runs the (CPU) backward, makes
    the hook raise UnsupportedEnvironmentError naming itself and that thread, before it takes
    the accumulator's window."""
    model, hook, accumulator = _hooked()
    loss = _earlier_microbatch(model, accumulator, 2.0)
    hook.last_microbatch_sum(3.0)
    record = accumulator.state_dict()
    with flushing_subnormals():
        with pytest.raises(UnsupportedEnvironmentError) as raised:
            loss.backward()
    assert str(raised.value).startswith(
        "WeightedAllReduceHook (in the backward's thread): the CPU flushes subnormals to zero"
    ), str(raised.value)
    assert hook.result is None
    assert_unchanged(accumulator, record)


def _window_both_ways(
    model: DistributedDataParallel,
    hook: WeightedAllReduceHook,
    accumulator: WeightedGradientsAccumulator,
    counts: tuple[int, ...],
    weights: tuple[float, ...],
    *,
    mode: str,
    last_factor: float = 1.0,
) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None], Any]:
    """One window through the hook on ``model`` and through no_sync + accumulate_* +
    all_reduce_mean + apply_to on a fresh copy with a like accumulator; the last loss is
    multiplied by ``last_factor``.  Returns (hook .grad, helper .grad, helper result)."""
    batches = _one_rank_batches(counts, seed=11)
    state = accumulator.state
    helper_model = DistributedDataParallel(_mlp())
    helper = WeightedGradientsAccumulator(
        dtype=state.dtype, loss_scale=state.loss_scale, fused=state.fused
    )
    with helper_model.no_sync():
        for index, ((x, y), weight) in enumerate(zip(batches, weights, strict=True)):
            factor = last_factor if index == len(batches) - 1 else 1.0
            (factor * _loss(helper_model, x, y, mode=mode)).backward()
            _accumulate(helper, helper_model.module, weight, mode=mode)
    expected = all_reduce_mean(helper.finish_sums())
    expected.apply_to(helper_model.module)

    *earlier, (x_last, y_last) = batches
    with model.no_sync():
        for (x, y), weight in zip(earlier, weights[:-1], strict=True):
            _loss(model, x, y, mode=mode).backward()
            _accumulate(accumulator, model.module, weight, mode=mode)
    loss = last_factor * _loss(model, x_last, y_last, mode=mode)
    (hook.last_microbatch_sum if mode == "sum" else hook.last_microbatch_mean)(weights[-1])
    loss.backward()
    return _grads(model.module), _grads(helper_model.module), expected


@pytest.mark.parametrize(
    ("counts", "weights", "mode", "dtype", "fused", "last_factor"),
    [
        ((3, 11, 4), (3.0, 11.0, 0.0), "sum", torch.float32, False, float("nan")),
        ((3, 11, 4), (3.0, 11.0, 0.0), "mean", torch.float32, False, float("nan")),
        ((3, 11, 1), (3.0, 11.0, 1.0), "sum", torch.float32, False, 1.0),
        ((3, 11, 1), (3.0, 11.0, 1.0), "mean", torch.bfloat16, False, 1.0),
        ((3, 11, 6), (3.0, 11.0, 6.0), "mean", torch.float32, True, 1.0),
        ((6,), (6.0,), "mean", torch.bfloat16, False, 1.0),
        ((6,), (6.0,), "sum", torch.float16, False, 1.0),
        ((3, 11, 4), (3.0, 11.0, 4.0), "sum", torch.float32, False, math.inf),
    ],
    ids=[
        "last-weight-0-nan-gradient-sum",
        "last-weight-0-nan-gradient-mean",
        "last-weight-1-sum",
        "last-weight-1-bfloat16-mean",
        "fused-mean",
        "only-the-last-microbatch-bfloat16-mean",
        "only-the-last-microbatch-float16-sum",
        "overflowing-last-gradient-sum",
    ],
)
def test_one_rank_hook_equals_the_helper_path_at_the_edges(
    one_rank_group: None,
    counts: tuple[int, ...],
    weights: tuple[float, ...],
    mode: str,
    dtype: torch.dtype,
    fused: bool,
    last_factor: float,
) -> None:
    """On one rank the hook's .grad and result equal the helper path's bit for bit (dtype,
    weight and counters included) for a last microbatch of weight 0 (its gradient, NaN here, is
    never read, and it counts as a zero-weight batch), of weight 1, with fused=True means, for a
    window that is only its last microbatch (no pending buffer: zeros in the work dtype), and
    for a last loss scaled by inf; the result's found_inf is the bool True exactly when one of
    its means holds a NaN or ±inf (only in that last case)."""
    model = DistributedDataParallel(_mlp())
    accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=LOSS_SCALE, fused=fused)
    hook = WeightedAllReduceHook(model, accumulator)
    hook_grads, helper_grads, expected = _window_both_ways(
        model, hook, accumulator, counts, weights, mode=mode, last_factor=last_factor
    )
    assert set(hook_grads) == set(helper_grads)
    for name, grad in helper_grads.items():
        assert_bitwise_equal(hook_grads[name], grad, f".grad of {name}")
    result = hook.result
    assert result is not None
    assert (result.weight, result.issued, result.zero_weight, result.loss_scale) == (
        expected.weight,
        expected.issued,
        expected.zero_weight,
        expected.loss_scale,
    )
    assert (result.issued, result.zero_weight) == (len(counts), weights.count(0.0))
    assert set(result.grads) == set(expected.grads)
    for name, grad in expected.grads.items():
        assert_bitwise_equal(result.grads[name], grad, f"result of {name}")
    non_finite = any(not bool(g.isfinite().all()) for g in result.grads.values() if g is not None)
    assert non_finite is (last_factor == math.inf)
    assert result.found_inf is non_finite


def test_one_rank_hook_with_one_bucket_per_parameter(one_rank_group: None) -> None:
    """With a bucket per parameter (DDP rebuilds its buckets after the first window), every
    window's .grad equals the helper path's bit for bit and the result, set once every bucket is
    reduced, holds every parameter."""
    model = DistributedDataParallel(_mlp(), bucket_cap_mb=1e-6)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    hook = WeightedAllReduceHook(model, accumulator)
    counts = ONE_RANK_COUNTS
    for window in range(2):
        hook_grads, helper_grads, expected = _window_both_ways(
            model, hook, accumulator, counts, tuple(map(float, counts)), mode="mean"
        )
        for name, grad in helper_grads.items():
            assert_bitwise_equal(hook_grads[name], grad, f"window {window} .grad of {name}")
        assert hook.result is not None
        assert set(hook.result.grads) == {n for n, _ in model.module.named_parameters()}
        for name, grad in expected.grads.items():
            assert_bitwise_equal(hook.result.grads[name], grad, f"window {window} {name}")
        model.zero_grad(set_to_none=True)  # as after the optimizer's step


def test_the_hook_defaults_to_the_ddp_models_group(one_rank_group: None) -> None:
    """Without ``group``, every collective of a window goes to the DDP model's own process
    group (here a subgroup), not to the default group."""
    group = dist.new_group([0])
    model = DistributedDataParallel(_mlp(), process_group=group)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    hook = WeightedAllReduceHook(model, accumulator)
    with _GroupSpy() as spy:
        _hook_step(model, hook, accumulator, _one_rank_batches(), mode="sum")
    assert hook.result is not None
    kinds = [kind for kind, _ in spy.calls]
    assert "all_gather_object" in kinds and "all_reduce" in kinds, kinds
    assert all(used is group for _, used in spy.calls), spy.calls


class _Bucket:
    """Stands in for a ``dist.GradBucket`` where only its ``gradients()`` are read."""

    def __init__(self, gradients: list[torch.Tensor]) -> None:
        self._gradients = gradients

    def gradients(self) -> list[torch.Tensor]:
        return list(self._gradients)


def test_the_bucket_gradient_is_the_buffer_only_when_its_views_tile_it_in_order() -> None:
    """The hook reads a bucket's gradient from DDP's flat buffer itself (no copy) when the
    bucket's gradients are views tiling that buffer in order, as DDP lays them out; otherwise
    (another order, a gap, or not covering the buffer) from a flat copy in bucket order."""
    buffer = torch.arange(10, dtype=torch.float32)
    first, second, third = buffer[0:2].view(2, 1), buffer[2:5], buffer[5:10].view(1, 5)
    assert _bucket_gradient(_Bucket([first, second, third]), buffer) is buffer  # type: ignore[arg-type]
    for gradients, elements in (
        ([second, first, third], [2, 3, 4, 0, 1, 5, 6, 7, 8, 9]),
        ([first, third], [0, 1, 5, 6, 7, 8, 9]),
        ([first, second], [0, 1, 2, 3, 4]),
    ):
        got = _bucket_gradient(_Bucket(gradients), buffer)  # type: ignore[arg-type]
        assert got.data_ptr() != buffer.data_ptr()
        assert_bitwise_equal(got, torch.tensor(elements, dtype=torch.float32), str(elements))


def test_a_failed_reduction_leaves_ddps_gradient_buffer_unscaled(one_rank_group: None) -> None:
    """The hook never writes DDP's own bucket buffer before the reduction succeeds: when the
    all-reduce fails, the backward raises its error and, with gradient_as_bucket_view=True
    (.grad is a view of that buffer), each .grad still holds this microbatch's plain
    gradient, not the gradient times the mean's weight."""
    model = DistributedDataParallel(_mlp(), gradient_as_bucket_view=True)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=LOSS_SCALE)
    hook = WeightedAllReduceHook(model, accumulator)
    (x, y), *_ = _one_rank_batches((6,), seed=11)
    plain = _mlp()
    _loss(plain, x, y, mode="mean").backward()
    loss = _loss(model, x, y, mode="mean")
    hook.last_microbatch_mean(float(len(y)))

    def failing_all_reduce(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the all-reduce failed")

    original = dist.all_reduce
    dist.all_reduce = failing_all_reduce  # type: ignore[assignment]
    try:
        with pytest.raises(RuntimeError, match="^the all-reduce failed$"):
            loss.backward()
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
    grads = _grads(model.module)
    for name, parameter in plain.named_parameters():
        assert_bitwise_equal(grads[name], parameter.grad, f".grad of {name}")


class _Sent(Exception):
    """Stops a metadata exchange once this rank's report has been captured."""


@pytest.mark.parametrize("differs", ["loss_scale", "dtype", "device_type"])
def test_ranks_disagreeing_on_scale_dtype_or_device_type_raise_alike_in_a_simulated_exchange(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch, differs: str
) -> None:
    """The metadata last_microbatch_sum exchanges carries its window's loss scale, work dtype
    and parameters' device type, so that ranks disagreeing on one of them all raise the same
    error before any gradient moves. In-process, two hooks play ranks 0 and 1 of a simulated
    two-rank group (all_gather_object hands each rank both hooks' reports): when rank 1's
    window differs in one of them, both ranks raise InvalidLossScaleError naming both scales
    and ranks, or ParameterMismatchError listing every rank's dtype or device type (as the
    spawned-rank test checks with real processes)."""
    rank_0 = (torch.float32, LOSS_SCALE, "cpu")  # (work dtype, loss scale, parameters' device)
    rank_1 = {
        "loss_scale": (torch.float32, 2 * LOSS_SCALE, "cpu"),
        "dtype": (torch.bfloat16, LOSS_SCALE, "cpu"),
        "device_type": (torch.float32, LOSS_SCALE, "meta"),
    }[differs]
    expected = {
        "loss_scale": {
            "error": "InvalidLossScaleError",
            "message": f"last_microbatch_sum: loss scale {2 * LOSS_SCALE!r} on rank 1 differs "
            f"from {LOSS_SCALE!r} on rank 0; S must be the same on every rank",
        },
        "dtype": {
            "error": "ParameterMismatchError",
            "message": "last_microbatch_sum: the work dtype differs across ranks: "
            "rank 0: float32, rank 1: bfloat16",
        },
        "device_type": {
            "error": "ParameterMismatchError",
            "message": "last_microbatch_sum: the buffers' device type differs across ranks: "
            "rank 0: cpu, rank 1: meta",
        },
    }[differs]
    hooks = []
    for dtype, loss_scale, device in (rank_0, rank_1):
        model = DistributedDataParallel(_mlp())
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)
        hooks.append(WeightedAllReduceHook(model, accumulator))
        model.module.to(device)
    monkeypatch.setattr(ddp_hook, "_membership", lambda group, *, caller: 2)
    sent: list[object] = []

    def capture(object_list: list[object], obj: object, group: object = None) -> None:
        sent.append(obj)
        raise _Sent

    monkeypatch.setattr(dist, "all_gather_object", capture)
    for hook in hooks:
        with pytest.raises(_Sent):
            hook.last_microbatch_sum(1.0)

    def exchange(object_list: list[object], obj: object, group: object = None) -> None:
        assert len(object_list) == len(sent) == 2
        object_list[:] = sent

    monkeypatch.setattr(dist, "all_gather_object", exchange)
    for rank, hook in enumerate(hooks):
        assert _captured(functools.partial(hook.last_microbatch_sum, 1.0)) == expected, rank


def test_a_mean_that_overflows_the_float16_bucket_is_found(one_rank_group: None) -> None:
    """A float16 model under DDP with a float32 work dtype and a loss scale below 1: every
    gradient of the real backwards is finite in float16, and so is the mean in D (75008), but
    the hook writes it into DDP's float16 bucket, where it is inf. The hook's found_inf speaks of
    what it wrote: True, so the §13 loop skips the window; a small window is found clean."""
    module = nn.Linear(4, 2).half()
    with torch.no_grad():
        module.weight.fill_(1.0)
        module.bias.fill_(0.0)
    model = DistributedDataParallel(module)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=0.5)
    hook = WeightedAllReduceHook(model, accumulator)
    found = []
    for size in (300.0, 1.0):  # d(loss)/d(weight) = S * 250 * size: 37500 finite in float16
        x = torch.full((1, 4), size, dtype=torch.float16)
        with model.no_sync():
            (0.5 * (model(x) * 250).sum()).backward()
            accumulator.accumulate_sum(module, 1.0)
        loss = 0.5 * (model(x) * 250).sum()
        hook.last_microbatch_sum(1.0)
        loss.backward()
        assert hook.result is not None
        grad = module.weight.grad
        assert grad is not None and grad.dtype == torch.float16
        found.append((hook.result.found_inf, bool(torch.isfinite(grad).all())))
        model.zero_grad(set_to_none=True)
    # Two microbatches of 37504 / S / W = 75008: inf in the float16 bucket, found.
    assert found == [(True, False), (False, True)]
