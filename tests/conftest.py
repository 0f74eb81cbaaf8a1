"""Shared test set-up: hypothesis profiles chosen by HYPOTHESIS_PROFILE, and the oracle
on every plan (`oracle_watch`): a test fails when `memgraph.verify` and the independent
oracle (`oracle.py`) disagree on a plan made while it ran.

Profiles: `dev` (fast, for editing), `ci` (more examples, no deadline, derandomized:
the default when the CI variable is set), `thorough` (thousands of examples, for a
nightly-style run: `HYPOTHESIS_PROFILE=thorough make test`).
"""

from __future__ import annotations

import os

import oracle_watch
import pytest
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


# -- the oracle on every plan --------------------------------------------------------


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "judges_plans_itself: compares the verifier and the oracle on its plans itself "
        "(the watch leaves them alone)",
    )
    oracle_watch.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail the test when the verifier and the oracle disagree on a plan made in it (or
    before it, since the last test ran)."""
    watch = oracle_watch.WATCH
    watch.paused = item.get_closest_marker("judges_plans_itself") is not None
    try:
        result = yield
    except BaseException as err:
        found = watch.take()
        if found:
            err.add_note(oracle_watch.disagreement(found))
        raise
    finally:
        watch.paused = False
    found = watch.take()
    if found:
        raise AssertionError(oracle_watch.disagreement(found))
    return result


def pytest_terminal_summary(terminalreporter) -> None:
    summary = oracle_watch.WATCH.summary()
    if summary:
        terminalreporter.write_line(summary)
