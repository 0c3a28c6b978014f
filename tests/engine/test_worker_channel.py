"""A worker's /generate channel (engine/worker/channel.py): the lines of a request made from
its step outputs without a task, their end, errors, silence and a channel that ends (unit,
in one event loop); then a real worker process: a channel carries the same tokens as a
request's own stream, several requests interleave on one, the refusals, and a channel whose
reader goes away stops its requests on the engine."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.engine.core import StepOutput
from kvpool.engine.worker.channel import Channel, RequestLines
from kvpool.engine.worker.frames import FrameBuilder
from kvpool.errors import InvalidArgument
from kvpool.launch.wait import wait_for
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool

TOKEN = "chan-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _out(token: int | None, finish: str | None = None, error: str | None = None) -> StepOutput:
    return StepOutput("r", token_id=token, time_s=1.0, finish_reason=finish, error=error)


async def _taken(channel: Channel) -> list[bytes]:
    """Every line the channel's stream wrote so far (its id's line left out)."""
    stream = channel.stream()
    await anext(stream)  # the id's line
    chunk = await asyncio.wait_for(anext(stream), 1.0)
    await stream.aclose()
    return chunk.splitlines()


class _Lines:
    """A request on a channel, with what its `stop` saw."""

    def __init__(self, channel: Channel, sid: int, frames: FrameBuilder | None = None,
                 timeout_s: float = 60.0) -> None:
        self.stops = 0
        self.lines = RequestLines(channel, sid, "r", frames or FrameBuilder(), self._stop,
                                  timeout_s)
        channel.add(self.lines)

    def _stop(self) -> None:
        self.stops += 1


def test_lines_are_the_frames_behind_the_stream_id_then_its_end() -> None:
    async def run() -> tuple[list[bytes], int, int]:
        channel = Channel()
        a, b = _Lines(channel, 3), _Lines(channel, 12)
        a.lines.deliver([_out(7)])
        b.lines.deliver([_out(9)])
        a.lines.deliver([_out(8, finish="length")])
        assert channel.num_requests == 1 and a.lines.done
        return await _taken(channel), a.stops, b.stops
    lines, a_stops, b_stops = asyncio.run(run())
    assert lines[0].startswith(b'3 {"type":"tokens","token_ids":[7]')
    assert lines[1].startswith(b'12 {"type":"tokens","token_ids":[9]')
    assert lines[2].startswith(b'3 {"type":"tokens","token_ids":[8]')
    assert json.loads(lines[3].split(b" ", 1)[1])["finish_reason"] == "length"
    assert lines[4] == b"3" and len(lines) == 5
    assert (a_stops, b_stops) == (0, 0)  # the engine finished it itself


def test_an_output_with_an_error_ends_the_lines_with_its_error() -> None:
    async def run() -> tuple[list[bytes], int]:
        channel = Channel()
        a = _Lines(channel, 1)
        a.lines.deliver([_out(5), _out(None, error="store node gone")])
        a.lines.deliver([_out(6)])  # nothing after its end
        return await _taken(channel), a.stops
    lines, stops = asyncio.run(run())
    assert lines[0].startswith(b'1 {"type":"tokens","token_ids":[5]')
    assert json.loads(lines[1].split(b" ", 1)[1]) == {"type": "error", "error": "store node gone"}
    assert lines[2:] == [b"1"] and stops == 0


def test_a_failure_while_making_lines_is_an_error_line_and_stops_the_request() -> None:
    class Broken(FrameBuilder):
        def add(self, outputs: list[StepOutput]) -> Any:
            raise ValueError("bad frame")

    async def run() -> tuple[list[bytes], int]:
        channel = Channel()
        a = _Lines(channel, 4, Broken())
        a.lines.deliver([_out(5)])
        return await _taken(channel), a.stops
    lines, stops = asyncio.run(run())
    assert json.loads(lines[0].split(b" ", 1)[1])["error"] == "ValueError: bad frame"
    assert lines[1:] == [b"4"] and stops == 1


def test_a_silent_request_times_out_with_an_error_and_is_stopped() -> None:
    async def run() -> tuple[list[bytes], int]:
        channel = Channel()
        a = _Lines(channel, 2, timeout_s=0.05)
        a.lines.deliver([_out(5)])
        await asyncio.sleep(0.3)
        return await _taken(channel), a.stops
    lines, stops = asyncio.run(run())
    assert lines[0].startswith(b'2 {"type":"tokens"')
    assert "produced nothing for 0.05s" in json.loads(lines[1].split(b" ", 1)[1])["error"]
    assert lines[2:] == [b"2"] and stops == 1


def test_a_channel_that_ends_stops_its_requests_and_refuses_new_ones() -> None:
    async def run() -> tuple[int, bool]:
        channel = Channel()
        a = _Lines(channel, 1)
        with pytest.raises(InvalidArgument, match="running on it already"):
            _Lines(channel, 1)
        stream = channel.stream()
        await anext(stream)
        channel.close()
        a.lines.deliver([_out(5)])  # too late: nothing more is made
        ended = not [chunk async for chunk in stream]
        with pytest.raises(InvalidArgument, match="it has ended"):
            _Lines(channel, 2)
        return a.stops, ended
    stops, ended = asyncio.run(run())
    assert stops == 1 and ended


def test_the_requests_of_one_wake_up_go_in_one_write() -> None:
    async def run() -> list[bytes]:
        channel = Channel()
        stream = channel.stream()
        await anext(stream)
        for sid in range(1, 33):
            _Lines(channel, sid).lines.deliver([_out(sid + 100)])
        return [await asyncio.wait_for(anext(stream), 1.0)]
    (chunk,) = asyncio.run(run())
    assert len(chunk.splitlines()) == 32


# -- a real worker ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tiny_llama: Path) -> Iterator[str]:
    port = free_port()
    with ExitStack() as stack:
        stack.enter_context(running(spawn_kvpool(
            "worker", "--role", "both", "--model", str(tiny_llama), "--port", str(port),
            "--block-size", "8", "--num-blocks", "256", "--max-model-len", "512",
            "--token", TOKEN)))
        wait_port(port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"


class _Reader:
    """A channel opened on `url`, read by a thread: its lines by stream id."""

    def __init__(self, url: str) -> None:
        self._cm = httpx.stream("GET", url + "/channel", headers=AUTH, timeout=30)
        self.response = self._cm.__enter__()
        self._lines = self.response.iter_lines()
        first = next(self._lines)
        assert first.startswith("channel ")
        self.id = first.split(" ", 1)[1]
        self.by_sid: dict[int, list[str]] = {}
        self.ended: set[int] = set()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._lines:
                sid, _, rest = line.partition(" ")
                if rest:
                    self.by_sid.setdefault(int(sid), []).append(rest)
                else:
                    self.ended.add(int(sid))
        except httpx.HTTPError:
            pass

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def _generate(url: str, rid: str, max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"request_id": rid, "prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13],
            "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}
    return httpx.post(url + "/generate", json=body | extra, headers=AUTH, timeout=30)


def _tokens(lines: list[str]) -> tuple[list[int], dict[str, Any]]:
    msgs = [json.loads(line) for line in lines]
    ids = [t for m in msgs if m["type"] == "tokens" for t in m["token_ids"]]
    return ids, msgs[-1]


def test_a_channel_carries_the_same_tokens_as_a_stream_for_requests_side_by_side(
        worker: str) -> None:
    plain = _generate(worker, "plain", 12)
    want, finish = _tokens([line for line in plain.text.splitlines() if line])
    reader = _Reader(worker)
    try:
        replies = [_generate(worker, f"c{sid}", 12, channel=reader.id, channel_sid=sid)
                   for sid in (1, 2, 3)]
        assert [r.json() for r in replies] == [{"channel": reader.id, "sid": s} for s in (1, 2, 3)]
        wait_for(lambda: reader.ended == {1, 2, 3}, 30, "three requests' ends on the channel")
        for sid in (1, 2, 3):
            ids, last = _tokens(reader.by_sid[sid])
            assert ids == want and len(ids) == 12
            assert last["type"] == "finish" and last["finish_reason"] == finish["finish_reason"]
            assert last["num_output_tokens"] == 12
    finally:
        reader.close()


def test_channel_refusals(worker: str) -> None:
    assert httpx.get(worker + "/channel", timeout=10).status_code == 401
    unknown = _generate(worker, "u", 4, channel="f" * 32, channel_sid=1)
    assert unknown.status_code == 400 and "no such channel" in unknown.json()["error"]["message"]
    reader = _Reader(worker)
    try:
        assert _generate(worker, "d1", 300, channel=reader.id, channel_sid=7).status_code == 200
        again = _generate(worker, "d2", 4, channel=reader.id, channel_sid=7)
        assert again.status_code == 400 and "running on it already" in again.text
        bad = _generate(worker, "d3", 4, channel=reader.id, channel_sid=-1)
        assert bad.status_code == 400
    finally:
        reader.close()


def test_a_channel_whose_reader_goes_away_stops_its_requests(worker: str) -> None:
    reader = _Reader(worker)
    for sid in (1, 2):
        assert _generate(worker, f"gone{sid}", 400, channel=reader.id,
                         channel_sid=sid).status_code == 200
    wait_for(lambda: all(len(reader.by_sid.get(s, [])) >= 2 for s in (1, 2)), 30,
             "both requests streaming")
    reader.close()

    def idle() -> bool:
        load = httpx.get(worker + "/load", headers=AUTH, timeout=10).json()
        return load["num_running"] == 0 and load["num_waiting"] == 0
    wait_for(idle, 15, "the channel's requests stopped on the engine")
