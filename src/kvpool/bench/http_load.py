"""A closed-loop HTTP/1.1 load: `concurrency` kept-alive connections, each sending its next
request as soon as the last reply has been read to its end. Raw sockets (asyncio streams), so
the client's own CPU stays small beside what it measures.

    drive(host, port, make, check, num_requests, concurrency)
        -> Load(requests, units, wall, latencies: each request's send to its reply's end)
      make(i)    -> (path, body)  the i-th request, POSTed as application/json
      check(body) -> units         what the reply carried (tokens); ValueError when it is wrong

`read_reply` reads one reply (Content-Length or chunked) off a stream; a reply that is not
200, or a connection that closes mid-reply, raises `ValueError` naming what was read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    requests: int
    units: int
    """What `check` counted over every reply (output tokens)."""
    wall_s: float
    latencies_s: tuple[float, ...] = ()
    """Each request's time from its send to the end of its reply, in completion order."""


def request_bytes(host: str, port: int, path: str, body: bytes) -> bytes:
    """A kept-alive POST of a JSON body."""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_reply(reader: asyncio.StreamReader) -> bytes:
    """The body of the next reply on `reader` (chunked bodies joined)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        status, headers = _head(head)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await _chunked(reader)
        else:
            body = await reader.readexactly(int(headers.get("content-length", "0")))
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise ValueError(f"the connection broke mid-reply: {exc!r}") from None
    if status != 200:
        raise ValueError(f"HTTP {status}: {body[:300]!r}")
    return body


def _head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0], 16)
        except ValueError:
            raise ValueError(f"bad chunk size line {size_line[:40]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return b"".join(parts)
        chunk = await reader.readexactly(size + 2)
        if chunk[-2:] != b"\r\n":
            raise ValueError("a chunk does not end with CRLF")
        parts.append(chunk[:-2])


async def drive(host: str, port: int, make: Callable[[int], tuple[str, bytes]],
                check: Callable[[bytes], int], num_requests: int, concurrency: int) -> Load:
    """Send `num_requests` requests over `concurrency` connections (closed loop); the first
    wrong reply raises ValueError."""
    counter = iter(range(num_requests))
    units = 0
    latencies: list[float] = []
    clock = time.perf_counter

    async def connection() -> None:
        nonlocal units
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        try:
            for i in counter:
                path, body = make(i)
                sent = clock()
                writer.write(request_bytes(host, port, path, body))
                reply = await read_reply(reader)
                latencies.append(clock() - sent)
                units += check(reply)  # after the await: `units += check(await ...)` loses updates
        finally:
            writer.close()

    start = clock()
    await asyncio.gather(*(connection() for _ in range(min(concurrency, num_requests))))
    return Load(num_requests, units, clock() - start, tuple(latencies))
