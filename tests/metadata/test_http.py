"""The HTTP protocol, exactly: status codes and bodies, limits, and broken servers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from kvpool.errors import MetadataError, MetadataUnavailable
from kvpool.metadata import MetadataClientConfig, connect_metadata
from kvpool.metadata.http_client import HttpMetadataBackend
from kvpool.metadata.server import MetadataLimits, MetadataServer
from tests.metadata.rawserver import raw_server
from tests.support.net import free_port


@pytest.fixture(scope="module")
def small_server() -> Iterator[MetadataServer]:
    with MetadataServer(port=0, limits=MetadataLimits(max_value_bytes=1000, max_key_len=8)) as s:
        yield s


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        yield client


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("query", ["", "?key=", "?key=%20%20", "?other=x"])
def test_missing_or_blank_key_is_400(
    metadata_server: MetadataServer, http: httpx.Client, method: str, query: str
) -> None:
    response = http.request(method, metadata_server.url + query, content=b"v")
    assert response.status_code == 400
    assert response.text == "missing or blank 'key' query parameter: use /metadata?key=NAME\n"


def test_key_length_limit(small_server: MetadataServer, http: httpx.Client) -> None:
    assert http.put(small_server.url, params={"key": "k" * 8}, content=b"v").status_code == 200
    response = http.put(small_server.url, params={"key": "k" * 9}, content=b"v")
    assert response.status_code == 400
    assert response.text == "key of 9 characters exceeds the limit of 8\n"
    assert http.get(small_server.url, params={"key": "k" * 9}).status_code == 400


def test_default_key_limit_is_1024(metadata_server: MetadataServer, http: httpx.Client) -> None:
    url = metadata_server.url
    assert http.put(url, params={"key": "x" * 1024}, content=b"v").status_code == 200
    assert http.put(url, params={"key": "x" * 1025}, content=b"v").status_code == 400


def test_absent_key_is_404(metadata_server: MetadataServer, http: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        response = http.request(method, metadata_server.url, params={"key": "http/absent"})
        assert response.status_code == 404
        assert response.text == "metadata not found: 'http/absent'\n"


def test_put_get_delete_bodies(metadata_server: MetadataServer, http: httpx.Client) -> None:
    url, params = metadata_server.url, {"key": "http/raw"}
    response = http.put(url, params=params, content=b"\x00raw\xff")
    assert (response.status_code, response.text) == (200, "metadata updated\n")
    response = http.get(url, params=params)
    assert response.status_code == 200
    assert response.content == b"\x00raw\xff"
    assert response.headers["content-type"] == "application/octet-stream"
    response = http.delete(url, params=params)
    assert (response.status_code, response.text) == (200, "metadata deleted\n")


def test_value_at_limit_is_stored_and_one_more_byte_is_413(
    small_server: MetadataServer, http: httpx.Client
) -> None:
    url = small_server.url
    assert http.put(url, params={"key": "v"}, content=b"a" * 1000).status_code == 200
    response = http.put(url, params={"key": "v"}, content=b"b" * 1001)
    assert response.status_code == 413
    assert response.text == "value of 1001 bytes exceeds the limit of 1000 bytes\n"
    assert small_server.backend.get("v") == b"a" * 1000


def test_chunked_body_over_limit_is_413(small_server: MetadataServer, http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(3):
            yield b"c" * 400

    response = http.put(small_server.url, params={"key": "chunked"}, content=chunks())
    assert response.status_code == 413
    assert response.text == "value of more than 1000 bytes exceeds the limit of 1000 bytes\n"
    assert small_server.backend.get("chunked") is None


def test_default_value_limit_is_16_mib(metadata_server: MetadataServer) -> None:
    client = connect_metadata(metadata_server.url)
    assert client is not None
    with client, pytest.raises(MetadataError, match=r"answered 413 to PUT 'http/huge'"):
        client.put("http/huge", bytes((16 << 20) + 1))
    assert metadata_server.backend.get("http/huge") is None


def test_server_shares_the_given_backend(metadata_server: MetadataServer) -> None:
    metadata_server.backend.put("http/shared", b"from-inside")
    client = connect_metadata(metadata_server.url)
    assert client is not None
    with client:
        assert client.get("http/shared") == b"from-inside"
        client.put("http/shared", b"from-outside")
    assert metadata_server.backend.get("http/shared") == b"from-outside"


def test_unreachable_server_fails_fast() -> None:
    client = HttpMetadataBackend(f"http://127.0.0.1:{free_port()}/metadata")
    started = time.monotonic()
    with client, pytest.raises(MetadataUnavailable, match=r"unreachable for GET 'k'.*ConnectError"):
        client.get("k")
    assert time.monotonic() - started < 1.0


def test_silent_server_times_out_instead_of_hanging() -> None:
    with raw_server(reply=None) as port:
        url = f"http://127.0.0.1:{port}/metadata"
        client = HttpMetadataBackend(url, MetadataClientConfig(timeout_s=0.3))
        started = time.monotonic()
        with client, pytest.raises(MetadataUnavailable, match=r"did not answer PUT 'k' within 0.3s"):
            client.put("k", b"v")
        assert 0.3 <= time.monotonic() - started < 2.0


def test_garbage_answer_is_a_metadata_error() -> None:
    with raw_server(reply=b"this is not http\r\n\r\n") as port:
        client = HttpMetadataBackend(f"http://127.0.0.1:{port}/metadata")
        with client, pytest.raises(MetadataError, match=f"127.0.0.1:{port}"):
            client.get("k")


def test_unexpected_status_is_a_metadata_error_with_the_body() -> None:
    reply = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom"
    with raw_server(reply=reply) as port:
        client = HttpMetadataBackend(f"http://127.0.0.1:{port}/metadata")
        with client, pytest.raises(MetadataError, match=r"answered 500 to DELETE 'k': boom"):
            client.delete("k")


def test_server_port_zero_picks_a_port_and_stop_frees_it() -> None:
    server = MetadataServer(port=0).start()
    port = server.port
    assert port != 0 and server.url == f"http://127.0.0.1:{port}/metadata"
    server.stop()
    server.stop()  # idempotent
    client = HttpMetadataBackend(f"http://127.0.0.1:{port}/metadata")
    with client, pytest.raises(MetadataUnavailable):
        client.get("k")
    with MetadataServer(port=port) as again:  # the same port can be reused at once
        assert again.port == port


def test_server_refuses_a_busy_port_and_a_second_start(metadata_server: MetadataServer) -> None:
    with pytest.raises(MetadataError, match=f"cannot listen on 127.0.0.1:{metadata_server.port}"):
        MetadataServer(port=metadata_server.port).start()
    with pytest.raises(MetadataError, match="already started"):
        metadata_server.start()
