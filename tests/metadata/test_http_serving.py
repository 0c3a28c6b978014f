"""The HTTP servers' stack: asyncio and h11 by default, uvloop and httptools with `fast`
(the proxy), and the slow-client defences on either, with real sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvpool.metadata.http_serving import (
    HttpLimits,
    QuietServer,
    _all_in,
    fast_stack,
    read_body,
    uvicorn_config,
)
from tests.support.net import free_port

httptools_impl = pytest.importorskip("uvicorn.protocols.http.httptools_impl")
pytest.importorskip("uvloop")


async def _app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


def test_fast_means_uvloop_and_httptools_with_the_defences() -> None:
    limits = HttpLimits(max_concurrency=7, head_timeout_s=3.0)
    fast = uvicorn_config(_app, limits, fast=True)
    plain = uvicorn_config(_app, limits)
    assert fast_stack() == ("uvloop", True)
    assert fast.loop == "uvloop" and plain.loop == "asyncio"
    assert issubclass(fast.http, httptools_impl.HttpToolsProtocol)  # type: ignore[arg-type]
    assert issubclass(plain.http, H11Protocol)  # type: ignore[arg-type]
    for cls in (fast.http, plain.http):
        assert (cls.max_concurrency, cls.head_timeout_s) == (7, 3.0)  # type: ignore[union-attr]


@contextmanager
def _serving(limits: HttpLimits, app: Any = _app) -> Iterator[int]:
    port = free_port()
    server = QuietServer(uvicorn_config(app, limits, fast=True, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def _closed(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_on_httptools_silent_connections_give_way_and_a_trickled_head_is_cut() -> None:
    limits = HttpLimits(max_concurrency=4, head_timeout_s=0.6, idle_timeout_s=30)
    with _serving(limits) as port:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        try:
            time.sleep(0.1)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
                assert [http.get("/").status_code for _ in range(3)] == [200] * 3
            assert sum(_closed(s, 0.05) for s in silent) >= 4  # evicted for the new ones
        finally:
            for s in silent:
                s.close()
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.monotonic()
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
            assert _closed(s, 3.0)
            assert 0.5 <= time.monotonic() - t0 <= 2.0


def test_the_startup_heap_is_frozen_out_of_the_collectors_way() -> None:
    import gc

    from kvpool.metadata.http_serving import SERVING_GC_THRESHOLDS, freeze_startup_heap

    before, thresholds = gc.get_freeze_count(), gc.get_threshold()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > max(before, 1000)  # this process's modules at least
        assert len(gc.get_objects(generation=2)) < gc.get_freeze_count()
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_requests_served_on_httptools_leave_no_garbage_for_the_collector() -> None:
    """Each request's cycle, scope and BodyWriter go with their last reference: the writer
    holds the cycle weakly (a strong reference made each request a reference cycle of about
    16 objects that only the collector could free)."""
    import gc

    with _serving(HttpLimits(idle_timeout_s=30)) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        def ask() -> None:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"ok"):  # head and body, in one read or two
                part = s.recv(4096)
                assert part, reply
                reply += part

        ask()  # the connection's own objects made
        gc.collect()
        gc.disable()
        try:
            for _ in range(100):
                ask()
            found = gc.collect()
        finally:
            gc.enable()
    assert found < 50, f"{found} objects in reference cycles after 100 requests"


_WHOLE: list[bool] = []
"""Whether each request `_echo_body` answered had its whole body in when it began."""


async def _echo_body(scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
    """Answers the body read with `read_body` (a 0.4 s deadline), or 408 when it is late."""
    from starlette.requests import Request

    request = Request(scope, receive)
    _WHOLE.append(_all_in(request))
    try:
        body, status = await read_body(request, 1 << 16, 0.4), 200
    except TimeoutError:
        body, status = b"late", 408
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _post_head(size: int) -> bytes:
    return f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode()


def test_a_body_that_came_whole_is_read_and_one_still_coming_keeps_its_deadline() -> None:
    """A body in with its head is read without arming the deadline; one whose end has not come
    yet is still held to it, however the first part came with the head."""
    _WHOLE.clear()
    with _serving(HttpLimits(idle_timeout_s=30), _echo_body) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(_post_head(5000) + b"x" * 5000)  # one write: all in with the head
            reply = b""
            while not reply.endswith(b"x" * 5000):
                part = s.recv(65536)
                assert part, reply
                reply += part
            assert reply.startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(_post_head(10) + b"12345")  # and the other five bytes never
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 408") and reply.endswith(b"late"), reply
            assert 0.3 <= time.monotonic() - t0 <= 2.0
    assert _WHOLE == [True, False]
