"""Hugging Face ``accelerate`` loops with token-weighted gradient accumulation (``wacc_torch``).

``accelerator.backward(loss)`` divides every microbatch's loss by ``gradient_accumulation_steps``:
with each microbatch's *mean* loss (``accumulate()``, the documented loop) every microbatch weighs
the same, whatever its token count; the guide's variable-size loop divides token sums by a count
over the *unshifted* labels, one token too many per sequence for a causal LM.
:class:`WaccAccumulation` replaces that backward: ``wacc.backward(loss, tokens)`` runs the
backward of the microbatch's mean loss, hands the gradients to a ``wacc_torch`` accumulator with
weight = ``tokens`` (its targets: :func:`count_tokens`), and on the window's last microbatch
writes the token-weighted mean into ``.grad``, before ``optimizer.step()``::

    wacc = WaccAccumulation(accelerator, model)
    accelerator.register_for_checkpointing(wacc)   # save_state / load_state keep the window
    for batch in dataloader:
        with accelerator.accumulate(model):
            with wacc.autocast():
                loss = model(**batch).loss             # this microbatch's mean
            wacc.backward(loss, count_tokens(batch["labels"], shift=True))
            optimizer.step()
            optimizer.zero_grad()

Inside ``accumulate()`` the window's last microbatch is the one on which accelerate syncs
(``accelerator.sync_gradients``); a loop without it (the guide's variable-size loop) says
``last=`` itself. ``accelerator.save_state`` mid-window saves the pending window (registered for
checkpointing; accelerate also saves its step counter), and ``load_state`` in a fresh process
restores it: the resumed window's gradient is bit for bit the uninterrupted one. Float16
(``mixed_precision="fp16"``): where accelerate has a ``GradScaler`` (a GPU) it scales each backward
and decides at the step, once per window (the accumulator carries its scaled sums unchanged);
where it has none (CPU: there its fp16 switch does nothing), ``wacc.autocast()`` is float16
autocast and a :class:`~wacc_torch.WindowLossScaler` (``loss_scaler=``) scales the losses and
skips an overflowing window whole (every ``.grad`` stays None: the optimizer's step changes
nothing). Across ranks (``accelerate launch`` / ``torchrun``; ``prepare`` wraps the model in DDP):
``WaccAccumulation`` gives the prepared model a DDP communication hook that sends nothing
(:func:`wacc_torch.ddp_hook.local_gradients_hook`), so the backward on which accelerate syncs
leaves every rank's gradients local (DDP never averages them); on the window's last microbatch
each rank's scaled sums and token count are SUM-reduced once (:func:`wacc_torch.all_reduce_mean`:
one metadata exchange, one all-reduce), divided by the loss scale once and by the global count
(semantics §7). Every rank hands its optimizer the same token mean over every rank's targets, and
the float16 scaler decides on those same reduced values: all ranks step or skip together.
:attr:`~WaccAccumulation.window_tokens` is then the global count, and ``save_state`` mid-window
keeps every rank's pending window (accelerate writes one process's custom state: ``state_dict``
gathers all of them, ``load_state_dict`` takes this rank's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from wacc_torch.errors import RecordError
from wacc_torch.integrations._framework import require
from wacc_torch.integrations._token_window import TokenWindow, count_tokens, keep_local
from wacc_torch.scaler import WindowLossScaler

__all__ = ["WaccAccumulation", "count_tokens"]

_BY = "wacc_torch.integrations.accelerate"


class WaccAccumulation:
    """Token-weighted accumulation for an ``accelerate`` loop (module docstring).

    ``accelerator`` and ``model`` are the prepared ones; ``dtype`` is the accumulator's work
    dtype (default float64 for a float64 model, else float32); ``loss_scaler`` a
    :class:`~wacc_torch.WindowLossScaler` for the CPU float16 path (default GradScaler's
    settings). After each window, :attr:`window_tokens` is the count it was divided by.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        loss_scaler: WindowLossScaler | None = None,
    ) -> None:
        require("accelerate", extra="frameworks", integration=_BY)
        if accelerator.distributed_type == "DEEPSPEED":
            raise NotImplementedError("WaccAccumulation does not drive DeepSpeed's engine")
        if accelerator.distributed_type == "FSDP":
            raise NotImplementedError("WaccAccumulation reduces across DDP ranks, not FSDP shards")
        across_ranks = accelerator.num_processes > 1
        fp16 = accelerator.mixed_precision == "fp16"
        own_scaler = fp16 and accelerator.scaler is None
        if loss_scaler is not None and not own_scaler:
            why = "accelerate's GradScaler decides" if fp16 else "mixed_precision is not fp16"
            raise ValueError(f"loss_scaler is for the CPU float16 path only ({why} here)")
        window = TokenWindow(
            dtype=dtype,
            loss_scaler=(loss_scaler or WindowLossScaler()) if own_scaler else None,
            across_ranks=across_ranks,
        )
        if across_ranks:  # checked first (ValueError), then the one change to the model
            keep_local(model)
        self.accelerator = accelerator
        self.model = model
        self.window = window
        self._own_scaler = own_scaler

    @property
    def window_tokens(self) -> float | None:
        """The target count the last finished window was divided by (None before the first)."""
        return self.window.window_tokens

    @property
    def loss_scaler(self) -> WindowLossScaler | None:
        """The window loss scaler of the CPU float16 path (None elsewhere)."""
        return self.window.loss_scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's context: float16 autocast on the CPU float16 path, else
        ``accelerator.autocast()``."""
        if self._own_scaler:
            return torch.autocast(self.accelerator.device.type, dtype=torch.float16)
        return self.accelerator.autocast()

    def backward(
        self, loss: torch.Tensor, tokens: int | float | torch.Tensor, *, last: bool | None = None
    ) -> bool | None:
        """The backward of one microbatch's mean ``loss`` (never divided by the accumulation
        steps), its gradients into the window with weight ``tokens``; on the window's last
        microbatch (``last``; default ``accelerator.sync_gradients``) the token-weighted mean goes
        into ``.grad``. Returns None inside the window, then whether the optimizer may step
        (False: no target in the window, or an overflow the scaler skips)."""
        if self._own_scaler:
            (loss * self.window.loss_scale).backward()
        elif self.accelerator.scaler is not None:  # a GPU's GradScaler: it unscales at the step
            self.accelerator.scaler.scale(loss).backward()
        else:
            loss.backward()
        self.window.add(self.model, tokens)
        if not (self.accelerator.sync_gradients if last is None else last):
            return None
        return self.window.finish(self.model)

    def state_dict(self) -> dict[str, Any]:
        """The pending window and the scaler (``accelerator.register_for_checkpointing``).
        Across ranks accelerate writes one process's custom state for all of them, so this is a
        collective: every rank's window, gathered (``{"ranks": [state of rank 0, ...]}``)."""
        state = self.window.state_dict()
        if not self.window.across_ranks:
            return state
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        return {"ranks": gathered}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the window of ``state`` for this model, bit for bit (across ranks: this
        rank's window of the gathered ones; :class:`~wacc_torch.RecordError` for a state saved
        by another number of ranks)."""
        if self.window.across_ranks or (isinstance(state, Mapping) and "ranks" in state):
            ranks = state.get("ranks") if isinstance(state, Mapping) else None
            world = dist.get_world_size() if self.window.across_ranks else 1
            if not isinstance(ranks, list) or len(ranks) != world:
                saved = len(ranks) if isinstance(ranks, list) else 1
                raise RecordError(
                    f"the window state was saved by {saved} process(es); this run has {world}"
                )
            state = ranks[dist.get_rank() if self.window.across_ranks else 0]
        self.window.load_state_dict(state, self.model)
