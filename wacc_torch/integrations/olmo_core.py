"""Token-weighted accumulation for OLMo-core's ``TransformerTrainModule``: a mixin,
:class:`TokenWeightedTrainModule`, placed before it.

``TransformerTrainModule.train_batch`` (``olmo_core/train/train_module/transformer/
train_module.py``, ai2-olmo-core 3.0.0, L402-404) divides every micro-batch's loss sum by
``batch_num_tokens_for_loss``, the rank's own count, never all-reduced, and its FSDP
(``fully_shard`` with no divide factor) then averages the ranks: every rank weighs ``1/N``
whatever its token count (exact in one process).  The mixin keeps the whole of
``train_batch`` (its batch split, its micro-batch loop, its metrics) and changes what its
backward sees and what reaches ``.grad``:

* ``model_forward``: the model's loss is the micro-batch's loss SUM (``loss_div_factor=None``),
  and its target count (labels not ``label_ignore_index``) is the micro-batch's weight; the
  logged ``ce_loss`` / ``z_loss`` are still divided by the rank's batch count, as before;
* under FSDP (``dp_config.name == "fsdp"``, OLMo-core's default): a
  :class:`wacc_torch.fsdp.FSDPWeightedWindow` on the model, over the data-parallel group.  Its
  ``microbatch(last=...)`` in ``_train_microbatch_context`` turns FSDP's gradient sync off on
  every micro-batch but the last, whose backward reduce-scatters the window's sums once, SUMMED
  over the ranks (divide factor 1); after ``train_batch``, ``finish_mean`` exchanges the token
  counts once and divides every shard by the global count (semantics §7, §8);
* without data parallelism (one process): a
  :class:`~wacc_torch.integrations._token_window.TokenWindow` (``accumulate_mean`` of each
  micro-batch's mean, weighted by its tokens, then ``finish``).

Either way, after ``train_batch`` every ``.grad`` holds the mean token loss's gradient over every
target of every rank's batch, and ``window_tokens`` that count.  A window without a single target
leaves every ``.grad`` None (the optimizer's step changes nothing) where OLMo-core divides by 0;
a ``train_batch`` that raises part-way leaves no pending micro-batch for the next one.
OLMo-core checkpoints between steps only (a window is one ``train_batch``): nothing is pending
there.  Not covered (``ValueError`` naming it on the first ``train_batch``): DDP and HSDP, tensor
and context parallelism (their loss or gradient reductions differ).  Reading: with an
``instance_mask`` OLMo-core counts a masked instance's tokens as zero-loss targets; the mixin
weighs the targets the loss sums over (the semantics' token mean).

Importing this module does not import OLMo-core, and the mixin itself needs only torch (it acts
inside an OLMo-core class); :data:`TokenWeightedTransformerTrainModule` (the mixin on
``TransformerTrainModule``) imports OLMo-core on first use and raises
:class:`~wacc_torch.integrations._framework.MissingFrameworkError` (an ``ImportError``) naming the
``olmo-core`` extra when it is missing.  Checked against ai2-olmo-core 3.0.0 (CPU, gloo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from wacc_torch.errors import ZeroTotalWeightError
from wacc_torch.fsdp import FSDPWeightedWindow
from wacc_torch.integrations._framework import require
from wacc_torch.integrations._token_window import TokenWindow

__all__ = ["TokenWeightedTrainModule", "TokenWeightedTransformerTrainModule"]

TokenWeightedTransformerTrainModule: Any  # declared only: built by __getattr__ on first use
_BUILT: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """``TokenWeightedTransformerTrainModule``, built (and OLMo-core imported) on first use."""
    if name == "TokenWeightedTransformerTrainModule":
        if name not in _BUILT:
            module = require(
                "olmo_core.train.train_module",
                extra="olmo-core",
                integration="wacc_torch.integrations.olmo_core",
            )
            _BUILT[name] = type(
                name,
                (TokenWeightedTrainModule, module.TransformerTrainModule),
                {"__module__": __name__, "__doc__": "The mixin on TransformerTrainModule."},
            )
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TokenWeightedTrainModule:
    """Mixin for OLMo-core's ``TransformerTrainModule`` (module docstring):
    ``class TrainModule(TokenWeightedTrainModule, TransformerTrainModule)``; ``window_tokens``
    is the global target count of the last finished window (None before the first)."""

    window_tokens: float | None = None
    _wacc_window: FSDPWeightedWindow | TokenWindow | None = None
    _wacc_tokens: int | None = None  # the current micro-batch's targets (set by model_forward)
    _wacc_in_batch = False  # inside train_batch: model_forward changes the training loss only

    def _wacc_open(self) -> FSDPWeightedWindow | TokenWindow:
        """The window for this module's model (made on the first batch), after checking that its
        parallelism is one the mixin covers."""
        owner: Any = self
        for enabled in ("tp_enabled", "cp_enabled"):
            if getattr(owner, enabled, False):
                raise ValueError(f"TokenWeightedTrainModule does not cover {enabled}=True")
        model = owner.model
        # OLMo-core's DDP is torch's composable replicate (no DistributedDataParallel to check):
        # its all-reduce averages each micro-batch's gradient inside the backward.
        name = getattr(getattr(owner, "dp_config", None), "name", None)
        if name is not None and name != "fsdp":  # DataParallelType is a StrEnum
            raise ValueError(
                f"TokenWeightedTrainModule covers FSDP data parallelism only, dp_config.name="
                f"{str(name)!r}"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("TokenWeightedTrainModule does not cover a DistributedDataParallel")
        if self._wacc_window is None:
            if isinstance(model, FSDPModule):
                group = getattr(owner, "dp_process_group", None)
                self._wacc_window = FSDPWeightedWindow(model, loss_scale=1.0, group=group)
            else:
                self._wacc_window = TokenWindow()
        return self._wacc_window

    def train_batch(self, batch: dict[str, Any], dry_run: bool = False) -> Any:
        """OLMo-core's ``train_batch``, then the window's token-weighted mean written into
        ``.grad`` (module docstring)."""
        window = self._wacc_open()
        self._wacc_in_batch = True
        try:
            done = super().train_batch(batch, dry_run)  # type: ignore[misc]
        except BaseException:
            # A batch that failed part-way leaves no partial window for the next one to add to.
            self._wacc_window, self._wacc_tokens = None, None
            raise
        finally:
            self._wacc_in_batch = False
        model: nn.Module = getattr(self, "model")  # noqa: B009 (the OLMo-core class's attribute)
        if isinstance(window, TokenWindow):
            window.finish(model)
            self.window_tokens = window.window_tokens
            return done
        try:
            self.window_tokens = window.finish_mean().weight
        except ZeroTotalWeightError:  # no target on any rank: nothing to average, no step
            self._wacc_window = None  # its counters are not reset by the raise: a fresh window
            self.window_tokens = 0.0
            for parameter in model.parameters():
                parameter.grad = None
        return done

    @contextlib.contextmanager
    def _train_microbatch_context(
        self, micro_batch_idx: int, num_micro_batches: int
    ) -> Iterator[None]:
        """OLMo-core's context (FSDP's ``set_is_last_backward``); under FSDP also the window's
        ``microbatch(last=...)``; after the backward, the micro-batch's tokens into the window."""
        window = self._wacc_open()
        last = micro_batch_idx == num_micro_batches - 1
        with super()._train_microbatch_context(micro_batch_idx, num_micro_batches):  # type: ignore[misc]
            if isinstance(window, FSDPWeightedWindow):
                window.microbatch(last=last)
            yield
        tokens, self._wacc_tokens = self._wacc_tokens, None
        if tokens is None:
            raise RuntimeError("a micro-batch's backward ran without its model_forward")
        if isinstance(window, FSDPWeightedWindow):
            window.add_weight(tokens)
        else:
            window.add(getattr(self, "model"), tokens)  # noqa: B009

    def model_forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        """In a training micro-batch (``loss_div_factor`` given): the loss SUM under FSDP, the
        micro-batch's token mean otherwise, its target count kept as its weight; the logged losses
        divided by the rank's batch count as OLMo-core divides them.  Anything else unchanged."""
        forward = super().model_forward  # type: ignore[misc]
        divisor = kwargs.get("loss_div_factor")
        if labels is None or divisor is None or not self._wacc_in_batch:
            return forward(input_ids, labels=labels, **kwargs)
        ignore = getattr(self, "label_ignore_index")  # noqa: B009
        tokens = int((labels != ignore).sum())
        output = forward(input_ids, labels=labels, **{**kwargs, "loss_div_factor": None})
        loss = output.loss
        if isinstance(self._wacc_window, TokenWindow):
            loss = loss / tokens  # TokenWindow.add takes a mean (a 0-target NaN is never read)
        self._wacc_tokens = tokens
        z_loss = None if output.z_loss is None else output.z_loss / divisor
        return output._replace(loss=loss, ce_loss=output.ce_loss / divisor, z_loss=z_loss)
