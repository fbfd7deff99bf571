"""What an audit run produces: a cell per loop × window (:class:`Cell`), the facts per loop
(:class:`LoopFacts`) and the whole result (:class:`AuditResult`), shared by the runner in one
process (:mod:`wacc.audit.runner`) and the runner across ranks (:mod:`wacc.audit.ranks`)."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wacc.audit.protocol import Adapter
from wacc.audit.windows import Window

__all__ = ["DTYPES", "TEST_LOSS_SCALE", "AuditResult", "Cell", "LoopFacts", "describe_error"]

TEST_LOSS_SCALE = 2.0**10
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}  # fmt: skip


@dataclass
class Cell:
    """One loop on one window."""

    adapter: str
    window: str
    status: str = "ok"  # ok | not installed | not importable: … | error: …
    rel_l2: float = math.nan  # run in D vs truth
    max_rel: float = math.nan  # over every nonzero truth element
    max_rel_normal: float = math.nan  # over the meaningful ones (metrics.meaningful_relative_...)
    normal_elements: int = 0  # how many those are
    max_rel_share: float = math.nan  # |T_i| / max |T| at that maximum
    ratio: float = math.nan  # run in D: ‖error‖ / ‖bound(D)‖
    element_ratio: float = math.nan  # run in D: max_i |error_i| / bound_i (wacc_ref error_ratio)
    semantic_rel_l2: float = math.nan  # float64 run vs truth
    semantic_ratio: float = math.nan  # float64 run: ‖error‖ / ‖bound(D)‖  -> the verdict
    semantic_element_ratio: float = math.nan
    counted: float | None = None  # what the loop divided by (None: never divides by a count)
    true_count: int = 0
    finite: bool = True
    deterministic: bool | None = None
    digest: str = ""
    world_size: int = 1  # ranks in the loop's world (--world-size)
    rank_tokens: tuple[int, ...] = ()  # per rank: its window's true target tokens (N > 1)
    rank_counted: tuple[float | None, ...] = ()  # per rank: what its loop divided by (N > 1)
    predicted_rel_l2: float = math.nan  # a loop that weighs ranks equally: its predicted error
    ranks_agree: bool | None = None  # N > 1: every rank hands its optimizer the same gradient
    rank_spread: float = 0.0  # N > 1: max over ranks of rel L2 between its gradient and rank 0's

    @property
    def verdict(self) -> str:
        """``pass`` / ``FAIL`` / the status when it did not run."""
        if self.status != "ok":
            return self.status
        ok = self.finite and self.semantic_ratio <= 1.0 and self.ranks_agree is not False
        return "pass" if ok else "FAIL"


@dataclass
class LoopFacts:
    """Per-loop findings (measured on the first window)."""

    adapter: Adapter
    status: str = "ok"
    version: str = ""
    model: str = ""
    truth_casts: tuple[str, ...] = ()  # the forward to the logits (affects the truth)
    loss_casts: tuple[str, ...] = ()  # the model's own loss (affects the loop's float64 run)
    needs_total: str = ""
    resume: str = ""
    resume_rel_l2: float = math.nan
    resume_after: int | None = None  # microbatches run before the mid-window checkpoint
    loss_scale: str = ""
    fp16: str = ""  # what its float16 path does with a window in which one microbatch overflows
    notes: list[str] = field(default_factory=list)


@dataclass
class AuditResult:
    """Everything one audit found."""

    dtype: str
    windows: list[Window]
    facts: list[LoopFacts]
    cells: list[Cell]
    world_size: int = 1
    # N > 1: per window name, each rank's window (``windows`` holds them joined: the truth's)
    rank_windows: dict[str, tuple[Window, ...]] = field(default_factory=dict)


def describe_error(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"error: {type(exc).__name__}: {first[:120]}{where}"
