"""Shared test set-up: hypothesis profiles chosen by HYPOTHESIS_PROFILE.

Profiles: `dev` (fast, for editing), `ci` (more examples, no deadline, derandomized:
the default when the CI variable is set), `thorough` (thousands of examples, for a
nightly-style run: `HYPOTHESIS_PROFILE=thorough make test`).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
