"""wacc/choices.py: the command line's names, light to import, in step with their sources."""

from __future__ import annotations

from wacc import choices
from wacc.judge import engine, implementation, profiles, verdict
from wacc_ref import formats


def test_the_copies_match_the_judge_and_the_reference() -> None:
    """The families, work dtypes and oracle sets the parser offers are the judge's own."""
    assert choices.FAMILY_NAMES == tuple(engine.family_names())
    assert choices.MACHINE == engine.MACHINE == choices.FAMILY_NAMES[-1]
    assert choices.WORK_DTYPES == formats.WORK_DTYPES
    assert tuple(choices.ORACLE_SET_NAMES) == tuple(verdict.ORACLE_SETS)


def test_the_definitions_are_the_ones_the_judge_uses() -> None:
    """FEATURES, PROFILES and DEFAULT_IMPL are defined once, here, and used by their modules."""
    assert implementation.FEATURES is choices.FEATURES
    assert set(implementation.FEATURE_METHODS) < set(choices.FEATURES)  # checksum is probed
    assert profiles.PROFILES is choices.PROFILES
    assert implementation.DEFAULT_IMPL == choices.DEFAULT_IMPL
    assert implementation.load_implementation(choices.DEFAULT_IMPL).missing == ()
