"""The storage log classifies gradient memory as its definition says, on known allocations."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.memory import StorageLog
from wacc_torch import WeightedGradientsAccumulator

# A function whose module is named like the accumulator's package: what it allocates is a
# wacc_torch transient by the frame rule, whatever the caller.
_PROBE_SOURCE = """
def probe(transient, kept):
    scratch = torch.empty(transient)  # created and freed inside the frame
    del scratch
    return torch.empty(kept)
"""


def _probe() -> object:
    namespace: dict[str, object] = {"__name__": "wacc_torch._bench_probe", "torch": torch}
    exec(compile(_PROBE_SOURCE, "<wacc_torch probe>", "exec"), namespace)
    return namespace["probe"]


def test_frame_rule_counts_package_allocations_and_only_those() -> None:
    """Storages made under a wacc_torch frame are gradient memory with their exact lifetimes;
    the caller's own allocations, before and during, are not."""
    probe = _probe()
    log = StorageLog()
    with log:
        outside = torch.empty(1000)  # 4000 bytes, the caller's
        kept = probe(300, 200)  # type: ignore[operator]
        also_outside = torch.empty(50)
    del outside, also_outside
    # Transient 1200 bytes then 800 kept, never live together: peak 1200. All: 4000 + 1200.
    assert log.peak(gradient_only=True) == 300 * 4
    assert log.peak(gradient_only=False) == 1000 * 4 + 300 * 4
    assert [(r.nbytes, r.gradient) for r in log.records] == [
        (4000, False),
        (1200, True),
        (800, True),
        (200, False),
    ]
    assert kept.numel() == 200


def test_marking_classifies_a_live_storage_for_its_whole_lifetime() -> None:
    """A storage marked once (a sampling point) counts from its creation to its release."""
    log = StorageLog()
    with log:
        first = torch.zeros(100)
        second = torch.zeros(300)
        log.mark([second, None])
        del second
        third = torch.zeros(50)
        log.mark([third])
    assert log.peak(gradient_only=True) == 300 * 4  # 300 and 50 never overlap
    assert log.peak(gradient_only=False) == (100 + 300) * 4
    del first, third


def test_real_accumulate_counts_its_buffer_not_the_callers_gradients() -> None:
    """A real accumulate_sum into a new float32 buffer of N elements: that buffer (N * 4 bytes,
    made by wacc_torch) is gradient memory and the caller's gradient is not."""
    elements = 4096
    module = nn.Linear(elements, 1, bias=False)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    log = StorageLog()
    with log:
        grad = torch.ones(1, elements)
        accumulator.accumulate_sum(module, 2, grads={"weight": grad})
    (buffer,) = accumulator._mode.window.pending.values()
    key = buffer.untyped_storage().data_ptr()
    index = log._live[key]
    assert log.records[index].nbytes == elements * 4 and log.records[index].gradient
    assert log.records[0].nbytes == elements * 4 and not log.records[0].gradient  # grad
    assert elements * 4 <= log.peak(gradient_only=True) <= log.peak(gradient_only=False)


def test_plain_backward_gradient_peak_is_the_parameter_bytes() -> None:
    """One backward through a bias-free linear layer, sampled in a post-accumulate-grad hook:
    the gradient peak is the weight's bytes exactly (autograd's other transients are not)."""
    module = nn.Linear(64, 32, bias=False)
    inputs = torch.randn(8, 64)
    log = StorageLog()
    hook = module.weight.register_post_accumulate_grad_hook(lambda p: log.mark([p.grad]))
    try:
        with log:
            module(inputs).square().sum().backward()
    finally:
        hook.remove()
    assert log.peak(gradient_only=True) == module.weight.numel() * 4
    assert log.peak(gradient_only=False) > module.weight.numel() * 4


def test_held_storages_count_from_the_start_until_freed() -> None:
    """A storage the accumulator kept from an earlier window (``held``) is gradient memory live
    from the log's first event: a later transient adds to it, and freeing it ends it; a
    storage already logged is not counted twice."""
    probe = _probe()
    kept = torch.empty(500)  # 2000 bytes, made before the log
    log = StorageLog()
    log.held([kept, kept[:10]])  # a view of the same storage: one record
    with log:
        made = probe(100, 25)  # type: ignore[operator]
        log.held([made])  # logged already: not a second record
        del kept
        later = probe(10, 1)  # type: ignore[operator]
    # One record each: the held storage (once, the view too), then each probe's two.
    assert [r.nbytes for r in log.records] == [2000, 400, 100, 40, 4]
    assert all(r.gradient for r in log.records)
    assert log.records[0].created == 0 and log.records[0].freed is not None  # freed by `del`
    # The peak is the held storage with the first transient (2000 + 400); after the free, 100
    # kept + a 40-byte transient. Without the held record it would be 400.
    assert log.peak(gradient_only=True) == 2000 + 400
    del made, later


def test_the_memory_suite_counts_the_work_tensor_kept_from_the_warm_up() -> None:
    """The buffered mode keeps its work tensor between windows (CPU): the memory suite's logged
    step, run after a warm-up window, still counts it (found by ``held_tensors``)."""
    from benchmarks import memory_suite, step
    from benchmarks.features import held_tensors

    config, device = step.FULL, torch.device("cpu")  # QUICK's tensors all go to an arena
    trainer = step.Trainer(
        "wacc-buffered", step.make_model(config, device), step.make_batches(config, device),
        1.0, False,
    )  # fmt: skip
    trainer.step()
    assert trainer.accumulator is not None
    held = held_tensors(trainer.accumulator)
    assert held, "the warm-up left no work tensor: nothing to count"
    log = memory_suite._logged_step(trainer)
    assert all(r.gradient for r in log.records if r.created == 0)
    assert sum(r.nbytes for r in log.records if r.created == 0) == sum(
        t.untyped_storage().nbytes() for t in held
    )
