"""A test helper: one rank of a two-process torchrun world (gloo, CPU) that trains one window of a
token-level ``nn.Linear`` classifier through an integration across ranks and saves what it
handed its optimizer (``torch.save``; the test reads it back with ``weights_only=True``).

Run as ``python -m torch.distributed.run --nproc-per-node=2 ranks_worker.py MODE OUT`` by
:func:`run_ranks`.  ``MODE``: ``accelerate`` (``WaccAccumulation`` in the documented
``accumulate()`` loop), ``trainer`` (``WaccTrainer.train()`` on the global dataset the Trainer
shards), ``empty`` (``WaccAccumulation`` on a window without a single target on any rank),
``resume`` (``accelerate``, with ``save_state`` after two microbatches, everything rebuilt and
``load_state``), ``zero1`` (``TokenWeightedEngine`` on DeepSpeed's ZeRO 1 engine with
``"gradient_allreduce_op": "sum"``; the gradient read right before the ZeRO optimizer's step with
``safe_get_full_grad``), ``zero1-idle`` (the same, rank 1's window without a single target).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
IN_FEATURES = 8
CLASSES = 5
# Per rank K = 4 microbatches of these token counts: rank 0 holds 211 tokens, rank 1 17 with a
# zero-token microbatch (its mean is NaN: the window must never read it).
RANK_TOKENS = ((1, 7, 200, 3), (5, 0, 9, 3))
WORLD = len(RANK_TOKENS)


def build_model() -> nn.Linear:
    """The same float32 weights on every rank."""
    generator = torch.Generator().manual_seed(2024)
    model = nn.Linear(IN_FEATURES, CLASSES)
    with torch.no_grad():
        model.weight.copy_(torch.randn(CLASSES, IN_FEATURES, generator=generator))
        model.bias.copy_(torch.randn(CLASSES, generator=generator))
    return model


def rank_data(rank: int, *, empty: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s microbatches ``(inputs [n, 8], labels [n])`` in float32 (``empty``: every
    label -100, no target anywhere)."""
    generator = torch.Generator().manual_seed(77 + rank)
    out = []
    for n in RANK_TOKENS[rank]:
        inputs = torch.randn(n, IN_FEATURES, generator=generator)
        labels = torch.randint(0, CLASSES, (n,), generator=generator)
        if rank == 0 and n == 1:
            labels[:] = 0  # the 1-token microbatch sees class 0 alone: equal weights are wrong
        if empty:
            labels[:] = -100
        out.append((inputs, labels))
    return out


class Classifier(nn.Module):
    """A Trainer-style module: ``forward(inputs, labels)`` -> ``{"loss": mean over targets}``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = build_model()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.linear(inputs.reshape(-1, IN_FEATURES))
        return {"loss": F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100)}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name.removeprefix("linear."): None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }


def _prepared() -> tuple[Any, nn.Module, Any, Any]:
    from accelerate import Accelerator

    from wacc_torch.integrations.accelerate import WaccAccumulation

    accelerator = Accelerator(gradient_accumulation_steps=len(RANK_TOKENS[0]), cpu=True)
    model = build_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    wacc = WaccAccumulation(accelerator, model)
    accelerator.register_for_checkpointing(wacc)
    return accelerator, model, optimizer, wacc


def _accelerate(
    rank: int, *, empty: bool = False, resume_after: int | None = None
) -> dict[str, Any]:
    accelerator, model, optimizer, wacc = _prepared()
    seen: dict[str, Any] = {}
    steps = []
    for index, (inputs, labels) in enumerate(rank_data(rank, empty=empty)):
        if index == resume_after:  # save mid-window, rebuild everything, restore
            directory = str(Path(os.environ["WORKER_OUT"]) / "state")
            accelerator.save_state(directory)
            accelerator, model, optimizer, wacc = _prepared()
            accelerator.load_state(directory)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(inputs), labels, ignore_index=-100)
            steps.append(wacc.backward(loss, int((labels != -100).sum())))
            if steps[-1] is not None:
                seen = _grads(accelerator.unwrap_model(model))
            optimizer.step()
            optimizer.zero_grad()
    return {"grads": seen, "steps": steps, "window_tokens": wacc.window_tokens}


def _trainer(rank: int) -> dict[str, Any]:
    from transformers import PrinterCallback, TrainingArguments

    from wacc_torch.integrations.transformers import WaccTrainer

    data = [rank_data(r) for r in range(WORLD)]
    # The one global dataset the Trainer shards: rank r reads global rows r, r + N, ...
    rows = [
        {"inputs": data[r][k][0], "labels": data[r][k][1]}
        for k in range(len(RANK_TOKENS[0]))
        for r in range(WORLD)
    ]
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, Any] = {}
    optimizer.register_step_pre_hook(lambda *_: seen.update(_grads(model)))
    args = TrainingArguments(
        output_dir=str(Path(os.environ["WORKER_OUT"]) / f"trainer{rank}"),
        per_device_train_batch_size=1, gradient_accumulation_steps=len(RANK_TOKENS[0]),
        max_steps=1, learning_rate=0.0, max_grad_norm=0.0, use_cpu=True, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, ddp_backend="gloo",
        train_sampling_strategy="sequential",
    )  # fmt: skip
    trainer = WaccTrainer(model=model, args=args, train_dataset=rows, shift_labels=False,
                          optimizers=(optimizer, None))  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return {"grads": seen, "steps": [], "window_tokens": trainer.window_tokens}


def _zero1(rank: int, *, idle: bool) -> dict[str, Any]:
    from wacc.audit.adapters.deepspeed import _world
    from wacc_torch.integrations.deepspeed import TokenWeightedEngine

    with _world(torch.float32, WORLD) as deepspeed:
        model = build_model()
        config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False, "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
            "gradient_allreduce_op": "sum",
        }  # fmt: skip
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        seen: dict[str, Any] = {}
        zero_step = engine.optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:  # after ZeRO 1's reduce, before its step
            full = deepspeed.utils.safe_get_full_grad
            seen.update({n: full(p).detach().clone() for n, p in model.named_parameters()})
            return zero_step(*args, **kwargs)

        engine.optimizer.step = step
        weighted = TokenWeightedEngine(engine)
        for inputs, labels in rank_data(rank, empty=idle and rank == 1):
            loss = F.cross_entropy(engine(inputs), labels, ignore_index=-100)
            weighted.backward(loss, tokens=int((labels != -100).sum()))
        result = weighted.step()
    return {"grads": seen, "steps": [], "window_tokens": result.weight}


def _main(mode: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    os.environ["WORKER_OUT"] = str(out)
    if mode == "trainer":
        saved = _trainer(rank)
    elif mode.startswith("zero1"):
        saved = _zero1(rank, idle=mode == "zero1-idle")
    else:
        saved = _accelerate(
            rank, empty=mode == "empty", resume_after=2 if mode == "resume" else None
        )
    gc.collect()  # the loop's cycles (DDP's) go now: at interpreter exit gloo can abort
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch.save(saved, out / f"rank{rank}.pt")


def run_ranks(mode: str, *, timeout: float = 300) -> list[dict[str, Any]]:
    """Every rank's saved result of a two-rank torchrun world in ``mode`` (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="wacc-integration-ranks-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
            "--standalone", __file__, mode, tmp,  # the agent binds its store's port itself
        ]  # fmt: skip
        done = subprocess.run(
            command, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise AssertionError(f"world exited {done.returncode}:\n{done.stderr[-6000:]}")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]))
