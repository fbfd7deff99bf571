"""The Hypothesis profiles of the suite, registered once: ``dev``, ``ci`` and ``nightly``.

Both the test suite (``tests/conftest.py``) and ``wacc check --profile`` use them. ``ci`` is
derandomized (a red CI run reproduces exactly) and has no deadline; ``nightly`` runs 20 times as
many examples and explores new ones. Hypothesis' example database (failing examples, replayed
first on the next run) lives under :data:`DATABASE_DIRECTORY` (``.hypothesis/wacc`` in the
working directory, or ``$WACC_HYPOTHESIS_DB``); ``ci`` uses none, so CI never depends on state.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

__all__ = ["DATABASE_DIRECTORY", "PROFILES", "profile_settings", "register_profiles"]

DATABASE_DIRECTORY = Path(os.environ.get("WACC_HYPOTHESIS_DB", ".hypothesis/wacc"))
CI_EXAMPLES = 100  # Hypothesis' own default, kept so the suite's property tests cost the same
NIGHTLY_FACTOR = 20
PROFILES: tuple[str, ...] = ("dev", "ci", "nightly")
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]


def register_profiles() -> None:
    """Register the three profiles with Hypothesis (idempotent)."""
    database = DirectoryBasedExampleDatabase(str(DATABASE_DIRECTORY))
    settings.register_profile(
        "dev",
        max_examples=CI_EXAMPLES,
        deadline=None,
        print_blob=True,
        database=database,
        suppress_health_check=_SLOW,
    )
    settings.register_profile(
        "ci",
        max_examples=CI_EXAMPLES,
        derandomize=True,
        deadline=None,
        print_blob=True,
        database=None,
        suppress_health_check=_SLOW,
    )
    settings.register_profile(
        "nightly",
        max_examples=CI_EXAMPLES * NIGHTLY_FACTOR,
        deadline=None,
        print_blob=True,
        database=database,
        suppress_health_check=_SLOW,
    )


def profile_settings(name: str) -> settings:
    """The registered settings of profile ``name`` (``ValueError`` for an unknown one)."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; profiles are {', '.join(PROFILES)}")
    register_profiles()
    return settings.get_profile(name)


register_profiles()
