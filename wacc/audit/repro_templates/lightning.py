"""Lightning's two documented accumulation paths (:mod:`wacc.audit.adapters.lightning`):
``Trainer(accumulate_grad_batches=K)`` and the manual-optimisation recipe, each through
``Trainer.fit`` on a ``LightningModule`` whose ``training_step`` returns the model's own mean
token loss; the resume saves with ``trainer.save_checkpoint`` after ``CHECKPOINT_AFTER`` batches,
stops the run (an exception, as a crash would) and fits a fresh module and ``Trainer`` with
``ckpt_path``.  Across ranks (``AUTOMATIC_RANKS``, ``MANUAL_RANKS``): the same fit with
``devices=N``, ``DDPStrategy(process_group_backend="gloo")`` and ``use_distributed_sampler=False``
(each rank reads its own window in order, as the audit's adapter does)."""

from __future__ import annotations

__all__ = [
    "AUTOMATIC",
    "AUTOMATIC_RANKS",
    "AUTOMATIC_RESUME",
    "IMPORTS",
    "MANUAL",
    "MANUAL_RANKS",
    "MANUAL_RESUME",
    "RESUME_IMPORTS",
]

IMPORTS = ("import tempfile", "import lightning.pytorch as pl")
RESUME_IMPORTS = ("import os",)

_MODULE = """
captured = []
steps = len(batches)


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build_model()
        self.automatic_optimization = {automatic}

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch)["loss"]  # the microbatch's mean token loss
{step}
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Capture(pl.Callback):  # the gradient right before the optimizer step
    def on_before_optimizer_step(self, trainer, module, optimizer):
        captured.append(gradient(module.model))


def make_trainer(callback):
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(), callbacks=[callback],{accumulate}
    )


loader = torch.utils.data.DataLoader(batches, batch_size=1)
"""

_FIT = """
make_trainer(Capture()).fit(Module(), loader)
grads = captured[0]
counted = "each microbatch's own mean"
"""

_RESUME = """

class Stop(Exception):
    pass


class Checkpoint(pl.Callback):  # checkpoint mid-window, then stop the run as a crash would
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx + 1 == CHECKPOINT_AFTER:
            trainer.save_checkpoint(path)
            raise Stop


path = os.path.join(tempfile.mkdtemp(), "mid_window.ckpt")
try:
    make_trainer(Checkpoint()).fit(Module(), loader)
except Stop:
    pass
make_trainer(Capture()).fit(Module(), loader, ckpt_path=path)  # fresh objects, resumed
grads = captured[0]
counted = "each microbatch's own mean"
"""

_AUTOMATIC = (
    _MODULE.replace("{automatic}", "True")
    .replace("{step}", "        return loss\n")
    .replace("{accumulate}", "\n        accumulate_grad_batches=steps,")
)
_MANUAL = (
    _MODULE.replace("{automatic}", "False")
    .replace(
        "{step}",
        """\
        # The manual-optimisation guide's "Gradient Accumulation" recipe, N = K.
        opt = self.optimizers()
        self.manual_backward(loss / steps)
        if (batch_idx + 1) % steps == 0:
            opt.step()
            opt.zero_grad()
""",
    )
    .replace("{accumulate}", "")
)
AUTOMATIC = _AUTOMATIC + _FIT
AUTOMATIC_RESUME = _AUTOMATIC + _RESUME
MANUAL = _MANUAL + _FIT
MANUAL_RESUME = _MANUAL + _RESUME

# Under torchrun: Lightning's TorchElasticEnvironment, no processes spawned; its
# DistributedSampler would shuffle the training set, so each rank reads its own window instead.
_ONE = 'accelerator="cpu", devices=1,'
_DDP = """accelerator="cpu", devices=len(RANK_TOKENS),
        strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        use_distributed_sampler=False,  # each rank reads its own window, in order
       """  # the line goes on with " max_epochs=1, ...": a line of its own
AUTOMATIC_RANKS = AUTOMATIC.replace(_ONE, _DDP)
MANUAL_RANKS = MANUAL.replace(_ONE, _DDP)
assert _DDP in AUTOMATIC_RANKS and _DDP in MANUAL_RANKS  # the one-process options were found
