"""Metadata fixtures: one server in-process, one `kvpool metadata` child process, real etcd."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from kvpool.metadata import MemoryBackend, MetadataBackend, connect_metadata
from kvpool.metadata.server import MetadataServer
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool

BACKEND_KINDS = ("memory", "http", "http-subprocess", "etcd")


@pytest.fixture(scope="session")
def metadata_server() -> Iterator[MetadataServer]:
    """A MetadataServer running on a background thread of this process, on a free port."""
    with MetadataServer(port=0) as server:
        yield server


@pytest.fixture(scope="session")
def metadata_subprocess_url() -> Iterator[str]:
    """URL of `kvpool metadata` started as a real child process, the way a user runs it."""
    port = free_port()
    with running(spawn_kvpool("metadata", "--port", str(port))) as proc:
        wait_port(port)
        assert proc.poll() is None
        yield f"http://127.0.0.1:{port}/metadata"


@pytest.fixture(params=BACKEND_KINDS)
def backend(request: pytest.FixtureRequest) -> Iterator[MetadataBackend]:
    kind = request.param
    if kind == "memory":
        made: MetadataBackend | None = MemoryBackend()
    elif kind == "http":
        made = connect_metadata(request.getfixturevalue("metadata_server").url)
    elif kind == "http-subprocess":
        made = connect_metadata(request.getfixturevalue("metadata_subprocess_url"))
    else:
        made = connect_metadata("etcd://" + request.getfixturevalue("etcd_endpoint"))
    assert made is not None
    with made:
        yield made


@pytest.fixture
def prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to the test (servers and etcd are shared by the session)."""
    return "t/" + re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name) + "/"
