"""A user's own loop (``wacc audit module:function``): its reproducer imports the user's function
as the audit did and calls it with the :class:`wacc.audit.protocol.LoopTask` it ran, written out
as a class of the script (``Task``: the same ``build_model``, ``dataset``, ``num_microbatches``,
``record_gradients`` and ``hook_optimizer``, in ``DTYPE``, with no loss scale and no float16 run;
in a resume script, ``checkpoint_after`` = ``CHECKPOINT_AFTER``).  The script itself imports
torch and the standard library only; the user's module imports what it imports (``LoopRun`` from
wacc, typically)."""

from __future__ import annotations

__all__ = ["IMPORTS", "body"]

IMPORTS = ("import importlib.util", "import sys", "import tempfile", "from pathlib import Path")

_TASK = '''
class WindowDataset(torch.utils.data.Dataset):
    """The window's microbatches, batch size 1, each fetch a fresh copy (LoopTask.dataset)."""

    def __len__(self):
        return len(batches)

    def __getitem__(self, index):
        return {{k: v.clone() for k, v in batches[index].items()}}


class Task:
    """The LoopTask the audit handed the loop ({what})."""

    dtype = DTYPE
    weights_dtype = torch.{weights}
    loss_scale = 1.0
    checkpoint_after = {checkpoint}
    fp16 = False
    learning_rate = 0.0

    def __init__(self):
        self.workdir = Path(tempfile.mkdtemp())
        self.captured = None
        self.steps_seen = 0
        self.models = []

    @property
    def dataset(self):
        return WindowDataset()

    @property
    def num_microbatches(self):
        return len(batches)

    def build_model(self):
        model = build_model()
        self.models.append(model)
        return model

    def record_gradients(self, model):  # the first optimizer step's gradients only
        self.steps_seen += 1
        if self.captured is None:
            self.captured = gradient(model)

    def hook_optimizer(self, optimizer, model):
        optimizer.register_step_pre_hook(lambda *_: self.record_gradients(model))
'''

_CALL = """
{load}
task = Task()
run = loop(task)
if task.captured is None:
    sys.exit("the loop never stepped its optimizer in this window")
grads = task.captured
counted = run.counted_tokens
if counted is None:
    counted = "no count (it never divides by one)"
"""

_FILE = """sys.path.insert(0, {folder!r})  # the loop's file: its folder first, as wacc loads it
found = importlib.util.spec_from_file_location("user_loop", {path!r})
module = importlib.util.module_from_spec(found)
found.loader.exec_module(module)
loop = module.{function}"""

_MODULE = """sys.path.insert(0, {root!r})  # where the audit imported the loop's module from
from {module} import {function} as loop"""


def body(*, module: str | None, path: str, function: str, weights: str, resume: bool) -> str:
    """The script's loop part: ``Task`` and the call.  ``module``: the dotted name the audit
    imported (``path`` is then the folder it was found in), or None for a file (``path``)."""
    if resume:
        what = f"resumed run: checkpoint_after = CHECKPOINT_AFTER, in the audited {weights}"
        checkpoint = "CHECKPOINT_AFTER"
    else:
        what = "float64 run: no checkpoint"
        checkpoint = "None"
    task = _TASK.format(what=what, weights=weights, checkpoint=checkpoint)
    if module is None:
        folder = path.rsplit("/", 1)[0]
        load = _FILE.format(folder=folder, path=path, function=function)
    else:
        load = _MODULE.format(root=path, module=module, function=function)
    return task + _CALL.format(load=load)
