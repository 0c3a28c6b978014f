"""etcd specifics: key layout in etcd itself, failover between endpoints, failures."""

from __future__ import annotations

import socket
import time

import pytest
from etcd3gw.client import Etcd3Client

from kvpool.errors import MetadataError, MetadataUnavailable
from kvpool.metadata import MetadataClientConfig, connect_metadata
from kvpool.metadata.etcd_backend import EtcdMetadataBackend
from tests.metadata.rawserver import raw_server
from tests.support.net import accept_in_threads, free_port


def _raw_client(endpoint: str) -> Etcd3Client:
    host, port = endpoint.rsplit(":", 1)
    return Etcd3Client(host=host, port=int(port), timeout=5, api_path="/v3/")


def test_keys_are_stored_in_etcd_verbatim_as_utf8(etcd_endpoint: str) -> None:
    key = "etcd/layout/mooncake/ram/节点-é:1"
    backend = connect_metadata(etcd_endpoint)  # bare host:port means etcd
    assert isinstance(backend, EtcdMetadataBackend)
    with backend:
        backend.put(key, b"\x00\x01")
        assert _raw_client(etcd_endpoint).get(key.encode("utf-8")) == [b"\x00\x01"]
        _raw_client(etcd_endpoint).put(key.encode("utf-8"), b"written by another client")
        assert backend.get(key) == b"written by another client"


def test_unreachable_etcd_fails_fast() -> None:
    backend = connect_metadata(f"etcd://127.0.0.1:{free_port()}")
    assert backend is not None
    started = time.monotonic()
    with backend, pytest.raises(MetadataUnavailable, match=r"unreachable for put 'k'"):
        backend.put("k", b"v")
    assert time.monotonic() - started < 1.0


def test_failover_to_the_live_endpoint(etcd_endpoint: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    backend = connect_metadata(f"etcd://{dead},{etcd_endpoint}")
    assert isinstance(backend, EtcdMetadataBackend)
    with backend:
        backend.put("etcd/failover", b"ok")
        assert backend.get("etcd/failover") == b"ok"
        assert backend.delete("etcd/failover") is True


def test_an_endpoint_that_breaks_off_its_reply_fails_over(etcd_endpoint: str) -> None:
    """A reply cut short (an endpoint dying mid-answer) raises requests' own error, not
    etcd3gw's: it counts as unreachable, and the next endpoint answers."""
    listener = socket.create_server(("127.0.0.1", 0))

    def cut_short(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 500\r\n\r\n{\"header\":{")
    accept_in_threads(listener, cut_short)
    try:
        backend = connect_metadata(
            f"etcd://127.0.0.1:{listener.getsockname()[1]},{etcd_endpoint}")
        assert isinstance(backend, EtcdMetadataBackend)
        with backend:
            backend.put("etcd/cut", b"ok")
            assert backend.get("etcd/cut") == b"ok"
    finally:
        listener.close()


def test_all_endpoints_down_names_each_one() -> None:
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    backend = connect_metadata(f"etcd://{first},{second}")
    assert backend is not None
    with backend, pytest.raises(MetadataUnavailable) as info:
        backend.get("k")
    assert f"{first}: ConnectionFailedError" in str(info.value)
    assert f"{second}: ConnectionFailedError" in str(info.value)


def test_silent_etcd_times_out_instead_of_hanging() -> None:
    with raw_server(reply=None) as port:
        backend = EtcdMetadataBackend([("127.0.0.1", port)], MetadataClientConfig(timeout_s=0.3))
        started = time.monotonic()
        with backend, pytest.raises(MetadataUnavailable, match="ConnectionTimeoutError"):
            backend.get("k")
        assert 0.3 <= time.monotonic() - started < 2.0


def _reply(status: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.mark.parametrize(
    "reply",
    [
        _reply("200 OK", b"garbage"),
        _reply("404 Not Found", b"not found"),
        _reply("200 OK", b'{"kvs": [{"value": "not base64!"}]}'),
        _reply("200 OK", b'{"kvs": [{"value": 1}]}'),
    ],
    ids=["not-json", "404", "bad-base64", "bad-value-type"],
)
def test_garbage_from_etcd_is_a_metadata_error(reply: bytes) -> None:
    with raw_server(reply=reply) as port:
        backend = EtcdMetadataBackend([("127.0.0.1", port)])
        with backend, pytest.raises(MetadataError, match=f"etcd 127.0.0.1:{port} failed get 'k'"):
            backend.get("k")


def test_not_etcd_at_all_is_not_reported_as_unreachable(metadata_server: object) -> None:
    port = metadata_server.port  # type: ignore[attr-defined]
    backend = EtcdMetadataBackend([("127.0.0.1", port)])
    with backend, pytest.raises(MetadataError) as info:
        backend.put("k", b"v")
    assert not isinstance(info.value, MetadataUnavailable)


def test_empty_endpoint_list_is_refused() -> None:
    with pytest.raises(MetadataError, match="at least one"):
        EtcdMetadataBackend([])


def test_value_over_etcd_request_limit_is_a_metadata_error(etcd_endpoint: str) -> None:
    backend = connect_metadata(etcd_endpoint)
    assert backend is not None
    with backend:
        with pytest.raises(MetadataError, match="request is too large") as info:
            backend.put("etcd/too-large", bytes(1_600_000))
        assert not isinstance(info.value, MetadataUnavailable)
        assert backend.get("etcd/too-large") is None
