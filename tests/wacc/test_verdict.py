"""The three oracles on single scenarios (wacc.verdict): named corner cases and planted faults.

Every failure message carries the scenario as JSON: ``wacc replay`` runs it again.
"""

from __future__ import annotations

import pytest
import torch

import wacc_torch
from wacc.implementation import DEFAULT_IMPL, load_implementation
from wacc.verdict import ORACLE_SETS, ScenarioVerdict, judge
from wacc_ref.scenario import Accumulate, Checkpoint, Finish, Restore, Scenario, to_json

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

    def single_rounding_add(
        self: object, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool
    ) -> None:
        del self, weight, mean
        buffer.add_(grad)  # one rounding in the promoted type: the bug the semantics warn of

    monkeypatch.setattr(wacc_torch.WeightedGradientsAccumulator, "_add", single_rounding_add)
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
        self: object, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool
    ) -> None:
        del self, mean
        buffer.add_(grad.to(buffer.dtype), alpha=weight * weight)

    monkeypatch.setattr(wacc_torch.WeightedGradientsAccumulator, "_add", weight_applied_twice)
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

    def single_rounding_add(
        self: object, buffer: torch.Tensor, grad: torch.Tensor, *, weight: float, mean: bool
    ) -> None:
        del self, weight, mean
        buffer.add_(grad)

    monkeypatch.setattr(wacc_torch.WeightedGradientsAccumulator, "_add", single_rounding_add)
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
