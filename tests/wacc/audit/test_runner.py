"""The audit on the loops that need no extra: plain PyTorch, wacc_torch, user loops."""

from __future__ import annotations

import math

import pytest

from wacc.audit.adapters import ADAPTERS
from wacc.audit.protocol import Adapter, user_adapter
from wacc.audit.runner import AuditResult, Cell, run_audit
from wacc.audit.windows import WINDOW_NAMES, build_window

CORRECT = ("plain", "wacc_torch-mean", "wacc_torch-sum")
EQUAL_WEIGHTING = "tests.wacc.audit.loops:equal_weighting"


@pytest.fixture(scope="module")
def result() -> AuditResult:
    loops = [ADAPTERS[n] for n in CORRECT] + [user_adapter(EQUAL_WEIGHTING)]
    return run_audit(loops, [build_window(w) for w in WINDOW_NAMES])


def _cell(result: AuditResult, loop: str, window: str) -> Cell:
    (cell,) = [c for c in result.cells if c.adapter == loop and c.window == window]
    return cell


@pytest.mark.slow
@pytest.mark.parametrize("loop", CORRECT)
@pytest.mark.parametrize("window", WINDOW_NAMES)
def test_correct_loops_pass_every_window(result: AuditResult, loop: str, window: str) -> None:
    """plain PyTorch and wacc_torch: within the float32 bound in float64, true count, finite,
    deterministic."""
    cell = _cell(result, loop, window)
    assert cell.status == "ok" and cell.verdict == "pass"
    assert cell.semantic_ratio <= 1.0
    assert cell.counted == cell.true_count == build_window(window).total_targets
    assert cell.finite and cell.deterministic


@pytest.mark.slow
def test_equal_weighting_flagged_on_unequal_and_passes_equal(result: AuditResult) -> None:
    """The `loss / accum_steps` loop fails the unequal window and passes the 4x64 control."""
    unequal = _cell(result, EQUAL_WEIGHTING, "unequal")
    assert unequal.verdict == "FAIL" and unequal.semantic_ratio > 1.0
    assert unequal.counted is None
    assert _cell(result, EQUAL_WEIGHTING, "equal").verdict == "pass"


@pytest.mark.slow
def test_resume_and_loss_scale_facts(result: AuditResult) -> None:
    """wacc_torch resumes bit-identically; the plain loop's checkpoint loses the pending
    gradient (measured error is large); both divide a fixed loss scale out once."""
    facts = {f.adapter.name: f for f in result.facts}
    for name in ("wacc_torch-mean", "wacc_torch-sum"):
        assert facts[name].resume == "restored (bit-identical)"
        assert facts[name].needs_total.startswith("no")
    assert facts["plain"].resume == "pending gradient lost"
    unequal = _cell(result, "plain", "unequal")
    assert facts["plain"].resume_rel_l2 > 1e6 * unequal.rel_l2
    assert facts["plain"].needs_total == "yes"
    for name in CORRECT:
        assert facts[name].loss_scale == "divided out once (bit-identical)"
    assert facts[EQUAL_WEIGHTING].resume.startswith("n/a")


def test_missing_and_broken_loops_are_rows_not_crashes() -> None:
    """A loop whose package is absent says "not installed"; one that raises or never steps
    is an error row; the audit goes on."""
    absent = Adapter(
        name="absent", title="absent", requires=("wacc_no_such_package",), model="plain",
        code_path="-", checked="-", loss_scale=False, checkpoint="-", run=ADAPTERS["plain"].run,
    )  # fmt: skip
    loops = [absent, user_adapter("tests.wacc.audit.loops:raises"),
             user_adapter("tests.wacc.audit.loops:never_steps"), ADAPTERS["plain"]]  # fmt: skip
    result = run_audit(loops, [build_window("unequal")])
    statuses = [c.status for c in result.cells]
    assert statuses[0] == "not installed"
    assert statuses[1].startswith("error: RuntimeError: this loop is broken on purpose")
    assert statuses[2].startswith("error: RuntimeError: the loop never stepped")
    assert statuses[3] == "ok" and math.isfinite(result.cells[3].rel_l2)


def test_user_adapter_rejects_bad_specs() -> None:
    """module:function that is malformed, unimportable or not callable is a ValueError naming it."""
    for spec in ("nocolon", "no_such_module_xyz:f", "tests.wacc.audit.loops:nothing"):
        with pytest.raises(ValueError, match=spec.split(":")[0]):
            user_adapter(spec)


@pytest.mark.slow
def test_fp16_overflow_fact(result: AuditResult) -> None:
    """In the audit: plain (GradScaler) and wacc_torch (WindowLossScaler) skip the window whose
    one microbatch overflows float16 and back the scale off; a user loop that declares no float16
    path is "not settable"."""
    facts = {f.adapter.name: f for f in result.facts}
    assert facts["plain"].fp16 == "skips the whole window (scale 65536 -> 32768)"
    for name in ("wacc_torch-mean", "wacc_torch-sum"):
        assert facts[name].fp16 == "skips the whole window (scale 4096 -> 2048)"
    assert facts[EQUAL_WEIGHTING].fp16 == "not settable"
