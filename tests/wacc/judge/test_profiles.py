"""The Hypothesis profiles (wacc.judge.profiles), shared by the suite and ``wacc check
--profile``."""

from __future__ import annotations

import pytest

from wacc.judge.profiles import NIGHTLY_FACTOR, PROFILES, profile_settings


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


def test_the_mutation_profile_is_ci_with_fewer_examples_and_not_offered_to_users() -> None:
    """``mutation`` is derandomized like ci, without deadline or database, runs a fifth of ci's
    examples (at least one), generates but never shrinks, and is not one of the profiles
    ``wacc check`` accepts."""
    from hypothesis import Phase, settings

    from wacc.judge.profiles import MUTATION_PROFILE

    ci, mutation = profile_settings("ci"), settings.get_profile(MUTATION_PROFILE)
    assert mutation.derandomize and mutation.deadline is None and mutation.database is None
    assert 1 <= mutation.max_examples == ci.max_examples // 5
    assert Phase.generate in mutation.phases and Phase.shrink not in mutation.phases
    assert MUTATION_PROFILE not in PROFILES
