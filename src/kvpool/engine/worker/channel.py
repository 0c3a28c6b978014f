"""One stream per proxy carrying the /generate lines of all its requests on this worker, so
that what an engine step makes for every request goes out in one write, not one per request.

    GET /channel            -> "channel <id>\\n", then "<sid> <line>\\n" ... as requests run
    POST /generate {..., "channel": id, "channel_sid": sid}
                            -> 200 {"channel": id, "sid": sid} once the request is started;
                               its NDJSON lines (frames, then the finish or error line) follow
                               on the channel as "<sid> <line>", and "<sid>\\n" ends them

A request's lines keep their order; several requests' interleave. The lines are those of the
request's own /generate stream, byte for byte. A channel whose reader goes away ends every
request it carries (each is aborted, as a /generate stream's client going away aborts its
request), and so does the end of the worker. The id is a secret of the channel's reader: a
request names its channel by it.

A request on a channel has no task of its own: `RequestLines.deliver` makes its lines from
each engine step's outputs in the step's wake-up of the event loop (Worker.attach), and the
channel's stream writes what every request made since its last write in one piece. (A task
per request per step cost about 2 us of the worker's event loop per output token, and each
request's own write as much again.) A resumed leg with nothing left to do still goes through
`ndjson` (`start`), whose task waits while `limit` bytes wait. The lines wait in the channel
until its stream takes them all. A reader that stops reading does not stop the engine, as with
a request's own stream (whose step outputs wait in its queue): what its requests make waits in
the channel, at most their remaining output.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from kvpool.engine.core import StepOutput
from kvpool.engine.worker.frames import FrameBuilder, scan
from kvpool.engine.worker.messages import ErrorLine, ndjson_line
from kvpool.errors import InvalidArgument
from kvpool.log import get_logger

log = get_logger("engine.worker.channel")

CHANNEL_BYTES = 1 << 20
"""Bytes waiting in a channel before its requests wait for its reader."""


class Channel:
    def __init__(self, limit: int = CHANNEL_BYTES) -> None:
        self.id = secrets.token_hex(16)
        self.limit = limit
        self.closed = False
        self._chunks: list[bytes] = []
        self._size = 0
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._pumps: dict[int, asyncio.Task[None]] = {}
        self._requests: dict[int, RequestLines] = {}

    @property
    def num_requests(self) -> int:
        return len(self._pumps) + len(self._requests)

    def _check_free(self, sid: int) -> None:
        if self.closed or sid in self._pumps or sid in self._requests:
            raise InvalidArgument(f"channel {self.id[:8]}...: " + (
                "it has ended" if self.closed else f"stream {sid} is running on it already"))

    def add(self, lines: RequestLines) -> None:
        """Carry a request's lines as `lines.sid` (InvalidArgument when the channel has ended
        or that stream id is running on it already)."""
        self._check_free(lines.sid)
        self._requests[lines.sid] = lines

    def discard(self, lines: RequestLines) -> None:
        """A request that did not start after all: no line of it was sent, nor will be."""
        if self._requests.get(lines.sid) is lines:
            del self._requests[lines.sid]
        lines.done = True

    def start(self, sid: int, lines: AsyncGenerator[bytes]) -> None:
        """Send the NDJSON `lines` of one request as `sid`, read by a task of their own
        (InvalidArgument, and `lines` closed, as `add`)."""
        try:
            self._check_free(sid)
        except InvalidArgument:
            _close_unstarted(lines)
            raise
        self._pumps[sid] = asyncio.get_running_loop().create_task(self._pump(sid, lines))

    async def _pump(self, sid: int, lines: AsyncGenerator[bytes]) -> None:
        prefix = b"%d " % sid
        try:
            async with contextlib.aclosing(lines):
                async for data in lines:
                    if not data:
                        continue
                    self.put_lines(prefix, data)
                    if self._size >= self.limit:
                        self._room.clear()
                        await self._room.wait()
        finally:
            self._pumps.pop(sid, None)
            if not self.closed:
                self._put(b"%d\n" % sid)

    def put_lines(self, prefix: bytes, data: bytes) -> None:
        """Every line of `data` (each ends with a newline) behind `prefix` ("<sid> ")."""
        if data.count(b"\n") == 1:  # one line: most steps
            self._put(prefix + data)
        else:
            self._put(prefix + data[:-1].replace(b"\n", b"\n" + prefix) + b"\n")

    def end(self, lines: RequestLines) -> None:
        """A request's last line was put: its end marker."""
        if self._requests.get(lines.sid) is lines:
            del self._requests[lines.sid]
            if not self.closed:
                self._put(b"%d\n" % lines.sid)

    def _put(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self._ready.set()

    async def stream(self) -> AsyncIterator[bytes]:
        """The channel's body: its id's line, then whatever its requests sent since the last
        write, in one piece each time."""
        yield b"channel %s\n" % self.id.encode()
        while True:
            while not self._chunks:
                if self.closed:
                    return
                self._ready.clear()
                await self._ready.wait()
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._size = 0
            self._room.set()
            yield data

    def close(self) -> None:
        """Its reader went away (or the worker ends): every request on it ends (aborted)."""
        self.closed = True
        for task in list(self._pumps.values()):
            task.cancel()
        requests, self._requests = self._requests, {}
        for lines in requests.values():
            lines.stop()
        self._room.set()
        self._ready.set()  # its stream ends


class RequestLines:
    """One request's lines on a channel, made from each engine step's outputs as they are
    delivered (`deliver`, on the event loop, never raising): its frames, an error line for an
    output that carries an error, and its end. `stop` stops the request on the engine (one
    whose lines ended before its engine said it finished: a stop string, the channel gone, an
    error here, `timeout_s` without an output)."""

    def __init__(self, channel: Channel, sid: int, request_id: str, frames: FrameBuilder,
                 stop: Callable[[], None], timeout_s: float) -> None:
        self.channel, self.sid, self.request_id, self.frames = channel, sid, request_id, frames
        self._stop, self._timeout_s = stop, timeout_s
        self._prefix = b"%d " % sid
        self.done = False
        loop = asyncio.get_running_loop()
        self._loop, self._last = loop, loop.time()
        self._timer: asyncio.TimerHandle | None = loop.call_at(self._last + timeout_s,
                                                               self._silent)

    def deliver(self, outs: list[StepOutput]) -> None:
        if self.done:
            return
        self._last = self._loop.time()
        try:
            failed, finished = scan(outs)
            lines = self.frames.add(outs if failed is None else outs[:failed])
            data = ndjson_line(lines[0]) if len(lines) == 1 else \
                b"".join([ndjson_line(msg) for msg in lines])
            if failed is not None:
                data += ndjson_line(ErrorLine(error=str(outs[failed].error)))
        except Exception as exc:
            log.exception("generate failed")
            self._fail(f"{type(exc).__name__}: {exc}")
            return
        if data:
            self.channel.put_lines(self._prefix, data)
        if failed is not None or self.frames.done:
            self._end(stopped=failed is None and not finished)

    def _silent(self) -> None:
        self._timer = None
        if self.done:
            return
        due = self._last + self._timeout_s
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._silent)
            return
        self._fail(f"request {self.request_id} produced nothing for {self._timeout_s}s")

    def _fail(self, error: str) -> None:
        self.channel.put_lines(self._prefix, ndjson_line(ErrorLine(error=error)))
        self._end(stopped=True)

    def _end(self, stopped: bool) -> None:
        """Its last line is out; `stopped`: the engine has not finished it (abort it)."""
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.channel.end(self)
        if stopped:
            self._stop()

    def stop(self) -> None:
        """The channel ended under it: no more lines, and the request stops."""
        if self.done:
            return
        self._end(stopped=True)


class Channels:
    """The open channels of a worker, by id."""

    def __init__(self) -> None:
        self._open: dict[str, Channel] = {}

    def open(self) -> Channel:
        channel = Channel()
        self._open[channel.id] = channel
        return channel

    def get(self, channel_id: str) -> Channel:
        channel = self._open.get(channel_id)
        if channel is None:
            raise InvalidArgument("no such channel on this worker (it ended, or the worker "
                                  "restarted)")
        return channel

    def close(self, channel: Channel) -> None:
        self._open.pop(channel.id, None)
        channel.close()

    def close_all(self) -> None:
        for channel in list(self._open.values()):
            self.close(channel)


def _close_unstarted(lines: AsyncGenerator[bytes]) -> None:
    """An async generator never started has nothing to clean up: closing it is synchronous."""
    with contextlib.suppress(RuntimeError, StopIteration):
        lines.aclose().send(None)
