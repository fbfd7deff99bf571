"""``run_audit(..., isolate=True)``: each loop in a fresh Python process (wacc.audit.isolation)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch

from tests.wacc.audit.loops import LEAK
from wacc.audit.protocol import Adapter, user_adapter
from wacc.audit.runner import AuditResult, LoopFacts, run_audit
from wacc.audit.windows import build_window

LOOPS = Path(__file__).with_name("loops.py")


def loop(name: str) -> Adapter:
    """A test loop of loops.py, named by its file (the worker imports it by the same rule)."""
    return user_adapter(f"{LOOPS}:{name}")


@pytest.fixture
def restored() -> Iterator[None]:
    """The state a loop may leave in this process, put back afterwards."""
    dtype = torch.get_default_dtype()
    yield
    os.environ.pop(LEAK, None)
    torch.set_default_dtype(dtype)


def counting() -> tuple[Callable[[int], Callable[[], None]], list[int]]:
    """A progress callback that records the announced total, then each tick."""
    seen: list[int] = []

    def start(total: int) -> Callable[[], None]:
        seen.append(total)
        return lambda: seen.append(1)

    return start, seen


def test_a_loops_global_state_stays_in_its_process() -> None:
    """A loop that leaves an environment variable and torch's default dtype behind does not
    disturb the next loop, nor the caller's process."""
    start, seen = counting()
    result = run_audit(
        [loop("leaves_state"), loop("needs_clean_state")], [build_window("equal")],
        progress=start, isolate=True,
    )  # fmt: skip
    assert [c.status for c in result.cells] == ["ok", "ok"]
    assert [c.verdict for c in result.cells] == ["pass", "pass"]
    assert LEAK not in os.environ and torch.get_default_dtype() == torch.float32
    total, *ticks = seen
    assert len(ticks) == total == 2 * 3  # per loop: three runs of the window (nothing else)


def test_in_one_process_the_same_loops_interfere(restored: None) -> None:
    """The control: in one process the second loop sees the first one's state and fails, so the
    test above would notice a worker that is not a fresh process."""
    start, seen = counting()
    result = run_audit(
        [loop("leaves_state"), loop("needs_clean_state")], [build_window("equal")], progress=start
    )
    total, *ticks = seen
    assert len(ticks) == total - 3  # the failing loop raises in its first run: none of its 3 ends
    assert result.cells[0].status == "ok"
    assert result.cells[1].status.startswith(
        "error: RuntimeError: another loop's state is in this process"
    )


def test_a_loop_that_kills_its_process_is_a_row_and_the_audit_goes_on() -> None:
    """A process that exits without a result gives each of its windows an error naming the exit
    code and the last line it printed; the loops beside it still run (two at a time here: the
    results in the order the loops were given)."""
    windows = [build_window("unequal"), build_window("equal")]
    result = run_audit([loop("dies"), loop("equal_weighting")], windows, isolate=True, jobs=2)
    assert [f.adapter.name for f in result.facts] == [f"{LOOPS}:dies", f"{LOOPS}:equal_weighting"]
    died = [c for c in result.cells if c.adapter.endswith(":dies")]
    expected = "error: the loop's process exited with code 3: the framework gave up here"
    assert [c.status for c in died] == [expected, expected]
    assert result.facts[0].status == expected
    after = [c for c in result.cells if c.adapter.endswith(":equal_weighting")]
    assert [c.status for c in after] == ["ok", "ok"]
    assert [c.verdict for c in after] == ["FAIL", "pass"]  # equal weighting, unequal window


def _comparable(record: dict[str, object]) -> dict[str, object]:
    """``record`` with NaN as a string: NaN is never equal to itself."""
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}


def _facts(result: AuditResult) -> list[dict[str, object]]:
    return [
        _comparable(
            {f.name: getattr(facts, f.name) for f in fields(LoopFacts) if f.name != "adapter"}
        )
        for facts in result.facts
    ]


def test_jobs_need_processes_of_their_own() -> None:
    """More than one job at a time only with isolate (loops in one process cannot overlap)."""
    with pytest.raises(ValueError, match="jobs"):
        run_audit([loop("equal_weighting")], [build_window("equal")], jobs=2)
    with pytest.raises(ValueError, match="jobs"):
        run_audit([loop("equal_weighting")], [build_window("equal")], isolate=True, jobs=0)


def test_a_loop_in_its_own_process_reports_what_it_reports_in_this_one(restored: None) -> None:
    """Isolation changes where a loop runs, not what it finds: every cell field (the gradient's
    hash included: bit-identical gradients) and every fact are the same."""
    adapters = [loop("equal_weighting")]
    windows = [build_window("unequal"), build_window("zero")]
    isolated = run_audit(adapters, windows, isolate=True)
    here = run_audit(adapters, windows)
    cells = [_comparable(asdict(c)) for c in isolated.cells]
    assert cells == [_comparable(asdict(c)) for c in here.cells]
    assert _facts(isolated) == _facts(here)


def test_accelerate_alone_in_a_fresh_process_reaches_its_float16_path() -> None:
    """Alone in a fresh process (the audit's default), the accelerate loop runs its float16 path
    after its float32 runs: accelerate's one AcceleratorState per process, made by the first run,
    must not refuse the second's mixed precision (each run stands for a script of its own)."""
    pytest.importorskip("accelerate")
    from wacc.audit.adapters import ADAPTERS

    result = run_audit([ADAPTERS["accelerate"]], [build_window("unequal")], isolate=True)
    (facts,) = result.facts
    assert facts.fp16.startswith("no float16 compute"), facts.fp16
    assert not facts.fp16.startswith("error")
