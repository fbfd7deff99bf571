"""The three oracles on single scenarios (wacc.verdict): named corner cases and planted faults.

Every failure message carries the scenario as JSON: ``wacc replay`` runs it again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

import wacc.verdict
import wacc_torch
import wacc_torch.buffered
from tests.wacc.impls import refusing_with
from wacc.implementation import DEFAULT_IMPL, Implementation, load_implementation
from wacc.verdict import ORACLE_SETS, ScenarioVerdict, judge
from wacc_ref.bounds import error_ratio, window_error_bound
from wacc_ref.corruption import CORRUPTION_KINDS
from wacc_ref.oracles import run_reference
from wacc_ref.scenario import (
    Accumulate,
    Checkpoint,
    Finish,
    Restore,
    RestoreCorrupted,
    Scenario,
    to_json,
)

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
    (a plain ValueError is not one) fails oracle 3 at each such restore."""
    verdict = judge(refusing_with(error, opaque=True), _every_corruption())
    refused = _refused_steps(verdict)
    assert refused, _verdict_text(verdict)
    assert [step.index for step in verdict.steps if step.failed] == refused, _verdict_text(verdict)
    for index in refused:
        step = verdict.steps[index]
        assert step.actual_error == f"unexpected {error.__name__}", step
        assert step.failed == ("semantics",), step


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

    monkeypatch.setattr(wacc.verdict, "window_error_bound", replaced_bound)
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
