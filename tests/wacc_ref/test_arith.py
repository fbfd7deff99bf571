"""Tests of wacc_ref.arith: the three engines of correctly rounded arithmetic agree bit for bit."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from wacc_ref import arith
from wacc_ref.formats import (
    FORMATS,
    WORK_DTYPES,
    Format,
    conv_to,
    get_format,
    op_format,
    round_to,
    same_value_bits,
)

SEED = 20240601
OP_SEEDS = {"add": 1, "mul": 2, "div": 3}
SAMPLES = 4000  # per format and operation; each sample also runs the Fraction ground truth


def random_values(rng: np.random.Generator, fmt: Format, count: int) -> list[float]:
    """Random values of ``fmt``: uniform biased exponent (subnormals included), random bits."""
    p = fmt.precision
    values = []
    for _ in range(count):
        biased = int(rng.integers(fmt.emin - 1, fmt.emax + 1))  # emin - 1 marks subnormals
        fraction = int(rng.integers(0, 1 << (p - 1)))
        if biased < fmt.emin:
            magnitude = math.ldexp(fraction, fmt.emin - p + 1)
        else:
            magnitude = math.ldexp((1 << (p - 1)) + fraction, biased - p + 1)
        values.append(-magnitude if rng.integers(0, 2) else magnitude)
    return values


def specials(fmt: Format) -> list[float]:
    """Edge values of ``fmt``: zeros, infinities, NaN, extremes of every range."""
    return [
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        fmt.max_finite,
        -fmt.max_finite,
        fmt.min_normal,
        -fmt.min_subnormal,
        fmt.min_subnormal,
        1.0,
        -1.0,
        fmt.min_normal - fmt.min_subnormal,
    ]


def operand_pairs(fmt: Format, seed: int) -> list[tuple[float, float]]:
    """Pairs that hit cancellation, wide exponent gaps, ties, underflow and overflow."""
    rng = np.random.default_rng(seed)
    a = random_values(rng, fmt, SAMPLES)
    b = random_values(rng, fmt, SAMPLES)
    pairs = list(zip(a, b, strict=True))
    for x, y in zip(a[:300], b[:300], strict=True):
        if math.isfinite(x) and math.isfinite(y):
            # Near-cancellation: y is -x nudged by a tiny value of the format.
            pairs.append((x, round_to(-x + math.ldexp(y, -fmt.precision - 3), fmt)))
            # A gap of p..2p binades: the second operand lands near a rounding tie.
            shift = int(rng.integers(fmt.precision - 1, 2 * fmt.precision + 2))
            pairs.append((x, round_to(math.ldexp(x, -shift) * (1.0 + math.ldexp(y, -60)), fmt)))
    edges = specials(fmt)
    pairs.extend((x, y) for x in edges for y in edges)
    # Subnormal and overflow ranges on purpose.
    for _ in range(200):
        small = math.ldexp(float(rng.integers(1, 1 << fmt.precision)), fmt.emin - fmt.precision)
        pairs.append((round_to(small, fmt), round_to(-small * 0.75, fmt)))
        pairs.append((fmt.max_finite, round_to(float(rng.uniform(0.0, 2.0)) * fmt.max_finite, fmt)))
    return pairs


def check_equal(got: float, want: float, what: str) -> None:
    assert same_value_bits(got, want), (
        f"{what}: got {got!r} ({got.hex()}), want {want!r} ({want.hex()})"
    )


def hexes(*values: float) -> str:
    return ", ".join(v.hex() for v in values)


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_array_matches_round_to(name: str) -> None:
    """round_array rounds every float64 exactly as formats.round_to does, ties and edges too."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(SEED)
    values = random_values(rng, fmt, 2000)
    quantum_low = math.ldexp(1.0, fmt.emin - fmt.precision + 1)
    extra: list[float] = []
    for v in values[:500]:
        if math.isfinite(v) and v != 0.0:
            step = math.ldexp(1.0, max(math.frexp(v)[1] - 1, fmt.emin) - fmt.precision + 1)
            tie = v + step / 2  # exact in float64
            extra += [tie, math.nextafter(tie, math.inf), math.nextafter(tie, -math.inf)]
    # Random float64 values across (and a little beyond) the format's range.
    exponents = rng.integers(fmt.emin - fmt.precision - 3, fmt.emax + 3, size=2000)
    extra += [float(x) for x in np.ldexp(rng.uniform(-2.0, 2.0, size=2000), exponents)]
    extra += [
        quantum_low / 2,
        -quantum_low / 2,
        quantum_low * 1.5,
        quantum_low / 2 * (1 + 2**-40),
        fmt.max_finite + fmt.max_finite * fmt.unit_roundoff / 2,
        math.nextafter(fmt.max_finite + fmt.max_finite * fmt.unit_roundoff, 0.0),
        float.fromhex("0x1.fffffffffffffp+1023"),
        float.fromhex("0x1p-1074"),
    ]
    inputs = values + specials(fmt) + extra
    got = arith.round_array(np.array(inputs), fmt)
    for x, g in zip(inputs, got.tolist(), strict=True):
        check_equal(g, round_to(x, fmt), f"round_array({x.hex()}, {name})")


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_conv_array_matches_conv_to(name: str) -> None:
    """conv_array converts float64 gradients exactly as formats.conv_to (float32 detour too)."""
    rng = np.random.default_rng(SEED + 1)
    inputs = [float(x) for x in rng.standard_normal(3000) * np.exp2(rng.integers(-140, 130, 3000))]
    inputs += random_values(rng, FORMATS["float64"], 500) + specials(FORMATS["float32"])
    inputs.append(1 + 2**-8 + 2**-30)  # semantics §2: the float32 detour gives 1.0 in bfloat16
    got = arith.conv_array(np.array(inputs), name)
    for x, g in zip(inputs, got.tolist(), strict=True):
        check_equal(g, conv_to(x, name), f"conv_array({x.hex()}, {name})")


def test_conv_array_keeps_the_double_rounding_of_the_spec_example() -> None:
    """float64 1 + 2**-8 + 2**-30 converts to bfloat16 1.0 (through float32), not 1.0078125."""
    got = float(arith.conv_array(np.array([1 + 2**-8 + 2**-30]), "bfloat16")[0])
    assert got == 1.0, got.hex()
    assert round_to(1 + 2**-8 + 2**-30, "bfloat16") == 1.0078125  # the single rounding differs


def test_exact_ops_follow_ieee_special_cases() -> None:
    """The ground-truth engine gives IEEE results for NaN, infinities and signed zeros."""
    f = "float32"
    inf, nan = math.inf, math.nan
    cases: list[tuple[str, float, float]] = [
        ("inf - inf", arith.exact_add(inf, -inf, f), nan),
        ("-0 + -0", arith.exact_add(-0.0, -0.0, f), -0.0),
        ("-0 + +0", arith.exact_add(-0.0, 0.0, f), 0.0),
        ("1 + -1", arith.exact_add(1.0, -1.0, f), 0.0),
        ("0 * inf", arith.exact_mul(0.0, inf, f), nan),
        ("-0 * 3", arith.exact_mul(-0.0, 3.0, f), -0.0),
        ("1 / -0", arith.exact_div(1.0, -0.0, f), -inf),
        ("0 / 0", arith.exact_div(0.0, 0.0, f), nan),
        ("-1 / inf", arith.exact_div(-1.0, inf, f), -0.0),
        ("inf / inf", arith.exact_div(inf, inf, f), nan),
        ("inf + -1 * inf", arith.exact_fma(inf, -1.0, inf, f), nan),
        # exact_fma(a, b, c) is a + b*c: -0 + (-0 * 5) = -0 + -0 = -0; -0 + (+0) = +0.
        ("-0 + -0 * 5", arith.exact_fma(-0.0, -0.0, 5.0, f), -0.0),
        ("-0 + -0 * -5", arith.exact_fma(-0.0, -0.0, -5.0, f), 0.0),
        (
            "fma(-2**-149, 2**-75, 2**-75)",
            # -2**-150 is a tie between -0 and -2**-149: the even one, zero, with the sign of x
            arith.exact_fma(-(2.0**-149), 2.0**-75, 2.0**-75, f),
            -0.0,
        ),
        ("mul 2**-75 * -2**-75", arith.exact_mul(2.0**-75, -(2.0**-75), f), -0.0),
        ("add max + max", arith.exact_add(FORMATS[f].max_finite, FORMATS[f].max_finite, f), inf),
    ]
    for what, got, want in cases:
        check_equal(got, want, what)


def _ground_truth_ops() -> dict[str, tuple[Callable[..., float], str]]:
    return {
        "add": (arith.exact_add, "add"),
        "mul": (arith.exact_mul, "mul"),
        "div": (arith.exact_div, "div"),
    }


@pytest.mark.parametrize("name", WORK_DTYPES)
@pytest.mark.parametrize("op", ["add", "mul", "div"])
def test_gmpy2_engine_matches_exact_rounding(name: str, op: str) -> None:
    """The gmpy2 local-context engine equals round_to(exact op), subnormal and overflow included."""
    fmt = FORMATS[name]
    exact, method = _ground_truth_ops()[op]
    engine = arith.gmpy2_engine(fmt)
    for a, b in operand_pairs(fmt, SEED + OP_SEEDS[op]):
        check_equal(
            getattr(engine, method)(a, b), exact(a, b, fmt), f"gmpy2 {op}({hexes(a, b)}) in {name}"
        )


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_gmpy2_fma_matches_exact_rounding(name: str) -> None:
    """The gmpy2 engine's fma(a, b, c) equals round_to(a + b*c) on random and edge operands."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(SEED + 7)
    pairs = operand_pairs(fmt, SEED + 8)
    thirds = random_values(rng, fmt, len(pairs))
    engine = arith.gmpy2_engine(fmt)
    for (a, b), c in zip(pairs, thirds, strict=True):
        check_equal(
            engine.fma(a, b, c),
            arith.exact_fma(a, b, c, fmt),
            f"gmpy2 fma({hexes(a, b, c)}) in {name}",
        )


def _vector_check(
    name: str,
    op: str,
    vector: Callable[..., np.ndarray],
    exact: Callable[..., float],
    pairs: list[tuple[float, float]],
) -> None:
    a = np.array([x for x, _ in pairs])
    b = np.array([y for _, y in pairs])
    got = vector(a, b, name).tolist()
    for (x, y), g in zip(pairs, got, strict=True):
        check_equal(g, exact(x, y, name), f"vector {op}({hexes(x, y)}) in {name}")


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_vector_engine_matches_exact_rounding(name: str) -> None:
    """add/mul/div_rounded equal round_to(exact op) elementwise, fallback elements included."""
    fmt = FORMATS[name]
    pairs = operand_pairs(fmt, SEED + 11)
    _vector_check(name, "add", arith.add_rounded, arith.exact_add, pairs)
    _vector_check(name, "mul", arith.mul_rounded, arith.exact_mul, pairs)
    _vector_check(name, "div", arith.div_rounded, arith.exact_div, pairs)
    # Divisors that are powers of two take the proved-exact route; 3 and 7 take the fallback.
    rng = np.random.default_rng(SEED + 12)
    for divisor in (2.0**15, 2.0**-3, 3.0, 7.0):
        numerators = random_values(rng, fmt, 300)
        _vector_check(
            name, "div", arith.div_rounded, arith.exact_div, [(x, divisor) for x in numerators]
        )


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_vector_fma_matches_exact_rounding(name: str) -> None:
    """fma_rounded equals round_to(a + b*c) with one rounding, elementwise."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(SEED + 13)
    pairs = operand_pairs(fmt, SEED + 14)
    if name == "float64":
        pairs = pairs[:600]  # element-by-element MPFR there; keep the test quick
    thirds = random_values(rng, fmt, len(pairs))
    got = arith.fma_rounded(
        np.array([a for a, _ in pairs]), np.array([b for _, b in pairs]), np.array(thirds), name
    ).tolist()
    for (a, b), c, g in zip(pairs, thirds, got, strict=True):
        check_equal(g, arith.exact_fma(a, b, c, name), f"vector fma({hexes(a, b, c)}) in {name}")


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_vector_division_in_op_format_matches_exact_rounding(name: str) -> None:
    """The finish_mean division y / round_op(W) in float32 is exact-rounded for D values y."""
    fmt = FORMATS[name]
    op = op_format(fmt)
    rng = np.random.default_rng(SEED + 15)
    numerators = random_values(rng, fmt, SAMPLES)
    divisors = random_values(rng, op, SAMPLES)
    _vector_check(
        op.name,
        "div",
        arith.div_rounded,
        arith.exact_div,
        list(zip(numerators, divisors, strict=True)),
    )


def test_vector_ops_keep_shapes_including_zero_dimensional() -> None:
    """The vector engine returns arrays of the broadcast shape, 0-d included."""
    assert arith.add_rounded(np.array(1.0), np.array(2.0), "bfloat16").shape == ()
    assert arith.fma_rounded(np.zeros((2, 3)), np.ones((2, 3)), 3.0, "float16").shape == (2, 3)
    assert arith.div_rounded(np.ones((4, 1)), 3.0, "bfloat16").shape == (4, 1)
    assert arith.round_array(np.array(1.0 + 2**-9), "bfloat16").shape == ()


def test_bfloat16_wide_gap_sum_uses_the_fallback_correctly() -> None:
    """A bfloat16 sum 2**100 + 2**-100 (inexact in float64) still rounds once, to 2**100."""
    got = arith.add_rounded(np.array([2.0**100, 1.0]), np.array([2.0**-100, 2.0**-8]), "bfloat16")
    assert got.tolist() == [2.0**100, 1.0], [v.hex() for v in got.tolist()]


def float64_operands(rng: np.random.Generator, fmt: Format, count: int) -> list[float]:
    """Arbitrary float64 values (53-bit significands), mostly within 80 binades of ``fmt``'s range.

    Not values of ``fmt``: operands that the format's own range would flush, overflow or
    subnormalize, and products below float64's TwoProduct range.  ±0, ±inf, NaN and the
    format's edge values are appended.
    """
    near = rng.integers(fmt.emin - 80, min(fmt.emax + 20, 1023), count)
    anywhere = rng.integers(-1074, 1024, count)
    exponents = np.where(rng.random(count) < 0.8, near, anywhere)
    values = np.ldexp(rng.uniform(1.0, 2.0, count), exponents) * rng.choice([-1.0, 1.0], count)
    return [float(v) for v in values] + specials(fmt)


def nudged_midpoint_triples(
    rng: np.random.Generator, fmt: Format, count: int
) -> list[tuple[float, float, float]]:
    """``(m, t, t)`` with ``m`` a midpoint of ``fmt`` and ``t`` so tiny that only ``m + t`` or
    ``m + t*t`` decides the rounding (``t*t`` underflows in float64)."""
    triples = []
    for v in random_values(rng, fmt, count):
        if math.isfinite(v) and v != 0.0 and abs(v) < fmt.max_finite:
            step = math.ldexp(1.0, max(math.frexp(v)[1] - 1, fmt.emin) - fmt.precision + 1)
            midpoint = v + math.copysign(step / 2, v)
            tiny = math.copysign(2.0**-550, v) if rng.random() < 0.5 else -(2.0**-550)
            triples.append((midpoint, tiny, tiny))
    return triples


@pytest.mark.parametrize("name", list(FORMATS))
def test_engines_read_any_float64_operand_exactly(name: str) -> None:
    """gmpy2 and vector engines equal round_to(exact op) for operands that are not values of F."""
    fmt = FORMATS[name]
    rng = np.random.default_rng([SEED, fmt.precision, fmt.emax, 19])
    a, b, c = (float64_operands(rng, fmt, 600) for _ in range(3))
    designed = nudged_midpoint_triples(rng, fmt, 100)
    assert designed, name
    a += [x for x, _, _ in designed]
    b += [y for _, y, _ in designed]
    c += [z for _, _, z in designed]
    engine = arith.gmpy2_engine(fmt)
    vector = {
        "add": arith.add_rounded(np.array(a), np.array(b), fmt).tolist(),
        "mul": arith.mul_rounded(np.array(a), np.array(b), fmt).tolist(),
        "div": arith.div_rounded(np.array(a), np.array(b), fmt).tolist(),
        "fma": arith.fma_rounded(np.array(a), np.array(b), np.array(c), fmt).tolist(),
    }
    for i, (x, y, z) in enumerate(zip(a, b, c, strict=True)):
        for op, want in (
            ("add", arith.exact_add(x, y, fmt)),
            ("mul", arith.exact_mul(x, y, fmt)),
            ("div", arith.exact_div(x, y, fmt)),
        ):
            check_equal(getattr(engine, op)(x, y), want, f"gmpy2 {op}({hexes(x, y)}) in {name}")
            check_equal(vector[op][i], want, f"vector {op}({hexes(x, y)}) in {name}")
        want = arith.exact_fma(x, y, z, fmt)
        check_equal(engine.fma(x, y, z), want, f"gmpy2 fma({hexes(x, y, z)}) in {name}")
        check_equal(vector["fma"][i], want, f"vector fma({hexes(x, y, z)}) in {name}")


def test_float8_e4m3fn_overflow_is_nan_in_every_engine() -> None:
    """e4m3fn has no inf: 448/0.9375 (477.8, above the 464 midpoint) is NaN, not 480, everywhere."""
    a, b = 448.0, float.fromhex("0x1.ep-1")
    engine = arith.gmpy2_engine("float8_e4m3fn")
    for sign in (1.0, -1.0):
        check_equal(arith.exact_div(sign * a, b, "float8_e4m3fn"), math.nan, "exact div")
        check_equal(engine.div(sign * a, b), math.nan, f"gmpy2 div({hexes(sign * a, b)})")
        got = float(arith.div_rounded(np.array([sign * a]), b, "float8_e4m3fn")[0])
        check_equal(got, math.nan, f"vector div({hexes(sign * a, b)})")


def test_gradual_underflow_check_passes_here() -> None:
    """With the default FPU mode the subnormal check is silent."""
    arith.check_gradual_underflow()


def test_gradual_underflow_check_detects_flush_to_zero() -> None:
    """After torch.set_flush_denormal(True) the reference refuses to compute (FTZ corrupts it)."""
    torch = pytest.importorskip("torch")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU does not support flush-to-zero")
    try:
        with pytest.raises(RuntimeError, match="flushes subnormals"):
            arith.check_gradual_underflow()
    finally:
        torch.set_flush_denormal(False)
    arith.check_gradual_underflow()


# --- semantics §6 fused candidates ---------------------------------------------------------------


def test_fused_candidates_bfloat16_fma_differs_from_two_step() -> None:
    """bf16 buf=1, c=0.5+2**-7, w=1-2**-8: fma and op_rounded give 1.5+2**-7, two-step 1.5."""
    # c*w = 0.5 + 3*2**-9 - 2**-15: just below the bf16 tie 0.5 + 1.5*2**-8, so t = 0.5 + 2**-8;
    # 1 + t = 1.5 + 2**-8 is a tie in [1, 2) (quantum 2**-7) and goes to the even 1.5.  The exact
    # 1.5 + 2**-8 + 2**-9 - 2**-15 is above that tie: 1.5 + 2**-7 (float32 holds it exactly).
    c, w = 0.5 + 2**-7, 1 - 2**-8
    candidates = arith.fused_mean_step_candidates(1.0, c, w, "bfloat16")
    assert candidates == frozenset({arith.BitwiseFloat(1.5 + 2**-7), arith.BitwiseFloat(1.5)})
    assert arith.fused_mean_step_accepts(1.5 + 2**-7, candidates)
    assert arith.fused_mean_step_accepts(1.5, candidates)
    assert not arith.fused_mean_step_accepts(1.5 + 2**-6, candidates)


def test_fused_candidates_float16_op_rounded_differs_from_fma() -> None:
    """fp16 buf=1, c=145*2**-12, w=113*2**-13: fma 1+2**-10, op_rounded and two-step 1.0."""
    # c*w = 16385 * 2**-25 = 2**-11 + 2**-25.  Exact sum 1 + 2**-11 + 2**-25 is above the fp16 tie
    # 1 + 2**-11, so the FMA gives 1 + 2**-10.  In float32 (quantum 2**-23) it rounds to the tie
    # 1 + 2**-11, which fp16 sends to the even 1.0; t = round_16(c*w) = 2**-11 gives the same tie.
    c, w = 145 * 2.0**-12, 113 * 2.0**-13
    candidates = arith.fused_mean_step_candidates(1.0, c, w, "float16")
    assert candidates == frozenset({arith.BitwiseFloat(1.0 + 2**-10), arith.BitwiseFloat(1.0)})


def test_fused_candidates_keep_both_signed_zeros() -> None:
    """fp16 buf=2**-24, c*w=-(2**-24+2**-34): fma gives -0.0, two-step +0.0; both are members."""
    c, w = -(2.0**-12 + 2.0**-22), 2.0**-12
    candidates = arith.fused_mean_step_candidates(2.0**-24, c, w, "float16")
    assert len(candidates) == 2
    assert arith.fused_mean_step_accepts(-0.0, candidates)
    assert arith.fused_mean_step_accepts(0.0, candidates)
    only_plus = arith.fused_mean_step_candidates(2.0**-24, -(2.0**-12), 2.0**-12, "float16")
    assert not arith.fused_mean_step_accepts(-0.0, only_plus)


def test_fused_candidates_overflow_and_nan() -> None:
    """fp16 overflow: t=round(c*w) overflows to inf while the FMA stays finite; NaN is a member."""
    # buf=-65504, c*w=131008: two-step t=inf -> inf; FMA and float32 give 65504 exactly.
    finite_or_inf = arith.fused_mean_step_candidates(-65504.0, 65504.0, 2.0, "float16")
    assert finite_or_inf == frozenset({arith.BitwiseFloat(65504.0), arith.BitwiseFloat(math.inf)})
    # buf=inf, c*w=-131008: two-step inf + -inf = NaN; FMA inf.
    with_nan = arith.fused_mean_step_candidates(math.inf, -65504.0, 2.0, "float16")
    assert arith.fused_mean_step_accepts(float("nan"), with_nan)
    assert arith.fused_mean_step_accepts(math.inf, with_nan)
    assert not arith.fused_mean_step_accepts(-math.inf, with_nan)
    assert len(with_nan) == 2


def test_fused_candidates_refuse_non_format_values() -> None:
    """Operands that are not values of D raise ValueError naming the operand (hex)."""
    with pytest.raises(ValueError, match=r"c=1\.00048828125"):
        arith.fused_mean_step_candidates(1.0, 1.0 + 2**-11, 1.0, "float16")
    with pytest.raises(TypeError, match="buf must be a float"):
        arith.fused_mean_step_candidates("1", 1.0, 1.0, "float16")  # type: ignore[arg-type]
    # Integers are accepted as the floats they equal.
    assert arith.fused_mean_step_candidates(1, 2, 3, "float16") == frozenset(
        {arith.BitwiseFloat(7.0)}
    )


@pytest.mark.parametrize("name", WORK_DTYPES)
def test_fused_candidates_contain_each_vector_variant(name: str) -> None:
    """For random operands each fused variant the accumulator can emulate is a candidate."""
    fmt = get_format(name)
    rng = np.random.default_rng(SEED + 17)
    count = 200 if name == "float64" else 800
    buf, c, w = (random_values(rng, fmt, count) for _ in range(3))
    w = [abs(x) if x != 0 else 1.0 for x in w]
    fma = arith.fma_rounded(np.array(buf), np.array(c), np.array(w), fmt).tolist()
    op_rounded = arith.round_array(
        arith.fma_rounded(np.array(buf), np.array(c), np.array(w), op_format(fmt)), fmt
    ).tolist()
    two_step = arith.add_rounded(
        np.array(buf), arith.mul_rounded(np.array(c), np.array(w), fmt), fmt
    ).tolist()
    for i in range(count):
        candidates = arith.fused_mean_step_candidates(buf[i], c[i], w[i], name)
        for variant, value in (
            ("fma", fma[i]),
            ("op_rounded", op_rounded[i]),
            ("two_step", two_step[i]),
        ):
            assert arith.fused_mean_step_accepts(value, candidates), (
                f"{variant} {value.hex()} not in {candidates} for "
                f"buf, c, w = {hexes(buf[i], c[i], w[i])}"
            )
