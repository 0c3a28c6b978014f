"""Socket driver helpers: feeding the frame decoder, and scatter/gather I/O without copies.

Two ways to read a connection. The handshake uses `receive_event`/`recv_control` with Python
socket timeouts and one deadline. Once a connection carries frames, `FrameReader` drives it:
the socket is blocking with kernel timeouts (`use_kernel_timeouts`), because CPython polls
before every call on a socket with a timeout, and that poll was a third of the syscalls of a
4 KiB round trip (docs/perf.md).
"""

from __future__ import annotations

import functools
import socket
import struct
import time
from collections.abc import Callable

from kvpool.busypoll import PollWindow, polled, recv_into_polling
from kvpool.errors import LocalProtocolError, PeerUnavailable, RemoteProtocolError, TransferTimeout
from kvpool.transfer.decoder import (
    NEED_DATA,
    Control,
    Data,
    Event,
    FrameDecoder,
    FrameEnd,
    FrameStart,
)
from kvpool.transfer.protocol import HEADER_BYTES, FrameType

IOV_MAX = 1024
SCRATCH_BYTES = 16 << 10
"""What a reader may take from the socket in one call beyond what the decoder asked for:
a frame's header, its descriptors and a small payload arrive in one recv instead of three."""
POLL_PAYLOAD_BYTES = 256 << 10
"""A payload with at most this much left to come is polled for (kvpool.busypoll); a larger
one waits in one MSG_WAITALL read."""
_TIMEVAL = struct.Struct("@ll")
_TYPE_AT, _LEN_AT, _LEN = 4, 20, struct.Struct("<Q")
"""Where a frame header keeps its type byte and its payload length (protocol.HEADER)."""


def use_kernel_timeouts(sock: socket.socket, recv_tick_s: float, send_timeout_s: float) -> None:
    """Blocking mode, with SO_RCVTIMEO / SO_SNDTIMEO doing the timing: a recv or send that
    waits that long raises BlockingIOError (EAGAIN) and costs nothing extra until then."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_tick_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_timeout_s))


def _timeval(seconds: float) -> bytes:
    micros = max(1, round(seconds * 1e6))  # a zero timeval would mean "never time out"
    return _TIMEVAL.pack(*divmod(micros, 1_000_000))


MIN_PAYLOAD_BYTES_PER_S = 1 << 20
"""The least a frame's payload must keep arriving at after its grace (`Pace`), on either side:
a peer that trickles bytes holds neither a target's write nor an initiator's read for long."""


class Pace:
    """The least a payload must keep arriving at: after a grace of `grace_s`, `min_rate`
    bytes/s over the bytes received so far (not the bytes announced: a peer that declares
    a huge frame and trickles it is cut off after the grace, whatever it declared)."""

    __slots__ = ("start", "grace_s", "min_rate", "received")

    def __init__(self, grace_s: float, min_rate: float) -> None:
        self.start = time.monotonic()
        self.grace_s, self.min_rate = grace_s, min_rate
        self.received = 0

    def check(self) -> None:
        if time.monotonic() - self.start > self.grace_s + self.received / self.min_rate:
            raise TransferTimeout(f"frame payload falls behind {self.min_rate:g} bytes/s "
                                  f"({self.received} bytes after the {self.grace_s:g}s grace: "
                                  "too slow a peer)")


class FrameReader:
    """Feeds one connection's `FrameDecoder`, for frames (after the handshake).

    A read takes what the decoder asked for plus, when the caller allows it (`greedy`),
    whatever else is already there up to SCRATCH_BYTES; payload bytes taken that way come back
    as Data events and are copied, the rest of a payload goes straight from the socket into
    the caller's views (`finish_frame`). Timeouts: the socket's SO_RCVTIMEO is a tick; a read
    that waited `frame_timeout_s` inside a frame (or `idle_timeout_s` between frames, None:
    for ever) raises TimeoutError.
    """

    def __init__(self, sock: socket.socket, frame_timeout_s: float,
                 idle_timeout_s: float | None, poll_us: int = 0) -> None:
        """Puts `sock` under kernel timeouts: the receive tick is the shorter limit, a send
        may wait `frame_timeout_s`. `poll_us`: how long the wait for a frame's first bytes
        polls before blocking while frames come soon (kvpool.busypoll)."""
        self.sock = sock
        self._poll = PollWindow(poll_us)
        self.decoder = FrameDecoder()
        self._frame_timeout_s = frame_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._tick_s = min(frame_timeout_s, idle_timeout_s or frame_timeout_s)
        use_kernel_timeouts(sock, self._tick_s, frame_timeout_s)
        self._scratch = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._scratch)

    def next_event(self, greedy: int = 0) -> Event | None:
        """The decoder's next event; None when the peer closed the connection between frames.
        `greedy`: read up to this many bytes at once (at most SCRATCH_BYTES) when the decoder
        needs more; only safe where the peer sends nothing after the frame unasked."""
        decoder = self.decoder
        while (event := decoder.next_event()) is NEED_DATA:
            if greedy >= SCRATCH_BYTES:
                view = self._view
            else:
                wanted = decoder.bytes_wanted()
                view = self._view[: min(wanted if wanted > greedy else greedy, SCRATCH_BYTES)]
            try:
                got = recv_into_polling(self.sock, view, self._poll)
            except BlockingIOError:  # a tick of SO_RCVTIMEO passed
                got = self._wait(functools.partial(self.sock.recv_into, view))
            if not got:
                if decoder.at_boundary:
                    return None
                raise PeerUnavailable("peer closed the connection mid-frame")
            decoder.receive_data(view[:got])
        return event

    def reply_into(self, prefix: int,
                   views: list[memoryview]) -> tuple[Event | None, list[memoryview] | None]:
        """Start reading a reply whose header and status bytes take `prefix` bytes and whose
        payload, when every descriptor is OK, fills `views` exactly: the same reads take the
        prefix into scratch and let the payload behind it land straight in `views` (one
        recvmsg for a small reply instead of a read, a copy out of the decoder and another
        copy; the start of a large one instead of a separate read). Returns the decoder's
        first event of the frame (None: the peer closed the connection before it) and, when
        payload bytes landed, the views still to fill (for `finish_frame`; [] when all
        came).

        Any other reply (a failed descriptor, an ERROR frame, a length that differs) gets
        the bytes that landed in `views` taken back and fed to the decoder behind the
        prefix, so it is decoded exactly as by `next_event`, and None comes back for the
        views: the caller's `finish_frame` then copies the payload where its statuses say.
        Only for a reader at a frame boundary whose peer sends nothing after the reply
        unasked."""
        decoder = self.decoder
        if not decoder.at_boundary or prefix > SCRATCH_BYTES or len(views) >= IOV_MAX:
            return self.next_event(prefix), None
        have, landed = 0, 0
        while have < prefix:
            iov = [self._view[have:prefix], *views]  # payload lands only behind a full prefix
            got = self._read_iov(iov)
            if not got:
                if have:
                    raise PeerUnavailable("peer closed the connection mid-frame")
                return None, None
            take = min(got, prefix - have)
            have, landed = have + take, got - take
        scratch = self._scratch
        count = prefix - HEADER_BYTES
        if scratch[_TYPE_AT] == FrameType.READ_RESP and scratch.count(0, HEADER_BYTES, prefix) \
                == count and _LEN.unpack_from(scratch, _LEN_AT)[0] == count + sum(
                    v.nbytes for v in views):
            decoder.receive_data(self._view[:prefix])
            event = decoder.next_event()
            if not landed:
                return event, None
            decoder.payload_received(landed)
            return event, _advance(views, landed)
        decoder.receive_data(self._view[:prefix])
        if landed:
            decoder.receive_data(b"".join(_front(views, landed)))
        return self.next_event(), None

    def _read_iov(self, iov: list[memoryview]) -> int:
        """One scatter read into `iov` of whatever has arrived (polled for first)."""
        sock = self.sock
        try:
            return polled(lambda: sock.recvmsg_into(iov, 0, socket.MSG_DONTWAIT)[0],
                          lambda: sock.recvmsg_into(iov)[0], self._poll)
        except BlockingIOError:  # a tick of SO_RCVTIMEO passed
            return self._wait(lambda: sock.recvmsg_into(iov)[0])

    def finish_frame(self, views: list[memoryview], pace: Pace | None = None) -> FrameEnd:
        """Move the payload of the frame just started into `views` (their sizes must add up to
        it): first what the decoder already holds, then the rest straight from the socket.
        With a `pace`, TransferTimeout once the payload fell behind it (checked between two
        reads), so a peer trickling bytes cannot stretch a frame for long."""
        pending = views
        decoder = self.decoder
        while True:
            event = decoder.next_event()
            if type(event) is FrameEnd:
                return event
            if type(event) is Data:
                pending = _fill(pending, event.data)
            elif event is NEED_DATA:
                pending = self._payload_into(pending, pace)
            else:
                raise RemoteProtocolError("frame did not end where its header said")

    def finish_frame_in_steps(self, views: list[memoryview], arrived: Callable[[int, int], None],
                              step_bytes: int, pace: Pace | None = None) -> FrameEnd:
        """As `finish_frame`, but the payload is taken a few whole views (about `step_bytes`)
        at a time, and `arrived(lo, hi)` is called once views[lo:hi] are full, while the
        rest of the frame still comes: the caller works on those bytes (the store client
        hashes them) while the peer sends the others, instead of after the whole frame. A
        frame whose payload the decoder already holds some of is finished whole, then
        reported."""
        if self.decoder.buffered:
            end = self.finish_frame(views, pace)
            arrived(0, len(views))
            return end
        lo = 0
        while lo < len(views):
            hi, size = lo + 1, views[lo].nbytes
            while hi < len(views) and size < step_bytes:
                size += views[hi].nbytes
                hi += 1
            pending = [v for v in views[lo:hi] if v.nbytes]
            while pending:
                if self.decoder.next_event() is not NEED_DATA:
                    raise RemoteProtocolError("frame ended before its payload did")
                pending = self._payload_into(pending, pace)
            arrived(lo, hi)
            lo = hi
        return self.finish_frame([], pace)

    def _payload_into(self, pending: list[memoryview], pace: Pace | None) -> list[memoryview]:
        """One scatter read of payload bytes straight into `pending`; the views left."""
        pending = [v for v in pending if v.nbytes]
        if not pending:
            raise LocalProtocolError("payload views are shorter than the frame's payload")
        if pace is not None:
            pace.check()
        chunk = pending[:IOV_MAX]
        # MSG_WAITALL: the kernel keeps filling until the views are full or a tick ran out,
        # instead of one return to Python per arriving segment (a large write took ~16);
        # the end of a payload is polled for first, as the start of a frame is
        try:
            if sum(v.nbytes for v in chunk) <= POLL_PAYLOAD_BYTES:
                got = polled(lambda: self.sock.recvmsg_into(chunk, 0, socket.MSG_DONTWAIT)[0],
                             lambda: self.sock.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0],
                             self._poll)
            else:
                got = self.sock.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:
            got = self._wait(lambda: self.sock.recvmsg_into(chunk, 0, socket.MSG_WAITALL)[0])
        if got == 0:
            raise PeerUnavailable("peer closed the connection mid-frame")
        self.decoder.payload_received(got)
        if pace is not None:
            pace.received += got
        return _advance(pending, got)

    def _wait(self, read: Callable[[], int]) -> int:
        """Retry `read` after SO_RCVTIMEO ticks until it returns, or raise TimeoutError once
        the applicable limit passed (counted from the start of the tick that just ran out)."""
        since = time.monotonic() - self._tick_s
        limit = self._idle_timeout_s if self.decoder.at_boundary else self._frame_timeout_s
        while True:
            if limit is not None and time.monotonic() - since >= limit:
                raise TimeoutError(f"peer sent nothing for {limit:g}s")
            try:
                return read()
            except BlockingIOError:
                continue


def _fill(views: list[memoryview], data: bytes) -> list[memoryview]:
    """Copy `data` into the front of `views`; the views still to fill."""
    if len(views) == 1 and views[0].nbytes == len(data):  # a small frame's whole payload
        views[0][:] = data
        return []
    source, offset = memoryview(data), 0
    for view in views:
        if offset == len(data):
            break
        n = min(view.nbytes, len(data) - offset)
        view[:n] = source[offset : offset + n]
        offset += n
    if offset < len(data):
        raise LocalProtocolError("payload views are shorter than the frame's payload")
    return _advance(views, offset)


def send_views(sock: socket.socket, views: list[bytes | bytearray | memoryview],
               total: int | None = None) -> None:
    """Send every view completely (gather write, `sendmsg`). A caller that knows the `total`
    byte count lets the usual single sendmsg go without wrapping each view first. On a socket
    with kernel timeouts a send that made no progress for SO_SNDTIMEO raises TimeoutError."""
    try:
        if total is not None and len(views) <= IOV_MAX:
            sent = sock.sendmsg(views)
            if sent == total:
                return
            views = _advance([memoryview(v) for v in views], sent)  # type: ignore[assignment]
        pending = [v if isinstance(v, memoryview) else memoryview(v) for v in views if len(v)]
        while pending:
            sent = sock.sendmsg(pending[:IOV_MAX] if len(pending) > IOV_MAX else pending)
            pending = _advance(pending, sent)
    except BlockingIOError:
        raise TimeoutError("peer took nothing within the send timeout") from None


def _front(views: list[memoryview], n: int) -> list[memoryview]:
    """The first n bytes of a list of views, as views."""
    out = []
    for view in views:
        if n <= 0:
            break
        out.append(view[:n] if view.nbytes > n else view)
        n -= view.nbytes
    return out


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first n bytes from a list of views."""
    i = 0
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    rest = views[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def receive_event(sock: socket.socket, decoder: FrameDecoder, deadline: float) -> Event | None:
    """The decoder's next event before `deadline` (time.monotonic(); TimeoutError after it,
    however the peer spaces its bytes), reading only the bytes the decoder wants. None when
    the peer closed the connection between frames. For the handshake (Python timeouts)."""
    while (event := decoder.next_event()) is NEED_DATA:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed before the frame was complete")
        sock.settimeout(left)
        data = sock.recv(decoder.bytes_wanted(), socket.MSG_WAITALL)
        if not data:
            if decoder.at_boundary:
                return None
            raise PeerUnavailable("peer closed the connection mid-frame")
        decoder.receive_data(data)
    return event


def recv_control(sock: socket.socket, deadline: float) -> Control:
    """One whole control frame (handshake or ERROR) before `deadline`."""
    event = receive_event(sock, FrameDecoder(), deadline)
    if event is None:
        raise PeerUnavailable("peer closed the connection during the handshake")
    if not isinstance(event, Control):
        kind = event.header.type.name if isinstance(event, FrameStart) else type(event).__name__
        raise RemoteProtocolError(f"expected a handshake frame, got {kind}")
    return event
