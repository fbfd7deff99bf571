"""``transformers.Trainer`` with ``gradient_accumulation_steps = K`` (the arguments of
:mod:`wacc.audit.adapters.trainer`; ``TrainingArguments.train_sampling_strategy`` is a 5.x
argument, written only when this transformers has it), in one process (``BODY``) and across
ranks (``RANKS``: ``ddp_backend="gloo"``, the global dataset whose shard accelerate hands rank
``r`` is every rank's window interleaved); ``RANK_TOKENS_*``: the same with
``average_tokens_across_devices=False``."""

from __future__ import annotations

import dataclasses

__all__ = ["BODY", "IMPORTS", "RANKS", "RANK_TOKENS_BODY", "RANK_TOKENS_RANKS"]

IMPORTS = (
    "import tempfile",
    "from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments",
)


def _sequential() -> str:
    """The keyword that makes Trainer read the window in order (transformers 5.x), as the adapter
    decides it.  Called on import: only the writer imports this module, after the audit (which
    has imported transformers already when a Trainer row failed)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return ""
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return ' train_sampling_strategy="sequential",' if "train_sampling_strategy" in names else ""


_BODY = """
model = build_model()
received = []  # the num_items_in_batch keyword Trainer hands the model, if any
model.register_forward_pre_hook(
    lambda module, args, kwargs: received.append(kwargs.get("num_items_in_batch")),
    with_kwargs=True,
)
captured = []


class Capture(TrainerCallback):  # the gradient right before optimizer.step()
    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        captured.append(gradient(model))


{dataset}args = TrainingArguments(
    output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=1,
    gradient_accumulation_steps=len(batches), learning_rate=0.0, max_grad_norm=0.0,
    use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no",
    disable_tqdm=True,{sequential} seed=0,{options}
)
trainer = Trainer(
    model=model, args=args, train_dataset={train}, callbacks=[Capture()],
    optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None),
)
trainer.remove_callback(PrinterCallback)  # it prints the run's metrics
trainer.train()
grads = captured[0]
n = received[0]
counted = f"num_items_in_batch {int(n)}" if n is not None else "no num_items_in_batch passed"
"""

_ONE = ""
_GLOBAL = """# The global dataset: Trainer hands rank r of N its items r, r + N, ...
# (BatchSamplerShard), so item k * N + r is rank r's microbatch k: every window, interleaved.
dataset = [every[r][0][k] for k in range(len(batches)) for r in range(len(every))]
"""
_DDP = """
    ddp_backend="gloo",  # torchrun's environment makes it a DDP run: on a CPU, gloo"""
_OWN = """
    average_tokens_across_devices=False,  # each rank divides by its own count"""


def _body(dataset: str, options: str) -> str:
    return (
        _BODY.replace("{dataset}", dataset)
        .replace("{train}", "dataset" if dataset else "batches")
        .replace("{sequential}", _sequential())
        .replace("{options}", options)
    )


BODY = _body(_ONE, "")
RANKS = _body(_GLOBAL, _DDP)
RANK_TOKENS_BODY = _body(_ONE, _OWN)
RANK_TOKENS_RANKS = _body(_GLOBAL, _DDP + _OWN)
