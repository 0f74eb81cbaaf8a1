"""What the several-devices tests share: one local Ray instance per test module, and the
`xdist_group` that keeps every Ray test on one pytest-xdist worker (`make test` runs
pytest on several processes): each of those would start its own instance of
`num_cpus=2` actors on the same CPUs, and `test_ray_cluster`'s first test wants a
process without an instance up."""

from __future__ import annotations

import pytest

RAY_GROUP = "ray"
"""The xdist_group of the tests that use Ray: those using `cluster`, and those marked
with it by hand (a test that starts Ray itself)."""

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


def pytest_collection_modifyitems(items) -> None:
    """Every test that uses `cluster` joins `RAY_GROUP` (a no-op without xdist)."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
