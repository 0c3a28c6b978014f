"""connect_metadata: which URI gives which backend; config bounds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.errors import ConfigError
from kvpool.metadata import MetadataClientConfig, connect_metadata
from kvpool.metadata.etcd_backend import EtcdMetadataBackend
from kvpool.metadata.http_client import HttpMetadataBackend
from kvpool.metadata.server import MetadataLimits, MetadataServer
from kvpool.metadata.uri import parse_etcd_endpoints
from tests.support.procs import python_env


@pytest.mark.parametrize("uri", ["P2PHANDSHAKE", "p2phandshake", "P2pHandShake", " P2PHANDSHAKE\n"])
def test_p2p_handshake_means_no_directory(uri: str) -> None:
    assert connect_metadata(uri) is None


@pytest.mark.parametrize(
    "uri",
    ["http://127.0.0.1:8080/metadata", "http://example.org/meta/data", "HTTP://h:1/metadata",
     "https://h:443/metadata"],
)
def test_http_uris(uri: str) -> None:
    backend = connect_metadata(uri, timeout_s=2.5)
    assert isinstance(backend, HttpMetadataBackend)
    with backend:
        assert backend.url == uri
        assert backend.config == MetadataClientConfig(timeout_s=2.5)


@pytest.mark.parametrize(
    ("uri", "endpoints"),
    [
        ("etcd://127.0.0.1:2379", [("127.0.0.1", 2379)]),
        ("etcd://h1:1,h2:2", [("h1", 1), ("h2", 2)]),
        ("etcd://h1:1, h2:2/", [("h1", 1), ("h2", 2)]),
        ("etcd://etcd-0.local", [("etcd-0.local", 2379)]),
        ("ETCD://[::1]:2380", [("::1", 2380)]),
        ("10.0.0.5:23790", [("10.0.0.5", 23790)]),
        ("localhost:2379", [("localhost", 2379)]),
    ],
)
def test_etcd_uris(uri: str, endpoints: list[tuple[str, int]]) -> None:
    assert parse_etcd_endpoints(uri.strip().split("://")[-1]) == endpoints
    backend = connect_metadata(uri)
    assert isinstance(backend, EtcdMetadataBackend)
    with backend:
        assert backend.url == "etcd://" + ",".join(f"{h}:{p}" for h, p in endpoints)


@pytest.mark.parametrize(
    "uri",
    ["", "   ", "localhost", "redis://h:6379", "file:///tmp/x", "http:/h:1/metadata", "h:port",
     "P2P", "etcd://", "etcd://h:1,,h:2", "etcd://h:0", "etcd://h:99999", "etcd://h:1/x"],
)
def test_unsupported_uris_name_the_accepted_forms(uri: str) -> None:
    with pytest.raises(ConfigError) as info:
        connect_metadata(uri)
    assert repr(uri) in str(info.value) or "etcd endpoint" in str(info.value)


def test_unknown_scheme_message_lists_every_form() -> None:
    with pytest.raises(ConfigError) as info:
        connect_metadata("ftp://h:1")
    assert str(info.value) == (
        "unsupported metadata URI 'ftp://h:1': use 'P2PHANDSHAKE' (no directory), "
        "'http://host:port/metadata', 'etcd://host:port[,host:port...]', or a bare etcd "
        "'host:port'"
    )


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("http://h:8080", "has no path: use http://h:8080/metadata"),
        ("http://h:8080/", "has no path: use http://h:8080/metadata"),
        ("http:///metadata", "has no host"),
        ("http://h:bad/metadata", "has a bad port"),
        ("http://h:1/metadata?key=x", "must not carry a query"),
    ],
)
def test_bad_http_uris(uri: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        connect_metadata(uri)


def test_non_string_uri_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unsupported metadata URI None"):
        connect_metadata(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, 3601.0])
def test_timeout_bounds(timeout_s: float) -> None:
    with pytest.raises(ConfigError, match="timeout_s"):
        connect_metadata("http://h:1/metadata", timeout_s=timeout_s)


def test_client_config_bounds() -> None:
    with pytest.raises(ConfigError, match="max_connections"):
        MetadataClientConfig(max_connections=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_value_bytes": 0}, "max_value_bytes"), ({"max_value_bytes": (1 << 31) + 1}, "max_value_bytes"),
     ({"max_key_len": 0}, "max_key_len"), ({"max_key_len": 65537}, "max_key_len")],
)
def test_server_limit_bounds(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        MetadataLimits(**kwargs)


@pytest.mark.parametrize("port", [-1, 65536])
def test_server_port_bounds(port: int) -> None:
    with pytest.raises(ConfigError, match="port must be in 0..65535"):
        MetadataServer(port=port)


def test_redis_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"^redis metadata \('redis://h:6379'\) is not supported"):
        connect_metadata("redis://h:6379")


def test_library_import_does_not_pull_in_the_server() -> None:
    code = "import sys, kvpool.metadata; print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=30
    )
    assert (result.returncode, result.stdout) == (0, "[]\n")
