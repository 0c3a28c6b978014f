"""The proxy's end of a worker's /generate channel (engine/worker/channel.py): one stream per
worker carrying the lines of every request the proxy runs there, read by one task that hands
each request's lines to its call. The worker then writes what an engine step made for all of
them at once, and the proxy reads it at once, instead of a write and a read per request.

    channel = await WorkerChannel.open(pool, url, headers, connect_s, read_s)  # its id in
    call = channel.call()        # a stream id; its lines are kept from now on
    ... POST /generate {..., "channel": channel.id, "channel_sid": call.sid} ...
    await call.next_lines()      # [line, ...] as they come; [] once the request's end came
    call.close()                 # always; lines that come later for it are dropped

A call's wait has the read timeout of a request's own stream (TimeoutError). A channel that
ends (the worker died or closed it, or it sent a line that is not a channel's) fails every call
on it with ChannelBroken (an OSError: the worker failed, not the request) and is not used
again; the next request opens another.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from kvpool.idle_timeout import IdleTimeout
from kvpool.serve.ndjson_reply import ReplyError
from kvpool.serve.worker_stream import StreamCall, StreamPool

CHANNEL_PATH = "/channel"


class ChannelBroken(ConnectionError):
    """The channel a call's lines came on ended before the call's end."""


class ChannelRefused(Exception):
    """The worker answered GET /channel with an error (status, body)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body


class ChannelCall:
    """One request's lines on a channel; has a `StreamCall`'s reading side."""

    __slots__ = ("sid", "status", "_channel", "_lines", "_done", "_error", "_waiter",
                 "_deadline", "_read_s")

    def __init__(self, channel: WorkerChannel, sid: int, read_s: float) -> None:
        self.sid, self.status = sid, 200
        self._channel, self._read_s = channel, read_s
        self._lines: list[bytes] = []
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = IdleTimeout()

    @property
    def channel_id(self) -> str:
        return self._channel.id

    async def next_lines(self) -> list[bytes]:
        """The request's lines that came since the last call (waiting for at least one), or
        [] once its end came. Raises what ended the channel, or TimeoutError."""
        while True:
            if self._lines:
                lines, self._lines = self._lines, []
                return lines
            if self._error is not None:
                raise self._error
            if self._done:
                return []
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._deadline.wait(waiter, self._read_s)
            finally:
                self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, line: bytes) -> None:
        self._lines.append(line)
        self._wake()

    def _end(self, error: BaseException | None = None) -> None:
        self._done = True
        self._error = self._error or error
        self._wake()

    def close(self) -> None:
        self._deadline.close()
        self._channel.forget(self.sid)


class WorkerChannel:
    def __init__(self, url: str, stream: StreamCall, channel_id: str, read_s: float) -> None:
        self.url, self.id, self._read_s = url, channel_id, read_s
        self._stream = stream
        self._calls: dict[int, ChannelCall] = {}
        self._sids = itertools.count(1)
        self.closed = False
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, pool: StreamPool, url: str, headers: dict[str, str], connect_s: float,
                   read_s: float) -> WorkerChannel:
        """Open a channel at `url` (its head and id within `read_s`). Raises ChannelRefused
        for an error reply, what `StreamPool.open` raises, ReplyError for a first line that
        is not a channel's id."""
        stream = await pool.open(url, CHANNEL_PATH, headers, b"", connect_s, read_s, "GET")
        try:
            if stream.status != 200:
                raise ChannelRefused(stream.status, await stream.read_all())
            first = await stream.next_lines()
            kind, _, channel_id = (first[0] if first else b"").partition(b" ")
            if kind != b"channel" or not channel_id or len(first) > 1:
                raise ReplyError(f"not a channel's first line: {first[:1]!r}")
        except BaseException:
            stream.close()
            raise
        stream.unbounded()  # silent while nothing runs there; its calls time out instead
        return cls(url, stream, channel_id.decode("ascii", "replace"), read_s)

    def call(self) -> ChannelCall:
        """A new stream id on this channel (ChannelBroken if it has ended)."""
        if self.closed:
            raise ChannelBroken(f"the channel to {self.url} has ended")
        call = ChannelCall(self, next(self._sids), self._read_s)
        self._calls[call.sid] = call
        return call

    def forget(self, sid: int) -> None:
        self._calls.pop(sid, None)

    async def _read(self) -> None:
        error: BaseException = ChannelBroken(f"the worker at {self.url} ended the channel")
        try:
            while batch := await self._stream.next_lines():
                self._route(batch)
        except (OSError, ReplyError) as exc:
            error = ChannelBroken(f"the channel to {self.url} broke: {exc!r}")
        except asyncio.CancelledError:
            error = ChannelBroken(f"the channel to {self.url} was closed")
            raise
        finally:
            self._end(error)

    def _route(self, batch: list[bytes]) -> None:
        """Each line to its call: "<sid> <line>", or "<sid>" for the end of a request's
        lines. ReplyError for a line of another form."""
        calls = self._calls
        for line in batch:
            sid, space, rest = line.partition(b" ")
            try:
                call = calls.get(int(sid))
            except ValueError:
                raise ReplyError(f"not a channel line: {line[:80]!r}") from None
            if call is None:  # its request's reader has gone: nobody wants it
                continue
            if space:
                call._feed(rest)
            else:
                call._end()
                del calls[call.sid]

    def _end(self, error: BaseException) -> None:
        self.closed = True
        self._stream.close()
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call._end(error)

    async def aclose(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
