"""User loops (``module:function``, the protocol of ``wacc.audit.protocol``) used by the tests."""

from __future__ import annotations

import os

import torch

from wacc.audit.protocol import LoopRun, LoopTask


def equal_weighting(task: LoopTask) -> LoopRun:
    """The pixparse pattern without timm: each microbatch's mean loss / accum_steps."""
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    task.hook_optimizer(optimizer, model)
    data = task.dataset
    for index in range(len(data)):
        batch = data[index]
        loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])["loss"]
        (loss / task.num_microbatches).backward()
    optimizer.step()
    return LoopRun(counted_tokens=None)


def raises(task: LoopTask) -> LoopRun:
    """A loop that fails: the audit must report it, not crash."""
    raise RuntimeError("this loop is broken on purpose")


def never_steps(task: LoopTask) -> LoopRun:
    """A loop that runs backward but never steps its optimizer."""
    model = task.build_model()
    batch = task.dataset[0]
    model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])["loss"].backward()
    return LoopRun(counted_tokens=None)


def fp16_no_scaler(task: LoopTask) -> LoopRun:
    """Float16 autocast and no loss scaler: an overflow reaches the optimizer."""
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    task.hook_optimizer(optimizer, model)
    data = task.dataset
    for index in range(len(data)):
        batch = data[index]
        with torch.autocast("cpu", dtype=torch.float16, enabled=task.fp16):
            loss = model(input_ids=batch["input_ids"][None], labels=batch["labels"][None])["loss"]
        (loss / task.num_microbatches).backward()
    optimizer.step()
    return LoopRun(counted_tokens=None)


fp16_no_scaler.fp16 = True  # type: ignore[attr-defined]


LEAK = "WACC_TEST_LEAKED_BY_A_LOOP"


def leaves_state(task: LoopTask) -> LoopRun:
    """``equal_weighting``, leaving global state behind as frameworks do (an environment
    variable and torch's default dtype)."""
    run = equal_weighting(task)
    os.environ[LEAK] = "1"
    torch.set_default_dtype(torch.float64)
    return run


def needs_clean_state(task: LoopTask) -> LoopRun:
    """``equal_weighting``, refusing to run after a loop left its state in this process."""
    if LEAK in os.environ or torch.get_default_dtype() != torch.float32:
        raise RuntimeError("another loop's state is in this process")
    return equal_weighting(task)


def dies(task: LoopTask) -> LoopRun:
    """A loop that takes its process down (a native crash, a launcher's exit)."""
    print("the framework gave up here", flush=True)
    os._exit(3)
