"""HeldHead: a response head goes out with the next write of the same loop turn, alone at
the next turn otherwise, and bytes keep their order whatever is held; a real uvloop server
answers through it with one write per response."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool.metadata.held_head import HeldHead


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def test_a_head_goes_with_the_next_write_of_the_same_turn() -> None:
    async def run() -> list[bytes]:
        rec = Recorder()
        t = HeldHead(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(HEAD)
        assert rec.writes == []
        t.write(b"ok")
        t.write(b"more")
        await asyncio.sleep(0)
        return rec.writes
    assert asyncio.run(run()) == [HEAD + b"ok", b"more"]


def test_a_head_alone_goes_at_the_next_turn_and_close_flushes_it() -> None:
    async def run() -> tuple[list[bytes], list[bytes], bool]:
        loop = asyncio.get_running_loop()
        rec = Recorder()
        t = HeldHead(rec, loop)  # type: ignore[arg-type]
        t.write(HEAD)
        await asyncio.sleep(0)
        alone = list(rec.writes)
        t.write(b"ok")
        t.write(HEAD)
        t.close()
        return alone, rec.writes, rec.closed
    alone, writes, closed = asyncio.run(run())
    assert alone == [HEAD] and writes == [HEAD, b"ok", HEAD] and closed


def test_an_abort_drops_what_is_held_and_the_rest_is_the_transports() -> None:
    async def run() -> Recorder:
        rec = Recorder()
        t = HeldHead(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(HEAD)
        t.abort()
        await asyncio.sleep(0)
        assert t.get_extra_info("peername") == ("127.0.0.1", 1) and t.is_closing()
        return rec
    rec = asyncio.run(run())
    assert rec.writes == [] and rec.aborted


def test_the_fast_protocol_writes_each_response_once() -> None:
    """The proxy's protocol (uvicorn's httptools one, with kvpool's defences, holding heads)
    over a recording transport: a JSON response and a stream of two chunks, each request's
    head written with its body's first bytes."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from kvpool.metadata.http_serving import HttpLimits, _protocol

    async def hello(_: Any) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def chunks() -> Any:
        yield b"one"
        await asyncio.sleep(0.01)
        yield b"two"

    async def stream(_: Any) -> StreamingResponse:
        return StreamingResponse(chunks())

    app = Starlette(routes=[Route("/hello", hello), Route("/stream", stream)])

    async def run(hold: bool) -> list[bytes]:
        config = Config(app=app, http="httptools", lifespan="off", access_log=False)
        rec = Recorder()
        protocol = _protocol(HttpLimits(), httptools=True, hold_heads=hold)
        proto = protocol(config=config, server_state=ServerState(), app_state={},
                         _loop=asyncio.get_running_loop())
        proto.connection_made(rec)
        proto.data_received(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        proto.data_received(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        proto.connection_lost(None)
        return rec.writes

    assert len(asyncio.run(run(False))) == 6  # without: each head a write of its own
    writes = asyncio.run(run(True))
    assert len(writes) == 4, writes
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b'{"ok":true}')
    assert writes[1].startswith(b"HTTP/1.1 200 OK\r\n") and writes[1].endswith(b"3\r\none\r\n")
    assert writes[2:] == [b"3\r\ntwo\r\n", b"0\r\n\r\n"]
