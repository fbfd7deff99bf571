"""semantics §7-§8: finish_sums, finish_mean, normalize_sums and AccumulatedGradients.apply_to."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from tests.wacc_torch.support import (
    DEVICES,
    WORK_DTYPE_PARAMS,
    TwoLayer,
    assert_bitwise_equal,
    assert_matches_reference,
    assert_records_equal,
    awkward_values,
    dtype_name,
    grads_snapshot,
    one_parameter,
    tracked_shapes,
)
from wacc_ref.arith import add_rounded, conv_array, div_rounded, mul_rounded, round_array
from wacc_ref.formats import conv_to, op_format, round_to
from wacc_torch import (
    AccumulatedGradients,
    InvalidLossScaleError,
    InvalidWeightError,
    ParameterMismatchError,
    UnsupportedEnvironmentError,
    WeightedGradientsAccumulator,
    ZeroTotalWeightError,
    normalize_sums,
)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_sequential_division_survives_an_overflowing_product(device: str) -> None:
    """fp16 with S = 2**15 and W = 4096 (S*W = 2**27 overflows fp16) finishes finite and exact."""
    scale = 2.0**15
    assert torch.tensor(scale, dtype=torch.float16) * 4096 == float("inf")
    module = one_parameter(device, (4,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=scale)
    first = torch.tensor([0.5, -1.0, 0.25, 2.0**-4], device=device) * scale
    second = torch.tensor([1.0, 0.75, -0.25, 2.0**-4], device=device) * scale
    accumulator.accumulate_sum(module, 1024, grads={"weight": first})
    accumulator.accumulate_sum(module, 3072, grads={"weight": second})
    mean = accumulator.finish_mean()
    assert mean.weight == 4096.0 and mean.normalized
    # Sums S*[1.5, -0.25, 0, 2**-3] are exact in fp16 (49152 <= 65504); dividing by powers of
    # two is exact down to fp16's subnormals: [1.5, -0.25, 0, 2**-3] / 4096.
    assert mean.grads["weight"] is not None
    assert mean.grads["weight"].tolist() == [1.5 * 2.0**-12, -(2.0**-14), 0.0, 2.0**-15]


@pytest.mark.parametrize("device", DEVICES)
def test_float16_mean_with_overflowing_product_is_exact(device: str) -> None:
    """accumulate_mean in fp16 with S = 2**15 and one batch of weight 4096 returns its gradient."""
    scale = 2.0**15
    module = one_parameter(device, (2,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=scale)
    # S * [2**-12, -2**-13] = [8, -4]; times 4096: [32768, -16384], exact in fp16.
    accumulator.accumulate_mean(
        module, 4096, grads={"weight": torch.tensor([8.0, -4.0], device=device)}
    )
    mean = accumulator.finish_mean().grads["weight"]
    assert mean is not None and mean.tolist() == [2.0**-12, -(2.0**-13)]


@pytest.mark.parametrize("device", DEVICES)
def test_float16_total_weight_beyond_float16_range_stays_finite(device: str) -> None:
    """fp16 buffers with W = 70000 (beyond fp16) divide in float32: finite, as semantics rounds."""
    module = one_parameter(device, (3,))
    accumulator = WeightedGradientsAccumulator(dtype=torch.float16, loss_scale=1.0)
    gradient = torch.tensor([7.0, -35.0, 1.0], device=device)
    accumulator.accumulate_sum(module, 30000, grads={"weight": gradient})
    accumulator.accumulate_sum(module, 40000, grads={"weight": torch.zeros(3, device=device)})
    mean = accumulator.finish_mean().grads["weight"]
    assert mean is not None
    expected = [
        round_to(round_to(Fraction(value) / 70000, "float32"), "float16") for value in (7, -35, 1)
    ]
    assert all(value != 0.0 for value in expected)
    assert mean.tolist() == expected, [float(x).hex() for x in mean.tolist()]


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_normalize_sums_matches_stepwise_rounding_reference(
    device: str, dtype: torch.dtype
) -> None:
    """Each element is round_D(round_op(round_D(g / S) / round_op(W))), bit for bit."""
    generator = torch.Generator().manual_seed(5)
    name = dtype_name(dtype)
    op_name = op_format(name).name
    sums = awkward_values((500,), dtype=dtype, around=dtype, generator=generator)
    # 3 is not a power of two: g / 3 rounds. 2**-3 * 7 likewise (7 needs 3 bits).
    for scale in (1.0, 2.0**12, 3.0, 7 * 2.0**-3):
        for weight in (1.0, 3.0, 1001.0, 70000.0, 0.1 + 0.2, 2.0**-20 * 5):
            result = normalize_sums({"g": sums.to(device)}, loss_scale=scale, total_weight=weight)
            values = sums.to(torch.float64).numpy()
            scaled = div_rounded(values, scale, name)
            expected = round_array(div_rounded(scaled, round_to(weight, op_name), op_name), name)
            assert_matches_reference(
                result["g"], expected, f"{name} S={scale.hex()} W={weight.hex()}"
            )


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_normalize_sums_in_place_gives_the_same_bits(dtype: torch.dtype) -> None:
    """``in_place=True`` overwrites and returns the given tensors with the out-of-place values."""
    generator = torch.Generator().manual_seed(6)
    sums = awkward_values((300,), dtype=dtype, around=dtype, generator=generator)
    original = sums.clone()
    fresh = normalize_sums({"g": sums, "none": None}, loss_scale=4.0, total_weight=1001.0)
    assert_bitwise_equal(sums, original, "input after an out-of-place call")
    assert fresh["none"] is None
    in_place = normalize_sums({"g": sums}, loss_scale=4.0, total_weight=1001.0, in_place=True)
    assert in_place["g"] is sums
    assert_bitwise_equal(sums, fresh["g"], "in-place result")


def test_normalize_sums_refuses_bad_arguments() -> None:
    """Zero/negative/NaN W, a bad loss scale (also with no tensor), non-tensors: specific errors."""
    sums = {"g": torch.ones(2, dtype=torch.float16)}
    with pytest.raises(ZeroTotalWeightError, match="0.0"):
        normalize_sums(sums, loss_scale=1.0, total_weight=0.0)
    for weight in (-1.0, float("nan"), float("inf"), 10**400):
        with pytest.raises(InvalidWeightError, match=repr(weight)):
            normalize_sums(sums, loss_scale=1.0, total_weight=weight)
    with pytest.raises(InvalidLossScaleError, match="65536.0.*float16"):
        normalize_sums(sums, loss_scale=2.0**16, total_weight=1.0)
    # Without any tensor there is no D to check against, but S itself must still be valid.
    for scale in (-1.0, float("nan"), "1.0"):
        with pytest.raises(InvalidLossScaleError, match=repr(scale)):
            normalize_sums({"g": None}, loss_scale=scale, total_weight=1.0)  # type: ignore[arg-type]
    with pytest.raises(ParameterMismatchError, match="'g'.*list"):
        normalize_sums({"g": [1.0]}, loss_scale=1.0, total_weight=1.0)  # type: ignore[dict-item]
    with pytest.raises(ParameterMismatchError, match="int32"):
        normalize_sums({"g": torch.ones(2, dtype=torch.int32)}, loss_scale=1.0, total_weight=1.0)
    with pytest.raises(TypeError, match="list"):
        normalize_sums([torch.ones(2)], loss_scale=1.0, total_weight=1.0)  # type: ignore[arg-type]
    assert torch.equal(sums["g"], torch.ones(2, dtype=torch.float16))


@pytest.mark.parametrize("device", DEVICES)
def test_finish_mean_on_zero_total_weight_raises_and_clears_nothing(device: str) -> None:
    """With W == 0, finish_mean raises ZeroTotalWeightError and the window continues unchanged."""
    module = TwoLayer(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=2.0)
    with pytest.raises(ZeroTotalWeightError):
        accumulator.finish_mean()
    for parameter in module.parameters():
        parameter.grad = torch.ones_like(parameter)
    accumulator.accumulate_mean(module, 0)
    accumulator.accumulate_sum(module, 0)
    before = accumulator.state_dict()
    with pytest.raises(ZeroTotalWeightError, match="issued=2, zero_weight=2"):
        accumulator.finish_mean()
    assert_records_equal(accumulator.state_dict(), before)
    shapes = tracked_shapes(module)
    accumulator.accumulate_sum(
        module, 2, grads={name: torch.full(s, 8.0, device=device) for name, s in shapes.items()}
    )
    mean = accumulator.finish_mean()
    assert (mean.issued, mean.zero_weight, mean.weight) == (3, 2, 2.0)
    assert all(g is not None and bool((g == 2.0).all()) for g in mean.grads.values())


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
@pytest.mark.parametrize("device", DEVICES)
def test_two_rank_sums_divided_once_equal_the_mean_of_the_union(
    device: str, dtype: torch.dtype
) -> None:
    """Two ranks' finish_sums, summed and divided once, equal finish_mean of the union, bitwise."""
    scale = 2.0**3
    # Small multiples of S*2**-4: every sum here is exact in every work dtype, so the
    # association order of the batches does not matter and the comparison can be bitwise.
    batches = [
        (3, [1.0, -2.0, 0.5]),
        (0, [float("nan")] * 3),
        (1, [0.25, 3.0, -1.0]),
        (200, [4.0, 0.0, 2.0]),
        (7, [-0.75, 1.5, 0.125]),
    ]
    rank_of = [0, 1, 1, 0, 1]
    ranks = [WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale) for _ in range(2)]
    union = WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale)
    modules = [one_parameter(device, (3,)) for _ in range(3)]
    for (weight, values), rank in zip(batches, rank_of, strict=True):
        gradient = torch.tensor(values, device=device) * scale
        ranks[rank].accumulate_sum(modules[rank], weight, grads={"weight": gradient})
        union.accumulate_sum(modules[2], weight, grads={"weight": gradient})
    local = [accumulator.finish_sums() for accumulator in ranks]
    assert not any(result.normalized for result in local)
    first, second = (result.grads["weight"] for result in local)
    assert first is not None and second is not None
    reduced = normalize_sums(
        {"weight": first + second},
        loss_scale=scale,
        total_weight=local[0].weight + local[1].weight,
    )
    mean = union.finish_mean()
    assert_bitwise_equal(reduced["weight"], mean.grads["weight"], f"{dtype_name(dtype)} mean")
    assert local[0].issued + local[1].issued == mean.issued == 5
    assert local[0].zero_weight + local[1].zero_weight == mean.zero_weight == 1


@pytest.mark.parametrize("device", DEVICES)
def test_finish_starts_a_new_window_and_keeps_the_binding(device: str) -> None:
    """After finish_* the counters are zero, no buffer is pending, the tracked set stays bound."""
    module = TwoLayer(device)
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1.0)
    shapes = tracked_shapes(module)
    ones = {name: torch.ones(shape, device=device) for name, shape in shapes.items()}
    accumulator.accumulate_sum(module, 3, grads=ones)
    sums = accumulator.finish_sums()
    assert (sums.issued, sums.zero_weight, sums.weight, sums.loss_scale) == (1, 0, 3.0, 1.0)
    record = accumulator.state_dict()
    assert (record["issued"], record["zero_weight"], record["total_weight"]) == (0, 0, 0.0)
    assert record["pending"] == {} and record["param_names"] == list(shapes)
    # The handed-over buffers belong to the caller: the next window does not touch them.
    accumulator.accumulate_sum(module, 1, grads=ones)
    assert all(g is not None and bool((g == 1.0).all()) for g in sums.grads.values())
    with pytest.raises(ParameterMismatchError, match="missing"):
        accumulator.accumulate_sum(one_parameter(device, (2,)), 1)
    mean = accumulator.finish_mean()
    assert mean.normalized and accumulator.state.issued == 0


def test_finish_sums_of_an_empty_window_is_allowed() -> None:
    """finish_sums with nothing accumulated returns no gradients and weight 0 (a rank w/o data)."""
    accumulator = WeightedGradientsAccumulator(dtype=torch.float32, loss_scale=1.0)
    sums = accumulator.finish_sums()
    assert sums == AccumulatedGradients(
        grads={},
        weight=0.0,
        loss_scale=1.0,
        issued=0,
        zero_weight=0,
        normalized=False,
        found_inf=False,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_apply_to_writes_grads_in_the_parameter_dtype(device: str) -> None:
    """apply_to converts each gradient to its parameter's dtype and writes None where no buffer."""
    module = TwoLayer(device).to(torch.float64)
    shapes = tracked_shapes(module)
    accumulator = WeightedGradientsAccumulator(dtype=torch.bfloat16, loss_scale=1.0)
    accumulator.accumulate_sum(
        module,
        4,
        grads={
            "first.weight": torch.full(
                shapes["first.weight"], 2.0, device=device, dtype=torch.float64
            )
        },
    )
    for parameter in module.parameters():
        parameter.grad = torch.ones_like(parameter)
    frozen_grad = module.frozen.grad
    accumulator.finish_mean().apply_to(module)
    grads = dict((name, p.grad) for name, p in module.named_parameters())
    assert grads["first.weight"] is not None and grads["first.weight"].dtype == torch.float64
    assert bool((grads["first.weight"] == 0.5).all())
    assert (
        grads["first.bias"] is None
        and grads["second.weight"] is None
        and grads["second.bias"] is None
    )
    assert grads["frozen"] is frozen_grad  # not tracked: left alone


def test_apply_to_checks_every_name_before_writing() -> None:
    """apply_to with an unknown name or a wrong shape raises and writes no .grad."""
    module = TwoLayer()
    for parameter in module.parameters():
        parameter.grad = torch.full_like(parameter, 3.0)
    before = grads_snapshot(module)
    base: dict[str, torch.Tensor | None] = {
        name: torch.zeros(shape) for name, shape in tracked_shapes(module).items()
    }
    for bad, message in (
        (dict(base, extra=torch.zeros(1)), "'extra'"),
        (dict(base, **{"second.bias": torch.zeros(3)}), r"'second.bias'.*\[3\].*\[2\]"),
        # A None gradient before the wrong one: the check goes on past it.
        (
            dict(base, **{"first.weight": None, "second.bias": torch.zeros(3)}),
            r"'second.bias'.*\[3\].*\[2\]",
        ),
    ):
        gradients = AccumulatedGradients(
            grads=bad,
            weight=1.0,
            loss_scale=1.0,
            issued=1,
            zero_weight=0,
            normalized=True,
            found_inf=False,
        )
        with pytest.raises(ParameterMismatchError, match=message):
            gradients.apply_to(module)
        after = grads_snapshot(module)
        for name, grad in before.items():
            assert_bitwise_equal(after[name], grad, f"{name}.grad")


@pytest.mark.parametrize("dtype", WORK_DTYPE_PARAMS)
def test_finish_mean_and_normalized_finish_sums_match_the_reference(dtype: torch.dtype) -> None:
    """finish_mean, and normalize_sums of finish_sums, equal the reference's stepwise mean."""
    name = dtype_name(dtype)
    op_name = op_format(name).name
    scale = 2.0**7
    weights = (1, 7, 200, 3)
    generator = torch.Generator().manual_seed(11)
    gradients = [
        awkward_values((200,), dtype=torch.float32, around=dtype, generator=generator)
        for _ in weights
    ]
    pending, total_weight = np.zeros(200), 0.0
    for weight, gradient in zip(weights, gradients, strict=True):
        weight_d = conv_to(float(weight), name)
        converted = conv_array(gradient.to(torch.float64).numpy(), name)
        pending = add_rounded(pending, mul_rounded(converted, weight_d, name), name)
        total_weight += weight_d  # round_64(W + w_D), in issue order
    scaled = div_rounded(pending, scale, name)
    expected = round_array(div_rounded(scaled, round_to(total_weight, op_name), op_name), name)

    for finish in ("mean", "sums"):
        module = one_parameter("cpu", (200,))
        accumulator = WeightedGradientsAccumulator(dtype=dtype, loss_scale=scale)
        for weight, gradient in zip(weights, gradients, strict=True):
            accumulator.accumulate_mean(module, weight, grads={"weight": gradient})
        if finish == "mean":
            result = accumulator.finish_mean()
            mean = result.grads["weight"]
        else:
            result = accumulator.finish_sums()
            mean = normalize_sums(
                result.grads, loss_scale=result.loss_scale, total_weight=result.weight
            )["weight"]
        assert result.weight == total_weight, (finish, result.weight.hex(), total_weight.hex())
        assert_matches_reference(mean, expected, f"{name} finish_{finish}")


def test_apply_to_refuses_flushed_subnormals_only_when_it_converts_a_dtype_on_the_cpu() -> None:
    """With flush-to-zero on, apply_to of same-dtype CPU gradients works; a CPU dtype
    conversion raises UnsupportedEnvironmentError naming apply_to and writes no .grad."""
    module = TwoLayer()
    grads: dict[str, torch.Tensor | None] = {
        name: torch.full(shape, 0.25) for name, shape in tracked_shapes(module).items()
    }
    same = AccumulatedGradients(
        grads=grads,
        weight=1.0,
        loss_scale=1.0,
        issued=1,
        zero_weight=0,
        normalized=True,
        found_inf=False,
    )
    converting = AccumulatedGradients(
        grads={name: g.to(torch.bfloat16) for name, g in grads.items() if g is not None},
        weight=1.0,
        loss_scale=1.0,
        issued=1,
        zero_weight=0,
        normalized=True,
        found_inf=False,
    )
    if not torch.set_flush_denormal(True):
        torch.set_flush_denormal(False)
        pytest.skip("this CPU cannot flush denormals (no FTZ/DAZ)")
    try:
        with pytest.raises(UnsupportedEnvironmentError) as caught:
            converting.apply_to(module)
        assert all(p.grad is None for p in module.parameters())
        same.apply_to(module)
    finally:
        torch.set_flush_denormal(False)
    assert str(caught.value) == (
        "apply_to: the CPU flushes subnormals to zero (flush-to-zero / denormals-are-zero is on, "
        "e.g. torch.set_flush_denormal(True)); §2 rounds with gradual underflow, so CPU results "
        "would differ. Call torch.set_flush_denormal(False) first."
    )
    assert all(module.get_parameter(name).grad is grad for name, grad in grads.items())


def test_apply_to_moves_each_gradient_to_its_parameters_device() -> None:
    """apply_to writes each CPU gradient onto its parameter's device (here the meta device)."""
    module = TwoLayer("meta")
    gradients = AccumulatedGradients(
        grads={name: torch.ones(shape) for name, shape in tracked_shapes(module).items()},
        weight=1.0,
        loss_scale=1.0,
        issued=1,
        zero_weight=0,
        normalized=True,
        found_inf=False,
    )
    gradients.apply_to(module)
    for name, shape in tracked_shapes(module).items():
        grad = module.get_parameter(name).grad
        assert grad is not None and grad.device.type == "meta" and grad.shape == shape
