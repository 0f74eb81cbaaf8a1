"""What the several-devices tests share: one local Ray instance per test module."""

from __future__ import annotations

import pytest

LOCAL_RAY = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
"""How the tests start Ray: two CPUs, no dashboard, actors' logs not echoed."""


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance for the module (`LOCAL_RAY`; one already up is used and left
    up); skipped where Ray is not installed."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'einpage[cluster]'")
    started = not ray.is_initialized()
    if started:
        ray.init(**LOCAL_RAY)
    yield
    if started:
        ray.shutdown()
