"""Suite-wide configuration: Hypothesis profiles (explicit, never global precision state)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# "ci" is derandomized so that a red CI run reproduces exactly on a developer's machine;
# "dev" explores new examples on every run.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
