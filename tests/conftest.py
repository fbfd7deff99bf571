"""Suite-wide configuration: Hypothesis profiles (explicit, never global precision state)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import gmpy2
import mpmath
import pytest
from hypothesis import settings

from tests import mutant
from wacc.profiles import register_profiles

# The profiles are wacc's own (``wacc check --profile`` uses the same ones): "ci" is
# derandomized so that a red CI run reproduces exactly; "dev" explores new examples.
register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Read when conftest is imported: mutmut's fork server imports it before it forks the mutants'
# workers, so they share one parsed copy (nothing there outside a mutmut run).
_MUTMUT_DURATIONS = mutant.read_durations()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under mutmut, run a mutant's covering tests fastest first. mutmut passes them in set order
    and stops at the first failure (``-x``), so a killed mutant otherwise often waits for a slow
    test that a fast one would have beaten; a survivor runs them all either way, so the verdicts
    are the same (the tests are independent: the suite passes in any order under xdist)."""
    if mutant.under_mutant() and _MUTMUT_DURATIONS:
        items[:] = mutant.fastest_first(items, _MUTMUT_DURATIONS)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection created (torch, the packages, the test modules) out of the cyclic
    garbage collector's reach: it lives for the whole run anyway, so a full collection (a test's
    ``gc.collect()``, or an automatic one) then walks only what the tests make. In a process
    forked after collection (mutmut's workers, ``python -m mutation``) walking the inherited heap
    would also copy every page of it: seconds per test, enough to pass for a hang."""
    gc.freeze()


def _global_precision() -> tuple[object, ...]:
    # The settings only: gmpy2's sticky flags (inexact, ...) legitimately change.
    context = gmpy2.get_context()
    return (
        mpmath.mp.prec,
        context.precision,
        context.emin,
        context.emax,
        context.subnormalize,
        context.round,
    )


@pytest.fixture(autouse=True)
def _no_global_precision_leaks() -> Iterator[None]:
    """Every test leaves mpmath's and gmpy2's global contexts exactly as it found them.

    Precision is always explicit in this project (a ``prec`` argument, a local gmpy2 context);
    a test or a library call that changes the global one would silently change its neighbours.
    """
    before = _global_precision()
    yield
    after = _global_precision()
    assert after == before, f"global precision changed: {before} -> {after}"
