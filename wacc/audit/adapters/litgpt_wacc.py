"""``litgpt+wacc`` and ``litgpt-bf16-mixed+wacc``: litgpt's ``fit``
(:mod:`wacc.audit.adapters.litgpt`: the same Fabric, ``setup`` and loop) with
``wacc_torch.WeightedGradientsAccumulator``, as a user would change ``litgpt/finetune/full.py``:

.. code-block:: python

    acc = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)  # before the loop
    ...
        with fabric.no_backward_sync(model, enabled=True):  # was: enabled=is_accumulating
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            fabric.backward(loss)  # no `/ train.gradient_accumulation_iters(devices, num_nodes)`
        acc.accumulate_mean(model, (targets[..., 1:] != -100).sum())  # the count `loss` averaged
        if not is_accumulating:
            finish_window(acc).apply_to(model)  # Σ_k n_k mean_k / Σ_k n_k, over every rank
            optimizer.step()

Two lines change and three come in: the division by ``gradient_accumulation_iters`` goes,
``no_backward_sync`` is on for every microbatch (below), the accumulator is made before the loop,
``accumulate_mean`` follows each backward with the count ``chunked_cross_entropy``'s mean divided by
(its ``non_masked_elems``: the shifted targets that are not ``-100``; a microbatch without targets
has a mean of 0 and weight 0), and ``finish_window(acc).apply_to(model)`` comes before the step.
``finish_window`` is :func:`wacc_torch.integrations.lightning.finish_window` (Fabric is
Lightning's): ``acc.finish_mean()`` on one device; across ranks every rank's sums and token counts
reduced once by :func:`wacc_torch.all_reduce_mean` (semantics §7), so DDP's own all-reduce must not
run: ``no_backward_sync(model, enabled=True)`` on *every* microbatch (the window's last one too),
where ``fit`` syncs the last.  Every rank then applies the same mean over every rank's tokens.  The
accumulator's dtype is the parameters' (``task.dtype``: float32 under ``32-true`` and
``bf16-mixed``, whose autocast leaves the parameters and their gradients in float32).  No checkpoint
inside a window (``fit`` saves at ``save_interval`` optimizer steps, when the window is empty) and
no float16 path (Fabric's ``16-mixed`` is GPU only), as for ``litgpt``.
"""

from __future__ import annotations

from typing import Any

from wacc.audit.adapters import litgpt
from wacc.audit.protocol import Adapter, LoopTask

__all__ = ["BF16_MIXED", "TRUE_32"]


def _main(fabric: Any, task: LoopTask, train: Any, devices: int, num_nodes: int) -> float:
    """``main``'s setup and ``fit``'s loop with the accumulator (module docstring); returns the
    window's weight (every rank's tokens)."""
    from litgpt.utils import CycleIterator, chunked_cross_entropy

    from wacc_torch import WeightedGradientsAccumulator
    from wacc_torch.integrations.lightning import finish_window

    model, optimizer, loader = litgpt.setup(fabric, task)
    acc = WeightedGradientsAccumulator(dtype=task.dtype, loss_scale=1.0)  # no loss scaler
    weight = 0.0
    state: dict[str, Any] = {"iter_num": 0, "step_count": 0}
    train_iterator = CycleIterator(loader)
    while state["step_count"] < 1:  # fit's loop (L272-294), up to its first optimizer step
        state["iter_num"] += 1
        batch = next(train_iterator)
        input_ids, targets = batch["input_ids"], batch["labels"]
        is_accumulating = (
            state["iter_num"] % train.gradient_accumulation_iters(devices, num_nodes) != 0
        )
        # No DDP all-reduce on any microbatch: finish_window reduces the window once.
        with fabric.no_backward_sync(model, enabled=True):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            fabric.backward(loss)
        acc.accumulate_mean(model, (targets[..., 1:] != -100).sum())
        if not is_accumulating:
            result = finish_window(acc)
            result.apply_to(model)
            weight = result.weight
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
    return weight


def _adapter(name: str, precision: str, title: str) -> Adapter:
    return Adapter(
        name=f"{name}+wacc",
        title=title,
        requires=("litgpt", "lightning"),
        model="plain",
        code_path=f"litgpt/finetune/full.py fit on lightning.Fabric(precision={precision!r}) with "
        "fabric.backward(loss); acc.accumulate_mean(model, (targets[..., 1:] != -100).sum()); "
        "finish_window(acc).apply_to(model) before the step; no_backward_sync(enabled=True) on "
        "every microbatch (across ranks: all_reduce_mean of every rank's sums and counts)",
        checked="litgpt 0.5.13 with lightning 2.6.6 (CPU, run here), this repository's wacc_torch",
        loss_scale=False,
        checkpoint="fit saves at save_interval optimizer steps, never inside a window",
        run=lambda task: litgpt.fit(task, precision, _main),
        fp16="no float16 path on the CPU: litgpt's 16-mixed is Fabric's GPU precision",
        ranks=True,
    )


TRUE_32 = _adapter("litgpt", "32-true", "litgpt fit, 32-true, with WeightedGradientsAccumulator")
BF16_MIXED = _adapter(
    "litgpt-bf16-mixed", "bf16-mixed", "litgpt fit, bf16-mixed, with WeightedGradientsAccumulator"
)
