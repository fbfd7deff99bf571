"""Which rounding a device's element-wise updates take, against the exact reference.

The updates users write on gradients, run on a device in float16, bfloat16 and float32 on seeded
values, each compared bit for bit with three exact models (wacc_ref: every operation computed
exactly and rounded where the model says, nothing else):

* ``one rounding (FMA/opmath)``: the scalar kept in float32 (PyTorch's ``opmath`` type for all
  three dtypes), the whole expression rounded once to float32, then to the dtype: what CUDA's
  kernels do (``a + alpha * b`` contracted into one FMA by nvcc, ``opmath`` scalars);
* ``two roundings (scalar rounded to dtype first)``: the scalar first converted to the dtype, then
  the expression as above: PyTorch's vectorized CPU kernels, which read ``alpha`` as the
  tensor's ``scalar_t``;
* ``op-rounded``: the scalar converted to the dtype and every operation rounded to the dtype:
  the scalar C++ code on ``c10::Half`` / ``c10::BFloat16`` (the CPU kernels' tail).

A CPU kernel runs a vectorized body and a scalar tail (the last ``n mod vector width`` elements),
so each op is classified twice: on the first :data:`BODY` elements and on the last :data:`TAIL`.
A rounding is named when its model equals the device's result on every element of that part
(several names when the models coincide there), else ``none`` with the share each model matched.
``max_ulps`` is the largest distance, in units in the last place of the dtype, from the exact
result rounded once (``round_D(exact)``): 0 where the device is correctly rounded.

GradScaler's two paths run under the non-power-of-two scale :data:`SCALE` = 3: ``unscale_``
multiplies by the float32 reciprocal ``float(1/3)`` (computed in float64), while fused optimizers
(``fused=True``, handed ``grad_scale`` and ``found_inf`` as GradScaler hands them) divide by the
scale; a power of two would hide the difference.  For SGD (no momentum) the three models are those
of the step ``p - lr·g`` with ``g`` the exact ``G/3`` (one rounding), ``g`` unscaled into the dtype
first (two roundings) or every operation in the dtype (op-rounded); AdamW's step has a square root
and is only measured (ulps from the float64 step rounded once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np
import numpy.typing as npt
import torch

from wacc_ref.arith import add_rounded, conv_array, mul_rounded, round_array
from wacc_ref.formats import round_to, ulp

__all__ = [
    "BODY",
    "DTYPES",
    "OP_CSV_FIELDS",
    "OPS",
    "ROUNDINGS",
    "SCALAR",
    "SCALE",
    "TAIL",
    "OpRow",
    "classify",
    "op_rows",
]

FloatArray = npt.NDArray[np.float64]

DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
ONE, TWO, OP = ROUNDINGS = (
    "one rounding (FMA/opmath)",
    "two roundings",
    "op-rounded",
)
# 1024 is a multiple of every CPU vector width for these dtypes; the 7 after it are the tail.
BODY, TAIL = 1024, 7
SCALAR = 1 / 3  # the alpha / factor users write: grad.add_(g, alpha=1/k) with k = 3
SCALE = 3.0  # the loss scale: not a power of two
LR = 0.1
SEED = 36
OPS: tuple[str, ...] = (
    "add_", "add_(alpha)", "mul_", "_foreach_add_(alpha)", "addcmul_(value)",
    "GradScaler unscale_", "SGD unfused", "SGD fused", "AdamW unfused", "AdamW fused",
)  # fmt: skip
_TORCH = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64,
}  # fmt: skip


@dataclass(frozen=True)
class OpRow:
    """One op in one dtype on one device."""

    device: str
    op: str
    dtype: str
    rounding: str  # the model(s) the vectorized body equals (see the module docstring)
    tail_rounding: str  # the same for the last TAIL elements
    max_ulps: float  # from round_D(exact), over all elements
    elements: int


OP_CSV_FIELDS: tuple[str, ...] = tuple(OpRow.__dataclass_fields__)


def _f32(value: float) -> float:
    return float(np.float32(value))


def _to_d(value: float, dtype: str) -> float:
    """PyTorch's conversion of a Python float to ``dtype`` (float16/bfloat16 via float32)."""
    return float(conv_array(np.array([value]), dtype)[0])


def _exact_round(values: Sequence[Fraction], dtype: str) -> FloatArray:
    return np.array([round_to(v, dtype) for v in values], dtype=np.float64)


def _fr(array: FloatArray) -> list[Fraction]:
    return [Fraction(v) for v in array.tolist()]


def _once(values: Sequence[Fraction], dtype: str) -> FloatArray:
    """round_D(round_32(value)): one rounding in float32 opmath, then to the dtype."""
    return round_array(_exact_round(values, "float32"), dtype)


def classify(result: FloatArray, models: dict[str, FloatArray]) -> str:
    """The names of the models equal to ``result`` bit for bit on every element (joined with
    " = "), or ``none`` with each model's share of equal elements."""
    equal = {
        name: np.array(
            [
                np.float64(a).tobytes() == np.float64(b).tobytes()
                for a, b in zip(result, m, strict=True)
            ]
        )
        for name, m in models.items()
    }
    matching = [name for name, eq in equal.items() if eq.all()]
    if matching:
        return " = ".join(matching)
    shares = ", ".join(f"{name} {int(eq.sum())}/{eq.size}" for name, eq in equal.items())
    return f"none ({shares})"


def _ulps(result: FloatArray, reference: FloatArray, dtype: str) -> float:
    """max |result - reference| in ulps of the dtype at the reference (inf on a non-finite)."""
    if not np.isfinite(result).all():
        return float("inf")
    pairs = zip(result.tolist(), reference.tolist(), strict=True)
    steps = [abs(a - b) / ulp(float(b), dtype) for a, b in pairs]
    return float(max(steps, default=0.0))


def _values(rng: np.random.Generator, dtype: str, sign: float = 1.0) -> FloatArray:
    """Values of one sign, magnitudes 2^-1..2^1: no cancellation, so an ulp of the result is an
    ulp of the inputs' scale and the distances say how the device rounded, not how a difference
    near zero amplifies a scalar's rounding."""
    return conv_array(sign * np.exp2(rng.uniform(-1.0, 1.0, BODY + TAIL)), dtype)


def _tensor(values: FloatArray, dtype: str, device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(device=device, dtype=_TORCH[dtype])


def _back(tensor: torch.Tensor) -> FloatArray:
    return tensor.detach().to("cpu", torch.float64).numpy().copy()


@dataclass(frozen=True)
class _Case:
    """An op: its result on a device, its exact value and its three models (any may be absent)."""

    run: Callable[[str], FloatArray]
    exact: list[Fraction]
    models: dict[str, FloatArray]


def _add_alpha_case(
    x: FloatArray, y: FloatArray, dtype: str, alpha: float | None, *, foreach: bool
) -> _Case:
    a = 1.0 if alpha is None else alpha
    a32, a_d = _f32(a), _to_d(a, dtype)
    fx, fy = _fr(x), _fr(y)

    def run(device: str) -> FloatArray:
        out = _tensor(x, dtype, device)
        other = _tensor(y, dtype, device)
        if foreach:
            torch._foreach_add_([out], [other], alpha=a)
        elif alpha is None:
            out.add_(other)
        else:
            out.add_(other, alpha=a)
        return _back(out)

    product = mul_rounded(a_d, y, dtype)
    return _Case(
        run=run,
        exact=[u + Fraction(a) * v for u, v in zip(fx, fy, strict=True)],
        models={
            ONE: _once([u + Fraction(a32) * v for u, v in zip(fx, fy, strict=True)], dtype),
            TWO: _once([u + Fraction(a_d) * v for u, v in zip(fx, fy, strict=True)], dtype),
            OP: add_rounded(x, product, dtype),
        },
    )


def _mul_case(x: FloatArray, dtype: str) -> _Case:
    s32, s_d = _f32(SCALAR), _to_d(SCALAR, dtype)
    fx = _fr(x)

    def run(device: str) -> FloatArray:
        out = _tensor(x, dtype, device)
        out.mul_(SCALAR)
        return _back(out)

    return _Case(
        run=run,
        exact=[u * Fraction(SCALAR) for u in fx],
        models={
            ONE: _once([u * Fraction(s32) for u in fx], dtype),
            TWO: _once([u * Fraction(s_d) for u in fx], dtype),
            OP: mul_rounded(x, s_d, dtype),
        },
    )


def _addcmul_case(x: FloatArray, t1: FloatArray, t2: FloatArray, dtype: str) -> _Case:
    v32, v_d = _f32(SCALAR), _to_d(SCALAR, dtype)
    fx, f1, f2 = _fr(x), _fr(t1), _fr(t2)

    def run(device: str) -> FloatArray:
        out = _tensor(x, dtype, device)
        out.addcmul_(_tensor(t1, dtype, device), _tensor(t2, dtype, device), value=SCALAR)
        return _back(out)

    return _Case(
        run=run,
        exact=[u + Fraction(SCALAR) * a * b for u, a, b in zip(fx, f1, f2, strict=True)],
        models={
            ONE: _once(
                [u + Fraction(v32) * a * b for u, a, b in zip(fx, f1, f2, strict=True)], dtype
            ),
            TWO: _once(
                [u + Fraction(v_d) * a * b for u, a, b in zip(fx, f1, f2, strict=True)], dtype
            ),
            OP: add_rounded(x, mul_rounded(mul_rounded(v_d, t1, dtype), t2, dtype), dtype),
        },
    )


def _inverse_scale() -> float:
    """GradScaler's ``inv_scale``: ``scale.double().reciprocal().float()``."""
    return float(torch.full((), SCALE, dtype=torch.float32).double().reciprocal().float())


def _unscale_case(g: FloatArray, dtype: str) -> _Case:
    inv32 = _inverse_scale()
    inv_d = _to_d(inv32, dtype)
    fg = _fr(g)

    def run(device: str) -> FloatArray:
        grad = _tensor(g, dtype, device)
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        inv = torch.full((), inv32, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, inv)
        return _back(grad)

    return _Case(
        run=run,
        exact=[u / Fraction(SCALE) for u in fg],
        models={
            ONE: _once([u * Fraction(inv32) for u in fg], dtype),
            TWO: _once([u * Fraction(inv_d) for u in fg], dtype),
            OP: mul_rounded(g, inv_d, dtype),
        },
    )


def _optimizer_result(
    kind: str, fused: bool | None, p: FloatArray, scaled_grad: FloatArray, dtype: str, device: str
) -> FloatArray:
    """One step of ``kind`` on parameters ``p`` with the scaled gradient ``G``, through
    GradScaler's path: unfused, ``unscale_``'s op then ``step()``; fused, ``grad_scale`` and
    ``found_inf`` set on the optimizer as ``GradScaler.step`` sets them; ``None``: a plain step
    on an unscaled gradient (the wide reference)."""
    param = torch.nn.Parameter(_tensor(p, dtype, device))
    param.grad = _tensor(scaled_grad, dtype, device)
    make = torch.optim.SGD if kind == "SGD" else torch.optim.AdamW
    optimizer = make([param], lr=LR, fused=bool(fused), foreach=None if fused else True)
    scale = torch.full((), SCALE, dtype=torch.float32, device=device)
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if fused is None:
        pass
    elif fused:
        # What GradScaler.step sets on an optimizer whose step supports AMP scaling.
        setattr(optimizer, "grad_scale", scale)  # noqa: B010
        setattr(optimizer, "found_inf", found_inf)  # noqa: B010
    else:
        inv = scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_([param.grad], found_inf, inv)
    optimizer.step()
    return _back(param)


def _sgd_case(p: FloatArray, scaled: FloatArray, dtype: str, *, fused: bool) -> _Case:
    fp, fs = _fr(p), _fr(scaled)
    lr = Fraction(LR)
    unscaled_d = round_array(_once([s * Fraction(_inverse_scale()) for s in fs], dtype), dtype)
    lr_d = _to_d(-LR, dtype)
    return _Case(
        run=lambda device: _optimizer_result("SGD", fused, p, scaled, dtype, device),
        exact=[u - lr * s / Fraction(SCALE) for u, s in zip(fp, fs, strict=True)],
        models={
            ONE: _once([u - lr * s / Fraction(SCALE) for u, s in zip(fp, fs, strict=True)], dtype),
            TWO: _once(
                [u - lr * Fraction(g) for u, g in zip(fp, unscaled_d.tolist(), strict=True)], dtype
            ),
            OP: add_rounded(p, mul_rounded(lr_d, unscaled_d, dtype), dtype),
        },
    )


def _adamw_case(p: FloatArray, scaled: FloatArray, dtype: str, *, fused: bool) -> _Case:
    # The float64 step from the exact-in-float64 G/3 is ~2^-50 relative from the real step:
    # far below half an ulp of any of the three dtypes (compute wide, round once).
    wide = _optimizer_result("AdamW", None, p, scaled / SCALE, "float64", "cpu")
    return _Case(
        run=lambda device: _optimizer_result("AdamW", fused, p, scaled, dtype, device),
        exact=_fr(wide),
        models={},
    )


def _cases(dtype: str) -> dict[str, _Case]:
    rng = np.random.default_rng([SEED, DTYPES.index(dtype)])
    x, y, t1, t2 = (_values(rng, dtype) for _ in range(4))
    # The scaled gradient: negative, so that the step p - lr·G/3 adds magnitudes.
    scaled = conv_array(SCALE * _values(rng, "float64", -1.0), dtype)
    return {
        "add_": _add_alpha_case(x, y, dtype, None, foreach=False),
        "add_(alpha)": _add_alpha_case(x, y, dtype, SCALAR, foreach=False),
        "mul_": _mul_case(x, dtype),
        "_foreach_add_(alpha)": _add_alpha_case(x, y, dtype, SCALAR, foreach=True),
        "addcmul_(value)": _addcmul_case(x, t1, t2, dtype),
        "GradScaler unscale_": _unscale_case(scaled, dtype),
        "SGD unfused": _sgd_case(x, scaled, dtype, fused=False),
        "SGD fused": _sgd_case(x, scaled, dtype, fused=True),
        "AdamW unfused": _adamw_case(x, scaled, dtype, fused=False),
        "AdamW fused": _adamw_case(x, scaled, dtype, fused=True),
    }


def _row(device: str, op: str, dtype: str, case: _Case) -> OpRow:
    try:
        result = case.run(device)
    except Exception as exc:  # a device that cannot run an op is a row saying so, not a crash
        reason = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return OpRow(device, op, dtype, reason, reason, float("nan"), BODY + TAIL)
    models = case.models
    if models:
        body = classify(result[:BODY], {k: m[:BODY] for k, m in models.items()})
        tail = classify(result[BODY:], {k: m[BODY:] for k, m in models.items()})
    else:
        body = tail = "measured only (no exact model of the whole step)"
    reference = _exact_round(case.exact, dtype)
    return OpRow(device, op, dtype, body, tail, _ulps(result, reference, dtype), result.size)


def op_rows(device: str, *, dtypes: Sequence[str] = DTYPES) -> list[OpRow]:
    """Every op of :data:`OPS` in every dtype on ``device`` (see the module docstring)."""
    rows = []
    for dtype in dtypes:
        for op, case in _cases(dtype).items():
            rows.append(_row(device, op, dtype, case))
    return rows


def op_csv_rows(rows: Sequence[OpRow]) -> list[dict[str, str]]:
    """The rows as CSV dicts (keys :data:`OP_CSV_FIELDS`, floats in ``repr``)."""
    return [{key: str(value) for key, value in asdict(row).items()} for row in rows]
