"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.clock import VirtualClock
from tests.support.etcd import etcd_server
from tests.support.net import free_port


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
