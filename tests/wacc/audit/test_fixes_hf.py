"""The ``+wacc`` rows of ``transformers.Trainer`` and ``accelerate`` (``wacc_torch.integrations``),
each run by the audit's own runner on a window its framework's row fails (real Trainer, real
accelerate, real backward): the token mean, the true count, the resume column and the float16
path; and the registry's map from each failing loop to its cause and fix (needs the
``frameworks`` extra)."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from wacc.audit.adapters import ADAPTERS  # noqa: E402
from wacc.audit.runner import run_audit  # noqa: E402
from wacc.audit.windows import build_window  # noqa: E402

REPLAYED = "no mid-window checkpoint; resume replays the window (bit-identical)"
RESTORED = "restored (bit-identical)"
SKIPPED = "skips the whole window (scale 4096 -> 2048)"  # and the clean twin applied: no "; ..."
COMMITTED = Path(__file__).resolve().parents[3] / "reports" / "audit" / "audit.csv"
# The loops whose adapters this integration's modules own (trainer, accelerate, peft, trl).
OWN = ("trainer-", "accelerate", "peft-", "trl-")


@pytest.mark.parametrize(
    ("loop", "window", "resume"),
    [
        ("trainer-hub+wacc", "unequal", REPLAYED),  # the Trainer counted 215 for 211
        ("trainer-bert+wacc", "zero", REPLAYED),  # a zero-target microbatch: its mean is NaN
        ("trainer-t5+wacc", "longtail", REPLAYED),
        ("trainer-plain+wacc", "unequal", REPLAYED),
        ("accelerate+wacc", "zero", RESTORED),
        ("accelerate-variable+wacc", "unequal", RESTORED),
    ],
)
def test_wacc_row_passes_where_its_framework_fails(loop: str, window: str, resume: str) -> None:
    """The ``+wacc`` row hands the optimizer the window's token mean (within the float32 bound,
    deterministically) divided by the true count; its mid-window resume is bit-identical (the
    Trainer's from its step checkpoint, accelerate's restored from save_state mid-window); its
    float16 path skips the overflowing window whole, backs the scale off, and applies the clean
    twin."""
    result = run_audit([ADAPTERS[loop]], [build_window(window)])
    (cell,) = result.cells
    (fact,) = result.facts
    assert cell.verdict == "pass", (cell.semantic_ratio, cell.status)
    assert cell.counted == cell.true_count and cell.deterministic
    assert fact.resume == resume
    assert fact.fp16 == SKIPPED


def test_every_fix_row_is_registered_right_after_its_loop() -> None:
    """Each ``fixed_by`` names a registered ``+wacc`` row that follows its loop in the report;
    the reference loop ``plain`` (a tutorial's DDP loop, no framework) is fixed by wacc_torch's
    own DDP-hook row, ``wacc_torch-sum``, registered after it."""
    names = list(ADAPTERS)
    fixed = {name: a.fixed_by for name, a in ADAPTERS.items() if a.fixed_by is not None}
    assert fixed.pop("plain") == "wacc_torch-sum"
    assert names.index("wacc_torch-sum") > names.index("plain")
    assert ADAPTERS["wacc_torch-sum"].cause is None and ADAPTERS["wacc_torch-sum"].fixed_by is None
    assert fixed  # the map is not empty
    for loop, fix in fixed.items():
        assert fix == f"{loop}+wacc" and names.index(fix) == names.index(loop) + 1
        assert ADAPTERS[fix].model == ADAPTERS[loop].model


def test_every_loop_that_fails_the_committed_audit_has_a_cause() -> None:
    """Each of this integration's loops that fails a window in the committed audit names its
    cause in the framework's source (a file:line) and, unless the cause is not the weighting,
    its fix row."""
    with COMMITTED.open(newline="", encoding="utf-8") as handle:
        failing = {r["loop"] for r in csv.DictReader(handle) if r["verdict"] == "FAIL"}
    own = sorted(loop for loop in failing if loop.startswith(OWN))
    assert own
    for loop in own:
        adapter = ADAPTERS[loop]
        assert adapter.cause is not None and re.search(r"\.(py|md):[0-9]+", adapter.cause), loop
        assert adapter.fixed_by is not None or "no wacc integration" in adapter.cause, loop
