"""torchtune and torchtitan: rows that say why they are not run here (checked 2026-12-03 with
``pip install --dry-run -c .ci/constraints.txt ...`` in an environment holding the ``frameworks``
and ``hf-extras`` extras: torch 2.13.0+cpu, transformers 5.24.0, accelerate 1.16.0, peft 0.21.2,
trl 1.16.0, datasets 5.2.0, huggingface_hub 2.4.0).

* torchtune 0.6.1 installs without touching torch or the extras (the dry-run adds only
  torchdata, omegaconf, tiktoken, sentencepiece, blobfile, kagglehub and their dependencies), but
  does not import: ``import torchtune`` raises "torchao not installed" (torchao is a prerequisite
  it does not declare), and the torchao that installs next to torch 2.13 (0.18.0, with the same
  constraints) has no ``torchao.dtypes.nf4tensor``, which ``torchtune/modules/common_utils.py``
  line 19 imports (``from torchao.dtypes.nf4tensor import NF4Tensor``): ``ModuleNotFoundError``.
  Its recipes' accumulation (``recipes/full_finetune_single_device.py``) cannot be reached.
* torchtitan 0.3.0 pins ``datasets<4.8.0,>=3.6.0``: the dry-run would replace the extras'
  datasets 5.2.0 by 4.7.0, and with it huggingface_hub 2.4.0 by 1.33.0, fsspec, dill and
  multiprocess (older versions that transformers and trl still accept, but not the ones they are
  checked with here), so it is not installed next to the other extras, and its ``Trainer`` (a
  ``torchrun``/FSDP2 training script configured by TOML files) is not driven.
"""

from __future__ import annotations

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["TORCHTITAN", "TORCHTUNE"]


def _never(task: LoopTask) -> LoopRun:
    raise RuntimeError("this loop is never run (Adapter.unsupported)")


TORCHTUNE = Adapter(
    name="torchtune",
    title="torchtune recipes (not run)",
    requires=("torchtune",),
    model="plain",
    code_path="recipes/full_finetune_single_device.py (not reached)",
    checked="torchtune 0.6.1 (pip dry-run, import tried)",
    loss_scale=False,
    checkpoint="not run",
    run=_never,
    fp16="not run",
    unsupported="torchtune 0.6.1 does not import next to torch 2.13: it needs torchao, whose "
    "0.18.0 lacks torchao.dtypes.nf4tensor",
)
TORCHTITAN = Adapter(
    name="torchtitan",
    title="torchtitan Trainer (not run)",
    requires=("torchtitan",),
    model="plain",
    code_path="torchtitan.train.Trainer (not reached)",
    checked="torchtitan 0.3.0 (pip dry-run)",
    loss_scale=False,
    checkpoint="not run",
    run=_never,
    fp16="not run",
    unsupported="torchtitan 0.3.0 pins datasets<4.8: it would downgrade the hf-extras' "
    "datasets 5.2.0 and huggingface_hub 2.4.0",
)
