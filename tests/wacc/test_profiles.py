"""The Hypothesis profiles (wacc.profiles), shared by the suite and ``wacc check --profile``."""

from __future__ import annotations

import pytest

from wacc.profiles import NIGHTLY_FACTOR, PROFILES, profile_settings


def test_ci_is_derandomized_without_deadline_or_database() -> None:
    """The ci profile reproduces exactly: derandomized, no deadline, no example database."""
    ci = profile_settings("ci")
    assert ci.derandomize and ci.deadline is None and ci.database is None


def test_nightly_runs_at_least_twenty_times_ci() -> None:
    """nightly's example budget is at least 20 times ci's, and it explores (not derandomized)."""
    ci, nightly = profile_settings("ci"), profile_settings("nightly")
    assert NIGHTLY_FACTOR >= 20 and nightly.max_examples >= 20 * ci.max_examples
    assert not nightly.derandomize


def test_every_profile_is_registered_and_unknown_ones_are_refused() -> None:
    """dev, ci and nightly resolve; any other name raises ValueError naming it."""
    assert [profile_settings(name).max_examples > 0 for name in PROFILES] == [True] * 3
    with pytest.raises(ValueError, match="'weekly'"):
        profile_settings("weekly")
