"""Frames relayed in the worker connection's read callback (`--read-relay`, the default): a
streamed choice of text alone takes the frames that come while its task waits, and writes their
chunks there. The same bytes as the generators make, nothing taken out of turn (a finish line,
an error, whatever follows them, and every frame while the client is slow go the usual way),
and a stream relayed this way is never cut by the read timeout."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import (
    FinishLine,
    GenerateRequest,
    PlainFrame,
    ndjson_line,
    plain_prefix,
)
from kvpool.errors import WorkerCallError
from kvpool.serve.backend import FrameRelay, read_relay
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.ndjson_reply import ReplyReader
from kvpool.serve.requests import ChoiceJob, PreparedRequest
from kvpool.serve.responses import Choice, ChoiceRelay, _choice_events, relayable
from kvpool.serve.text import TextStream
from kvpool.serve.tokenizer import ModelTokenizer
from kvpool.serve.worker_client import WorkerClient
from kvpool.serve.worker_stream import LineRelay, StreamPool
from tests.serve.test_worker_client import read_request
from tests.serve.test_worker_stream import HEAD, _lines, _serving


def _relay_lines(relay: FrameRelay, on_lines: Callable[[], None]) -> LineRelay:
    """kvpool's lean reader's relay (worker_client.generate)."""
    return read_relay(relay, plain_prefix, on_lines)


def _frame(ids: list[int]) -> bytes:
    return ndjson_line(PlainFrame(ids, [1.0 + i for i in range(len(ids))]))


def _chunk(line: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(line), line)


FINISH = FinishLine(finish_reason="length").model_dump_json(exclude_none=True).encode() + b"\n"


class _Relay:
    """A FrameRelay that records what it takes."""

    def __init__(self, ready: bool = True) -> None:
        self.is_ready = ready
        self.frames: list[list[int]] = []

    def ready(self) -> bool:
        return self.is_ready

    def take(self, frame: PlainFrame) -> bool:
        self.frames.append(frame.token_ids)
        return True


def _reply(*body_lines: bytes) -> ReplyReader:
    reply = ReplyReader()
    reply.feed(HEAD + b"".join(_chunk(line) for line in body_lines))
    return reply


def test_the_plain_frames_a_read_begins_with_are_taken_merged() -> None:
    relay, told = _Relay(), []
    take = _relay_lines(relay, lambda: told.append(1))
    reply = _reply(_frame([1, 2]), _frame([3]))
    assert take(reply) is True  # nothing left for the reader
    assert relay.frames == [[1, 2, 3]] and told == [1]
    assert reply.lines() == []


def test_a_finish_line_and_all_after_it_are_the_readers() -> None:
    """The frame before it is taken; the finish line and the frame after it are given back
    in order, and nothing of the stream is taken from then on."""
    relay = _Relay()
    take = _relay_lines(relay, lambda: None)
    reply = _reply(_frame([1]), FINISH, _frame([2]))
    assert take(reply) is False
    assert relay.frames == [[1]]
    assert reply.lines() == [FINISH.rstrip(), _frame([2]).rstrip()]
    reply.feed(_chunk(_frame([3])))
    assert take(reply) is False and relay.frames == [[1]]
    assert reply.lines() == [_frame([3]).rstrip()]


def test_a_frame_the_relay_declines_goes_back_with_the_rest() -> None:
    """A relay that does not take a frame (a stop string may end in it): those lines and all
    after them are the reader's, and nothing of the stream is taken from then on."""
    class Declining(_Relay):
        def take(self, frame: PlainFrame) -> bool:
            return False

    take = _relay_lines(Declining(), lambda: None)
    reply = _reply(_frame([1]), _frame([2]))
    assert take(reply) is False
    assert reply.lines() == [_frame([1]).rstrip(), _frame([2]).rstrip()]
    reply.feed(_chunk(_frame([3])))
    assert take(reply) is False and reply.lines() == [_frame([3]).rstrip()]


def test_a_relay_not_ready_takes_nothing() -> None:
    relay = _Relay(ready=False)
    reply = _reply(_frame([1]), _frame([2]))
    assert _relay_lines(relay, lambda: None)(reply) is False
    assert relay.frames == [] and len(reply.lines()) == 2


def test_a_partial_line_waits_and_the_replys_end_wakes_the_reader() -> None:
    relay = _Relay()
    take = _relay_lines(relay, lambda: None)
    reply = _reply()
    line = _frame([7])
    reply.feed(_chunk(line[:5]))
    assert take(reply) is True and relay.frames == []
    reply.feed(_chunk(line[5:]) + b"0\r\n\r\n")
    assert take(reply) is False  # taken, but the reply ended: the reader must see it
    assert relay.frames == [[7]] and reply.done


def test_lines_given_back_come_first() -> None:
    reply = _reply(b"a\n", b"b\n")
    got = reply.lines()
    reply.put_back(got[1:])
    reply.feed(_chunk(b"c\n"))
    assert reply.lines() == [b"b", b"c"]


def _paced(lines: list[bytes], gap_s: float) -> Any:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            writer.write(HEAD)
            for line in lines:
                await asyncio.sleep(gap_s)
                writer.write(_chunk(line))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read()
        except ConnectionError:
            pass
        finally:
            writer.close()
    return _serving(serve)


def test_a_relayed_stream_is_never_cut_by_the_read_limit() -> None:
    """20 frames 0.05 s apart, all taken while the reader waits (1 s, against its 0.3 s
    limit); the reader gets the finish line alone."""
    relay = _Relay()

    async def go() -> list[bytes]:
        async with _paced([_frame([i]) for i in range(20)] + [FINISH], 0.05) as url:
            return await _lines(url, 0.3, relay=_relay_lines(relay, lambda: None))
    assert asyncio.run(go()) == [FINISH.rstrip()]
    assert sum(relay.frames, []) == list(range(20))


def test_frames_a_relay_stands_aside_for_reach_the_reader_in_order() -> None:
    """A relay not ready for a stretch of a stream (a slow client): those frames go to the
    reader, and the relay takes the stream again once the reader waits again; in all, every
    frame once, in order."""
    seq: list[int] = []

    class Stepping(_Relay):
        def ready(self) -> bool:
            return not 5 <= len(seq) < 10

        def take(self, frame: PlainFrame) -> bool:
            seq.extend(frame.token_ids)
            return True

    relay = Stepping()

    async def go() -> list[bytes]:
        async with _paced([_frame([i]) for i in range(20)] + [FINISH], 0.02) as url:
            pool = StreamPool(5.0)
            call = await pool.open(url, "/generate", {}, b"{}", 1.0, 5.0)
            call.relay_with(_relay_lines(relay, lambda: None))
            read: list[bytes] = []
            try:
                while batch := await call.next_lines():
                    read += batch
                    seq.extend(i for line in batch if b"token_ids" in line
                               for i in json.loads(line)["token_ids"])
            finally:
                call.close()
                pool.close()
            return read
    read = asyncio.run(go())
    assert seq == list(range(20))
    assert read[-1] == FINISH.rstrip() and 5 <= len(read) - 1 <= 10


def test_a_relay_that_fails_fails_the_read() -> None:
    def broken(reply: ReplyReader) -> bool:
        raise RuntimeError("relay bug")

    async def go() -> None:
        async with _paced([_frame([1]), FINISH], 0.05) as url:
            with pytest.raises(RuntimeError, match="relay bug"):
                await _lines(url, 1.0, relay=broken)
    asyncio.run(go())


def test_a_frame_after_a_finish_the_reader_read_fails_the_leg_as_without_the_relay() -> None:
    """The relay not ready while a frame and the finish line come (a slow client: the reader
    reads both), ready again when a frame follows the finish (a worker that misbehaves): the
    frame is not relayed; the leg fails on it, as it does with no relay at all."""
    class Late(_Relay):
        calls = 0

        def ready(self) -> bool:
            self.calls += 1
            return self.calls > 2

    async def leg(relay: FrameRelay | None) -> list[object]:
        client = WorkerClient(5.0)
        req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                              sampling=SamplingParams(max_tokens=8))
        try:
            async with _paced([_frame([1]), FINISH, _frame([2])], 0.05) as url:
                return [m async for m in client.generate(url, req, relay)]
        finally:
            await client.aclose()

    for relay in (None, Late()):
        with pytest.raises(WorkerCallError, match="a line after the finish line"):
            asyncio.run(leg(relay))
        assert relay is None or relay.frames == []


# -- the same bytes as the generators make ---------------------------------------------------

TEXT = "the cache block pool: héllo wörld, 日本語 and a ✓ tick"


def _chunks(ids: list[int]) -> list[list[int]]:
    """`ids` cut into chunks of 1, 2 and 3 tokens in turn (some cut inside a character)."""
    out, i, n = [], 0, 1
    while i < len(ids):
        out.append(ids[i:i + n])
        i, n = i + n, n % 3 + 1
    return out


async def _generated(proxy: Any, prep: PreparedRequest, choice: Choice) -> bytes:
    return b"".join([e async for e in _choice_events(proxy, prep, choice)])


async def _relayed(proxy: Any, prep: PreparedRequest, rest: list[list[int]],
                   choice: Callable[[list[list[int]]], Choice], relay: ChoiceRelay) -> bytes:
    """The generators' events for the first chunk, then `rest` through `relay` while they wait
    for the next, as long as it accepts them, then the rest of `rest` and the end (flush and
    finish) from the generators."""
    written: list[bytes] = []
    left: list[list[int]] = []
    c = relay.choice = choice(left)  # the generators read `left` once they wait again
    relay.attach(SimpleNamespace(ready=lambda: True, write=written.append))  # type: ignore[arg-type]
    events = _choice_events(proxy, prep, c)
    head = [await anext(events)]  # the first chunk's text (a chat's role chunk first)
    if prep.kind == "chat":
        head.append(await anext(events))
    for i, ids in enumerate(rest):
        if not relay.accepts(ids):
            left += rest[i:]
            break
        relay.take(ids)
    tail = [e async for e in events]
    return b"".join(head + written + tail)


CASES = [("completion", []), ("chat", []), ("completion", ["日本"]), ("chat", ["ö"]),
         ("completion", ["wörldX", "zq"])]
"""(kind, stop strings): none; one that ends the text early (the relay stands aside at the
chunk that may end it); ones that never match, though their beginnings are held back."""


@pytest.mark.parametrize(("kind", "stop"), CASES)
def test_relayed_chunks_are_the_bytes_the_generators_make(tiny_model: Path, kind: str,
                                                         stop: list[str]) -> None:
    tok = ModelTokenizer(str(tiny_model))
    ids = tok.encode(TEXT, add_special_tokens=False)
    first, *rest = _chunks(ids)
    metrics = ProxyMetrics()
    proxy = SimpleNamespace(metrics=metrics, model_name="m", tokenizer=tok)
    job = ChoiceJob(0, 0, [5, 6], SamplingParams(max_tokens=len(ids)))
    prep = PreparedRequest(kind, "cmpl-1", [[5, 6]], [job], stop, True, False)  # type: ignore[arg-type]
    assert relayable(prep, 1)

    def choice(chunks: list[list[int]]) -> Choice:
        async def gen() -> AsyncIterator[list[int]]:
            for c in chunks:
                yield c
        run = SimpleNamespace(finish_reason="length", sse=None)
        return Choice(job, run, first, gen(),  # type: ignore[arg-type]
                      TextStream(tok.decode, stop, tok.byte_pieces))

    want = asyncio.run(_generated(proxy, prep, choice(rest)))
    relay = ChoiceRelay(metrics)
    got = asyncio.run(_relayed(proxy, prep, rest, choice, relay))
    assert _events(got) == _events(want)
    texts = "".join(json.loads(e[6:])["choices"][0].get("text", "") or
                    json.loads(e[6:])["choices"][0].get("delta", {}).get("content", "") or ""
                    for e in got.decode().split("\n\n") if e.startswith("data: {"))
    cut = min((TEXT.index(x) for x in stop if x in TEXT), default=len(TEXT))
    assert texts == TEXT[:cut]
    relayed = metrics.read_relay_frames.value
    assert (relayed == len(rest)) if cut == len(TEXT) else (0 < relayed < len(rest))


def test_a_stop_string_in_the_character_the_output_ended_inside_of_finishes_with_stop() -> None:
    """The engine ended (`length`) inside a character, and a stop string ends in the text
    held for it: the stream sends the text before the stop string and finishes `stop`."""
    pieces = {0: b"ab", 1: b" \xc3"}  # 1: a space and half of a character

    def decode(ids: Sequence[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    async def rest() -> AsyncIterator[list[int]]:
        yield [1]

    proxy = SimpleNamespace(metrics=ProxyMetrics(), model_name="m", tokenizer=None)
    job = ChoiceJob(0, 0, [5, 6], SamplingParams(max_tokens=2))
    prep = PreparedRequest("completion", "cmpl-1", [[5, 6]], [job], ["\ufffd"], True, False)
    run = SimpleNamespace(finish_reason="length", sse=None)
    c = Choice(job, run, [0], rest(), TextStream(decode, ["\ufffd"], pieces))  # type: ignore[arg-type]
    body = asyncio.run(_generated(proxy, prep, c)).decode()
    chunks = [json.loads(e[6:])["choices"][0] for e in body.split("\n\n")
              if e.startswith("data: {")]
    assert "".join(ch["text"] for ch in chunks) == "ab "
    assert chunks[-1]["finish_reason"] == "stop"


def _events(body: bytes) -> list[bytes]:
    """The SSE events of `body`, `created` masked (a clock reading that may tick between)."""
    return [re.sub(rb'"created":\d+', b'"created":0', e) for e in body.split(b"\n\n")]


def test_what_is_not_text_alone_is_not_relayed() -> None:
    job = ChoiceJob(0, 0, [5], SamplingParams(max_tokens=4))
    base = PreparedRequest("completion", "cmpl-1", [[5]], [job], [], True, False)
    assert relayable(base, 1)
    from dataclasses import replace
    assert relayable(replace(base, stop=["x"]), 1)  # as long as no stop string may end
    for other in (replace(base, stream=False),
                  replace(base, logprobs=1), replace(base, echo=True),
                  replace(base, trace=True), replace(base, score_only=True)):
        assert not relayable(other, 1), other
    assert not relayable(base, 2)


# -- through real processes: an emulated worker and proxies with the relay and without -------

Proxies = dict[str, str]
SPEED_UP = 100.0
LONG = {"model": "emulated-model", "prompt": "the pool keeps every block of the cache",
        "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def proxies() -> Iterator[Proxies]:
    """One emulated worker (sped up 100x: a step every half millisecond or so), a proxy with
    the relay, one without, and one relaying the text chunks the worker makes
    (--worker-sse)."""
    from kvpool.bench.proxy_cluster import start_proxy, start_worker

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        proc, port = start_worker(stack, Path(tmp), SPEED_UP)
        out = {}
        for name, flags in (("relay", ()), ("plain", ("--no-read-relay",)),
                            ("wsse", ("--worker-sse",))):
            _, proxy_port, _ = start_proxy(stack, Path(tmp), proc, port, SPEED_UP,
                                            flags=flags)
            out[name] = f"http://127.0.0.1:{proxy_port}"
        yield out


def _relayed_frames(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^kvpool_proxy_read_relay_frames_total (\S+)$", text, re.M)
    assert found, "no relay counter in /metrics"
    return float(found.group(1))


def _text_and_usage(body: str) -> tuple[str, Any]:
    events = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert body.endswith("data: [DONE]\n\n")
    return text, [e["usage"] for e in events if e.get("usage")]


def test_a_stream_relayed_in_the_read_callback_is_the_streams_text(proxies: Proxies) -> None:
    """The same text and usage through every proxy; only the relaying ones take frames in
    their read callback (the worker's text chunks too, with --worker-sse): most of a
    400-token stream's, read by a client that keeps up."""
    got = {}
    for name, url in proxies.items():
        before = _relayed_frames(url)
        resp = httpx.post(url + "/v1/completions", json=LONG | {"max_tokens": 400},
                          timeout=120)
        assert resp.status_code == 200, resp.text
        got[name] = (_text_and_usage(resp.text), _relayed_frames(url) - before)
    (relay_text, relayed), (plain_text, not_relayed) = got["relay"], got["plain"]
    assert relay_text == plain_text and relay_text[1][0]["completion_tokens"] == 400
    assert relayed > 100 and not_relayed == 0
    assert got["wsse"][0] == plain_text and got["wsse"][1] > 100


def test_a_stop_string_ends_a_relayed_stream_where_it_ends_the_others(
        proxies: Proxies) -> None:
    """A stop string from the middle of a stream's text: both proxies end the text right
    before it, finish with `stop`, and the relaying one relayed the frames before it."""
    body = LONG | {"max_tokens": 400}
    text, _ = _text_and_usage(httpx.post(proxies["plain"] + "/v1/completions", json=body,
                                         timeout=120).text)
    stop = text[len(text) // 2:len(text) // 2 + 4]
    got = {}
    for name, url in proxies.items():
        before = _relayed_frames(url)
        resp = httpx.post(url + "/v1/completions", json=body | {"stop": [stop]}, timeout=120)
        events = [json.loads(e[6:]) for e in resp.text.split("\n\n") if e.startswith("data: {")]
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        got[name] = (_text_and_usage(resp.text)[0], reasons, _relayed_frames(url) - before)
    assert got["relay"][:2] == got["plain"][:2] == got["wsse"][:2] == \
        (text[:text.index(stop)], ["stop"])
    assert got["relay"][2] > 10 and got["wsse"][2] > 10 and got["plain"][2] == 0


def _raw_stream(url: str, body: dict[str, Any], pause_s: float) -> bytes:
    """A client with a small receive buffer that reads the head, stops reading for `pause_s`
    (the proxy's buffer fills: its writes must wait), then reads the rest: the body,
    de-chunked."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(4096)
        time.sleep(pause_s)
        # then read at speed: a 4 KiB window, acknowledged late, trickles the rest (seconds)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        while not raw.endswith(b"0\r\n\r\n"):
            more = sock.recv(65536)
            assert more, "the proxy closed the stream"
            raw += more
    head, _, chunked = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body_out, rest = b"", chunked
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        body_out, rest = body_out + rest[:n], rest[n + 2:]
    return body_out


def test_a_client_too_slow_for_the_relay_gets_every_byte_in_order(proxies: Proxies) -> None:
    """A client that stops reading for a second while its 3,000-token stream runs: the
    proxy's writes wait for it (the relay stands aside while the client's buffer is full) and
    it gets the same text as a client that keeps up (through the proxy without the relay)."""
    want = _text_and_usage(httpx.post(proxies["plain"] + "/v1/completions", json=LONG,
                                      timeout=120).text)
    for name in ("relay", "wsse"):
        got = _text_and_usage(_raw_stream(proxies[name], LONG, 1.0).decode())
        assert got == want, name


def test_a_chat_stream_of_the_workers_text_is_relayed_after_its_role_chunk(
        proxies: Proxies) -> None:
    """--worker-sse, chat: the role chunk, then the worker's text chunks (most of them taken
    in the read callback), the same content as the proxy's own text."""
    body = {"model": LONG["model"], "messages": [{"role": "user", "content": LONG["prompt"]}],
            "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
    got = {}
    for name in ("plain", "wsse"):
        before = _relayed_frames(proxies[name])
        resp = httpx.post(proxies[name] + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        events = [json.loads(e[6:]) for e in resp.text.split("\n\n") if e.startswith("data: {")]
        deltas = [c["delta"] for e in events for c in e["choices"]]
        got[name] = (deltas[0], "".join(d.get("content") or "" for d in deltas),
                     _relayed_frames(proxies[name]) - before)
    assert got["wsse"][:2] == got["plain"][:2] and got["plain"][0] == {"role": "assistant",
                                                                      "content": ""}
    assert got["wsse"][2] > 50 and got["plain"][2] == 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_worker_made_stream_whose_worker_failed_after_its_last_token_keeps_the_held_text(
        tiny_model: Path, kind: str) -> None:
    """--worker-sse: the decode worker holds the output's end back (it begins a stop string)
    and fails once the output is complete, before its finish line (`Run._complete`: the
    request is done, nothing to resume): the proxy sends that held text itself, so the client
    has the whole text, then `length`."""
    from kvpool.engine.worker.messages import SseSpec
    from kvpool.engine.worker.sse_text import SseText
    from kvpool.serve.responses import _relayed as relayed_events

    tok = ModelTokenizer(str(tiny_model))
    ids = tok.encode(TEXT, add_special_tokens=False)
    first, *rest = _chunks(ids)
    stop = [TEXT[-3:] + "qq"]  # begins with the text's end, never ends in it
    job = ChoiceJob(0, 0, [5, 6], SamplingParams(max_tokens=len(ids)))
    prep = PreparedRequest(kind, "cmpl-1", [[5, 6]], [job], stop, True, False)  # type: ignore[arg-type]
    spec = SseSpec(kind=kind, id="cmpl-1", model="m", index=0, stop=stop)
    worker = SseText(spec, tok.decode, sent_ids=first, pieces=tok.byte_pieces)
    run = SimpleNamespace(sse=spec, frame_sse=None, finish_sse=None, finish_reason=None,
                          token_ids=list(first))

    async def frames() -> AsyncIterator[list[int]]:
        for chunk_ids in rest:
            run.token_ids += chunk_ids
            run.frame_sse = worker.take(chunk_ids)[1]
            yield chunk_ids
        run.finish_reason = "length"  # the worker failed here: no finish line

    async def body() -> bytes:
        c = Choice(job, run, first, frames(),  # type: ignore[arg-type]
                   TextStream(tok.decode, stop, tok.byte_pieces))
        return b"".join([e async for e in relayed_events(proxy, prep, c)])

    proxy = SimpleNamespace(metrics=ProxyMetrics(), model_name="m", tokenizer=tok)
    events = [json.loads(e[6:])["choices"][0] for e in asyncio.run(body()).decode().split("\n\n")
              if e.startswith("data: {")]
    text = "".join((e.get("text") if kind == "completion" else e["delta"].get("content")) or ""
                   for e in events)
    assert text == TEXT and events[-1]["finish_reason"] == "length"
    assert worker.finish_events("length").startswith("data: ")  # it held text back
