"""The initiator side of the tcp transport: a pool of connections per peer, fed with frames.

Each connection has one worker thread that sends a frame, waits for its reply, and reports
per-descriptor outcomes to the frame's batch. A broken connection fails the frame in hand (never
reporting partial success) and is re-established for the next frame.
"""

from __future__ import annotations

import fcntl
import itertools
import queue
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.errors import AuthError, PeerUnavailable, RemoteProtocolError, TransferTimeout
from kvpool.transfer.auth import (
    INITIATOR,
    TARGET,
    check_proof,
    new_nonce,
    nonce_of,
    proof,
    require_token,
)
from kvpool.transfer.batch import Batch, OpCode
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.decoder import Control, Event, FrameStart
from kvpool.transfer.protocol import (
    FENCED_REASON,
    HEADER_BYTES,
    FrameType,
    Header,
    Status,
    encode_control,
    encode_descriptors,
    encode_header,
    encode_single,
)
from kvpool.transfer.segment import readable_now
from kvpool.transfer.wire import (
    MIN_PAYLOAD_BYTES_PER_S,
    SCRATCH_BYTES,
    FrameReader,
    Pace,
    recv_control,
    send_views,
)

_request_ids = itertools.count(1)
_TRUST_IDLE_S = 0.01
"""A pooled connection used again within this long is not polled for a peer's close first
(one syscall per frame saved); a peer that closes it in that window fails one frame, as a
close between the poll and the send always could."""
ARRIVAL_STEP_BYTES = 512 << 10
"""A READ frame with an `arrived` hook takes its payload this much at a time (in whole
descriptors) and reports each step, so the caller's work on it (hashing) overlaps the arrival of
the rest: a batch of 32 x 64 KiB comes in 4 steps, so up to 3/4 of its 2 MiB hash overlaps
the peer's send, for 3 more recvmsg calls (256 KiB and 1 MiB steps: docs/perf.md)."""
_FAILURE_TEXT = {
    Status.OUT_OF_RANGE: "target range is not inside a buffer registered at the target",
    Status.READ_ONLY: "target buffer is registered read-only",
    Status.FENCED: FENCED_REASON,
}


@dataclass(slots=True)
class Frame:
    """Descriptors bound for one peer in one message, and where to report their outcome."""

    op: OpCode
    batch: Batch
    indices: list[int]
    addrs: list[int]
    lengths: list[int]
    views: list[memoryview]
    fences: list[int] | None = None
    """Per descriptor; None means all 0 (unfenced)."""

    def fail(self, reason: str) -> None:
        self.batch.complete(self.indices, reason)

    def sent(self) -> None:
        """The frame's payload is in the socket (a WRITE), its answer not yet in."""
        self.batch.sent(self.indices)

    def arrived(self, lo: int, hi: int) -> None:
        """The data of descriptors lo..hi-1 of a READ is in local memory, the rest of the
        frame not yet."""
        self.batch.sent(self.indices[lo:hi])

    def finish(self, statuses: list[Status]) -> None:
        """Report the target's per-descriptor statuses to the batch."""
        if statuses.count(Status.OK) == len(statuses):
            self.batch.complete(self.indices)
            return
        self.batch.complete([i for i, s in zip(self.indices, statuses, strict=True) if s == Status.OK])
        for index, status in zip(self.indices, statuses, strict=True):
            if status != Status.OK:
                self.batch.complete([index], failure_text(status))


def failure_text(status: Status) -> str:
    """Why a descriptor the target refused failed, in words."""
    return _FAILURE_TEXT.get(status, f"remote status {status}")


def open_connection(host: str, port: int, config: TransferConfig, me: str) -> tuple[socket.socket, dict[str, Any]]:
    """Connect and handshake (see kvpool.transfer.auth); returns the socket and the peer's
    descriptor (HELLO_OK body). Raises PeerUnavailable, AuthError (the peer refused us, or
    could not prove it knows our token: it got no frame but HELLO), RemoteProtocolError."""
    try:
        sock = socket.create_connection((host, port), timeout=config.connect_timeout_s)
    except OSError as exc:
        raise PeerUnavailable(f"cannot connect to {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = _handshake(sock, f"{host}:{port}", config, me)
        sock.settimeout(config.timeout_s)
        return sock, body
    except BaseException:
        sock.close()
        raise


def _control(sock: socket.socket, deadline: float) -> tuple[Header, dict[str, Any] | str]:
    event = recv_control(sock, deadline)
    return event.header, event.body


def _handshake(sock: socket.socket, name: str, config: TransferConfig, me: str) -> dict[str, Any]:
    deadline = time.monotonic() + config.timeout_s
    nonce = new_nonce()
    send_views(sock, [encode_control(FrameType.HELLO, {"peer": me, "nonce": nonce})])
    header, body = _control(sock, deadline)
    if header.type == FrameType.CHALLENGE:
        token = require_token(config.token, name)
        target_nonce = nonce_of(body)
        presented = body.get("proof") if isinstance(body, dict) else None
        if not check_proof(token, TARGET, nonce, target_nonce, name, presented):
            raise AuthError(f"{name} failed to prove it knows the shared token (wrong token, or "
                            "not the peer its segment descriptor claims); nothing was sent to it")
        answer = {"proof": proof(token, INITIATOR, nonce, target_nonce, name)}
        send_views(sock, [encode_control(FrameType.AUTH, answer)])
        header, body = _control(sock, deadline)
    elif header.type == FrameType.HELLO_OK and config.token is not None:
        raise AuthError(f"{name} skipped authentication: it did not prove it knows the shared "
                        "token; nothing was sent to it")
    if header.type == FrameType.ERROR:
        raise AuthError(f"{name} refused the handshake: {body}")
    if header.type != FrameType.HELLO_OK or not isinstance(body, dict):
        raise RemoteProtocolError(f"expected HELLO_OK from {name}, got {header.type.name}")
    return body


@dataclass(slots=True, eq=False)
class Connection:
    """One pooled connection to a peer, with the frame reader that owns its decoder."""

    sock: socket.socket
    reader: FrameReader
    idle_since: float = 0.0

    @classmethod
    def open(cls, host: str, port: int, config: TransferConfig, me: str) -> Connection:
        sock, _ = open_connection(host, port, config, me)
        # a reply is due whenever this side reads: no idle wait between frames here
        return cls(sock, FrameReader(sock, config.timeout_s, idle_timeout_s=config.timeout_s,
                                     poll_us=config.reply_poll_us))

    def close(self) -> None:
        self.sock.close()


class PendingRead:
    """A one-descriptor READ whose frame is out (`PeerLink.begin_read`). `finish()` reads the
    reply into its view and returns what `PeerLink.exchange` would; `abandon()` gives a reply
    no longer wanted up (read off now if all of it is in, else its connection closed: nothing
    lands in the view after it returns, and the connection never goes back to the pool
    mid-frame). Call one of them, once."""

    __slots__ = ("_link", "_conn", "_rid", "_length", "_view", "timed_out")

    def __init__(self, link: PeerLink, conn: Connection, rid: int, length: int,
                 view: memoryview) -> None:
        self._link, self._conn, self._rid = link, conn, rid
        self._length, self._view = length, view
        self.timed_out = False
        """Set by `finish` when the peer did not answer within the timeout."""

    def finish(self) -> list[Status] | str:
        link = self._link
        try:
            statuses = _read_reply(self._conn, self._rid, [self._length], [self._view], None,
                                   Pace(link.timeout_s, MIN_PAYLOAD_BYTES_PER_S))
        except BaseException as exc:
            self._conn.close()
            if not isinstance(exc, Exception):
                raise
            self.timed_out = isinstance(exc, TimeoutError | socket.timeout | BlockingIOError
                                        | TransferTimeout)
            return f"{link.host}:{link.port}: {_describe(exc)}"
        link.checkin(self._conn)
        return statuses

    def abandon(self) -> None:
        """Give the reply up: read at once if all of it is in already (after a master round
        trip it nearly always is: the connection then goes back to the pool, not closed, so a
        key that keeps moving costs no new connection per get), else close the connection."""
        if _bytes_waiting(self._conn.sock) >= HEADER_BYTES + 1 + self._length:
            self.finish()
        else:
            self._conn.close()


class PeerLink:
    """Connections to one peer segment.

    Frames run either inline in the caller's thread (sync calls) or on worker threads (batch
    submits); both check a connection out of the idle pool, or open a new one, per frame.
    """

    def __init__(self, host: str, port: int, config: TransferConfig, me: str) -> None:
        self.host, self.port = host, port
        self._config = config
        self._me = me
        self._queue: queue.SimpleQueue[Frame | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def send(self, frames: list[Frame]) -> None:
        """Queue frames for the worker threads; returns at once. Queued under the lock, so a
        concurrent `close()` either refuses them here or finds them ahead of its sentinels
        (then they fail promptly instead of waiting out the batch timeout)."""
        with self._lock:
            if self._closed:
                for frame in frames:
                    frame.fail("transfer engine is closed")
                return
            self._grow(len(frames))
            for frame in frames:
                self._queue.put(frame)

    def run_inline(self, frames: list[Frame]) -> None:
        """Run frames in the calling thread (the first one), the rest on workers."""
        if len(frames) > 1:
            self.send(frames[1:])
        if frames:
            self._run(frames[0])

    def _grow(self, wanted: int) -> None:
        while len(self._threads) < min(wanted, self._config.connections_per_peer):
            thread = threading.Thread(target=self._worker, name=f"kvpool-tcp-{self.port}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            idle, self._idle = self._idle, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join(timeout=self._config.timeout_s)
        for conn in idle:
            conn.close()

    def _worker(self) -> None:
        while (frame := self._queue.get()) is not None:
            self._run(frame)

    def _run(self, frame: Frame) -> None:
        hook = frame.batch.on_sent is not None
        outcome = self.exchange(frame.op, frame.addrs, frame.lengths, frame.views, frame.fences,
                                frame.sent if hook and frame.op == OpCode.WRITE else None,
                                frame.arrived if hook and frame.op == OpCode.READ else None,
                                frame.batch)
        if isinstance(outcome, str):
            frame.fail(outcome)
        else:
            frame.finish(outcome)

    def exchange(self, op: OpCode, addrs: list[int], lengths: list[int], views: list[memoryview],
                 fences: list[int] | None, sent: Callable[[], None] | None = None,
                 arrived: Callable[[int, int], None] | None = None,
                 batch: Batch | None = None) -> list[Status] | str:
        """Run one frame in the calling thread: the target's per-descriptor statuses, or why
        the whole frame failed (then no descriptor counts as done). `sent`: called once a
        WRITE's payload is in the socket, before waiting for the answer. `arrived(lo, hi)`:
        called as a large READ's descriptors lo..hi-1 have their data, before the rest.
        `batch`: the frame's, which may give it up (`Batch.give_up`) while it runs."""
        conn: Connection | None = None
        try:
            conn = self._checkout()
            if batch is not None and not batch.frame_started(conn.sock):
                self.checkin(conn)
                return "the batch was given up before this frame started"
            pace = Pace(self._config.timeout_s, MIN_PAYLOAD_BYTES_PER_S) \
                if op == OpCode.READ else None  # (a write's reply carries no payload)
            try:
                statuses = _run_frame(conn, op, addrs, lengths, views, fences, sent, arrived,
                                      pace)
            finally:
                if batch is not None:
                    batch.frame_ended(conn.sock)
        except Exception as exc:  # whatever happens, the frame ends and the worker lives
            if conn is not None:
                conn.close()
            return f"{self.host}:{self.port}: {_describe(exc)}"
        self.checkin(conn)
        return statuses

    def begin_read(self, addr: int, length: int, view: memoryview,
                   fence: int) -> PendingRead | str | None:
        """A one-descriptor READ in two steps, for a caller with something to do meanwhile:
        its frame is sent now on an idle pooled connection (None when there is none: a new
        connection's handshake is not begun ahead of anything), and the `PendingRead` takes
        the reply or gives it up. The connection is this read's alone in between. A string
        says why the frame could not be sent."""
        conn = self._idle_connection()
        if conn is None:
            return None
        try:
            rid = _send_frame(conn, OpCode.READ, [addr], [length], [view], [fence])
        except Exception as exc:  # noqa: BLE001 - reported as the frame's failure
            conn.close()
            return f"{self.host}:{self.port}: {_describe(exc)}"
        return PendingRead(self, conn, rid, length, view)

    def _idle_connection(self) -> Connection | None:
        """A pooled connection that is still open, or None (none idle, or the link closed)."""
        with self._lock:
            idle = self._idle.pop() if self._idle and not self._closed else None
        if idle is not None and time.monotonic() - idle.idle_since >= _TRUST_IDLE_S \
                and not _still_open(idle.sock):
            idle.close()  # the peer closed it while idle (e.g. it restarted)
            return None
        return idle

    def _checkout(self) -> Connection:
        with self._lock:
            if self._closed:
                raise PeerUnavailable("transfer engine is closed")
        return self._idle_connection() or \
            Connection.open(self.host, self.port, self._config, self._me)

    @property
    def timeout_s(self) -> float:
        return self._config.timeout_s

    def checkin(self, conn: Connection) -> None:
        """Keep `conn` for the next frame: up to one connection per worker thread plus the
        one a sync caller runs its first frame on (`run_inline`), which are all in use at once
        in a large batch; keeping one fewer reopened a connection, handshake included, on
        nearly every batch of 1 MiB objects (docs/perf.md)."""
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self._closed and len(self._idle) <= self._config.connections_per_peer:
                self._idle.append(conn)
                return
        conn.close()


def _bytes_waiting(sock: socket.socket) -> int:
    """Bytes that a read of `sock` would return now (FIONREAD); 0 when that cannot be told."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except OSError:
        return 0


def _still_open(sock: socket.socket) -> bool:
    """False when an idle connection was closed or reset by the peer. (An idle connection
    has nothing to read unless the peer closed it: then the peek sees EOF or an error.)"""
    try:
        return not readable_now(sock.fileno()) or sock.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | socket.timeout | BlockingIOError):
        return "peer did not answer within the timeout"
    return str(exc) or type(exc).__name__


def _run_frame(conn: Connection, op: OpCode, addrs: list[int], lengths: list[int],
               views: list[memoryview], fences: list[int] | None,
               sent: Callable[[], None] | None = None,
               arrived: Callable[[int, int], None] | None = None,
               pace: Pace | None = None) -> list[Status]:
    """Send one frame and receive its reply; returns the statuses. A READ's payload that
    falls behind `pace` fails the frame (a trickling peer would hold the call)."""
    rid = _send_frame(conn, op, addrs, lengths, views, fences)
    if op == OpCode.WRITE:
        if sent is not None:
            sent()  # e.g. hash the bytes just sent while the peer takes them in
        count = len(addrs)
        reply = _expect(conn.reader, FrameType.WRITE_ACK, rid, count, HEADER_BYTES + count)
        conn.reader.finish_frame([])
        return reply.statuses
    return _read_reply(conn, rid, lengths, views, arrived, pace)


def _send_frame(conn: Connection, op: OpCode, addrs: list[int], lengths: list[int],
                views: list[memoryview], fences: list[int] | None) -> int:
    """Send one frame (a WRITE with its payload); returns its request id."""
    rid = next(_request_ids)
    count = len(addrs)
    ftype = FrameType.WRITE if op == OpCode.WRITE else FrameType.READ
    if count == 1:
        head = encode_single(ftype, rid, addrs[0], lengths[0], fences[0] if fences else 0)
    else:
        payload_len = sum(lengths) if op == OpCode.WRITE else 0
        head = encode_header(ftype, count, rid, payload_len) + encode_descriptors(addrs, lengths, fences)
    if op == OpCode.WRITE:
        send_views(conn.sock, [head, *views], len(head) + sum(lengths))
    else:
        conn.sock.sendall(head)  # a header and descriptors: small; a stall raises BlockingIOError
    return rid


def _read_reply(conn: Connection, rid: int, lengths: list[int], views: list[memoryview],
                arrived: Callable[[int, int], None] | None = None,
                pace: Pace | None = None) -> list[Status]:
    """The reply to READ frame `rid`: its statuses, the data gone from the socket straight
    into the OK descriptors' views (a single descriptor's with the reply's status byte in
    one read, `reply_into`; a small frame of several comes in the reply's first recv and is
    copied from there)."""
    count = len(lengths)
    reply_prefix = HEADER_BYTES + count
    payload = sum(lengths)
    if count == 1:  # a refused descriptor gets no payload: nothing lands in its view
        event, rest = conn.reader.reply_into(reply_prefix, views)
        reply = _check_reply(event, FrameType.READ_RESP, rid, count)
        if rest is not None:  # OK, and the payload's first bytes already in place
            conn.reader.finish_frame(rest, pace)
            return reply.statuses
    else:  # several: bytes landing ahead of the statuses could be a refused one's view's
        whole = reply_prefix + payload  # the reply when every descriptor is OK
        reply = _expect(conn.reader, FrameType.READ_RESP, rid, count,
                        whole if whole <= SCRATCH_BYTES else reply_prefix)
    statuses = reply.statuses
    ok_views = views
    if statuses.count(Status.OK) != count:
        ok_views = [v for v, s in zip(views, statuses, strict=True) if s == Status.OK]
        payload = sum(v.nbytes for v in ok_views)
    if reply.payload_bytes != payload:
        raise RemoteProtocolError("READ_RESP length does not match its OK descriptors")
    if arrived is not None and ok_views is views and reply_prefix + payload > SCRATCH_BYTES:
        conn.reader.finish_frame_in_steps(views, arrived, ARRIVAL_STEP_BYTES, pace)
    else:
        conn.reader.finish_frame(ok_views, pace)
    return statuses


def _expect(reader: FrameReader, ftype: FrameType, rid: int, count: int,
            reply_bytes: int) -> FrameStart:
    """The reply's FrameStart, reading up to `reply_bytes` at once: never more than the
    reply we expect, so nothing of a later frame is read ahead."""
    return _check_reply(reader.next_event(reply_bytes), ftype, rid, count)


def _check_reply(event: Event | None, ftype: FrameType, rid: int, count: int) -> FrameStart:
    """`event` if it starts the reply expected (type, request id, count), else why not."""
    if event is None:
        raise PeerUnavailable("peer closed the connection before replying")
    if isinstance(event, Control):
        raise PeerUnavailable(f"peer reported: {event.body}")
    if not isinstance(event, FrameStart):
        raise RemoteProtocolError(f"expected {ftype.name} #{rid}, got {type(event).__name__}")
    header = event.header
    if header.type != ftype or header.request_id != rid or header.count != count:
        raise RemoteProtocolError(f"expected {ftype.name} #{rid} x{count}, got {header.type.name} "
                                  f"#{header.request_id} x{header.count}")
    return event
