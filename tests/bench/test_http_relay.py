"""The least HTTP relay of `kvpool bench proxy --py-relay` (kvpool.bench.http_relay), as a real
child process in front of a real HTTP server (uvicorn): requests on a kept-alive connection
answered whole, a streamed reply's pieces re-chunked intact, bytes that are not HTTP and an
upstream that refuses both close the client's connection."""

from __future__ import annotations

import socket

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvpool.bench.http_relay import running_http_relay
from kvpool.launch.ports import free_port
from kvpool.metadata.http_serving import HttpLimits
from tests.metadata.test_http_serving import _serving


async def _upper(request: Request) -> Response:
    body = await request.body()
    return Response(body.upper(), media_type=request.headers["content-type"])


async def _lines(request: Request) -> StreamingResponse:
    count = int(request.query_params["n"])

    async def lines():  # type: ignore[no-untyped-def]
        for i in range(count):
            yield b'{"i": %d}\n' % i
    return StreamingResponse(lines(), media_type="application/x-ndjson")


APP = Starlette(routes=[Route("/upper", _upper, methods=["POST"]),
                        Route("/lines", _lines, methods=["POST"])])


def test_requests_on_a_kept_alive_connection_get_their_replies_whole() -> None:
    with _serving(HttpLimits(), APP) as upstream, running_http_relay(upstream) as (port, pid):
        assert pid > 0
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            big = bytes(range(97, 123)) * 40_000  # ~1 MiB: many reads either way
            for payload in (b"abc", big, b"again"):
                got = client.post("/upper", content=payload,
                                  headers={"content-type": "text/plain"})
                assert got.status_code == 200
                assert got.headers["content-type"].startswith("text/plain")
                assert got.content == payload.upper()
            lines = client.post("/lines?n=500", content=b"{}",
                                headers={"content-type": "application/json"})
            assert lines.text.splitlines() == [f'{{"i": {i}}}' for i in range(500)]
            missing = client.post("/nowhere", content=b"{}")
            assert missing.status_code == 404


def test_bytes_that_are_not_http_close_the_connection() -> None:
    with _serving(HttpLimits(), APP) as upstream, running_http_relay(upstream) as (port, _):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"\x00\x01 not a request\r\n\r\n")
            assert _closed(s)


def test_an_upstream_that_refuses_closes_the_clients_connection() -> None:
    with running_http_relay(free_port()) as (port, _):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /upper HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
            assert _closed(s)


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True
