"""Running scenarios on any implementation (wacc.judge.runner): records, corruptions, foreign
errors."""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import pytest
import torch

from wacc.judge.implementation import DEFAULT_IMPL, Implementation, load_implementation
from wacc.judge.runner import AGNOSTIC_CORRUPTIONS, follows_schema, run_implementation
from wacc.judge.verdict import judge
from wacc_ref.corruption import CORRUPTION_KINDS
from wacc_ref.scenario import Accumulate, Checkpoint, Finish, RestoreCorrupted, Scenario, to_json


def _with_corruptions() -> Scenario:
    return Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=4.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            Accumulate.of("sum", 3.0, {"weight": (1.0, -2.0)}),
            Checkpoint(),
            # the first len(AGNOSTIC_CORRUPTIONS) kinds map to every agnostic corruption once
            *(RestoreCorrupted(kind) for kind in CORRUPTION_KINDS[: len(AGNOSTIC_CORRUPTIONS)]),
            Finish("mean"),
        ),
    )


def test_wacc_torch_records_follow_the_schema_and_opaque_ones_do_not() -> None:
    """Schema detection: wacc_torch's record has every documented key; an opaque one has not."""
    made = load_implementation(DEFAULT_IMPL).make(torch.float32, 1.0)
    opaque = load_implementation("tests.wacc.impls:opaque_records").make(torch.float32, 1.0)
    assert follows_schema(made.state_dict()) and not follows_schema(opaque.state_dict())


def test_a_correct_opaque_implementation_refuses_every_agnostic_corruption() -> None:
    """Missing/extra key, wrong type, truncated and flipped files are all refused or detected."""
    trace, run = run_implementation(
        load_implementation("tests.wacc.impls:opaque_records"), _with_corruptions()
    )
    corrupted = [o for o in trace.outcomes if o.op == "restore_corrupted"]
    assert len(corrupted) == len(AGNOSTIC_CORRUPTIONS) and not run.schema
    assert all(o.error == "RecordError" or o.skipped for o in corrupted), run.messages
    assert not judge(
        load_implementation("tests.wacc.impls:opaque_records"), _with_corruptions()
    ).failed


def test_an_implementation_that_accepts_corrupted_records_is_flagged() -> None:
    """A load that swallows a damaged record fails oracle 3 at those restore steps."""
    verdict = judge(load_implementation("tests.wacc.impls:opaque_credulous"), _with_corruptions())
    assert verdict.failed_oracles == ("semantics",), to_json(verdict.scenario)
    flagged = [step.index for step in verdict.steps if step.failed]
    assert flagged and all(verdict.steps[i].op == "restore_corrupted" for i in flagged)


def test_a_foreign_exception_is_a_divergence_not_a_crash() -> None:
    """A RuntimeError from the implementation is recorded as 'unexpected RuntimeError'."""
    scenario = Scenario(
        work_dtype="float64",
        grad_dtype="float64",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", ()),),
        steps=(Accumulate.of("mean", 2.0, {"weight": (1.0,)}), Finish("sums")),
    )
    verdict = judge(load_implementation("tests.wacc.impls:raises_on_mean"), scenario)
    assert verdict.steps[0].actual_error == "unexpected RuntimeError"
    assert "semantics" in verdict.steps[0].failed
    line = _line_of("tests/wacc/impls.py", 'raise RuntimeError("means are not implemented")')
    assert verdict.messages[0] == (
        f"RuntimeError: means are not implemented (at tests/wacc/impls.py:{line}, "
        "in accumulate_mean)"
    )
    assert verdict.tracebacks[0].startswith("Traceback (most recent call last)")
    assert verdict.tracebacks[0].rstrip().endswith("RuntimeError: means are not implemented")


def _line_of(path: str, text: str) -> int:
    """The 1-based line of ``path`` (from the repository root) that holds ``text``, once."""
    lines = (Path(__file__).resolve().parents[3] / path).read_text(encoding="utf-8").splitlines()
    (number,) = [n for n, line in enumerate(lines, start=1) if text in line]
    return number


def test_the_implementations_frame_skips_torch_and_the_judge() -> None:
    """The frame named is the implementation's own, even when torch raised inside its call."""
    from wacc.judge.exceptions import implementation_frame

    def implementation() -> None:
        torch.nn.Linear(2, 2)(torch.zeros(3))  # raised under torch/nn/modules/*.py

    try:
        implementation()
    except RuntimeError as exc:
        frame = implementation_frame(exc)
        assert "torch" in traceback.extract_tb(exc.__traceback__)[-1].filename
    assert frame is not None and frame.name == "implementation"
    assert frame.filename == __file__


@pytest.mark.parametrize("asynchronous", [False, True])
def test_checkpoints_change_nothing_and_records_round_trip(asynchronous: bool) -> None:
    """A checkpoint's record equals the state of its moment, even resolved after later steps."""
    scenario = Scenario(
        work_dtype="bfloat16",
        grad_dtype="float32",
        loss_scale=2.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            Accumulate.of("sum", 5.0, {"weight": (1.0, 3.0)}),
            Checkpoint(asynchronous=asynchronous),
            Accumulate.of("sum", 2.0, {"weight": (4.0, 4.0)}),
        ),
    )
    trace, _ = run_implementation(load_implementation(DEFAULT_IMPL), scenario)
    checkpoint = trace.outcomes[1]
    assert checkpoint.record is not None
    assert checkpoint.record.key() == trace.outcomes[0].state.key()
    assert trace.outcomes[2].state.key() != checkpoint.record.key()


def test_a_float64_mean_beyond_float32_is_judged_like_the_reference() -> None:
    """The judge's module holds its parameters in the work dtype: a float64 window whose mean
    (1e300) lies beyond float32 passes with found_inf False, as the reference says of D, where
    float32 parameters would make wacc_torch's found_inf speak of float32 (semantics §8)."""
    scenario = Scenario(
        work_dtype="float64",
        grad_dtype="float64",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(Accumulate.of("sum", 1.0, {"weight": (1e300, -2.0)}), Finish("mean")),
    )
    trace, _ = run_implementation(load_implementation(DEFAULT_IMPL), scenario)
    finished = trace.outcomes[-1].result
    assert finished is not None and finished.found_inf is False
    assert not judge(load_implementation(DEFAULT_IMPL), scenario).failed


def _window_with_checkpoints(*, asynchronous: bool) -> Scenario:
    return Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            Accumulate.of("sum", 3.0, {"weight": (1.0, -2.0)}),
            Checkpoint(asynchronous=asynchronous),
            Finish("sums"),
        ),
    )


@pytest.mark.parametrize(
    ("factory", "asynchronous", "index", "error", "text"),
    [
        ("state_dict_raises", False, 0, "unexpected RuntimeError from state_dict()",
         "RuntimeError: state_dict cannot write a window with batches in it"),
        ("async_result_raises", True, 1,
         "unexpected RuntimeError from state_dict_async().result()",
         "RuntimeError: the async record was lost in transit"),
    ],
)  # fmt: skip
def test_a_record_that_cannot_be_taken_is_a_divergence_with_its_text(
    factory: str, asynchronous: bool, index: int, error: str, text: str
) -> None:
    """A ``state_dict()`` that raises when the judge reads the state after a step, or an async
    handle whose ``.result()`` raises, is that step's divergence (oracle 3) with the
    exception's text and the implementation's line, not an exception out of the judge."""
    implementation = load_implementation(f"tests.wacc.impls:{factory}")
    verdict = judge(implementation, _window_with_checkpoints(asynchronous=asynchronous))
    step = verdict.steps[index]
    assert step.actual_error == error and "semantics" in step.failed
    assert verdict.messages[index].startswith(text)
    assert "(at tests/wacc/impls.py:" in verdict.messages[index]


def test_a_factory_that_raises_for_one_dtype_is_a_divergence_at_the_first_step() -> None:
    """A factory that builds float32 accumulators (so it loads) and raises for float64 makes
    every float64 scenario diverge at its first step, with the factory's text."""

    def make(dtype: torch.dtype, loss_scale: float) -> object:
        if dtype == torch.float64:
            raise NotImplementedError("no float64 accumulator in this build")
        return load_implementation(DEFAULT_IMPL).make(dtype, loss_scale)

    implementation = Implementation(spec="local:make", factory=make, fused=False, missing=())
    scenario = dataclasses.replace(
        _window_with_checkpoints(asynchronous=False), work_dtype="float64"
    )
    verdict = judge(implementation, scenario)
    assert verdict.steps[0].actual_error == "unexpected NotImplementedError"
    assert verdict.messages[0].startswith("NotImplementedError: no float64 accumulator")
    assert "semantics" in verdict.steps[0].failed
