"""Shared test set-up: hypothesis profiles chosen by HYPOTHESIS_PROFILE, and the oracle
on every plan (`oracle_watch`): a test fails when `memgraph.verify` and the independent
oracle (`oracle.py`) disagree on a plan made while it ran.

Profiles: `dev` (fast, for editing), `ci` (more examples, no deadline, derandomized:
the default when the CI variable is set), `thorough` (thousands of examples, for a
nightly-style run: `HYPOTHESIS_PROFILE=thorough make test`).
"""

from __future__ import annotations

import os

# On a pytest-xdist worker (`make test`), NumPy's BLAS and torch get the worker's share of
# the CPUs (at least one thread) instead of a thread per CPU each: with a worker per CPU,
# that oversubscribes them. Measured on 2 cores, 2 workers, three files of the torch
# reference models: 42 s with 1 thread a worker, 49 s with 2. Set before either loads;
# a variable already set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _threads = str(max(1, (os.cpu_count() or 1) // _workers))
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)

import oracle_watch  # noqa: E402  (after the threads are set: it loads NumPy)
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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
    config.addinivalue_line(
        "markers",
        "xdist_group(name): tests pytest-xdist runs on one worker, one after another "
        "(registered here too, so the marks hold without xdist installed)",
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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under `--dist loadgroup`, give each test marked `xdist_group(NAME)` the id suffix
    `@NAME` that pytest-xdist's scheduler groups by. xdist 3.8 writes the suffix into
    `item._nodeid`, which pytest 9.2 no longer reads (its node ids are structured), so
    the groups silently fall apart (pytest-dev/pytest-xdist#1386); this does what xdist
    means to, and nothing where the suffix is already there (a fixed xdist)."""
    if not config.getoption("loadgroup", default=False):  # set on xdist workers only
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            _set_nodeid(item, item.nodeid + suffix)


def _set_nodeid(item, nodeid: str) -> None:
    """Give `item` the node id `nodeid` by pytest's private fields: `_id` (a `NodeId`)
    from pytest 9.2, `_nodeid` before. Where neither works (a later pytest), the Ray
    tests are only not grouped: each worker then starts its own local instance, which
    is slower, not wrong (each test's instance is its process's own)."""
    try:
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(nodeid)
    except (ImportError, AttributeError, TypeError, ValueError):
        try:
            item._nodeid = nodeid
        except AttributeError:
            return


def pytest_sessionfinish(session) -> None:
    """On a pytest-xdist worker, hand the watch's counts to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["oracle_watch"] = oracle_watch.WATCH.counted()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the pytest-xdist controller: add a finished worker's counts to the summary."""
    counted = getattr(node, "workeroutput", {}).get("oracle_watch")
    if counted:
        oracle_watch.WATCH.add(counted)


def pytest_terminal_summary(terminalreporter) -> None:
    summary = oracle_watch.WATCH.summary()
    if summary:
        terminalreporter.write_line(summary)
