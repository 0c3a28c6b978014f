"""The master's RPC driver: one thread, a `selectors` loop over plain TCP, the sans-I/O
service inside.

Each connection carries length-prefixed msgpack frames (framing.py); replies go back on the
same connection in request order. Sockets are non-blocking: partial reads are reassembled by
a per-connection FrameDecoder, partial writes wait in a per-connection buffer (and the
connection is not read again until it is flushed, and the requests of one read are handled
only while that buffer stays under OUT_CAP_BYTES, so a client that never reads cannot make
the master queue without bound). A frame with an oversized length gets one error reply and
then that connection is closed; nobody else notices. Between requests, and at least every
`tick_interval_s`, the loop runs the core's timeouts and closes connections past their
deadline. The core is guarded by `lock` so the admin HTTP server can read it from its own
thread.

With a token, a connection starts with the handshake of rpc_auth.py: until it completes, the
master reads at most MAX_HANDSHAKE_FRAME_BYTES per frame and gives it `handshake_timeout_s`
in all. Limits (RpcLimits): connections at once, handshakes at once, idle timeout, and a
pause of the listener when accept() runs out of descriptors. At a limit the oldest handshake
(or the longest idle connection) makes room for the newcomer, so a peer that opens many
connections and never finishes them cannot lock the clients out. No failure while serving one
connection ends the loop: it is logged (at most once per ERROR_LOG_INTERVAL_S per kind) and
that connection is dropped.
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
from collections.abc import Callable

from kvpool.busypoll import PollWindow, select_polling
from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import AuthError, LocalProtocolError, RemoteProtocolError, StoreError
from kvpool.log import RateLimitedLog, get_logger
from kvpool.store.master.rpc_limits import RpcLimits
from kvpool.store.master.service import MasterService
from kvpool.store.wire.auth import MAX_HANDSHAKE_FRAME_BYTES, ServerHandshake, answer_without_token
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.protocol import MAX_FRAME_BYTES, encode_reply, peek_req_id

log = get_logger("store.rpc")
RECV_BYTES = 256 << 10
ERROR_LOG_INTERVAL_S = 5.0
"""Repeated failures (a bug hit on every request, accept failing) log once per interval."""
ACCEPTS_PER_TURN = 64
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


OUT_CAP_BYTES = 4 << 20
"""Replies waiting for one connection's socket beyond which its next requests wait too: a
client that sends many requests and reads none cannot make the master queue without bound
(one read of small requests that each answer the segment table was hundreds of MiB)."""
FRAMES_PER_BATCH = 256
"""Requests handled at once under the lock before their replies' size is looked at."""


class _Conn:
    __slots__ = ("sock", "decoder", "out", "closing", "handshake", "deadline_s", "pending")

    def __init__(self, sock: socket.socket, handshake: ServerHandshake | None,
                 deadline_s: float) -> None:
        self.sock = sock
        self.decoder = FrameDecoder(MAX_FRAME_BYTES if handshake is None
                                    else MAX_HANDSHAKE_FRAME_BYTES)
        self.out = bytearray()
        self.closing = False
        """Close once `out` is flushed (after a protocol error)."""
        self.handshake = handshake
        """Until the peer authenticated (a master with a token): its handshake; else None."""
        self.deadline_s = deadline_s
        """Monotonic time at which the connection is closed unless it makes progress."""
        self.pending: list[bytes] = []
        """Requests read but not handled yet (their replies would exceed OUT_CAP_BYTES)."""


class RpcServer:
    """Raises StoreError when it cannot listen on host:port."""

    def __init__(self, service: MasterService, host: str, port: int,
                 lock: threading.Lock, tick_interval_s: float = 0.1,
                 token: str | None = None, limits: RpcLimits | None = None,
                 poll_us: int = 0, clock: Clock = SYSTEM_CLOCK) -> None:
        """`clock`: the time of connection deadlines, ticks and the stall check (the
        core's)."""
        self.service = service
        self.clock = clock
        self.token = token
        self.lock = lock
        self.tick_interval_s = tick_interval_s
        self.limits = limits or RpcLimits()
        self._listener = _listen(host, port)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, _READ, None)
        self._sel.register(self._wake_r, _READ, None)
        self._conns: dict[int, _Conn] = {}
        self._num_handshakes = 0
        self._accept_paused_until: float | None = None
        self._stop = threading.Event()
        self._next_tick = self._last_turn_s = self.clock.now()
        self._errors = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._poll = PollWindow(poll_us)
        """Polls for the next request while requests come back to back (kvpool.busypoll)."""
        self._refusals = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._accept_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="kvpool-master-rpc", daemon=True)

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close every socket (also when never started)."""
        self._stop.set()
        if self._thread.is_alive():
            self._wake_w.send(b"x")
            self._thread.join(5)
        if not self._thread.is_alive():
            self._close_all()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()

    def stall_problem(self, max_stall_s: float) -> str | None:
        """Why the loop is not serving (stopped, or no turn for `max_stall_s`), or None."""
        if not self._thread.is_alive():
            return "the RPC loop is not running"
        stalled_s = self.clock.now() - self._last_turn_s
        if stalled_s > max_stall_s:
            return f"the RPC loop has not turned for {stalled_s:.1f}s"
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._last_turn_s = self.clock.now()
            try:
                self._turn()
            except Exception:  # a bug must not end the loop: log it and keep serving
                self._errors.warn("RPC loop error (serving continues)", exc_info=True)

    def _turn(self) -> None:
        now = self.clock.now()
        for key, events in select_polling(self._sel, max(0.0, self._next_tick - now),
                                          self._poll):
            if key.data is not None:
                self._serve_event(key.data, events)
            elif key.fileobj is self._listener:
                self._accept()
        now = self.clock.now()
        if now >= self._next_tick:
            self._next_tick = now + self.tick_interval_s
            with self.lock:
                self.service.core.tick()
            self._expire(now)
            self._resume_accepting(now)

    def _serve_event(self, conn: _Conn, events: int) -> None:
        """One connection's event; a failure drops that connection only."""
        try:
            self._on_event(conn, events)
        except Exception:
            self._errors.warn("dropping an RPC connection after an error", exc_info=True)
            self._drop(conn)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause_accepting(exc)
                    return
                self._accept_log.warn("RPC accept failed: %s", exc)  # e.g. reset already
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        handshaking = self.token is not None
        limits = self.limits
        if not self._make_room(handshaking):
            self._accept_log.warn("refusing an RPC connection: %d connections, %d in the "
                                  "handshake (limits %d and %d)", len(self._conns),
                                  self._num_handshakes, limits.max_connections,
                                  limits.max_handshakes)
            sock.close()
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        now = self.clock.now()
        if handshaking:
            assert self.token is not None
            conn = _Conn(sock, ServerHandshake(self.token), now + limits.handshake_timeout_s)
            self._num_handshakes += 1
        else:
            conn = _Conn(sock, None, now + limits.idle_timeout_s)
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, _READ, conn)

    def _make_room(self, handshaking: bool) -> bool:
        """Whether a new connection fits. At a cap, the connection that has made no progress
        the longest gives way: the oldest handshake, else (at max_connections) the longest
        idle connection with nothing left to send. So connections that never finish, or sit
        idle, cannot lock clients out; an evicted client reconnects on its next call. False
        when every connection is busy."""
        limits = self.limits
        if handshaking and self._num_handshakes >= limits.max_handshakes:
            return self._evict(lambda c: c.handshake is not None, "handshake")
        if len(self._conns) >= limits.max_connections:
            return self._evict(lambda c: c.handshake is not None, "handshake") or \
                self._evict(lambda c: not c.out and not c.closing, "idle")
        return True

    def _evict(self, eligible: Callable[[_Conn], bool], kind: str) -> bool:
        """Close the eligible connection with the earliest deadline; False if none."""
        victim = min((c for c in self._conns.values() if eligible(c)),
                     key=lambda c: c.deadline_s, default=None)
        if victim is None:
            return False
        self._refusals.warn("at the connection limit: closing the oldest %s connection "
                            "for a new one", kind)
        self._drop(victim)
        return True

    def _pause_accepting(self, exc: OSError) -> None:
        """Out of descriptors: stop watching the listener for a while instead of spinning
        on a connection that cannot be accepted (it waits in the backlog)."""
        self._accept_log.warn("RPC accept failed (%s); pausing accepts for %.1fs", exc,
                              self.limits.accept_backoff_s)
        self._sel.unregister(self._listener)
        self._accept_paused_until = self.clock.now() + self.limits.accept_backoff_s

    def _resume_accepting(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self._listener, _READ, None)

    def _expire(self, now: float) -> None:
        """Close connections past their deadline (handshake or idle)."""
        for conn in [c for c in self._conns.values() if c.deadline_s <= now]:
            self._refusals.warn("closing an RPC connection: %s", "no handshake in time"
                                if conn.handshake is not None else "idle")
            self._drop(conn)

    def _on_event(self, conn: _Conn, events: int) -> None:
        if events & _WRITE:
            self._flush(conn)
        elif events & _READ:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        handshaking = conn.handshake is not None
        try:
            data = conn.sock.recv(MAX_HANDSHAKE_FRAME_BYTES if handshaking else RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        if not handshaking:
            conn.deadline_s = self.clock.now() + self.limits.idle_timeout_s
        try:
            frames = conn.decoder.feed(data)
        except RemoteProtocolError as exc:
            self._refuse(conn, str(exc))
            return
        if handshaking:
            frames = self._authenticate(conn, frames)
        if frames:
            conn.pending += frames
            self._serve(conn)

    def _serve(self, conn: _Conn) -> None:
        """Handle the connection's pending requests while its waiting replies stay under
        OUT_CAP_BYTES; the rest wait until the socket has taken those (`_flush`)."""
        while conn.pending and len(conn.out) < OUT_CAP_BYTES and not conn.closing:
            frames = conn.pending[:FRAMES_PER_BATCH]
            del conn.pending[:FRAMES_PER_BATCH]
            replies = self._handle(frames)
            self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))
            if conn.sock.fileno() < 0:  # dropped: the peer went away
                return

    def _authenticate(self, conn: _Conn, frames: list[bytes]) -> list[bytes]:
        """Feed handshake frames; the frames left once it completed (none before)."""
        handshake = conn.handshake
        assert handshake is not None
        answers = []
        while frames and not handshake.done:
            try:
                answers.append(handshake.receive(frames.pop(0)))
            except AuthError as exc:
                self._refuse(conn, str(exc))
                return []
        if handshake.done:
            conn.handshake = None
            self._num_handshakes -= 1
            conn.decoder.max_frame_bytes = MAX_FRAME_BYTES
            conn.deadline_s = self.clock.now() + self.limits.idle_timeout_s
        self._send(conn, b"".join(encode_frame(a) for a in answers))
        return frames

    def _refuse(self, conn: _Conn, reason: str) -> None:
        """One error reply (request id 0), then close: the stream cannot continue."""
        self._refusals.warn("refusing an RPC client: %s", reason)
        conn.closing = True
        self._send(conn, encode_frame(encode_reply(0, int(E.INVALID_PARAMS), reason)))

    def _handle(self, frames: list[bytes]) -> list[bytes]:
        handle = self.service.handle
        with self.lock:
            replies = [handle(f) if f[:1] != b"\x00" else _zero_led(f, handle) for f in frames]
        try:
            return [encode_frame(reply) for reply in replies]
        except LocalProtocolError:
            return [self._frame_or_refusal(frame, reply)
                    for frame, reply in zip(frames, replies, strict=True)]

    @staticmethod
    def _frame_or_refusal(request: bytes, reply: bytes) -> bytes:
        """The reply's frame, or an error reply when the result is too large to send."""
        try:
            return encode_frame(reply)
        except LocalProtocolError as exc:
            return encode_frame(encode_reply(peek_req_id(request), int(E.INVALID_PARAMS),
                                             f"reply too large: {exc}"))

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.out:  # already waiting for the socket to drain: keep the order
            conn.out += data
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the peer went away; its replies go nowhere
            self._drop(conn)
            return
        if sent < len(data):
            conn.out += memoryview(data)[sent:]
            self._sel.modify(conn.sock, _WRITE, conn)
        elif conn.closing:
            self._drop(conn)

    def _flush(self, conn: _Conn) -> None:
        """The socket takes more of what is waiting; read again once everything is out."""
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        del conn.out[:sent]
        if conn.handshake is None and sent:
            conn.deadline_s = self.clock.now() + self.limits.idle_timeout_s
        if len(conn.out) < OUT_CAP_BYTES and conn.pending:
            self._serve(conn)
            if conn.sock.fileno() < 0:
                return
        if conn.out:
            return
        if conn.closing:
            self._drop(conn)
        else:
            self._sel.modify(conn.sock, _READ, conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is conn and conn.handshake is not None:
            self._num_handshakes -= 1
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


def _zero_led(frame: bytes, handle: Callable[[bytes], bytes]) -> bytes:
    """The reply to a frame that starts with a zero byte: a handshake frame on an
    authenticated connection (or to a master without a token) gets OK; anything else is no
    request, and the service says so."""
    answer = answer_without_token(frame)
    return handle(frame) if answer is None else answer


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise StoreError(f"master RPC cannot listen on {host}:{port}: {exc.strerror or exc}"
                         ) from None
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
