"""The Hypothesis profiles of the suite, registered once: ``dev``, ``ci`` and ``nightly``
(and ``mutation``, the mutation run's own, not offered to ``wacc check``).

Both the test suite (``tests/conftest.py``) and ``wacc check --profile`` use them. ``ci`` is
derandomized (a red CI run reproduces exactly) and has no deadline; ``nightly`` runs 20 times as
many examples and explores new ones. Hypothesis' example database (failing examples, replayed
first on the next run) lives under :data:`DATABASE_DIRECTORY` (``.hypothesis/wacc`` in the
working directory, or ``$WACC_HYPOTHESIS_DB``); ``ci`` uses none, so CI never depends on state.

``mutation`` is ``ci`` with a fifth of its examples and neither shrinking nor explaining a
failure: a surviving mutant runs every test that covers it, a killed one stops at its first
failing example, and at ``ci``'s budget the property tests made a full run several hours long on
two cores. Its score is therefore a lower bound on the power of the suite as CI runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from wacc.choices import PROFILES

__all__ = [
    "DATABASE_DIRECTORY",
    "MUTATION_EXAMPLES",
    "MUTATION_PROFILE",
    "PROFILES",
    "profile_settings",
    "register_profiles",
]

DATABASE_DIRECTORY = Path(os.environ.get("WACC_HYPOTHESIS_DB", ".hypothesis/wacc"))
CI_EXAMPLES = 100  # Hypothesis' own default, kept so the suite's property tests cost the same
NIGHTLY_FACTOR = 20
MUTATION_EXAMPLES = CI_EXAMPLES // 5
MUTATION_PROFILE = "mutation"
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]


def register_profiles() -> None:
    """Register the three profiles with Hypothesis (idempotent)."""
    database = DirectoryBasedExampleDatabase(str(DATABASE_DIRECTORY))
    # Every option explicit and the parent Hypothesis' own default, so that registering again
    # while another profile is loaded gives the same profiles.
    base = settings.get_profile("default")
    settings.register_profile(
        "dev",
        parent=base,
        max_examples=CI_EXAMPLES,
        derandomize=False,
        deadline=None,
        print_blob=True,
        database=database,
        suppress_health_check=_SLOW,
    )
    settings.register_profile(
        "ci",
        parent=base,
        max_examples=CI_EXAMPLES,
        derandomize=True,
        deadline=None,
        print_blob=True,
        database=None,
        suppress_health_check=_SLOW,
    )
    settings.register_profile(
        "nightly",
        parent=base,
        max_examples=CI_EXAMPLES * NIGHTLY_FACTOR,
        derandomize=False,
        deadline=None,
        print_blob=True,
        database=database,
        suppress_health_check=_SLOW,
    )
    settings.register_profile(
        MUTATION_PROFILE,
        parent=settings.get_profile("ci"),
        max_examples=MUTATION_EXAMPLES,
        # A mutant is killed by the first failing example: shrinking it, and explaining it
        # (which traces every line), only cost time, seconds per killed mutant.
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )


def profile_settings(name: str) -> settings:
    """The registered settings of profile ``name`` (``ValueError`` for an unknown one)."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; profiles are {', '.join(PROFILES)}")
    register_profiles()
    return settings.get_profile(name)


register_profiles()
