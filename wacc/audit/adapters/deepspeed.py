"""DeepSpeed's engine on the CPU (gloo; one process at world size 1), ZeRO stage 0, the loop its
"Getting Started" guide writes (``for step, batch in enumerate(data_loader): loss =
model_engine(batch); model_engine.backward(loss); model_engine.step()``) on the plain causal LM
(whose forward returns its own *mean* token loss):

.. code-block:: python

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=SGD(...), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": K,
        "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0})
    for batch in window:
        loss = engine(**batch)["loss"]
        engine.backward(loss)
        engine.step()

``engine.backward`` divides each microbatch's mean by ``gradient_accumulation_steps``
(``deepspeed/runtime/engine.py``, ``DeepSpeedEngine.backward``: ``loss = loss /
self.gradient_accumulation_steps() if scale_wrt_gas else loss``; ``_scale_loss_by_gas`` is the
same division for the pipeline engine) and ``engine.step`` steps the client optimizer only on the
accumulation boundary (``is_gradient_accumulation_boundary``: ``(self.micro_steps + 1) %
self.gradient_accumulation_steps() == 0``), after the boundary backward's all-reduce
(``allreduce_gradients`` → ``buffered_allreduce_fallback``, a mean over the one rank: exact).
Every microbatch weighs the same whatever its token count; a microbatch without targets has a
``0/0`` mean.  The gradient is read in a ``torch.optim`` step pre-hook on the client ``SGD``
(``lr=task.learning_rate``): ZeRO 0 in float32 uses it as ``engine.optimizer`` itself.  The config
sets ``"gradient_clipping": 0.0``: DeepSpeed's default is 1.0 (``runtime/constants.py``,
``GRADIENT_CLIPPING_DEFAULT = 1.0``), and ``_take_model_step`` clips (``clip_fp32_gradients``)
before the optimizer's step, so the audit would read a clipped gradient (on ``unequal``, whose
equal-weighted gradient has norm 1.2, every element scaled by 1/1.2: 7.36 instead of 8.9).

On the CPU: ``DS_ACCELERATOR=cpu`` picks ``CPU_Accelerator``, whose communication backend is
gloo without Intel's ``oneccl_bindings_for_pytorch`` (``accelerator/cpu_accelerator.py``:
"fallback to gloo if oneccl_binding_for_pytorch is not installed").  The run sets
``MASTER_ADDR``/``MASTER_PORT`` (a free port)/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` for
``deepspeed.initialize``'s ``init_distributed`` and restores them, destroys the process group it
created (``deepspeed.comm.destroy_process_group``) and puts back ``sys.excepthook`` (which
``torch.distributed.init_process_group`` wraps to prefix ``[rank0]``) and the accelerator that
was set before.  Building ``comm.torch.TorchBackend`` JIT-compiles DeepSpeed's shared-memory
all-reduce (``build_shm_op``: ``deepspeed_shm_comm``, a C++ extension, even when installed with
``DS_BUILD_OPS=0``): the first run on a machine spends about 1.5 min in the compiler (2 cores),
later ones load it from torch's extension cache.  DeepSpeed's log lines and prints are kept out of
the caller's output.

The float64 copy: the engine refuses float64 gradients in its all-reduce
(``engine.py``, ``split_half_float_double_sparse``: ``assert t.dtype in supported_types,
f"attempting to reduce an unsupported grad type: {t.dtype}"``; ``CPU_Accelerator.
supported_dtypes`` is float32, bfloat16 and float16 where the CPU has it).  For the float64 copy
only, the engine runs on a ``CPU_Accelerator`` whose ``supported_dtypes`` adds float64, set
through DeepSpeed's public ``deepspeed.accelerator.set_accelerator``: the division, the
accumulation and the step are DeepSpeed's unchanged, and the audited float32 run uses the stock
accelerator (its error is the float64 run's to float32 rounding: tested).  The float64 copy is
still rounded to float32 once: the all-reduce casts each gradient to ``communication_data_type``
and back (``allreduce_bucket``: ``tensor.to(self.communication_data_type)``, float32 unless fp16 or
bf16; the config takes only ``fp16``/``bf16``/``fp32``), so its ``err/bound`` on the equal control
is float32's last rounding (about 0.09), not 0.

Checkpoint: ``engine.save_checkpoint(dir)`` after ``c`` microbatches, then a fresh model, optimizer
and engine, ``engine.load_checkpoint(dir)`` and the remaining microbatches.  The checkpoint
(``_common_checkpoint_state``) holds the module, the optimizer's state, ``global_steps``,
``global_samples`` and ``skipped_steps``, but neither ``.grad`` nor ``micro_steps``: the resumed
engine counts micro-steps from 0 again, so its boundary is ``K`` microbatches after the load and
only ``K - c`` remain — it never steps in the window, and the adapter says so (a row error: the
pending gradient is lost and the boundary moves by ``c`` microbatches).

Loss scaling: DeepSpeed's fixed scale is ``"fp16": {"enabled": true, "loss_scale": S}`` (``0``:
dynamic, ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``), which casts the model to
float16 (master weights in ``FP16_UnfusedOptimizer`` for a client optimizer): no float32 run takes
a fixed scale, so the column is "not settable".  ``fp16.enabled`` is refused on a CPU without
oneDNN float16 (``engine.py``, ``_do_sanity_check``: ``if self.fp16_enabled() and not
get_accelerator().is_fp16_supported(): raise ValueError("Type fp16 is not supported on your
device.")``; ``CPU_Accelerator.is_fp16_supported`` is ``torch.ops.mkldnn.
_is_mkldnn_fp16_supported()``, AVX512-FP16 or AMX-FP16).  Float16 (``task.fp16``): DeepSpeed's
other float16 switch, ``"torch_autocast": {"enabled": true, "dtype": "fp16"}``: float32 parameters,
the forward under ``torch.autocast(cpu, float16)`` (``runtime/torch_autocast.py``,
``autocast_if_enabled``) and, at ZeRO 0, the engine's own dynamic ``torch.amp.GradScaler``
(``engine.torch_autocast_z0_gradscaler``: ``engine.backward`` scales with it, ``_take_model_step``
steps through it).  Checked against deepspeed 0.19.8 (CPU, torch 2.13.0, run here; the
``deepspeed`` extra).

Across ranks (``task.world_size > 1``, a torchrun world; ``deepspeed`` ZeRO 0, ``deepspeed-zero1``
ZeRO 1): the same loop, ``deepspeed.initialize``'s ``init_distributed`` reading the torchrun
environment as torchrun set it (nothing overridden), gloo from the CPU accelerator.  ZeRO 1 takes
the client ``SGD`` only with ``"zero_allow_untested_optimizer": true`` (``engine.py:2300``: SGD is
not on ZeRO's tested list) and steps it on its flat fp32 partition, so its gradient is read in the
loop instead, right after the boundary ``engine.backward`` and before ``engine.step``: every
parameter's full gradient through DeepSpeed's public ``deepspeed.utils.safe_get_full_grad``
(``utils/tensor_fragment.py:208``: each rank's reduced fragment, all-reduced).  What decides the
weighting across ranks (deepspeed 0.19.8, run here): ``engine.py:3413`` (``backward``: ``loss /
gradient_accumulation_steps()``) on each microbatch's *mean*; ``engine.py:3073-3095``
(``allreduce_gradients``: communication only on the boundary); ZeRO 0 ``engine.py:3963-3966``
(``buffered_allreduce_fallback``: ``values.mul_(1. / dp_world_size)`` around the all-reduce,
``gradient_allreduce_op`` "mean" by default), ZeRO 1 ``runtime/zero/stage_1_and_2.py:958``
(``reduce_gradients``) → ``gradient_reduction_w_predivide`` (``stage_1_and_2.py:1485-1508``:
``div_(dp_world_size)``, all-reduce).  Every microbatch of every rank weighs 1 / (N K).  Measured
at N = 2 (ranks of 211 and 17 tokens, one with a zero-token microbatch), the float64 run: ZeRO 0
rel L2 4.7260845251, ZeRO 1 4.7260845384, against 4.7260845201 predicted from the microbatch counts
(agreement 4e-8 and 5e-8: the reduce's float32 ``communication_data_type``, and for ZeRO 1 the
float32 buffer ``get_full_hp_grad`` assembles the full gradient in, ``tensor_fragment.py:107``);
a FAIL.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from wacc.audit.protocol import Adapter, LoopRun, LoopTask

__all__ = ["ADAPTER", "ZERO1", "DeepSpeedAdapter"]

# What a run sets; torch._dynamo, which the engine imports, writes TORCHINDUCTOR_CACHE_DIR.
_ENV = ("DS_ACCELERATOR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
        "TORCHINDUCTOR_CACHE_DIR")  # fmt: skip
_LOGGERS = ("DeepSpeed", "torch.distributed")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's log lines (its own stdout handler), prints and warnings kept out of the
    caller's output; the logger levels and warning filters restored afterwards."""
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set, every name of ``_ENV`` restored afterwards."""
    saved = {name: os.environ.get(name) for name in _ENV}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _cpu_accelerator(dtype: torch.dtype) -> Any:
    """DeepSpeed's ``CPU_Accelerator``; for a float64 run one that lets float64 gradients through
    the all-reduce (module docstring)."""
    cpu: Any = importlib.import_module("deepspeed.accelerator.cpu_accelerator").CPU_Accelerator
    if dtype != torch.float64:
        return cpu()

    class Float64CPU(cpu):
        def supported_dtypes(self) -> list[torch.dtype]:
            return [*super().supported_dtypes(), torch.float64]

    return Float64CPU()


@contextlib.contextmanager
def _world(dtype: torch.dtype, world_size: int = 1) -> Iterator[Any]:
    """A gloo world on DeepSpeed's CPU accelerator; yields the ``deepspeed`` module: one process
    at world size 1, else the torchrun world this rank is in (its environment read by
    ``init_distributed`` as torchrun set it).  Everything it sets is put back (module
    docstring)."""
    hook = sys.excepthook
    with _quiet(), _environment(DS_ACCELERATOR="cpu"):
        deepspeed: Any = importlib.import_module("deepspeed")
        accelerators: Any = importlib.import_module("deepspeed.accelerator")
        before = accelerators.get_accelerator()
        # A torch_autocast engine sets these module globals for good, and every later ZeRO
        # optimizer in the process reads them (stage_1_and_2.py:608-612: a GradScaler of its own
        # even without torch_autocast): put back too.
        autocast: Any = importlib.import_module("deepspeed.runtime.torch_autocast")
        autocast_state = (autocast.TORCH_AUTOCAST_INITIALIZED, autocast.TORCH_AUTOCAST_DTYPE)
        created = not torch.distributed.is_initialized()
        port = str(_free_port())
        alone = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1",
                     LOCAL_RANK="0")  # fmt: skip
        try:
            accelerators.set_accelerator(_cpu_accelerator(dtype))
            with _environment(**(alone if world_size == 1 else {})):
                yield deepspeed
        finally:
            if created and torch.distributed.is_initialized():
                deepspeed.comm.destroy_process_group()
            accelerators.set_accelerator(before)
            autocast.TORCH_AUTOCAST_INITIALIZED, autocast.TORCH_AUTOCAST_DTYPE = autocast_state
            sys.excepthook = hook


def _engine(
    task: LoopTask, deepspeed: Any, stage: int = 0, **options: Any
) -> tuple[Any, torch.nn.Module]:
    """A fresh model, client ``SGD`` and engine (module docstring) at ZeRO ``stage``;
    ``options`` go into the config as they are."""
    model = task.build_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=task.learning_rate)
    if stage == 0:  # ZeRO 1 steps the client SGD on its flat partition: read in the loop instead
        task.hook_optimizer(optimizer, model)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": task.num_microbatches,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed's default 1.0 would clip the gradient read here
    }
    if stage > 0:  # ZeRO refuses a client optimizer off its tested list (SGD) without it
        config["zero_allow_untested_optimizer"] = True
    if task.fp16:
        config["torch_autocast"] = {"enabled": True, "dtype": "fp16"}
    config.update(options)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, model


def _scale(engine: Any) -> float | None:
    """The scale of the ``torch_autocast`` ``GradScaler``: the engine's at ZeRO 0, the ZeRO
    optimizer's at ZeRO 1 (``stage_1_and_2.py`` ``torch_autocast_gradscaler``); None without one."""
    scaler = engine.torch_autocast_z0_gradscaler
    if scaler is None:
        scaler = getattr(engine.optimizer, "torch_autocast_gradscaler", None)
    return None if scaler is None else float(scaler.get_scale())


class _FullGradients(torch.nn.Module):
    """The model's parameters, each carrying the full gradient ZeRO 1 holds partitioned
    (``deepspeed.utils.safe_get_full_grad``: every rank's fragment, all-reduced), under the model's
    parameter names: what ``task.record_gradients`` reads."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        full: Any = importlib.import_module("deepspeed.utils").safe_get_full_grad
        self.held = [(name, p, full(p)) for name, p in model.named_parameters()]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """``(name, parameter)`` with ``.grad`` the full gradient (copies: the model's own
        parameters are left alone)."""
        for name, parameter, grad in self.held:
            copy = torch.nn.Parameter(parameter.detach().clone())
            copy.grad = None if grad is None else grad.detach().clone().to(parameter.dtype)
            yield name, copy


def run(task: LoopTask) -> LoopRun:
    """ZeRO 0: ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` per microbatch
    (module docstring)."""
    return _run(task, stage=0)


def run_zero1(task: LoopTask) -> LoopRun:
    """The same loop with ``"zero_optimization": {"stage": 1}``."""
    return _run(task, stage=1)


def _run(task: LoopTask, *, stage: int) -> LoopRun:
    data = task.dataset
    resumed_at = 0
    with _world(task.dtype, task.world_size) as deepspeed:
        engine, model = _engine(task, deepspeed, stage)
        before = _scale(engine)
        for index in range(len(data)):
            if task.checkpoint_after == index:
                directory = str(task.workdir / "deepspeed_checkpoint")
                engine.save_checkpoint(directory)
                del engine
                engine, model = _engine(task, deepspeed, stage)
                engine.load_checkpoint(directory)
                resumed_at = engine.micro_steps
            batch = {k: v[None] for k, v in data[index].items()}
            loss = engine(**batch)["loss"]
            engine.backward(loss)
            if stage > 0 and engine.is_gradient_accumulation_boundary():
                # The boundary backward has reduced the partitions; step() consumes them next.
                task.record_gradients(_FullGradients(model))
            engine.step()
        after = _scale(engine)
    if task.checkpoint_after is not None and task.steps_seen == 0:
        k, c = task.num_microbatches, task.checkpoint_after
        raise RuntimeError(
            f"never steps after load_checkpoint: micro_steps restarts at {resumed_at} (not "
            f"checkpointed), boundary {k} microbatches on, {k - c} remain"
        )
    if not task.fp16:
        return LoopRun(counted_tokens=None)
    if before is None or after is None:
        return LoopRun(counted_tokens=None, note="no torch_autocast GradScaler")
    return LoopRun(counted_tokens=None, loss_scales=(before, after))


class DeepSpeedAdapter(Adapter):
    """An :class:`Adapter` whose import check runs as the audit runs DeepSpeed: importing it picks
    its accelerator (``DS_ACCELERATOR=cpu``) and logs that to stdout otherwise."""

    def unavailable(self) -> str | None:
        """:meth:`Adapter.unavailable`, quiet and on the CPU accelerator."""
        with _quiet(), _environment(DS_ACCELERATOR="cpu"):
            return super().unavailable()


ADAPTER = DeepSpeedAdapter(
    name="deepspeed",
    title="DeepSpeed engine, ZeRO 0, gradient_accumulation_steps=K",
    requires=("deepspeed",),
    model="plain",
    code_path="deepspeed.initialize(ZeRO 0, gradient_clipping=0); engine.backward: "
    "loss / gradient_accumulation_steps; engine.step on the boundary",
    checked="deepspeed 0.19.8 (CPU, gloo, run here)",
    loss_scale=False,
    checkpoint=None,
    run=run,
    fp16=None,
    fixed_by="deepspeed+wacc",
    cause="deepspeed/runtime/engine.py:3413 (deepspeed 0.19.8, DeepSpeedEngine.backward) divides "
    "each microbatch's loss by gradient_accumulation_steps (`loss = loss / "
    "self.gradient_accumulation_steps() if scale_wrt_gas else loss`): every microbatch weighs "
    "1/K whatever its token count.",
    ranks=True,
)
ZERO1 = DeepSpeedAdapter(
    name="deepspeed-zero1",
    title="DeepSpeed engine, ZeRO 1, gradient_accumulation_steps=K",
    requires=("deepspeed",),
    model="plain",
    code_path="deepspeed.initialize(ZeRO 1, gradient_clipping=0); engine.backward: "
    "loss / gradient_accumulation_steps; partitioned reduce on the boundary; engine.step",
    checked="deepspeed 0.19.8 (CPU, gloo, run here)",
    loss_scale=False,
    checkpoint=None,
    run=run_zero1,
    fp16=None,
    ranks=True,
    fixed_by="deepspeed-zero1+wacc",
    cause="deepspeed/runtime/engine.py:3413 (deepspeed 0.19.8, DeepSpeedEngine.backward) divides "
    "each microbatch's loss by gradient_accumulation_steps, as at ZeRO 0, and ZeRO 1's reduce "
    "(runtime/zero/stage_1_and_2.py:1485-1508, gradient_reduction_w_predivide) averages the "
    "ranks: every microbatch of every rank weighs 1/(N K).",
)
