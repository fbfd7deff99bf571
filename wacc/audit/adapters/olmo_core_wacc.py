"""``olmo-core+wacc``: OLMo-core's ``TransformerTrainModule.train_batch`` (:mod:`wacc.audit.
adapters.olmo_core`, driven the same way: :func:`~wacc.audit.adapters.olmo_core.drive`) with
:class:`wacc_torch.integrations.olmo_core.TokenWeightedTrainModule` placed before it, as a user
would declare the train module:

.. code-block:: python

    from wacc_torch.integrations.olmo_core import TokenWeightedTrainModule

    class TrainModule(TokenWeightedTrainModule, TransformerTrainModule):
        pass

Its own ``train_batch`` runs unchanged: the mixin makes each micro-batch's loss the loss SUM and
keeps its target count; at world size 1 (no data parallelism) a ``TokenWindow`` takes each
micro-batch's mean weighted by its tokens and writes the window's token-weighted mean after
``train_batch``; across ranks (OLMo-core's FSDP, as the ``olmo-core`` row drives it) an
``FSDPWeightedWindow`` turns FSDP's gradient sync off on every micro-batch but the last, whose
reduce-scatter SUMS the ranks' sums (divide factor 1), and ``finish_mean`` divides every shard by
the count of every rank's targets (exchanged once).  The audit must find every window exact at
every world size; its counted tokens are the mixin's ``window_tokens`` (the global count).  No
checkpoint inside a batch and no float16 path, as for ``olmo-core``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from wacc.audit.adapters import olmo_core
from wacc.audit.protocol import LoopRun, LoopTask

__all__ = ["ADAPTER"]


def _window_tokens(module: Any, wrapped: Any) -> float | None:
    """The mixin's count of the window's targets over every rank."""
    tokens: float | None = module.window_tokens
    return tokens


def run(task: LoopTask) -> LoopRun:
    """``olmo_core.drive`` with the mixin on ``TransformerTrainModule`` (module docstring)."""
    from wacc_torch.integrations.olmo_core import TokenWeightedTransformerTrainModule

    return olmo_core.drive(task, TokenWeightedTransformerTrainModule, _window_tokens)


# The facts of the framework's row (requires, model, checked, checkpoint, float16, ranks), with
# this row's own name, code path and run; it weighs by every rank's tokens and fixes nothing.
ADAPTER = replace(
    olmo_core.ADAPTER,
    name="olmo-core+wacc",
    title="OLMo-core TransformerTrainModule with TokenWeightedTrainModule",
    code_path="class TrainModule(TokenWeightedTrainModule, TransformerTrainModule): its "
    "train_batch unchanged; model_forward: the loss sum and the micro-batch's tokens; one process: "
    "TokenWindow (accumulate_mean, finish); FSDP: FSDPWeightedWindow (microbatch(last), "
    "add_weight, finish_mean: one reduce-scatter SUM, / the global token count)",
    run=run,
    weighs_ranks_equally=False,
    fixed_by=None,
    cause=None,
)
