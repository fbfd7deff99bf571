"""A bound twice too loose is as wrong as one too tight: the tightness checks notice a doubled term.

Each test of ``test_bounds`` that constructs a window nearly attaining the bound pins the bound
to its closed form (up to the float evaluation) and the error to at least a derived fraction of
it.  Here every term of the derivation (module docstring of ``wacc_ref.bounds``) is doubled in
turn, by wrapping the function that builds it, and at least one of those checks must fail: the
meta-test of the tightness tests, as the planted bugs are the judge's.  (The frozen corpus's
floor, a doubled *whole* bound, is ``tests/wacc/test_corpus.py``.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from tests.wacc_ref import test_bounds as tight
from wacc_ref import bounds
from wacc_ref.formats import WORK_DTYPES

_CACHED = ("_constants", "_conversion_roundings", "_term_factors")


def _clear_caches() -> None:
    for name in _CACHED:
        getattr(bounds, name).cache_clear()


def _twice_as_far(upper: Any, lower: Any) -> tuple[Any, Any]:
    """A factor interval [lower, upper] around 1, its distance to 1 doubled."""
    return 1 + 2 * (upper - 1), 1 - 2 * (1 - lower)


def _doubled_tolerance(field: str) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(monkeypatch: pytest.MonkeyPatch) -> None:
        table = {
            name: dataclasses.replace(tol, **{field: 2 * getattr(tol, field)})
            for name, tol in bounds.TOLERANCES.items()
        }
        monkeypatch.setattr(bounds, "TOLERANCES", MappingProxyType(table))

    return apply


def _doubled_conversion(case: int) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(monkeypatch: pytest.MonkeyPatch) -> None:
        original = bounds._conversion_roundings

        def doubled(dtype: str) -> tuple[tuple[Any, Any, Any], ...]:
            cases = list(original(dtype))
            if case < len(cases):
                upper, lower, absolute = cases[case]
                cases[case] = (*_twice_as_far(upper, lower), 2 * absolute)
            return tuple(cases)

        monkeypatch.setattr(bounds, "_conversion_roundings", doubled)

    return apply


def _doubled_term(change: Callable[[Any], Any]) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(monkeypatch: pytest.MonkeyPatch) -> None:
        original = bounds._term_factors

        def doubled(*args: Any) -> Any:
            return change(original(*args))

        monkeypatch.setattr(bounds, "_term_factors", doubled)

    return apply


def _later_steps_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    original = bounds._term_factors

    def doubled(dtype: str, kind: str, steps_after: int, *rest: Any) -> Any:
        # (1 + u_o')(1 + u) per later step, as if each later step rounded twice as far
        return original(dtype, kind, 2 * steps_after, *rest)

    monkeypatch.setattr(bounds, "_term_factors", doubled)


def _doubled_normalized(field: str) -> Callable[[pytest.MonkeyPatch], None]:
    def apply(monkeypatch: pytest.MonkeyPatch) -> None:
        original = bounds._normalized_scalars

        def doubled(*args: Any) -> Any:
            scalars = original(*args)
            if scalars is None:
                return None
            if field == "constant":
                return dataclasses.replace(scalars, constant=2 * scalars.constant)
            upper, lower = _twice_as_far(scalars.psi_upper, scalars.psi_lower)
            return dataclasses.replace(scalars, psi_upper=upper, psi_lower=lower)

        monkeypatch.setattr(bounds, "_normalized_scalars", doubled)

    return apply


def _doubled_inflation(monkeypatch: pytest.MonkeyPatch) -> None:
    original = bounds._inflate

    def doubled(computed: np.ndarray, operations: int) -> np.ndarray:
        # the allowance (n + 2) 2**-52 relative and (n + 1) 2**-1074 absolute, doubled
        allowance: np.ndarray = original(computed, operations) - computed
        return computed + 2 * allowance

    monkeypatch.setattr(bounds, "_inflate", doubled)


# Term of the derivation -> how to double it.  Names follow the module docstring of bounds.
DOUBLINGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "u of D (every rounding into D)": _doubled_tolerance("unit_roundoff"),
    "eta of D (underflow into D)": _doubled_tolerance("underflow_unit_exact"),
    "u of op(D) (op-then-D, the division by W)": _doubled_tolerance("op_unit_roundoff"),
    "eta of op(D)": _doubled_tolerance("op_underflow_unit_exact"),
    "Step 1, one conversion rounding (U_c, L_c, B_c)": _doubled_conversion(1),
    "Step 1, two conversion roundings through float32": _doubled_conversion(2),
    "Step 2, a term's factor interval [L_j, U_j]": _doubled_term(
        lambda f: dataclasses.replace(
            f, **dict(zip(("upper", "lower"), _twice_as_far(f.upper, f.lower), strict=True))
        )
    ),
    "Step 2, a term's absolute error a_0": _doubled_term(
        lambda f: dataclasses.replace(f, abs_constant=2 * f.abs_constant)
    ),
    "Step 2, the later steps' factors U_p**(K-j)": _later_steps_doubled,
    "Step 3, psi and the divisions' factors": _doubled_normalized("psi"),
    "Step 3, the divisions' underflow constant": _doubled_normalized("constant"),
    "the float evaluation's allowance (_inflate)": _doubled_inflation,
}


def _checks() -> Iterator[tuple[str, Callable[[], None]]]:
    """Every constructed tightness check of test_bounds, one call per parameter set."""
    for dtype in WORK_DTYPES:
        for finish in tight.FINISHES:
            yield (
                f"tie chain {dtype} {finish}",
                lambda d=dtype, f=finish: tight.test_tie_chain_of_sums_nearly_attains_the_bound(
                    d, f
                ),
            )
        yield (
            f"tie product {dtype}",
            lambda d=dtype: tight.test_tie_product_of_a_mean_nearly_attains_the_bound(d),
        )
        yield (
            f"two-step ties {dtype}",
            lambda d=dtype: (
                tight.test_product_and_addition_ties_of_the_two_step_order_nearly_attain_the_bound(
                    d
                )
            ),
        )
        yield (
            f"weight rounding {dtype}",
            lambda d=dtype: tight.test_rounded_weight_sum_is_the_whole_error_and_the_whole_bound(d),
        )
        yield (
            f"division by S {dtype}",
            lambda d=dtype: tight.test_loss_scale_division_nearly_attains_two_thirds_of_the_bound(
                d
            ),
        )
        yield (
            f"division by W {dtype}",
            lambda d=dtype: tight.test_weight_division_nearly_attains_two_thirds_of_the_bound(d),
        )
        if dtype != "float64":
            yield (
                f"single conversion {dtype}",
                lambda d=dtype: tight.test_single_conversion_nearly_attains_the_bound(d),
            )
            yield f"underflow {dtype}", lambda d=dtype: tight.test_underflow_terms_are_attained(d)
        if dtype in ("float16", "bfloat16"):
            yield (
                f"double conversion {dtype}",
                lambda d=dtype: tight.test_double_conversion_nearly_attains_the_bound(d),
            )


def _failing_checks() -> list[str]:
    failing = []
    for name, check in _checks():
        try:
            check()
        except AssertionError:
            failing.append(name)
    return failing


@contextmanager
def _fresh_caches() -> Iterator[None]:
    _clear_caches()
    try:
        yield
    finally:
        _clear_caches()  # nothing computed under a doubled term outlives the test


def test_the_tightness_checks_pass_on_the_bound_as_derived() -> None:
    """Control: with no term doubled, every constructed tightness check passes."""
    with _fresh_caches():
        assert _failing_checks() == []


@pytest.mark.parametrize("term", list(DOUBLINGS))
def test_doubling_any_term_of_the_bound_fails_a_tightness_check(
    term: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``term`` doubled, at least one constructed window shows the bound too loose."""
    with _fresh_caches():
        DOUBLINGS[term](monkeypatch)
        failing = _failing_checks()
        monkeypatch.undo()
    print(f"\n[tightness] {term} doubled: caught by {len(failing)} checks: {failing[:4]}")
    assert failing, f"no tightness check notices {term!r} doubled"


def test_the_evaluation_allowance_is_the_documented_one() -> None:
    """_inflate adds (n + 2) 2**-52 relative and (n + 1) 2**-1074 absolute, nothing more or less."""
    computed = np.array([1.0, 0.0, 0.75, 2.0**-1060])
    for operations in (1, 4, 25):
        expected = computed * (1 + (operations + 2) * 2.0**-52) + (operations + 1) * 2.0**-1074
        assert np.array_equal(bounds._inflate(computed, operations), expected), operations
