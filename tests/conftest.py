"""Fixtures shared by every test package, and the CI switch: under KVPOOL_CI=1 (`.ci/run`)
a skip fails unless its reason says CI cannot provide its cause (tests.support.require)."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from kvpool.clock import VirtualClock
from tests.support.etcd import etcd_server
from tests.support.net import free_port
from tests.support.require import CI_SWITCH, in_ci, skip_allowed_in_ci


def _fail_a_quiet_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Under the CI switch, turn a skip CI should not see into a failure that says why."""
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if skip_allowed_in_ci(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"{CI_SWITCH}=1: a skip whose cause CI provides fails ({reason}); a cause "
                       "CI cannot provide skips with tests.support.require.skip_outside_ci")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_a_quiet_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector,
                               ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _fail_a_quiet_skip(report)
    return report


@pytest.fixture
def vclock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def etcd_endpoint() -> Iterator[str]:
    """'127.0.0.1:PORT' of a real etcd server shared by the whole test session."""
    with etcd_server() as endpoint:
        yield endpoint
