"""The check engine (wacc.judge.engine): wacc_torch passes every family; a fault is found and
shrunk."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.wacc_torch.support import DEVICES
from wacc.judge.engine import FAMILIES, MACHINE, CheckConfig, DtypeSummary, run_check, run_family
from wacc.judge.implementation import DEFAULT_IMPL, load_implementation
from wacc_ref import formats
from wacc_ref.scenario import Accumulate, from_json, to_json

# The default implementation on the CPU is not repeated here: tests/wacc/test_gate.py's `runs`
# fixture runs `wacc gate --update-baseline` on it, which runs these same families and the machine
# under the ci profile on every work dtype and exits 1 (failing that fixture) on any scenario that
# fails an oracle. Running it twice cost ~2 minutes of CI for no new power.
_CHECKED = [
    pytest.param(spec, device.values[0], id=f"{spec}-{device.id}", marks=device.marks)
    for spec in (
        DEFAULT_IMPL,
        "wacc.implementation:wacc_torch_fused",
        "wacc.implementation:wacc_torch_zero_copy",
    )
    for device in DEVICES
    if (spec, device.values[0]) != (DEFAULT_IMPL, "cpu")
]


@pytest.mark.slow  # ~10-15 s per dtype: every family and the machine under the ci profile
@pytest.mark.parametrize("work_dtype", formats.WORK_DTYPES)
@pytest.mark.parametrize(("spec", "device"), _CHECKED)
def test_wacc_torch_passes_wacc_check_under_ci(spec: str, work_dtype: str, device: str) -> None:
    """wacc_torch (fused and zero-copy; reproducible on a device) holds every oracle on every
    family and the machine."""
    report = run_check(
        load_implementation(spec), CheckConfig(dtypes=(work_dtype,), device=device, profile="ci")
    )
    summary = report.summaries[work_dtype]
    assert report.passed, "\n".join(
        line + "\n" + to_json(f.verdict.scenario)
        for f in report.findings
        for line in f.verdict.describe()
    )
    assert summary.scenarios >= len(FAMILIES) * 100 and summary.max_ratio <= 1.0


def test_a_fault_is_found_shrunk_and_written(tmp_path: Path) -> None:
    """Double unscaling is found, shrunk to one accumulate step, and its JSON replays it."""
    implementation = load_implementation("tests.wacc.impls:double_unscale")
    config = CheckConfig(dtypes=("float32",), families=("windows",), examples=30)
    report = run_check(implementation, config, out=tmp_path)
    (finding,) = report.findings
    accumulates = [s for s in finding.verdict.scenario.steps if isinstance(s, Accumulate)]
    assert len(accumulates) == 1, to_json(finding.verdict.scenario)
    assert finding.verdict.failed_oracles == ("emulation", "bound")
    assert finding.path is not None and finding.path.parent == tmp_path
    replayed = from_json(finding.path.read_text(encoding="utf-8"))
    assert to_json(replayed) == to_json(finding.verdict.scenario)


def test_the_state_machine_finds_a_fault() -> None:
    """The stateful machine alone catches double unscaling and shrinks it to <= 3 accumulates."""
    implementation = load_implementation("tests.wacc.impls:double_unscale")
    # Hypothesis also draws constants from every local module loaded, so which examples come
    # first depends on what else the session imported: 200 sufficed alone but not after the
    # benchmark tests; the run stops at the first failure, so the margin costs nothing here.
    config = CheckConfig(dtypes=("float16",), families=(MACHINE,), examples=400)
    shrunk = run_family(implementation, "float16", MACHINE, config)
    assert shrunk is not None
    accumulates = [s for s in shrunk.scenario.steps if isinstance(s, Accumulate)]
    assert 1 <= len(accumulates) <= 3, to_json(shrunk.scenario)


def test_a_seed_makes_a_run_reproducible() -> None:
    """Two runs with one seed judge as many scenarios with the same worst metrics."""
    implementation = load_implementation(DEFAULT_IMPL)
    config = CheckConfig(dtypes=("bfloat16",), families=("windows",), examples=15, seed=1234)

    def summary() -> DtypeSummary:
        return run_check(implementation, config).summaries["bfloat16"]

    first, second = summary(), summary()
    assert (first.scenarios, first.max_ratio, first.max_rel_error) == (
        second.scenarios,
        second.max_ratio,
        second.max_rel_error,
    )


def test_an_implementation_without_records_runs_no_interruptions() -> None:
    """Without records the families draw no checkpoint, and a correct implementation passes."""
    implementation = load_implementation("tests.wacc.impls:counters_only")
    config = CheckConfig(dtypes=("float16",), families=("interruptions", MACHINE), examples=20)
    assert run_check(implementation, config).passed
