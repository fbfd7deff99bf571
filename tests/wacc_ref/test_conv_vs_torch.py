"""wacc_ref.formats.conv_to models PyTorch's float64 -> D conversion bit for bit (§2 conv_D).

Judge-side test: it imports torch (the reference package itself never does).  Random float64
values over every exponent range of D, plus constructed double-rounding cases where PyTorch's
float64 -> float32 -> D path differs from the correctly rounded round_to(x, D).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from wacc_ref.formats import FORMATS, WORK_DTYPES, Format, conv_to, from_bits, round_to, to_bits

torch = pytest.importorskip("torch")

SEED = 20240612
SAMPLES = 100_000
SCALAR_SUBSAMPLE = 2_000
DOUBLE_ROUNDING_CASES = 2_000


def _random_float64(
    rng: np.random.Generator, count: int, target: Format
) -> npt.NDArray[np.float64]:
    """Random float64 values: 3/4 with exponents near ``target``'s range, 1/4 anywhere.

    A third keep only 24 significand bits (float32-exact: ties at the D level are then common), a
    third keep 25 (float32 ties), the rest are full 53-bit values.  ±0, ±inf, NaN appended.
    """
    near = count * 3 // 4
    lo = max(target.emin - target.precision - 3 + 1023, 0)
    hi = min(target.emax + 3 + 1023, 2046)
    biased = np.concatenate([rng.integers(lo, hi + 1, near), rng.integers(0, 2047, count - near)])
    fraction = rng.integers(0, 2**52, count, dtype=np.uint64)
    kind = rng.integers(0, 3, count)
    fraction[kind == 0] &= np.uint64(((1 << 23) - 1) << 29)
    fraction[kind == 1] &= np.uint64(((1 << 24) - 1) << 28)
    sign = rng.integers(0, 2, count, dtype=np.uint64)
    bits = (sign << np.uint64(63)) | (biased.astype(np.uint64) << np.uint64(52)) | fraction
    specials = np.array([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=np.float64)
    result: npt.NDArray[np.float64] = np.concatenate([bits.view(np.float64), specials])
    return result


def _double_rounding_cases(rng: np.random.Generator, count: int, target: Format) -> list[float]:
    """float64 values that PyTorch's two roundings send to the even neighbour the wrong way.

    x = midpoint of two adjacent D values + an offset towards the odd neighbour, too small to
    survive rounding to float32: round_32(x) is the exact midpoint, which then ties to the even
    neighbour, while round_D(x) goes to the odd one.
    """
    max_bits = to_bits(target.max_finite, target)
    out: list[float] = []
    while len(out) < count:
        low_bits = int(rng.integers(1, max_bits))
        low, high = from_bits(low_bits, target), from_bits(low_bits + 1, target)
        midpoint = (low + high) / 2  # exact in float64 (at most 12 significand bits)
        # An offset of at most a quarter float32 ulp of the midpoint, at least 2**-60 of it.
        float32_ulp = math.ldexp(1.0, max(math.frexp(midpoint)[1] - 1, -126) - 23)
        offset = math.ldexp(float32_ulp, -int(rng.integers(2, 30)))
        towards_odd = offset if low_bits % 2 == 0 else -offset
        x = midpoint + towards_odd
        if x == midpoint or abs(x) > target.max_finite:
            continue  # the offset vanished in float64 (deep subnormals): not a case
        out.append(x if rng.random() < 0.5 else -x)
    return out


def _torch_convert(values: npt.NDArray[np.float64], name: str) -> npt.NDArray[np.float64]:
    """torch.tensor(values, dtype=float64).to(D), read back exactly as float64."""
    converted = torch.tensor(values, dtype=torch.float64).to(getattr(torch, name))
    result: npt.NDArray[np.float64] = converted.to(torch.float64).numpy()
    return result


def _bit_mismatches(
    inputs: Sequence[float], got: npt.NDArray[np.float64], want: npt.NDArray[np.float64]
) -> list[str]:
    """The first few positions where got and want differ as float64 bit patterns (NaN == NaN)."""
    same = (got.view(np.uint64) == want.view(np.uint64)) | (np.isnan(got) & np.isnan(want))
    return [
        f"x={inputs[i].hex()}: got {float(got[i]).hex()}, want {float(want[i]).hex()}"
        for i in np.flatnonzero(~same)[:8]
    ]


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_conv_to_matches_torch_tensor_to(name: str) -> None:
    """conv_to(x, D) equals torch.tensor(x, dtype=float64).to(D) on 10**5 random values."""
    target = FORMATS[name]
    rng = np.random.default_rng([SEED, target.precision, target.emax])
    values = _random_float64(rng, SAMPLES, target)
    inputs = values.tolist()
    got = np.array([conv_to(x, name) for x in inputs], dtype=np.float64)
    bad = _bit_mismatches(inputs, got, _torch_convert(values, name))
    assert not bad, f"{name} (seed {SEED}): {bad}"


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_conv_to_matches_torch_scalar_construction(name: str) -> None:
    """conv_to(x, D) equals torch.tensor(x, dtype=D) built from a Python float (subsample)."""
    target = FORMATS[name]
    rng = np.random.default_rng([SEED, target.precision, target.emax, 1])
    inputs = _random_float64(rng, SCALAR_SUBSAMPLE, target).tolist()
    dtype = getattr(torch, name)
    got = np.array([conv_to(x, name) for x in inputs], dtype=np.float64)
    want = np.array([float(torch.tensor(x, dtype=dtype).item()) for x in inputs])
    bad = _bit_mismatches(inputs, got, want)
    assert not bad, f"{name} (seed {SEED}): {bad}"


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_conv_to_models_torch_double_rounding(name: str) -> None:
    """On constructed double-rounding inputs conv_to equals torch and differs from round_to."""
    target = FORMATS[name]
    rng = np.random.default_rng([SEED, target.precision, target.emax, 2])
    inputs = _double_rounding_cases(rng, DOUBLE_ROUNDING_CASES, target)
    got = np.array([conv_to(x, name) for x in inputs], dtype=np.float64)
    bad = _bit_mismatches(inputs, got, _torch_convert(np.array(inputs), name))
    assert not bad, f"{name} (seed {SEED}): {bad}"
    correctly_rounded = np.array([round_to(x, name) for x in inputs], dtype=np.float64)
    agree = [x.hex() for x, c, r in zip(inputs, got, correctly_rounded, strict=True) if c == r]
    assert not agree, f"{name}: conv_to == round_to on constructed cases {agree[:8]}"


def test_spec_example_in_torch() -> None:
    """§2's example: torch gives 1.0 for 1 + 2**-8 + 2**-30 in bfloat16, as conv_to does."""
    x = 1 + 2**-8 + 2**-30
    assert torch.tensor(x, dtype=torch.bfloat16).item() == conv_to(x, "bfloat16") == 1.0
    assert round_to(x, "bfloat16") == 1.0078125
