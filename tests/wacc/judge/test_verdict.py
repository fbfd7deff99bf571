"""The three oracles on single scenarios (wacc.judge.verdict): named corner cases and planted
faults.

Every failure message carries the scenario as JSON: ``wacc replay`` runs it again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

import wacc.judge.verdict
import wacc_torch
import wacc_torch.buffered
from tests.wacc import impls
from tests.wacc.impls import refusing_with
from wacc.judge.implementation import DEFAULT_IMPL, Implementation, load_implementation
from wacc.judge.runner import in_module_order
from wacc.judge.verdict import ORACLE_SETS, ScenarioVerdict, judge
from wacc_ref.bounds import error_ratio, window_error_bound
from wacc_ref.corruption import CHECKSUM_KINDS, CORRUPTION_KINDS
from wacc_ref.oracles import run_reference
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    RestoreCorrupted,
    Scenario,
    SetLossScale,
    to_json,
)
from wacc_ref.traces import ScenarioTrace

LARGEST_FLOAT64 = float.fromhex("0x1.fffffffffffffp+1023")


def _verdict_text(verdict: ScenarioVerdict) -> str:
    return "\n".join(verdict.describe()) + "\nreplay this scenario:\n" + to_json(verdict.scenario)


def _convert_then_add() -> Scenario:
    # 1 + round_bf16(2**-8 + 2**-20) = 1 + 2**-8 is a bf16 tie and goes to even (1.0); a single
    # rounding of the exact 1 + 2**-8 + 2**-20 lies above the tie and gives 1 + 2**-7.
    return Scenario(
        work_dtype="bfloat16",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (1,)),),
        steps=(
            Accumulate.of("sum", 1.0, {"weight": (1.0,)}),
            Accumulate.of("sum", 1.0, {"weight": (2.0**-8 + 2.0**-20,)}),
            Finish("sums"),
        ),
    )


# Named scenarios that random generation reaches rarely or never.
CORPUS: dict[str, Scenario] = {
    "convert then add (bf16 tie)": _convert_then_add(),
    "total weight overflows float64": Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            Accumulate.of("sum", LARGEST_FLOAT64, {"weight": (1.0, 2.0)}),
            Accumulate.of("sum", LARGEST_FLOAT64, {"weight": (1.0, 2.0)}),
            Finish("sums"),
        ),
    ),
    "fp16 S=2**15, W=4096: S*W overflows, sequential division does not": Scenario(
        work_dtype="float16",
        grad_dtype="float32",
        loss_scale=2.0**15,
        fused=False,
        parameters=(("weight", (3,)),),
        steps=(
            Accumulate.of("sum", 4000.0, {"weight": (2.0**15, -(2.0**14), 3.0)}),
            Accumulate.of("sum", 96.0, {"weight": (2.0**14, 2.0**-9, 2.0**-24)}),
            Finish("mean"),
        ),
    ),
    "fp16 W=70000 (W itself overflows fp16)": Scenario(
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            Accumulate.of("sum", 70000.0, {"weight": (7.0, -1.0)}),
            Finish("mean"),
        ),
    ),
    "mid-window resume, mixed sum and mean": Scenario(
        work_dtype="bfloat16",
        grad_dtype="float32",
        loss_scale=2.0**8,
        fused=False,
        parameters=(("weight", (2,)), ("bias", ())),
        steps=(
            Accumulate.of(
                "mean", 7.0, {"weight": (float.fromhex("0x1.99999ap-4"), -3.0), "bias": (1.5,)}
            ),
            Checkpoint(asynchronous=True),
            Restore(),
            Accumulate.of("sum", 200.0, {"weight": (250.0, 2.0**-10)}),
            Finish("mean"),
        ),
    ),
}


@pytest.mark.parametrize("name", list(CORPUS))
def test_wacc_torch_passes_every_oracle_on_the_corpus(name: str) -> None:
    """Each named corner case holds under oracles 1, 2 and 3 for wacc_torch."""
    verdict = judge(load_implementation(DEFAULT_IMPL), CORPUS[name])
    assert not verdict.failed, _verdict_text(verdict)
    assert verdict.oracles == ORACLE_SETS["strict"]


def test_the_sequential_division_is_within_the_bound_where_s_times_w_overflows() -> None:
    """fp16 with S*W = 2**27 finishes finite and within the error bound (ratio measured)."""
    verdict = judge(load_implementation(DEFAULT_IMPL), CORPUS[list(CORPUS)[2]])
    finish = verdict.steps[-1]
    assert finish.op == "finish_mean" and 0.0 <= finish.max_ratio <= 1.0


def test_a_single_rounding_add_is_caught_by_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding the float32 gradient straight into the bf16 buffer fails oracle 1 at its step."""

    def single_rounding_add(buffer: torch.Tensor, grad: torch.Tensor, **_: object) -> None:
        buffer.add_(grad)  # one rounding in the promoted type: the bug the semantics warn of

    monkeypatch.setattr(wacc_torch.buffered, "add_into", single_rounding_add)
    verdict = judge(load_implementation(DEFAULT_IMPL), _convert_then_add())
    assert verdict.failed_oracles == ("emulation",), _verdict_text(verdict)
    assert verdict.steps[1].failed == ("emulation",) and verdict.steps[1].max_ulps == 1.0
    assert any("0x1.02" in line for line in verdict.describe())


def test_a_wrong_fused_step_leaves_the_accepted_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused mean step that applies the weight twice fails the step-local oracle 1."""
    scenario = Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=True,
        parameters=(("weight", (2,)),),
        steps=(Accumulate.of("mean", 3.0, {"weight": (1.0, -0.5)}), Finish("mean")),
    )
    fused = load_implementation("wacc.implementation:wacc_torch_fused")
    assert not judge(fused, scenario).failed

    def weight_applied_twice(
        buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, **_: object
    ) -> None:
        buffer.add_(grad.to(buffer.dtype), alpha=weight * weight)

    monkeypatch.setattr(wacc_torch.buffered, "add_into", weight_applied_twice)
    verdict = judge(fused, scenario)
    assert "emulation" in verdict.steps[0].failed and "bound" in verdict.failed_oracles
    assert any("pending['weight'][flat 0]" in line for line in verdict.describe())


def test_double_unscale_fails_emulation_and_bound_but_not_semantics() -> None:
    """Dividing by S twice changes values only: oracles 1 and 2 fail, the counters agree."""
    scenario = CORPUS["fp16 S=2**15, W=4096: S*W overflows, sequential division does not"]
    verdict = judge(load_implementation("tests.wacc.impls:double_unscale"), scenario)
    assert verdict.failed_oracles == ("emulation", "bound"), _verdict_text(verdict)
    assert verdict.steps[-1].max_ratio > 1.0


def test_the_bound_oracle_alone_accepts_value_differences_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--oracle bound`` does not apply oracle 1: a one-ulp single-rounding add passes it."""

    def single_rounding_add(buffer: torch.Tensor, grad: torch.Tensor, **_: object) -> None:
        buffer.add_(grad)

    monkeypatch.setattr(wacc_torch.buffered, "add_into", single_rounding_add)
    verdict = judge(
        load_implementation(DEFAULT_IMPL), _convert_then_add(), oracles=ORACLE_SETS["bound"]
    )
    assert verdict.oracles == ("bound", "semantics")
    assert not verdict.failed, _verdict_text(verdict)


def test_opaque_records_are_judged_on_counters_and_results() -> None:
    """A correct implementation with records of its own layout passes, resume included."""
    verdict = judge(
        load_implementation("tests.wacc.impls:opaque_records"),
        CORPUS["mid-window resume, mixed sum and mean"],
    )
    assert not verdict.failed, _verdict_text(verdict)


def test_an_all_zero_gradient_for_an_untouched_parameter_is_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished +0.0 tensor where the reference has None is reported as a note, not a failure."""
    original = wacc_torch.WeightedGradientsAccumulator.finish_sums

    def finish_sums_with_zeros(self: wacc_torch.WeightedGradientsAccumulator):  # type: ignore[no-untyped-def]
        result = original(self)
        grads = {
            name: torch.zeros(()) if grad is None else grad for name, grad in result.grads.items()
        }
        return wacc_torch.AccumulatedGradients(
            grads=grads,
            weight=result.weight,
            loss_scale=result.loss_scale,
            issued=result.issued,
            zero_weight=result.zero_weight,
            normalized=False,
            found_inf=result.found_inf,
        )

    monkeypatch.setattr(
        wacc_torch.WeightedGradientsAccumulator, "finish_sums", finish_sums_with_zeros
    )
    scenario = Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)), ("bias", ())),
        steps=(Accumulate.of("sum", 3.0, {"weight": (1.0, 2.0)}), Finish("sums")),
    )
    verdict = judge(load_implementation(DEFAULT_IMPL), scenario)
    assert not verdict.failed, _verdict_text(verdict)
    assert verdict.steps[-1].notes == (
        "step 1 (finish_sums): grads['bias'] is all +0.0 where the reference has None",
    )


# --------------------------------------------------------------------------- helpers


Transform = Callable[[str, torch.Tensor | None], torch.Tensor | None]


class _FinishingWith:
    """wacc_torch, with each finished gradient passed through ``transform(name, grad)``."""

    def __init__(self, dtype: torch.dtype, loss_scale: float, transform: Transform) -> None:
        self._inner = wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)
        self._transform = transform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _changed(self, result: wacc_torch.AccumulatedGradients) -> wacc_torch.AccumulatedGradients:
        return wacc_torch.AccumulatedGradients(
            grads={name: self._transform(name, grad) for name, grad in result.grads.items()},
            weight=result.weight,
            loss_scale=result.loss_scale,
            issued=result.issued,
            zero_weight=result.zero_weight,
            normalized=result.normalized,
            found_inf=result.found_inf,
        )

    def finish_sums(self) -> wacc_torch.AccumulatedGradients:
        return self._changed(self._inner.finish_sums())

    def finish_mean(self) -> wacc_torch.AccumulatedGradients:
        return self._changed(self._inner.finish_mean())


def _finishing_with(transform: Transform, what: str) -> Implementation:
    """An implementation: wacc_torch whose finished gradients ``transform`` changes."""

    def make(dtype: torch.dtype, loss_scale: float) -> _FinishingWith:
        return _FinishingWith(dtype, loss_scale, transform)

    return Implementation(spec=f"finishing with {what}", factory=make, fused=False, missing=())


def _scenario(
    work_dtype: str,
    parameters: Sequence[tuple[str, tuple[int, ...]]],
    steps: Sequence[Accumulate | Checkpoint | Finish | Restore | RestoreCorrupted],
) -> Scenario:
    return Scenario(
        work_dtype=work_dtype,
        grad_dtype=work_dtype,
        loss_scale=1.0,
        fused=False,
        parameters=tuple(parameters),
        steps=tuple(steps),
    )


# ------------------------------------------------------------- corrupted restores (oracle 3)


def _every_corruption() -> Scenario:
    """One window with a pending buffer, a checkpoint, then every corruption kind in turn."""
    return _scenario(
        "float32",
        (("weight", (2,)), ("bias", ())),
        (
            Accumulate.of("sum", 3.0, {"weight": (1.0, -2.0), "bias": (0.5,)}),
            Checkpoint(),
            *(RestoreCorrupted(kind) for kind in CORRUPTION_KINDS),
            Finish("sums"),
        ),
    )


class RecordError(Exception):
    """Not wacc_torch's RecordError: an unrelated class that only shares its name."""


def _refused_steps(verdict: ScenarioVerdict) -> list[int]:
    """The corrupted restores the implementation raised at (the others were skipped)."""
    return [
        step.index
        for step in verdict.steps
        if step.op == "restore_corrupted" and step.actual_error is not None
    ]


@pytest.mark.parametrize(
    ("error", "judged_as"),
    [
        (wacc_torch.ParameterMismatchError, "ParameterMismatchError"),
        (wacc_torch.InvalidWeightError, "InvalidWeightError"),
        (wacc_torch.WeightedAccumulationError, "WeightedAccumulationError"),
        (ValueError, "unexpected ValueError"),
        (KeyError, "unexpected KeyError"),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_a_schema_record_refused_with_another_class_than_record_error_fails(
    error: type[Exception], judged_as: str
) -> None:
    """Semantics §12: a corrupted record of the §9 schema must be refused with RecordError; any
    other class (another §11 error, or a foreign one) fails oracle 3 at each such restore."""
    verdict = judge(refusing_with(error, opaque=False), _every_corruption())
    refused = _refused_steps(verdict)
    assert len(refused) >= 20, _verdict_text(verdict)  # every schema kind applies here
    assert [step.index for step in verdict.steps if step.failed] == refused, _verdict_text(verdict)
    for index in refused:
        step = verdict.steps[index]
        assert step.actual_error == judged_as and step.failed == ("semantics",), step
        assert f"step {index} (restore_corrupted): expected RecordError, got {judged_as}" in (
            step.lines
        ), step.lines


@pytest.mark.parametrize("opaque", [False, True], ids=["schema", "opaque"])
def test_a_foreign_class_named_record_error_refuses_a_corrupted_record(opaque: bool) -> None:
    """A class named RecordError counts as RecordError (semantics §12): refusing every corrupted
    record with it passes, for schema and opaque records alike (the control of the tests around)."""
    verdict = judge(refusing_with(RecordError, opaque=opaque), _every_corruption())
    assert _refused_steps(verdict), _verdict_text(verdict)
    assert not verdict.failed, _verdict_text(verdict)


@pytest.mark.parametrize(
    "error",
    [wacc_torch.ParameterMismatchError, wacc_torch.InvalidWeightError, wacc_torch.ZeroCopyError],
    ids=lambda error: error.__name__,
)
def test_an_opaque_record_may_be_refused_with_any_error_of_the_family(
    error: type[Exception],
) -> None:
    """Semantics §12: an opaque record's corruption may be refused with any §11 error (here one
    that is not RecordError); the judge accepts it at every corrupted restore."""
    verdict = judge(refusing_with(error, opaque=True), _every_corruption())
    assert _refused_steps(verdict), _verdict_text(verdict)
    assert not verdict.failed, _verdict_text(verdict)


@pytest.mark.parametrize("error", [ValueError, KeyError, RuntimeError], ids=lambda e: e.__name__)
def test_an_opaque_record_refused_with_a_foreign_error_fails(error: type[Exception]) -> None:
    """Semantics §12: an opaque record's corruption refused with an error outside the §11 family
    (a plain ValueError is not one) fails oracle 3 at each such restore, where RecordError was
    expected."""
    verdict = judge(refusing_with(error, opaque=True), _every_corruption())
    refused = _refused_steps(verdict)
    assert refused, _verdict_text(verdict)
    assert [step.index for step in verdict.steps if step.failed] == refused, _verdict_text(verdict)
    for index in refused:
        step = verdict.steps[index]
        assert step.actual_error == f"unexpected {error.__name__}", step
        assert step.failed == ("semantics",), step
        # Judged against RecordError (what the reference raises), not against the error raised.
        assert step.lines[0] == (
            f"step {index} (restore_corrupted): error expected RecordError, "
            f"got unexpected {error.__name__}"
        ), step.lines


# --------------------------------------------------------------------- the bound (oracle 2)


def _one_rounding_window() -> tuple[Scenario, list[Fraction]]:
    """float32 sums 1 + 3 * 2**-25 (and 1.5 + 3 * 2**-25): the second add rounds; the exact
    results are returned with the scenario."""
    tiny = 3 * 2.0**-25
    scenario = _scenario(
        "float32",
        (("weight", (2,)),),
        (
            Accumulate.of("sum", 1.0, {"weight": (1.0, 1.5)}),
            Accumulate.of("sum", 1.0, {"weight": (tiny, tiny)}),
            Finish("sums"),
        ),
    )
    exact = [Fraction(1.0) + Fraction(tiny), Fraction(1.5) + Fraction(tiny)]
    return scenario, exact


def _finish_bound(scenario: Scenario) -> np.ndarray:
    """wacc_ref.bounds' bound of the finished sums of ``scenario``'s single window."""
    steps = [step for step in scenario.steps if isinstance(step, Accumulate)]
    return window_error_bound(
        kind=[step.kind for step in steps],
        grads=[scenario.grad_arrays(step)["weight"] for step in steps],
        weights=[step.weight for step in steps],
        dtype=scenario.work_dtype,
        loss_scale=scenario.loss_scale,
        normalized=False,
    )


def _neighbours(value: float, count: int) -> list[float]:
    """The float32 values within ``count`` steps of ``value``, nearest first."""
    out: list[float] = []
    for direction in (-np.inf, np.inf):
        current = np.float32(value)
        for _ in range(count):
            current = np.nextafter(current, np.float32(direction))
            out.append(float(current))
    return sorted(out, key=lambda candidate: abs(candidate - value))


def _replacing(values: Sequence[float]) -> Implementation:
    def replace(name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:
            return None
        return torch.tensor(values, dtype=grad.dtype).reshape(grad.shape)

    return _finishing_with(replace, f"the values {[v.hex() for v in values]}")


def test_an_error_between_one_and_two_bounds_fails_the_bound_oracle() -> None:
    """Oracle 2 accepts error/bound <= 1 only: a finished result whose error is more than the
    bound of wacc_ref.bounds but at most twice it fails, and its ratio is reported exactly."""
    scenario, exact = _one_rounding_window()
    bound = _finish_bound(scenario)
    finished = run_reference(scenario).outcomes[-1].result
    assert finished is not None
    reference = dict(finished.grads)["weight"]
    assert reference is not None
    exact_array = np.array(exact, dtype=object)
    # Per element, the nearest float32 value whose error is in (1, 2] bounds.
    chosen: list[float] = []
    for position, value in enumerate(reference.reshape(-1).tolist()):
        ratios = {
            candidate: error_ratio(
                np.array([candidate]),
                exact_array[position : position + 1],
                bound[position : position + 1],
            )
            for candidate in _neighbours(value, 4)
        }
        within = [c for c, r in ratios.items() if 1.0 < r <= 2.0]
        assert within, f"no float32 value near {value.hex()} has 1 < error/bound <= 2: {ratios}"
        chosen.append(within[0])
    expected_ratio = error_ratio(np.array(chosen), exact_array, bound)
    assert 1.0 < expected_ratio <= 2.0
    verdict = judge(_replacing(chosen), scenario, oracles=ORACLE_SETS["bound"])
    finish = verdict.steps[-1]
    assert verdict.failed_oracles == ("bound",) and finish.failed == ("bound",), _verdict_text(
        verdict
    )
    assert finish.max_ratio == expected_ratio, (finish.max_ratio, expected_ratio, chosen)


@pytest.mark.parametrize("exactly_one", [True, False], ids=["ratio-1", "ratio-above-1"])
def test_the_bound_oracle_threshold_is_a_ratio_of_one_inclusive(
    monkeypatch: pytest.MonkeyPatch, exactly_one: bool
) -> None:
    """With the bound replaced by the error itself, error/bound is exactly 1 and oracle 2 holds
    (the ratio must be <= 1); with the next smaller float64 as bound, the ratio exceeds 1 and
    oracle 2 fails."""
    scenario, exact = _one_rounding_window()
    result = [1.0, 1.5]  # the float32 values just below the correctly rounded sums
    errors = [float(abs(Fraction(value) - x)) for value, x in zip(result, exact, strict=True)]
    assert [Fraction(e) for e in errors] == [
        abs(Fraction(value) - x) for value, x in zip(result, exact, strict=True)
    ]  # each error is a float64 exactly
    bound = np.array(errors if exactly_one else [np.nextafter(e, 0.0) for e in errors])

    def replaced_bound(**kwargs: Any) -> np.ndarray:
        # Every step gets this bound; the pending sums (errors 0, then a quarter ulp) stay within.
        del kwargs
        return bound

    monkeypatch.setattr(wacc.judge.verdict, "window_error_bound", replaced_bound)
    verdict = judge(_replacing(result), scenario, oracles=ORACLE_SETS["bound"])
    finish = verdict.steps[-1]
    if exactly_one:
        assert finish.max_ratio == 1.0 and not verdict.failed, _verdict_text(verdict)
    else:
        assert finish.max_ratio > 1.0 and finish.failed == ("bound",), _verdict_text(verdict)


# ------------------------------------------------------------------ ulps and signs (oracle 1)


def _negated(name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
    del name
    return None if grad is None else -grad


SIGN_FLIP_VALUES: dict[str, tuple[float, ...]] = {
    "normal and subnormal": (1.5, -(2.0**100) * 1.25, 3 * 2.0**-130),
    "infinite": (math.inf, 2.0, -3.0),
}


@pytest.mark.parametrize("values", list(SIGN_FLIP_VALUES))
def test_a_sign_flipped_result_is_far_in_ulps(values: str) -> None:
    """Oracle 1 fails a finished result with every sign flipped, and max_ulps is the distance
    from x to -x in units of float32's spacing at x, 2|x| / spacing(x) (infinite for ±inf)."""
    gradient = SIGN_FLIP_VALUES[values]
    scenario = _scenario(
        "float32",
        (("weight", (len(gradient),)),),
        (Accumulate.of("sum", 2.0, {"weight": gradient}), Finish("sums")),
    )
    verdict = judge(_finishing_with(_negated, "every sign flipped"), scenario)
    finish = verdict.steps[-1]
    assert "emulation" in finish.failed, _verdict_text(verdict)
    single = np.array(gradient, dtype=np.float32)  # one add into +0.0: the result is the input
    expected = max(
        math.inf if np.isinf(x) else 2 * abs(float(x)) / abs(float(np.spacing(x))) for x in single
    )
    assert finish.max_ulps == expected, (finish.max_ulps, expected, _verdict_text(verdict))


def test_a_nan_with_its_sign_flipped_is_no_divergence() -> None:
    """NaN signs and payloads are not compared (semantics §12): a result whose only change is
    the sign of its NaNs passes every oracle with max_ulps 0."""
    scenario = _scenario(
        "float32",
        (("weight", (2,)),),
        (Accumulate.of("sum", 2.0, {"weight": (math.nan, math.nan)}), Finish("sums")),
    )
    verdict = judge(_finishing_with(_negated, "NaN signs flipped"), scenario)
    assert not verdict.failed and verdict.steps[-1].max_ulps == 0.0, _verdict_text(verdict)


# -------------------------------------------------------------- None where no gradient came


def _untouched_bias() -> Scenario:
    return _scenario(
        "float32",
        (("weight", (2,)), ("bias", (2,))),
        (Accumulate.of("sum", 3.0, {"weight": (1.0, 2.0)}), Finish("sums")),
    )


def _bias_as(values: Sequence[float]) -> Implementation:
    def fill(name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
        return torch.tensor(values, dtype=torch.float32) if name == "bias" else grad

    return _finishing_with(fill, f"bias {[v.hex() for v in values]} where it has no gradient")


NOT_POSITIVE_ZEROS: dict[str, tuple[float, float]] = {
    "-0.0": (-0.0, -0.0),
    "+0.0 and -0.0": (0.0, -0.0),
    "a subnormal": (0.0, 2.0**-149),
}


@pytest.mark.parametrize("oracles", ["strict", "bound"])
@pytest.mark.parametrize("values", list(NOT_POSITIVE_ZEROS))
def test_anything_but_positive_zeros_where_the_reference_has_none_fails(
    values: str, oracles: str
) -> None:
    """Semantics §12: only an all +0.0 gradient (bit for bit) where the reference has None is a
    note; -0.0 or any other value there is a divergence, with or without oracle 1."""
    verdict = judge(
        _bias_as(NOT_POSITIVE_ZEROS[values]), _untouched_bias(), oracles=ORACLE_SETS[oracles]
    )
    finish = verdict.steps[-1]
    expected_oracle = "emulation" if oracles == "strict" else "semantics"
    assert finish.failed == (expected_oracle,) and finish.notes == (), _verdict_text(verdict)
    assert finish.lines == ("step 1 (finish_sums): grads['bias'] expected None, got values",)


def test_positive_zeros_where_the_reference_has_none_are_a_note_without_oracle_1() -> None:
    """Under ``--oracle bound`` too, an all +0.0 gradient where the reference has None is a note."""
    verdict = judge(_bias_as((0.0, 0.0)), _untouched_bias(), oracles=ORACLE_SETS["bound"])
    assert not verdict.failed, _verdict_text(verdict)
    assert verdict.steps[-1].notes == (
        "step 1 (finish_sums): grads['bias'] is all +0.0 where the reference has None",
    )


def test_none_where_the_reference_has_values_fails_without_oracle_1() -> None:
    """Under ``--oracle bound`` a finished gradient of None where the reference has values is a
    divergence of oracle 3 (oracle 2 has no value to bound)."""
    verdict = judge(
        _finishing_with(lambda name, grad: None, "every gradient None"),
        _untouched_bias(),
        oracles=ORACLE_SETS["bound"],
    )
    finish = verdict.steps[-1]
    assert finish.failed == ("semantics",), _verdict_text(verdict)
    assert finish.lines == ("step 1 (finish_sums): grads['weight'] is None, expected values",)


# ------------------------------------------------------------------ the metrics, by hand

SMALLEST_SUBNORMAL32 = 2.0**-149

# (expected, actual, work dtype, max ulps): |a - e| over D's spacing at the EXPECTED value;
# ±0 are 0 apart, NaN matches NaN (sign and payload not compared), any other NaN/inf mismatch
# is infinitely far.
ULPS_CASES: dict[str, tuple[tuple[float, ...], tuple[float, ...], str, float]] = {
    "equal": ((1.0, -3.5), (1.0, -3.5), "float32", 0.0),
    "one float32 spacing above 1": ((1.0,), (1.0 + 2.0**-23,), "float32", 1.0),
    "spacing at the expected value, not the actual": ((2.0,), (1.0,), "float32", 2.0**22),
    "the other way round": ((1.0,), (2.0,), "float32", 2.0**23),
    "in bfloat16's spacing": ((1.0,), (1.5,), "bfloat16", 64.0),
    "in float16's spacing": ((1.0,), (1.0 + 2.0**-10,), "float16", 1.0),
    "the maximum over elements": ((1.0, 1.0, 1.0), (1.0, 1.0 + 2.0**-21, 1.0), "float32", 4.0),
    "+0.0 and -0.0": ((0.0, -0.0), (-0.0, 0.0), "float32", 0.0),
    "zero to the smallest subnormal": ((0.0,), (SMALLEST_SUBNORMAL32,), "float32", 1.0),
    "subnormals": ((SMALLEST_SUBNORMAL32,), (3 * SMALLEST_SUBNORMAL32,), "float32", 2.0),
    "NaN and NaN": ((math.nan,), (-math.nan,), "float32", 0.0),
    "NaN and NaN, then one spacing": ((math.nan, 1.0), (math.nan, 2.0), "float32", 2.0**23),
    "inf and inf, then one spacing": ((math.inf, 1.0), (math.inf, 2.0), "float32", 2.0**23),
    "inf and -inf": ((math.inf,), (-math.inf,), "float32", math.inf),
    "inf expected, finite got": ((math.inf,), (1.0,), "float32", math.inf),
    "finite expected, -inf got": ((1.0,), (-math.inf,), "float32", math.inf),
    "NaN expected, finite got": ((math.nan,), (1.0,), "float32", math.inf),
    "finite expected, NaN got": ((1.0,), (math.nan,), "float32", math.inf),
    "inf expected, NaN got": ((math.inf,), (math.nan,), "float32", math.inf),
}


@pytest.mark.parametrize("case", list(ULPS_CASES))
def test_ulps_is_the_distance_in_spacings_of_the_work_dtype_at_the_expected_value(
    case: str,
) -> None:
    """_ulps: max over elements of |a - e| / spacing_D(e), 0 for ±0 against each other and for
    NaN against NaN, +inf where a NaN or an infinity is not matched (values derived by hand)."""
    expected, actual, dtype, ulps = ULPS_CASES[case]
    got = wacc.judge.verdict._ulps(np.array(expected), np.array(actual), dtype)
    assert got == ulps, (case, got, ulps)


def test_relative_error_is_taken_over_the_nonzero_exact_values_only() -> None:
    """_rel_error: max |a - x| / |x| computed exactly over the elements whose exact value x is
    nonzero (an exact zero is skipped whatever sits there, ±0, inf or NaN); a NaN or an
    infinity against a nonzero x, or a ratio beyond float64, is +inf; any shape is flattened."""
    tiny = 2.0**-1022  # float64's smallest normal: every nonzero x below is subnormal

    def rel_error(actual: np.ndarray, exact: list[Fraction]) -> float:
        return wacc.judge.verdict._rel_error(actual, exact, tiny, [0.0] * len(exact))

    # x = 0 first (skipped), then |1.5 - 1| / 1 = 1/2 and |-3 + 4| / 4 = 1/4.
    assert rel_error(np.array([5.0, 1.5, -3.0]), [Fraction(0), Fraction(1), Fraction(-4)]) == 0.5
    # Exact, not in float: |1/4 - 1/3| / (1/3) = 1/4.
    assert rel_error(np.array([0.25]), [Fraction(1, 3)]) == 0.25
    assert rel_error(np.array([[0.25, 1.5]]), [Fraction(1, 3), Fraction(1)]) == 0.5
    assert rel_error(np.array([1.0, -2.0]), [Fraction(1), Fraction(-2)]) == 0.0
    assert rel_error(np.array([-0.0, math.inf, math.nan]), [Fraction(0)] * 3) == 0.0
    assert rel_error(np.array([-0.0]), [Fraction(1, 2**200)]) == 1.0
    assert rel_error(np.array([1.0, math.nan]), [Fraction(1), Fraction(1)]) == math.inf
    assert rel_error(np.array([-math.inf]), [Fraction(1)]) == math.inf
    assert rel_error(np.array([LARGEST_FLOAT64]), [Fraction(1, 2**1022)]) == math.inf
    assert rel_error(np.array([]), []) == 0.0


def test_relative_error_skips_the_exact_values_below_the_normal_range() -> None:
    """_rel_error only counts elements whose exact value is at least D's smallest normal: in
    float16 (smallest normal 2**-14) a 0 where the exact value is 2**-20 is skipped (the bound's
    absolute term judges it), while a 0 against exactly 2**-14, or against -2**-14, is a
    relative error of 1."""
    rel_error = wacc.judge.verdict._rel_error
    tiny = 2.0**-14
    assert rel_error(np.array([0.0]), [Fraction(1, 2**20)], tiny, [0.0]) == 0.0
    both = [Fraction(1, 2**20), Fraction(1, 2**14)]
    assert rel_error(np.array([0.0, 0.0]), both, tiny, [0.0, 0.0]) == 1.0
    assert rel_error(np.array([0.0]), [Fraction(-1, 2**14)], tiny, [0.0]) == 1.0
    assert rel_error(np.array([math.nan]), [Fraction(1, 2**15)], tiny, [0.0]) == 0.0


def test_relative_error_skips_the_elements_whose_bound_reaches_their_value() -> None:
    """Where the error bound is at least |x| (a cancellation: the exact value is far below the
    terms summed), the bound's absolute part decides and the element is skipped: a 0 against
    x = 2**-40 with bound 2**-40 counts nothing, with bound just below 2**-40 it is 1; a
    well-conditioned element next to it still counts."""
    rel_error = wacc.judge.verdict._rel_error
    tiny = 2.0**-1022
    x = Fraction(1, 2**40)
    assert rel_error(np.array([0.0]), [x], tiny, [2.0**-40]) == 0.0
    assert rel_error(np.array([0.0]), [x], tiny, [2.0**-40 * (1 - 2.0**-53)]) == 1.0
    assert rel_error(np.array([0.0, 1.5]), [x, Fraction(1)], tiny, [1.0, 0.0]) == 0.5


def test_the_helpers_refuse_inputs_of_different_lengths() -> None:
    """The judge's helpers pair arrays element by element and traces step by step: inputs of
    different lengths are a ValueError, never a comparison of the common prefix."""
    verdict = wacc.judge.verdict
    with pytest.raises(ValueError):
        verdict._ulps(np.array([1.0, 2.0]), np.array([1.0]), "float32")
    with pytest.raises(ValueError):
        verdict._rel_error(np.array([1.0]), [Fraction(1), Fraction(2)], 2.0**-1022, [0.0, 0.0])
    scenario = _every_corruption()
    trace = run_reference(scenario)
    short = ScenarioTrace(outcomes=trace.outcomes[:-1], implementation=trace.implementation)
    with pytest.raises(ValueError):
        verdict._windows(scenario, short)
    with pytest.raises(ValueError):
        verdict._strip_interruptions(scenario, short)
    for helper in (verdict._agnostic_expectations, verdict._checksum_optional):
        with pytest.raises(ValueError):
            helper(scenario, trace, short)
        with pytest.raises(ValueError):
            helper(scenario, short, trace)


def test_the_worst_element_refuses_inputs_of_different_lengths() -> None:
    """_worst_element, like the other helpers, raises ValueError when the exact values or the
    bounds are fewer than the elements (never a line about a truncated window)."""
    one, two = [Fraction(1)], [Fraction(1), Fraction(2)]
    with pytest.raises(ValueError):  # fewer exact values than elements
        wacc.judge.verdict._worst_element(np.array([3.0, 5.0]), one, np.array([0.5, 0.5]))
    with pytest.raises(ValueError):  # fewer bounds than elements
        wacc.judge.verdict._worst_element(np.array([3.0, 5.0]), two, np.array([0.5]))


# ----------------------------------------------------------------- the windows of oracle 2


def test_the_window_model_follows_errors_checkpoints_and_restores() -> None:
    """_windows: after each accumulate the open window (a refused one adds nothing), at a
    finish the window it closed (None if it raised), None at checkpoints and restores; a
    restore reopens its checkpoint's window, a skipped corrupted restore changes nothing."""
    scenario = _scenario(
        "float32",
        (("weight", (1,)),),
        (
            Checkpoint(),  # of the empty window: the pending kinds do not apply to it
            Accumulate.of("sum", 2.0, {"weight": (1.0,)}),
            RestoreCorrupted("pending_unknown_parameter"),  # skipped
            Accumulate.of("mean", 3.0, {"weight": (2.0,)}),
            Checkpoint(),
            Accumulate.of("sum", 5.0, {"weight": (4.0,)}),
            Restore(),
            Accumulate.of("sum", -1.0, {"weight": (8.0,)}),  # InvalidWeightError
            Finish("sums"),
            Finish("mean"),  # ZeroTotalWeightError: the window is empty
        ),
    )
    expected = run_reference(scenario)
    assert expected.outcomes[2].skipped and expected.outcomes[2].error is None
    assert expected.outcomes[7].error == "InvalidWeightError"
    assert expected.outcomes[9].error == "ZeroTotalWeightError"
    windows = wacc.judge.verdict._windows(scenario, expected)
    shown = [None if window is None else [(t.kind, t.weight) for t in window] for window in windows]
    two = [("sum", 2.0), ("mean", 3.0)]
    assert shown == [
        None,
        [("sum", 2.0)],
        None,
        two,
        None,
        [*two, ("sum", 5.0)],
        None,
        two,
        two,
        None,
    ]


# ------------------------------------------------- implementations with one deviation each


class _Wrapping:
    """wacc_torch (reproducible), every attribute forwarded; subclasses change one method."""

    def __init__(self, dtype: torch.dtype, loss_scale: float) -> None:
        self._inner = wacc_torch.WeightedGradientsAccumulator(dtype=dtype, loss_scale=loss_scale)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _implementation(cls: type[_Wrapping], what: str) -> Implementation:
    return Implementation(spec=f"wacc_torch {what}", factory=cls, fused=False, missing=())


class _WithoutChecksum(_Wrapping):
    """Records without the optional ``checksum`` field (semantics §9)."""

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict(checksum=False)

    def state_dict_async(self) -> wacc_torch.StateDictHandle:
        return self._inner.state_dict_async(checksum=False)


class _RecordsOtherBuffers(_Wrapping):
    """Accumulates correctly, but its record leaves out the buffer of ``bias`` and holds the
    negation of the buffer of ``weight``."""

    def state_dict(self) -> dict[str, Any]:
        record = self._inner.state_dict(checksum=False)
        pending = dict(record["pending"])
        pending.pop("bias", None)
        if "weight" in pending:
            pending["weight"] = -pending["weight"]
        return {**record, "pending": pending}


class _MisreadsPendingOnLoad(_Wrapping):
    """Its restore loads the negation of every pending buffer of the record."""

    def load_state_dict(self, record: dict[str, Any], module: torch.nn.Module) -> None:
        changed = {key: value for key, value in record.items() if key != "checksum"}
        changed["pending"] = {name: -buffer for name, buffer in record["pending"].items()}
        self._inner.load_state_dict(changed, module)


class _MeanOfNothing(_Wrapping):
    """finish_mean of a window with W == 0 returns the (empty) sums instead of raising
    ZeroTotalWeightError."""

    def finish_mean(self) -> wacc_torch.AccumulatedGradients:
        try:
            return self._inner.finish_mean()
        except wacc_torch.ZeroTotalWeightError:
            return self._inner.finish_sums()


RESUME_LINE = (
    "resume is not bit-identical: the finished results differ from the same scenario run "
    "without its checkpoints and restores"
)


# -------------------------------------------------------------- the verdict's own summaries


def test_maximum_is_the_largest_value_of_a_metric_over_the_steps() -> None:
    """ScenarioVerdict.maximum: the largest max_ulps / max_rel_error / max_ratio of any step,
    0.0 for a scenario without steps. Dividing an fp16 mean by S = 2**15 a second time flushes
    (1.5 * 2**-12, -2**-13) to ±0: 1.5 * 2**-12 / 2**-22 = 1536 ulps, relative error 1."""
    scenario = CORPUS["fp16 S=2**15, W=4096: S*W overflows, sequential division does not"]
    verdict = judge(load_implementation("tests.wacc.impls:double_unscale"), scenario)
    assert verdict.maximum("max_ulps") == 1536.0, _verdict_text(verdict)
    assert verdict.maximum("max_rel_error") == 1.0
    finish = verdict.steps[-1]
    assert verdict.maximum("max_ratio") == finish.max_ratio > 1.0
    assert all(step.max_ratio < finish.max_ratio for step in verdict.steps[:-1])
    empty = judge(load_implementation(DEFAULT_IMPL), _scenario("float32", (("weight", (1,)),), ()))
    assert empty.steps == () and not empty.failed and empty.describe() == []
    for metric in ("max_ulps", "max_rel_error", "max_ratio"):
        assert empty.maximum(metric) == 0.0 and isinstance(empty.maximum(metric), float)


def test_describe_prefixes_each_line_with_its_failed_oracles_and_stops_at_the_limit() -> None:
    """ScenarioVerdict.describe: the scenario-level lines first, then every step's lines, each
    prefixed with the oracles that failed there ("[emulation, bound] ..."), the first 12 by
    default and the first ``limit`` when given."""
    scenario = CORPUS["fp16 S=2**15, W=4096: S*W overflows, sequential division does not"]
    verdict = judge(load_implementation("tests.wacc.impls:double_unscale"), scenario)
    lines = verdict.describe()
    assert lines[:2] == [
        "[emulation, bound] step 2 (finish_mean) grads['weight'][flat 0]: "
        "expected 0.0003662 (0x1.800p-12), got 0.0 (0x0.000p+0)",
        "[emulation, bound] step 2 (finish_mean) grads['weight'][flat 1]: "
        "expected -0.0001221 (-0x1.000p-13), got -0.0 (-0x0.000p+0)",
    ], lines
    assert lines[2].startswith("[emulation, bound] step 2 (finish_mean): 'weight' error/bound = ")
    # the worst element, its value and the exact one (the reference's 0x1.8p-12) are named
    assert f"[flat 0] = 0.0, exact {float.fromhex('0x1.8p-12')!r}, bound " in lines[2], lines[2]
    assert len(lines) == 3

    refused = judge(refusing_with(ValueError, opaque=False), _every_corruption())
    every = refused.describe(limit=1000)
    assert len(every) > 13, every
    assert refused.describe() == every[:12]
    assert refused.describe(limit=5) == every[:5]
    assert every[:2] == [
        "[semantics] step 2 (restore_corrupted): error expected RecordError, "
        "got unexpected ValueError",
        "[semantics] step 2 (restore_corrupted): expected RecordError, got unexpected ValueError",
    ]


# ---------------------------------------------------------------- values (oracle 1) in detail


def test_pending_buffers_are_compared_by_name_then_by_value() -> None:
    """Oracle 1 on a schema record: a missing pending buffer is reported with both name lists,
    and the buffers both have are compared element by element, each line naming the buffer."""
    scenario = _scenario(
        "float32",
        (("weight", (2,)), ("bias", ())),
        (
            Accumulate.of("sum", 1.0, {"weight": (1.0, -2.0), "bias": (0.5,)}),
            Finish("sums"),
        ),
    )
    verdict = judge(_implementation(_RecordsOtherBuffers, "recording other buffers"), scenario)
    step = verdict.steps[0]
    assert step.failed[0] == "emulation", _verdict_text(verdict)
    assert step.lines[:3] == (
        "step 0 (accumulate_sum, weight 1.0): pending buffers ['weight'], expected ['bias', "
        "'weight']",
        "step 0 (accumulate_sum, weight 1.0) pending['weight'][flat 0]: expected 1.0 "
        "(0x1.000000p+0), got -1.0 (-0x1.000000p+0); input grads['weight'][flat 0] = 1.0 "
        "(0x1.000000p+0)",
        "step 0 (accumulate_sum, weight 1.0) pending['weight'][flat 1]: expected -2.0 "
        "(-0x1.000000p+1), got 2.0 (0x1.000000p+1); input grads['weight'][flat 1] = -2.0 "
        "(-0x1.000000p+1)",
    ), step.lines
    assert not verdict.steps[1].failed, _verdict_text(verdict)  # the finished sums are right


def _presence_mix(name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Parameter a: None (as expected); b: +0.0 where None is expected; c: None where values
    are expected; d: negated."""
    if name == "b":
        return torch.zeros(2)
    if name == "c":
        return None
    if name == "d" and grad is not None:
        return -grad
    return grad


@pytest.mark.parametrize("oracles", ["strict", "bound"])
def test_every_parameter_of_a_finished_result_is_judged(oracles: str) -> None:
    """Each finished gradient is judged in turn, whatever came before it: None on both sides is
    fine, +0.0 where None is expected is a note, None where values are expected is a line, and
    (under oracle 1) a wrong value is a line per element naming the parameter."""
    scenario = _scenario(
        "float32",
        (("a", (2,)), ("b", (2,)), ("c", (2,)), ("d", (2,))),
        (Accumulate.of("sum", 1.0, {"c": (1.0, 2.0), "d": (3.0, -4.0)}), Finish("sums")),
    )
    verdict = judge(
        _finishing_with(_presence_mix, "a mix of None and values"),
        scenario,
        oracles=ORACLE_SETS[oracles],
    )
    finish = verdict.steps[-1]
    assert finish.notes == (
        "step 1 (finish_sums): grads['b'] is all +0.0 where the reference has None",
    ), _verdict_text(verdict)
    missing = "step 1 (finish_sums): grads['c'] is None, expected values"
    if oracles == "strict":
        assert finish.lines[:3] == (
            missing,
            "step 1 (finish_sums) grads['d'][flat 0]: "
            "expected 3.0 (0x1.800000p+1), got -3.0 (-0x1.800000p+1)",
            "step 1 (finish_sums) grads['d'][flat 1]: "
            "expected -4.0 (-0x1.000000p+2), got 4.0 (0x1.000000p+2)",
        ), finish.lines
    else:
        assert finish.lines[0] == missing, finish.lines
    assert finish.lines[-1].startswith("step 1 (finish_sums): 'd' error > bound: ")


@pytest.mark.parametrize("oracles", ["strict", "bound"])
def test_a_result_where_the_reference_raises_fails_semantics_only(oracles: str) -> None:
    """finish_mean of an empty window must raise ZeroTotalWeightError; an implementation that
    returns a result there fails oracle 3 at that step (with no value to compare or bound)."""
    scenario = _scenario(
        "float32",
        (("weight", (2,)),),
        (Accumulate.of("sum", 1.0, {"weight": (1.0, 2.0)}), Finish("sums"), Finish("mean")),
    )
    verdict = judge(
        _implementation(_MeanOfNothing, "returning the mean of nothing"),
        scenario,
        oracles=ORACLE_SETS[oracles],
    )
    assert [step.failed for step in verdict.steps] == [(), (), ("semantics",)], _verdict_text(
        verdict
    )
    finish = verdict.steps[-1]
    assert finish.expected_error == "ZeroTotalWeightError" and finish.actual_error is None
    assert finish.lines[0] == "step 2 (finish_mean): error expected ZeroTotalWeightError, got None"
    assert finish.max_ulps == finish.max_rel_error == finish.max_ratio == 0.0


# ----------------------------------------------------------------- records (oracle 3) in detail


def test_records_without_checksum_skip_the_checksum_corruptions() -> None:
    """The checksum is optional (semantics §9): for records without one, the two checksum
    corruption kinds do not apply, the run skips them, and the judge accepts that."""
    implementation = _implementation(_WithoutChecksum, "without checksums")
    scenario = _every_corruption()
    checksum_steps = [
        index
        for index, step in enumerate(scenario.steps)
        if isinstance(step, RestoreCorrupted) and step.kind in CHECKSUM_KINDS
    ]
    assert len(checksum_steps) == len(CHECKSUM_KINDS)
    with_checksum = judge(load_implementation(DEFAULT_IMPL), scenario)
    assert [with_checksum.steps[i].actual_error for i in checksum_steps] == ["RecordError"] * 2
    verdict = judge(implementation, scenario)
    assert not verdict.failed, _verdict_text(verdict)
    assert [verdict.steps[i].actual_error for i in checksum_steps] == [None, None]
    assert all(verdict.steps[i].expected_error == "RecordError" for i in checksum_steps)


def test_a_restore_that_changes_the_results_fails_resume() -> None:
    """Oracle 3's resume check: when every restore loads a checkpoint taken right before it
    (corrupted restores in between allowed), the finished results must equal those of the same
    scenario without checkpoints and restores; a restore that misreads the buffers fails it, and
    describe() shows that line first."""
    scenario = _scenario(
        "float32",
        (("weight", (2,)),),
        (
            Accumulate.of("sum", 1.0, {"weight": (1.0, 2.0)}),
            Checkpoint(),
            RestoreCorrupted("issued_negative"),
            Restore(),
            Finish("sums"),
        ),
    )
    verdict = judge(_implementation(_MisreadsPendingOnLoad, "misreading buffers"), scenario)
    assert verdict.scenario_lines == (RESUME_LINE,), _verdict_text(verdict)
    assert verdict.describe()[0] == RESUME_LINE
    assert "semantics" in verdict.failed_oracles


ROLLBACKS: dict[str, tuple[Any, ...]] = {
    # The restore drops the accumulate after the checkpoint: not the straight run's result.
    "an accumulate rolled back": (
        Checkpoint(),
        Accumulate.of("sum", 1.0, {"weight": (1.0, 2.0)}),
        Restore(),
        Accumulate.of("sum", 2.0, {"weight": (3.0, 4.0)}),
        Finish("sums"),
    ),
    # The restore reopens a finished window.
    "a finish rolled back": (
        Accumulate.of("sum", 1.0, {"weight": (1.0, 2.0)}),
        Checkpoint(),
        Finish("sums"),
        Restore(),
        Finish("mean"),
    ),
    # A resume where a finish raises (W == 0): no result to compare, on either side.
    "a finish that raises": (
        Checkpoint(),
        Restore(),
        Finish("mean"),
        Accumulate.of("mean", 2.0, {"weight": (3.0, 4.0)}),
        Finish("mean"),
    ),
}


@pytest.mark.parametrize("name", list(ROLLBACKS))
def test_a_correct_implementation_passes_restores_that_roll_back(name: str) -> None:
    """The resume check applies only where every restore follows its checkpoint directly; a
    restore that rolls steps back (and a resumed finish that raises) is no failure for a correct
    implementation."""
    scenario = _scenario("float32", (("weight", (2,)),), ROLLBACKS[name])
    verdict = judge(load_implementation(DEFAULT_IMPL), scenario)
    assert not verdict.failed, _verdict_text(verdict)


RESTORE_ORDERS: dict[str, tuple[tuple[Any, ...], bool]] = {
    "no restore": ((Accumulate.of("sum", 1.0, {"weight": (1.0,)}), Finish("sums")), True),
    "checkpoint, restore": ((Checkpoint(), Restore()), True),
    "checkpoint, restore, restore": ((Checkpoint(), Restore(), Restore()), True),
    "corrupted restores in between": (
        (
            Accumulate.of("sum", 1.0, {"weight": (1.0,)}),
            Checkpoint(),
            RestoreCorrupted("issued_negative"),
            Restore(),
        ),
        True,
    ),
    "an accumulate in between": (
        (Checkpoint(), Accumulate.of("sum", 1.0, {"weight": (1.0,)}), Restore()),
        False,
    ),
    "a finish in between": ((Checkpoint(), Finish("sums"), Restore()), False),
    "a second restore after an accumulate": (
        (Checkpoint(), Restore(), Accumulate.of("sum", 1.0, {"weight": (1.0,)}), Restore()),
        False,
    ),
    "a new checkpoint after the accumulate": (
        (
            Checkpoint(),
            Accumulate.of("sum", 1.0, {"weight": (1.0,)}),
            Checkpoint(),
            Restore(),
        ),
        True,
    ),
}


@pytest.mark.parametrize("name", list(RESTORE_ORDERS))
def test_restores_follow_checkpoints_only_with_nothing_but_corrupted_restores_between(
    name: str,
) -> None:
    """_restores_follow_checkpoints: True when each restore has only its checkpoint, other
    restores or corrupted restores before it since the last checkpoint (resume is then exact)."""
    steps, follows = RESTORE_ORDERS[name]
    scenario = _scenario("float32", (("weight", (1,)),), steps)
    assert wacc.judge.verdict._restores_follow_checkpoints(scenario) is follows


# ------------------------------------------------------------------ what a verdict records


def test_the_verdict_records_the_scenario_the_implementation_weights_and_messages() -> None:
    """A ScenarioVerdict names the scenario judged (in module order) and the implementation's
    spec, keeps each raising step's exception message by step index, and each StepVerdict the
    weight of its accumulate step (None for other steps)."""
    scenario = _every_corruption()
    implementation = refusing_with(ValueError, opaque=False)
    verdict = judge(implementation, scenario)
    assert verdict.scenario == in_module_order(scenario)
    assert verdict.implementation == "tests.wacc.impls:refusing_with(ValueError, schema)"
    assert [step.weight for step in verdict.steps] == [3.0] + [None] * (len(scenario.steps) - 1)
    refused = _refused_steps(verdict)
    assert sorted(verdict.messages) == refused, verdict.messages
    first = "field 'format_version' must be 1, got 2"
    # each message names the implementation's own line that raised
    assert verdict.messages[2].startswith(
        f"ValueError: refused with ValueError: {first} (at tests/wacc/impls.py:"
    ), verdict.messages[2]
    clean = judge(load_implementation(DEFAULT_IMPL), scenario)
    assert not clean.failed, clean.messages
    assert clean.messages[2].startswith(f"RecordError: {first} (at wacc_torch/"), clean.messages
    assert sorted(clean.messages) == refused and clean.implementation == DEFAULT_IMPL
    assert judge(load_implementation(DEFAULT_IMPL), _convert_then_add()).messages == {}


def test_the_implementation_runs_on_the_device_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """judge passes its ``device`` to every run of the implementation: the scenario and, for
    the resume check, the same scenario without checkpoints and restores."""
    devices: list[object] = []
    real = wacc.judge.verdict.run_implementation

    def recording(*args: Any, **kwargs: Any) -> Any:
        devices.append(kwargs.get("device", "not given"))
        return real(*args, **kwargs)

    monkeypatch.setattr(wacc.judge.verdict, "run_implementation", recording)
    device = torch.device("cpu")
    verdict = judge(
        load_implementation(DEFAULT_IMPL),
        CORPUS["mid-window resume, mixed sum and mean"],
        device=device,
    )
    assert not verdict.failed, _verdict_text(verdict)
    assert devices == [device, device]


def test_lines_are_grouped_by_the_step_they_name() -> None:
    """_by_step: each line goes to the step its ``step N `` prefix names (the last step when N is
    past the end), a line without that prefix to step 0; there is always a step 0 group."""
    lines = [
        "trace length: expected 3 steps, got 2",
        "step 1 (finish_sums): a",
        "step 7 (checkpoint): b",
        "step 0 (accumulate_sum): c",
        "step 2 (restore): d",
    ]
    assert wacc.judge.verdict._by_step(lines, 3) == [
        ["trace length: expected 3 steps, got 2", "step 0 (accumulate_sum): c"],
        ["step 1 (finish_sums): a"],
        ["step 7 (checkpoint): b", "step 2 (restore): d"],
    ]
    assert wacc.judge.verdict._by_step(lines[:1], 0) == [lines[:1]]


# ---------------------------------------------------------- the exact values behind oracle 2

EXACT_WINDOWS: dict[str, tuple[str, tuple[Any, ...]]] = {
    # W = 2: the zero-weight batch adds nothing, the mean (6, 10) / 2 is exact.
    "a zero-weight batch first": (
        "float32",
        (
            Accumulate.of("sum", 0.0, {"weight": (1.0, 2.0)}),
            Accumulate.of("sum", 2.0, {"weight": (3.0, 5.0)}),
            Finish("mean"),
        ),
    ),
    # W = 2: a batch without gradients counts in W only, the mean (3, 5) / 2 is exact.
    "a batch without gradients first": (
        "float32",
        (
            Accumulate.of("sum", 1.0, {}),
            Accumulate.of("sum", 1.0, {"weight": (3.0, 5.0)}),
            Finish("mean"),
        ),
    ),
    # A mean step multiplies by w_D = conv_bf16(0.1) and W is the sum of those: the exact
    # mean of one batch is its gradient, (1, -3), whatever the rounding of w_D.
    "a mean batch whose weight rounds in D": (
        "bfloat16",
        (Accumulate.of("mean", 0.1, {"weight": (1.0, -3.0)}), Finish("mean")),
    ),
}


@pytest.mark.parametrize("name", list(EXACT_WINDOWS))
def test_the_exact_mean_counts_every_batch_of_the_window(name: str) -> None:
    """Oracle 2's exact value Σ c_k / S / W over the whole window (zero-weight and gradient-less
    batches skipped, later ones still counted; a mean batch with its D-rounded weight): for
    windows whose mean is exactly representable, wacc_torch's mean has relative error 0."""
    dtype, steps = EXACT_WINDOWS[name]
    verdict = judge(load_implementation(DEFAULT_IMPL), _scenario(dtype, (("weight", (2,)),), steps))
    assert not verdict.failed, _verdict_text(verdict)
    finish = verdict.steps[-1]
    assert finish.max_rel_error == 0.0 and finish.max_ratio == 0.0, finish


# ------------------------------------------------------------- more oracle 1/3 details


class _FinishReportsMore(_Wrapping):
    """finish_sums reports twice the window's weight and no gradient for ``bias``."""

    def finish_sums(self) -> wacc_torch.AccumulatedGradients:
        result = self._inner.finish_sums()
        return wacc_torch.AccumulatedGradients(
            grads={**result.grads, "bias": None},
            weight=2 * result.weight,
            loss_scale=result.loss_scale,
            issued=result.issued,
            zero_weight=result.zero_weight,
            normalized=result.normalized,
            found_inf=result.found_inf,
        )


@pytest.mark.parametrize("oracles", ["strict", "bound"])
def test_a_finished_result_is_judged_on_its_counters_and_its_gradients(oracles: str) -> None:
    """Oracle 3 compares the counters of a finished result (its weight here), and the None rule
    adds its own line at the same step, with or without oracle 1."""
    scenario = _scenario(
        "float32",
        (("weight", (2,)), ("bias", ())),
        (Accumulate.of("sum", 3.0, {"weight": (1.0, 2.0), "bias": (0.5,)}), Finish("sums")),
    )
    verdict = judge(
        _implementation(_FinishReportsMore, "reporting more"),
        scenario,
        oracles=ORACLE_SETS[oracles],
    )
    weight = (
        "step 1 (finish_sums) result.weight: expected 3.0 (0x1.8000000000000p+1), "
        "got 6.0 (0x1.8000000000000p+2)"
    )
    missing = "step 1 (finish_sums): grads['bias'] is None, expected values"
    finish = verdict.steps[-1]
    if oracles == "strict":
        assert finish.failed == ("emulation", "semantics"), _verdict_text(verdict)
        assert finish.lines == (missing, weight), finish.lines
    else:
        assert finish.failed == ("semantics",), _verdict_text(verdict)
        assert finish.lines == (weight, missing), finish.lines


class _MiscountingRecords(_Wrapping):
    """Accumulates correctly; its record reports issued, zero_weight and total_weight one too
    high."""

    def state_dict(self) -> dict[str, Any]:
        record = self._inner.state_dict(checksum=False)
        return {
            **record,
            "issued": record["issued"] + 1,
            "zero_weight": record["zero_weight"] + 1,
            "total_weight": record["total_weight"] + 1.0,
        }


def test_every_counter_difference_is_reported_at_its_step_however_many() -> None:
    """Oracle 3 reports every difference, not a first few: wrong counters after each of 30
    steps give three lines at each step (90 in all)."""
    steps = [Accumulate.of("sum", 1.0, {"weight": (1.0,)}) for _ in range(29)]
    scenario = _scenario("float32", (("weight", (1,)),), (*steps, Finish("sums")))
    verdict = judge(_implementation(_MiscountingRecords, "miscounting"), scenario)
    assert [len(step.lines) for step in verdict.steps] == [3] * 30, _verdict_text(verdict)
    assert all(step.failed == ("semantics",) for step in verdict.steps)
    assert verdict.steps[28].lines == (
        "step 28 (accumulate_sum) state.issued: expected 29, got 30",
        "step 28 (accumulate_sum) state.zero_weight: expected 0, got 1",
        "step 28 (accumulate_sum) state.total_weight: expected 29.0 (0x1.d000000000000p+4), "
        "got 30.0 (0x1.e000000000000p+4)",
    )


class _ClearsOnBadRecord(_Wrapping):
    """A load that, instead of refusing a bad record, starts a fresh window."""

    def __init__(self, dtype: torch.dtype, loss_scale: float) -> None:
        super().__init__(dtype, loss_scale)
        self._settings = (dtype, loss_scale)

    def load_state_dict(self, record: dict[str, Any], module: torch.nn.Module) -> None:
        try:
            self._inner.load_state_dict(record, module)
        except wacc_torch.RecordError:
            dtype, loss_scale = self._settings
            self._inner = wacc_torch.WeightedGradientsAccumulator(
                dtype=dtype, loss_scale=loss_scale
            )


def test_the_resume_check_needs_a_restore() -> None:
    """Without a (plain) restore there is no resume to check: a corrupted restore that changes
    the results fails at its own step and after, never as a resume failure."""
    scenario = _scenario(
        "float32",
        (("weight", (2,)),),
        (
            Accumulate.of("sum", 1.0, {"weight": (1.0, 2.0)}),
            Checkpoint(),
            RestoreCorrupted("issued_negative"),
            Finish("sums"),
        ),
    )
    verdict = judge(_implementation(_ClearsOnBadRecord, "clearing on a bad record"), scenario)
    assert "semantics" in verdict.steps[2].failed, _verdict_text(verdict)
    assert "emulation" in verdict.steps[3].failed, _verdict_text(verdict)
    assert verdict.scenario_lines == ()


class _RecordsOddBuffers(_Wrapping):
    """Accumulates correctly; its record holds ``a`` in another shape, ``b`` negated, no ``c``
    and an extra buffer ``ghost``."""

    def state_dict(self) -> dict[str, Any]:
        record = self._inner.state_dict(checksum=False)
        pending = dict(record["pending"])
        if "a" in pending:
            pending["a"] = pending["a"].reshape(1, -1)
        if "b" in pending:
            pending["b"] = -pending["b"]
            pending["ghost"] = pending["b"].clone()
        pending.pop("c", None)
        return {**record, "pending": pending}


def test_buffers_of_unknown_names_or_shapes_are_reported_and_the_rest_bounded() -> None:
    """A pending buffer under an unknown name or in another shape is an oracle 1 line and has
    no bound; the buffers after it are still compared and bounded."""
    scenario = _scenario(
        "float32",
        (("a", (2,)), ("b", (2,)), ("c", ())),
        (
            Accumulate.of("sum", 1.0, {"a": (1.0, 2.0), "b": (3.0, 4.0), "c": (5.0,)}),
            Finish("sums"),
        ),
    )
    verdict = judge(_implementation(_RecordsOddBuffers, "recording odd buffers"), scenario)
    step = verdict.steps[0]
    assert step.failed == ("emulation", "bound"), _verdict_text(verdict)
    assert step.lines[:4] == (
        "step 0 (accumulate_sum, weight 1.0): pending buffers ['a', 'b', 'ghost'], expected "
        "['a', 'b', 'c']",
        "step 0 (accumulate_sum, weight 1.0) pending['a']: shape (2,) != (1, 2)",
        "step 0 (accumulate_sum, weight 1.0) pending['b'][flat 0]: expected 3.0 (0x1.800000p+1), "
        "got -3.0 (-0x1.800000p+1); input grads['b'][flat 0] = 3.0 (0x1.800000p+1)",
        "step 0 (accumulate_sum, weight 1.0) pending['b'][flat 1]: expected 4.0 (0x1.000000p+2), "
        "got -4.0 (-0x1.000000p+2); input grads['b'][flat 1] = 4.0 (0x1.000000p+2)",
    ), step.lines
    assert step.lines[4].startswith("step 0 (accumulate_sum, weight 1.0): 'b' error > bound: ")
    assert len(step.lines) == 5 and step.max_ratio == math.inf


# ------------------------------------------------------------------ fused means (oracle 1)


def test_a_fused_fp16_mean_is_judged_per_step_and_element() -> None:
    """Fused float16 means on CPU round the vectorized chunks and the scalar tail of a tensor
    differently (§6 allows both): the stepwise oracle accepts wacc_torch's fused mode on a
    40-element tensor, where no single reference variant matches every element."""
    size = 40
    first = tuple(float(np.float16((k + 1) / 7)) for k in range(size))
    second = tuple(float(np.float16(-(k + 3) / 5)) for k in range(size))
    scenario = Scenario(
        work_dtype="float16",
        grad_dtype="float16",
        loss_scale=1.0,
        fused=True,
        parameters=(("weight", (size,)),),
        steps=(
            Accumulate.of("mean", 0.1, {"weight": first}),
            Accumulate.of("mean", 0.3, {"weight": second}),
            Finish("mean"),
        ),
    )
    verdict = judge(load_implementation("wacc.implementation:wacc_torch_fused"), scenario)
    assert not verdict.failed, _verdict_text(verdict)


def test_a_wrong_fused_step_is_reported_for_every_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step-local oracle 1 of a fused implementation names each element outside the §6 set
    with the values allowed there, for all 70 elements of the tensor."""
    size = 70
    scenario = Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=True,
        parameters=(("weight", (size,)),),
        steps=(Accumulate.of("mean", 3.0, {"weight": (1.0,) * size}), Finish("mean")),
    )

    def weight_applied_twice(
        buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, **_: object
    ) -> None:
        buffer.add_(grad.to(buffer.dtype), alpha=weight * weight)

    monkeypatch.setattr(wacc_torch.buffered, "add_into", weight_applied_twice)
    verdict = judge(load_implementation("wacc.implementation:wacc_torch_fused"), scenario)
    step = verdict.steps[0]
    assert step.failed[0] == "emulation", _verdict_text(verdict)
    elements = [line for line in step.lines if "state.pending['weight'][flat " in line]
    assert len(elements) == size, step.lines
    assert elements[0] == (
        "step 0 (accumulate_mean) state.pending['weight'][flat 0]: got 9.0 (0x1.200000p+3), "
        "allowed ['3.0 (0x1.800000p+1)'] "
        "(buf 0.0 (0x0.000000p+0), g 1.0 (0x1.0000000000000p+0), w_D 3.0 (0x1.800000p+1))"
    ), elements[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_finished_gradient_in_another_dtype_than_d_fails_the_semantics(dtype: str) -> None:
    """semantics §8 hands over the D buffers: means widened to float32 (the same values, exact)
    fail oracle 3 with one line per gradient naming both dtypes, except where D is float32."""
    scenario = Scenario(
        work_dtype=dtype,
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)), ("bias", ())),
        steps=(Accumulate.of("mean", 3.0, {"weight": (1.0, 2.0), "bias": (0.5,)}), Finish("mean")),
    )
    verdict = judge(load_implementation("tests.wacc.impls:widens_means"), scenario)
    if dtype == "float32":
        assert not verdict.failed, _verdict_text(verdict)
        return
    assert verdict.failed_oracles == ("semantics",), _verdict_text(verdict)
    lines = [line for line in verdict.describe() if "tensor; the finished gradients" in line]
    assert lines == [
        f"[semantics] step 1 (finish_mean): grads[{name!r}] is a float32 tensor; the finished "
        f"gradients are the {dtype} buffers (semantics §7, §8)"
        for name in ("weight", "bias")
    ], _verdict_text(verdict)


class _OverflowingMeans(impls._Delegating):
    """finish_mean's means multiplied by 2**16 (float16: +-inf for every |mean| >= 1), with a
    found_inf that describes those values truthfully."""

    def finish_mean(self) -> wacc_torch.AccumulatedGradients:
        result = self._inner.finish_mean()
        grads = {n: None if g is None else g * 2.0**16 for n, g in result.grads.items()}
        found = any(not bool(g.isfinite().all()) for g in grads.values() if g is not None)
        return dataclasses.replace(result, grads=grads, found_inf=found)


def _overflowing_means(dtype: torch.dtype, loss_scale: float) -> _OverflowingMeans:
    return _OverflowingMeans(dtype, loss_scale)


def test_a_found_inf_true_to_wrong_values_fails_the_value_oracles_only() -> None:
    """found_inf is judged against the gradients it describes, never against the reference's
    (semantics §7, §8): means that overflow to inf where the reference's are finite, with a
    found_inf that says so, fail oracles 1 and 2 (the values) and not oracle 3."""
    scenario = Scenario(
        work_dtype="float16",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)), ("bias", ())),
        steps=(Accumulate.of("mean", 3.0, {"weight": (1.0, 2.0), "bias": (0.5,)}), Finish("mean")),
    )
    implementation = Implementation(
        spec="tests.wacc.judge.test_verdict:_overflowing_means",
        factory=_overflowing_means,
        fused=False,
        missing=(),
    )
    verdict = judge(implementation, scenario)
    assert verdict.failed_oracles == ("emulation", "bound"), _verdict_text(verdict)


class _OpaqueWideningMeans(impls._Opaque):
    """Opaque records, and finish_mean's means handed over as float32 whatever D."""

    def finish_mean(self) -> wacc_torch.AccumulatedGradients:
        result = self._inner.finish_mean()
        grads = {n: None if g is None else g.float() for n, g in result.grads.items()}
        return dataclasses.replace(result, grads=grads)


def _opaque_widening_means(dtype: torch.dtype, loss_scale: float) -> _OpaqueWideningMeans:
    return _OpaqueWideningMeans(dtype, loss_scale)


def test_an_opaque_record_implementation_is_still_judged_on_its_finished_dtypes() -> None:
    """The invariants of one trace hold for opaque records too (semantics §7, §8, §12): means
    widened to float32 from a float16 window fail oracle 3 with one line per gradient naming
    both dtypes, although the record is not of the §9 schema."""
    scenario = Scenario(
        work_dtype="float16",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)), ("bias", ())),
        steps=(Accumulate.of("mean", 3.0, {"weight": (1.0, 2.0), "bias": (0.5,)}), Finish("mean")),
    )
    implementation = Implementation(
        spec="tests.wacc.judge.test_verdict:_opaque_widening_means",
        factory=_opaque_widening_means,
        fused=False,
        missing=(),
    )
    verdict = judge(implementation, scenario)
    assert verdict.failed_oracles == ("semantics",), _verdict_text(verdict)
    lines = [line for line in verdict.describe() if "tensor; the finished gradients" in line]
    assert lines == [
        f"[semantics] step 1 (finish_mean): grads[{name!r}] is a float32 tensor; the finished "
        "gradients are the float16 buffers (semantics §7, §8)"
        for name in ("weight", "bias")
    ], _verdict_text(verdict)


def test_the_bound_line_names_the_worst_element_and_says_bound_0_is_exact() -> None:
    """The bound oracle's line names the element whose error is the largest part of its bound,
    with its value, the exact value and the bound; where the bound is 0 it says the exact value
    must come out instead of a ratio of inf; an element without a bound (inf) is never named."""
    from wacc.judge.verdict import _worst_element

    exact = [Fraction(1), Fraction(2), Fraction(3), Fraction(4)]
    bound = np.array([0.5, 0.0, math.inf, 0.25])
    line = _worst_element(np.array([1.25, 2.0, 99.0, 4.5]), exact, bound)
    assert line == "error/bound = 2 > 1: [flat 3] = 4.5, exact 4.0, bound 0.25"
    line = _worst_element(np.array([1.25, 2.5, 99.0, 4.0]), exact, bound)
    assert line == (
        "error/bound = inf: [flat 1] = 2.5, exact 2.0, bound 0 (the exact value must come out)"
    )
    huge = [Fraction(10) ** 400, Fraction(1)]
    line = _worst_element(np.array([0.0, 1.0]), huge, np.array([1.0, 1.0]))
    assert line == "error/bound = inf > 1: [flat 0] = 0.0, exact inf, bound 1"


def test_the_bound_line_names_the_first_worst_element_and_the_sign_of_an_overflow() -> None:
    """Of elements whose error is the same largest part of the bound (a finite ratio, or inf
    where the bound is 0), the line names the first; an exact value beyond float64 is shown as
    the infinity of its sign; with no element whose error is nonzero under a finite bound the
    line says the ratio alone."""
    from wacc.judge.verdict import _worst_element

    ones = [Fraction(1)] * 3
    # |1.5 - 1| / 0.25 = 2 at flat 0 and 2, |1.25 - 1| / 0.25 = 1 at flat 1 (after a larger one)
    line = _worst_element(np.array([1.5, 1.25, 1.5]), ones, np.array([0.25] * 3))
    assert line == "error/bound = 2 > 1: [flat 0] = 1.5, exact 1.0, bound 0.25"
    line = _worst_element(np.array([2.5, 3.0]), [Fraction(2)] * 2, np.array([0.0, 0.0]))
    assert line.startswith("error/bound = inf: [flat 0] = 2.5, exact 2.0, bound 0 "), line
    # -10**400 is below -LARGEST_FLOAT64: its float is -inf; |0 + 10**400| / 1 overflows to +inf
    line = _worst_element(np.array([0.0]), [-(Fraction(10) ** 400)], np.array([1.0]))
    assert line == "error/bound = inf > 1: [flat 0] = 0.0, exact -inf, bound 1"
    # every error 0, or nonzero only where no bound applies (inf): nothing to name
    assert _worst_element(
        np.array([1.0, 2.0]), [Fraction(1), Fraction(2)], np.array([0.5] * 2)
    ) == ("error/bound > 1")
    assert _worst_element(np.array([5.0]), [Fraction(1)], np.array([math.inf])) == (
        "error/bound > 1"
    )


def test_the_exact_result_of_a_window_uses_the_loss_scale_set_before_it() -> None:
    """Oracle 2 divides the window's exact sum by the loss scale in force for that window (set
    by set_loss_scale, not the scenario's initial one): float32, S = 4 from the start value 1,
    one sum batch of weight 1 with gradients (4, 8) finishes as the mean (4, 8) / 4 / 1 = (1, 2),
    exact in float32, so wacc_torch's result has relative error and error/bound 0."""
    scenario = Scenario(
        work_dtype="float32",
        grad_dtype="float32",
        loss_scale=1.0,
        fused=False,
        parameters=(("weight", (2,)),),
        steps=(
            SetLossScale(4.0),
            Accumulate.of("sum", 1.0, {"weight": (4.0, 8.0)}),
            Finish("mean"),
        ),
    )
    verdict = judge(load_implementation(DEFAULT_IMPL), scenario)
    assert not verdict.failed, _verdict_text(verdict)
    finish = verdict.steps[-1]
    assert finish.op == "finish_mean" and finish.max_rel_error == 0.0 and finish.max_ratio == 0.0


def test_zeros_finished_from_an_empty_window_are_a_note_with_nothing_to_bound() -> None:
    """finish_sums of an empty window has None gradients; an implementation that hands in +0.0
    tensors of the parameters' shapes there gets a note (semantics §12), and oracle 2 has no
    batch to bound them by: the verdict holds, under both oracle sets."""

    shapes = {"weight": (2,), "bias": ()}

    class ZerosForNone(_FinishingWith):
        def _changed(
            self, result: wacc_torch.AccumulatedGradients
        ) -> wacc_torch.AccumulatedGradients:
            grads = dict(result.grads)
            result = dataclasses.replace(
                result,
                grads={
                    name: torch.zeros(shape) if grads.get(name) is None else grads[name]
                    for name, shape in shapes.items()
                },
            )
            return super()._changed(result)

    def make(dtype: torch.dtype, loss_scale: float) -> ZerosForNone:
        return ZerosForNone(dtype, loss_scale, lambda name, grad: grad)

    implementation = Implementation(spec="+0.0 for None", factory=make, fused=False, missing=())
    scenario = _scenario("float32", tuple(shapes.items()), (Finish("sums"),))
    for oracles in ("strict", "bound"):
        verdict = judge(implementation, scenario, oracles=ORACLE_SETS[oracles])
        assert not verdict.failed, _verdict_text(verdict)
        assert verdict.steps[0].notes == tuple(
            f"step 0 (finish_sums): grads[{name!r}] is all +0.0 where the reference has None"
            for name in ("weight", "bias")
        )


def test_the_verdict_keeps_the_traceback_of_each_raising_step() -> None:
    """Next to each raising step's message, a ScenarioVerdict keeps the exception's whole
    formatted traceback under the same step index: it starts like Python's and ends with the
    exception class and message the implementation raised."""
    scenario = _every_corruption()
    verdict = judge(refusing_with(ValueError, opaque=False), scenario)
    refused = _refused_steps(verdict)
    assert refused and sorted(verdict.tracebacks) == refused, verdict.tracebacks
    for index in refused:
        text = verdict.tracebacks[index]
        assert text.startswith("Traceback (most recent call last)"), text
        last = text.rstrip().splitlines()[-1]
        assert last.startswith("ValueError: refused with ValueError: "), text
        assert verdict.messages[index].startswith(last), (verdict.messages[index], last)


def test_a_step_is_named_by_its_index_and_op_and_an_accumulate_by_its_weight() -> None:
    """_step_title: every failure line starts with the step's index and op; an accumulate's
    title adds its weight as Python writes the float64 (exact: repr round-trips)."""
    title = wacc.judge.verdict._step_title
    assert title(3, Finish("mean")) == "step 3 (finish_mean)"
    assert (
        title(0, Accumulate.of("sum", 0.1, {"w": (1.0,)})) == "step 0 (accumulate_sum, weight 0.1)"
    )
    assert title(7, Accumulate.of("mean", 1e300, {})) == "step 7 (accumulate_mean, weight 1e+300)"


def test_a_diverging_pending_entry_shows_the_gradient_entry_its_step_added() -> None:
    """_with_inputs: for an accumulate step each pending-buffer line gains the input gradient at
    the same flat position, shown in the work dtype; lines of another step kind, of a parameter
    the step did not touch, or past the input's end are left as they are."""
    with_inputs = wacc.judge.verdict._with_inputs
    step = Accumulate.of("sum", 1.0, {"w": (1.5, -2.0)})
    lines = ["x pending['w'][flat 1]: expected 0.0, got 1.0", "no position here"]
    assert with_inputs(lines, step, "w", "bfloat16") == [
        "x pending['w'][flat 1]: expected 0.0, got 1.0; input grads['w'][flat 1] = -2.0 "
        "(-0x1.00p+1)",
        "no position here",
    ]
    assert with_inputs(lines, step, "other", "float32") == lines
    assert with_inputs(lines, Finish("sums"), "w", "float32") == lines
    beyond = ["x pending['w'][flat 2]: expected 0.0, got 1.0"]
    assert with_inputs(beyond, step, "w", "float32") == beyond
    first = ["x pending['w'][flat 0]: got 1.0"]
    assert with_inputs(first, step, "w", "float32") == [
        "x pending['w'][flat 0]: got 1.0; input grads['w'][flat 0] = 1.5 (0x1.800000p+0)"
    ]


def test_a_bound_below_one_spacing_of_d_says_the_exact_value_must_come_out() -> None:
    """A bound smaller than D's smallest spacing (a few float64 subnormals: the absolute term of
    an exact sum) is named as such, not as a ratio of inf or 1e300; a bound of one spacing or
    more keeps its ratio."""
    line = wacc.judge.verdict._worst_element(
        np.array([-1.0]), [Fraction(-2)], np.array([2.47e-323]), 2.0**-149
    )
    assert line == (
        "error > bound: [flat 0] = -1.0, exact -2.0, bound 2.47e-323, below one spacing of D "
        "(the exact value must come out)"
    )
    line = wacc.judge.verdict._worst_element(
        np.array([-1.0]), [Fraction(-2)], np.array([2.0**-149]), 2.0**-149
    )
    assert line.startswith("error/bound = 7.14e+44 > 1: [flat 0] = -1.0, exact -2.0"), line
