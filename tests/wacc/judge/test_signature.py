"""wacc/judge/signature.py: one bug is one signature, in the gate as in ``wacc check``; the gate's
findings of a check family are replayable and carry the implementation's exception text."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.wacc.planted import PLANTED
from wacc.commands.check import _grouped
from wacc.gate import measure as gate_measure
from wacc.gate.compare import compare
from wacc.gate.groups import UNREPRODUCED, group_findings
from wacc.gate.metrics import Metrics
from wacc.gate.outputs import failure_lines, write_junit, write_summary
from wacc.judge.engine import CheckConfig, run_check
from wacc.judge.implementation import load_implementation
from wacc.judge.signature import divergence, signature
from wacc.judge.verdict import judge
from wacc.report.corpus import CorpusEntry, build_corpus
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    Scenario,
    from_json,
    without_interruptions,
)

SAME_DIVERGENCE = [
    # one quantity at one kind of step, whatever the values, names, positions and wording
    ("emulation", "step 3 (finish_mean) grads['a'][flat 0]: expected 0x1p+0 (1), got 2"),
    ("emulation", "step 9 (finish_mean) grads['b.w'][flat 17]: expected 3, got 0x1.8p+1 (3.0)"),
]
OTHER_DIVERGENCES = [
    ("bound", "step 3 (finish_mean): 'a' error/bound = 3.2 > 1: [flat 0] = 1.0, exact 2.0"),
    ("emulation", "step 2 (accumulate_sum, weight 2.0) pending['a'][flat 0]: expected 1, got 2"),
    ("semantics", "step 2 (accumulate_sum) state.total_weight: expected 3.0 (3), got 2.0"),
    ("semantics", "step 2 (accumulate_sum) state.zero_weight: expected 1, got 0"),
    ("semantics", "step 2 (accumulate_mean): error expected InvalidWeightError, got None"),
    ("semantics", "step 2 (accumulate_mean): error expected None, got unexpected RuntimeError"),
    ("semantics", "step 4 (restore_corrupted): expected RecordError, got None"),
    ("semantics", "resume is not bit-identical: the finished results differ"),
]


def test_a_signature_is_what_diverged_not_the_lines_wording_or_numbers() -> None:
    """Two lines of one oracle about one quantity at one kind of step (a sum and a mean are one
    kind) are one signature, whatever their numbers, names and positions; another oracle,
    quantity, error class or kind of step is another signature."""
    assert len({divergence(oracle, line) for oracle, line in SAME_DIVERGENCE}) == 1
    sum_and_mean = [
        ("semantics", "step 1 (accumulate_sum) state.zero_weight: expected 1, got 0"),
        ("semantics", "step 5 (accumulate_mean) state.zero_weight: expected 2, got 1"),
    ]
    assert len({divergence(oracle, line) for oracle, line in sum_and_mean}) == 1
    lines = [SAME_DIVERGENCE[0], *OTHER_DIVERGENCES]
    assert len({divergence(oracle, line) for oracle, line in lines}) == len(lines)
    # a name that holds "inf" is a name, not a value; found_inf wrong either way is one quantity
    found_inf = [
        "step 3 (finish_mean): found_inf is False, but the finished gradients hold NaN or ±inf",
        "step 5 (finish_sums): found_inf is True, but the finished gradients hold no NaN or ±inf",
    ]
    assert {divergence("semantics", line) for line in found_inf} == {
        "[semantics] finish: found_inf is #"
    }


def test_a_missing_refusal_is_one_signature_whatever_came_instead() -> None:
    """Where the semantics demand an error class, what the implementation did instead (nothing,
    another class, a crash of its own) is one divergence: the refusal is missing. Where none was
    due, each class raised is its own (another check misfired)."""
    missing = [
        "step 2 (accumulate_sum): error expected ParameterMismatchError, got None",
        "step 4 (accumulate_mean): error expected ParameterMismatchError, got InvalidWeightError",
        "step 1 (accumulate_sum): error expected ParameterMismatchError, got unexpected "
        "RuntimeError: The size of tensor a (2) must match the size of tensor b (3)",
    ]
    assert {divergence("semantics", line) for line in missing} == {
        "[semantics] accumulate: error expected ParameterMismatchError"
    }
    misfired = [
        "step 2 (accumulate_sum): error expected None, got InvalidWeightError",
        "step 2 (accumulate_sum): error expected None, got ParameterMismatchError",
        "step 2 (accumulate_sum): error expected None, got unexpected RuntimeError: boom",
    ]
    assert len({divergence("semantics", line) for line in misfired}) == len(misfired)
    # A class raised where another is demanded and none of its own is due: that check misfired.
    early = "step 3 (accumulate_mean): error expected InvalidWeightError, got " \
        "ParameterMismatchError (no ParameterMismatchError is due at this step)"  # fmt: skip
    assert divergence("semantics", early) == divergence("semantics", misfired[1])


def test_a_divergence_a_restore_hides_is_the_uninterrupted_windows() -> None:
    """A planted bug (found_inf from the inputs converted to float32, a flag kept outside the
    record) that a restore happens to hide: the window with its checkpoint and restore passes
    every step, the same window without them reports found_inf True with finite gradients. The
    resume finding names that run's failure and has its signature, the same as where the bug
    shows at a step (one bug, one group), not a signature of its own."""
    huge = float.fromhex("0x1p+508")  # finite in float64, inf once converted to float32
    steps = (Accumulate("mean", 1.0, (("w", (huge,)),)), Checkpoint(), Restore(), Finish("sums"))
    scenario = Scenario(work_dtype="float64", grad_dtype="float64", loss_scale=1.0, fused=False,
                        parameters=(("w", (1,)),), steps=steps)  # fmt: skip
    implementation = PLANTED["FoundInfFromInputs"].implementation
    verdict = judge(implementation, scenario)
    assert verdict.failed and not any(step.failed for step in verdict.steps), verdict.describe()
    assert verdict.uninterrupted is not None
    assert (
        "which fails on its own: [semantics] step 1 (finish_sums): found_inf is True"
        in (verdict.scenario_lines[0])
    )
    seen_at_a_step = judge(implementation, without_interruptions(scenario))
    assert signature(verdict) == signature(seen_at_a_step) == "[semantics] finish: found_inf is #"
    # wacc_torch's window and its resume agree: no uninterrupted verdict is made
    assert not judge(
        load_implementation("wacc.implementation:wacc_torch_reproducible"), scenario
    ).failed


def test_a_broken_invariant_is_one_signature_whichever_field_shows_it() -> None:
    """A step that raised and changed the state (§11) is one divergence whichever counter or
    buffer moved, and is that even where the state also differs from the reference's; a
    checkpoint's record that is wrong (§9) is one whichever field shows it. A counter that is
    wrong after a step that did not raise stays its own quantity."""
    raised = [
        "step 4 (restore_corrupted) raised but changed state.issued: expected 0, got 1",
        "step 3 (restore_corrupted) raised but changed state.zero_weight: expected 0, got 1",
        "step 2 (restore_corrupted) raised but changed state.pending['w'][flat 0]: expected 1, "
        "got 2",
    ]
    assert len({divergence("semantics", line) for line in raised}) == 1
    records = [
        "step 1 (checkpoint) record.issued: expected 1, got 0",
        "step 0 (checkpoint) record.loss_scale: expected 1.0 (0x1p+0), got 0.25 (0x1p-2)",
        "step 6 (checkpoint) record.pending['head.bias'][flat 0]: expected 1, got 2",
    ]
    assert {divergence("semantics", line) for line in records} == {"[semantics] checkpoint: record"}
    counters = [
        "step 3 (accumulate_sum) state.zero_weight: expected 0, got 1",
        "step 3 (accumulate_sum) state.total_weight: expected 3.0, got 2.0",
    ]
    assert len({divergence("semantics", line) for line in counters}) == 2


def test_a_state_read_that_raises_is_one_signature_whatever_the_step_expected() -> None:
    """An implementation whose state_dict() raises (outside §11) when the judge reads the state
    after a step is one divergence, whichever step came before (an accumulate, a refused one, a
    checkpoint) and whatever that step was expected to do; after a step that refused as the
    semantics demand, the line says so and that the state read after it failed."""
    implementation = load_implementation("tests.wacc.impls:state_dict_always_raises")

    def judged(*steps: Accumulate | Checkpoint) -> list[str]:
        scenario = Scenario(work_dtype="float32", grad_dtype="float32", loss_scale=1.0,
                            fused=False, parameters=(("w", (1,)),), steps=steps)  # fmt: skip
        verdict = judge(implementation, scenario)
        assert verdict.failed
        return [signature(verdict), *verdict.describe()]

    accepted = judged(Accumulate("sum", 1.0, (("w", (1.0,)),)))
    refused = judged(Accumulate("sum", -1.0, (("w", (1.0,)),)))
    checkpoint = judged(Checkpoint())
    assert accepted[0] == refused[0] == checkpoint[0], (accepted, refused, checkpoint)
    assert accepted[0] == "[semantics] state read: unexpected RuntimeError from state_dict()"
    said = (
        "[semantics] step 0 (accumulate_sum): raised InvalidWeightError as expected, then the "
        "state read after it failed: unexpected RuntimeError from state_dict()"
    )
    assert said in refused, refused
    # the lines a refusal or a misfired check gives stay what they were
    other = [
        "step 2 (accumulate_sum): error expected ParameterMismatchError, got None",
        "step 2 (accumulate_sum): error expected None, got unexpected RuntimeError: boom",
    ]
    assert all(divergence("semantics", line) != accepted[0] for line in other)


def test_a_record_that_changes_after_it_is_returned_diverges_at_its_checkpoint() -> None:
    """A record that later accumulation changes (it aliases the pending buffers; semantics §9:
    a copy) fails at its checkpoint step, as it is at the end of the scenario, with a message
    that says so, whether or not a restore uses it: one signature, "checkpoint: record".
    wacc_torch's record, a copy, passes the same windows."""
    grads = (("w", (1.0, 2.0)),)
    later = (("w", (3.0, 4.0)),)
    aliasing = PLANTED["RecordAliasing"].implementation
    copying = load_implementation("wacc.implementation:wacc_torch_reproducible")
    for tail in ((Finish("sums"),), (Restore(), Finish("sums"))):
        steps = (Accumulate("sum", 1.0, grads), Checkpoint(), Accumulate("sum", 1.0, later), *tail)
        scenario = Scenario(work_dtype="float32", grad_dtype="float32", loss_scale=1.0,
                            fused=False, parameters=(("w", (2,)),), steps=steps)  # fmt: skip
        verdict = judge(aliasing, scenario)
        assert [step.index for step in verdict.steps if step.failed][:1] == [1], verdict.describe()
        assert "changed after state_dict() returned it" in verdict.messages[1]
        assert signature(verdict) == "[semantics] checkpoint: record"
        assert not judge(copying, scenario).failed


def _only_families(monkeypatch: pytest.MonkeyPatch, *families: str) -> None:
    """The gate's check units of ``families`` only (its corpus units are the ``corpus``
    passed to ``measure``)."""
    monkeypatch.setattr(gate_measure, "family_names", lambda: families)


def _corpus_of(family: str, per_cell: int) -> list[CorpusEntry]:
    """The gate's corpus scenarios of ``family``: the first ``per_cell`` of each work dtype x
    gradient dtype cell."""
    taken: dict[tuple[str, str], int] = {}
    entries = []
    for entry in build_corpus(size="default", corpus_seed=0):
        cell = (entry.scenario.work_dtype, entry.scenario.grad_dtype)
        if entry.family == family and taken.get(cell, 0) < per_cell:
            taken[cell] = taken.get(cell, 0) + 1
            entries.append(entry)
    return entries


@pytest.mark.slow  # a gate over one family's corpus and checks, and `wacc check`, per bug
@pytest.mark.parametrize(
    "name",
    [
        "ScaleTimesWeight",
        "ZeroWeightNotCounted",
        "DoubleUnscale",
        "ReciprocalDivision",
        "EqualWeightMean",
        "BroadcastAccepted",
        "BoolAccepted",
        "AnyFloatingAccepted",
        "NonContiguousRefused",
        "NonAtomicLoad",
        "AsyncSnapshotLate",
        "RecordAliasing",
    ],
)
def test_one_planted_bug_is_one_group_in_the_gate_and_one_block_in_check(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted bug judged by the gate over its family's corpus scenarios (every dtype) and
    check units fails many scenarios with other values, steps and wording, and is one failure
    group; ``wacc check``'s families on every dtype show it as one block."""
    planted = PLANTED[name]
    _only_families(monkeypatch, planted.family)
    metrics = gate_measure.measure(
        planted.implementation, corpus=_corpus_of(planted.family, per_cell=2)
    )
    groups = group_findings(metrics)
    # scenarios of several keys fail (work dtypes; corpus and check units): other values, steps
    assert len({key for group in groups for key in group.keys}) >= 4, groups
    assert [group.signature for group in groups] == [groups[0].signature], groups
    config = CheckConfig(families=(planted.family,), shrink_seconds=5.0)
    blocks = _grouped(run_check(planted.implementation, config).findings)
    assert len(blocks) == len(groups)
    assert signature(blocks[0][0].verdict) == groups[0].signature


@pytest.mark.slow  # the stateful machine on every dtype, and `wacc check` on one
def test_a_stateful_failure_is_one_replayable_finding_and_no_phantom_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A deterministic planted bug the stateful machine finds is one failing scenario per
    dtype in the gate, with its finding and replay file (no group of a failure that "did not
    recur"), and judging the replay file again fails with the same signature; ``wacc check``
    counts it once too."""
    planted = PLANTED["ZeroWeightNotCounted"]
    _only_families(monkeypatch, "stateful")
    metrics = gate_measure.measure(planted.implementation, corpus=[], out=tmp_path)
    assert all(m.failing == len(m.findings) == 1 for m in metrics.values()), metrics
    groups = group_findings(metrics)
    assert UNREPRODUCED.signature not in [group.signature for group in groups]
    for finding in (f for m in metrics.values() for f in m.findings):
        assert finding.replay is not None
        scenario = from_json(Path(finding.replay).read_text(encoding="utf-8"))
        assert signature(judge(planted.implementation, scenario)) == finding.signature
    config = CheckConfig(dtypes=("float32",), families=("stateful",), shrink_seconds=5.0)
    assert run_check(planted.implementation, config).summaries["float32"].failed == 1


def test_the_gates_outputs_carry_the_implementations_exception_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An implementation whose accumulate_mean raises NotImplementedError("... my text ...")
    fails the gate's scenarios with means: its text is in the printed failure blocks, in
    gate.md and in the JUnit XML (not only "got unexpected NotImplementedError")."""
    implementation = load_implementation("tests.wacc.impls:not_implemented_mean")
    _only_families(monkeypatch)  # the corpus units alone
    corpus = [
        entry
        for entry in _corpus_of("windows", per_cell=1)
        if any(getattr(step, "kind", "") == "mean" for step in entry.scenario.steps)
    ][:6]
    metrics = gate_measure.measure(implementation, corpus=corpus, out=tmp_path / "replays")
    baseline = {key: Metrics(scenarios=m.scenarios) for key, m in metrics.items()}
    comparison = compare(metrics, baseline)
    groups = group_findings(metrics)
    spec = implementation.spec
    printed = "\n".join(failure_lines(groups, implementation=spec))
    summary = write_summary(comparison, tmp_path / "gate.md", implementation=spec, seconds=1.0,
                            groups=groups).read_text(encoding="utf-8")  # fmt: skip
    junit = write_junit(comparison, tmp_path / "gate.xml", implementation=spec)
    text = "NotImplementedError: means are my text: not written yet"
    assert text in printed and text in summary
    assert text in junit.read_text(encoding="utf-8")
