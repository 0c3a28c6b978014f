"""The master's RPC driver: one thread, a `selectors` loop over plain TCP, the sans-I/O
service inside.

Each connection carries length-prefixed msgpack frames (framing.py); replies go back on the
same connection in request order. Sockets are non-blocking: partial reads are reassembled by
a per-connection FrameDecoder, partial writes wait in a per-connection buffer (and the
connection is not read again until it is flushed, so a client that never reads cannot make
the master queue without bound). A frame with an oversized length gets one error reply and
then that connection is closed; nobody else notices. Between requests, and at least every
`tick_interval_s`, the loop runs the core's timeouts. The core is guarded by `lock` so the
admin HTTP server can read it from its own thread.
"""

from __future__ import annotations

import hmac
import logging
import selectors
import socket
import threading
import time

from kvpool.errors import LocalProtocolError, RemoteProtocolError
from kvpool.log import get_logger
from kvpool.store.codes import ErrorCode as E
from kvpool.store.framing import FrameDecoder, auth_token, encode_frame
from kvpool.store.protocol import encode_reply, peek_req_id
from kvpool.store.service import MasterService

log = get_logger("store.rpc")
RECV_BYTES = 256 << 10
ERROR_LOG_INTERVAL_S = 5.0
"""Repeated failures (a bug hit on every request, accept failing) log once per interval."""
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE


class RateLimitedLog:
    """Warnings that may repeat many times a second, logged at most once per interval with
    the count of those left out."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._log, self.interval_s = logger, interval_s
        self._last_s = -interval_s
        self._suppressed = 0

    def warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_s < self.interval_s:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" ({self._suppressed} more like it in the last {self.interval_s:.0f}s)"
        self._log.warning(message, *args, exc_info=exc_info)
        self._last_s, self._suppressed = now, 0


class _Conn:
    __slots__ = ("sock", "decoder", "out", "closing", "authed")

    def __init__(self, sock: socket.socket, authed: bool) -> None:
        self.sock = sock
        self.decoder = FrameDecoder()
        self.out = bytearray()
        self.closing = False
        """Close once `out` is flushed (after a protocol error)."""
        self.authed = authed
        """False until the connection presented the shared token (when one is set)."""


class RpcServer:
    def __init__(self, service: MasterService, host: str, port: int,
                 lock: threading.Lock, tick_interval_s: float = 0.1,
                 token: str | None = None) -> None:
        self.service = service
        self.token = token
        self.lock = lock
        self.tick_interval_s = tick_interval_s
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
            self._listener.listen(socket.SOMAXCONN)
        except BaseException:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, _READ, None)
        self._sel.register(self._wake_r, _READ, None)
        self._conns: dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._next_tick = self._last_turn_s = time.monotonic()
        self._errors = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="kvpool-master-rpc", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
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

    @property
    def last_turn_s(self) -> float:
        """Monotonic time at which the loop last began a turn (it turns at least every
        `tick_interval_s` while alive)."""
        return self._last_turn_s

    def stall_problem(self, max_stall_s: float) -> str | None:
        """Why the loop is not serving (stopped, or no turn for `max_stall_s`), or None."""
        if not self._thread.is_alive():
            return "the RPC loop is not running"
        stalled_s = time.monotonic() - self._last_turn_s
        if stalled_s > max_stall_s:
            return f"the RPC loop has not turned for {stalled_s:.1f}s"
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._last_turn_s = time.monotonic()
            try:
                self._turn()
            except Exception:  # a bug must not end the loop: log it and keep serving
                self._errors.warn("RPC loop error (serving continues)", exc_info=True)

    def _turn(self) -> None:
        timeout = max(0.0, self._next_tick - time.monotonic())
        for key, events in self._sel.select(timeout):
            if key.data is not None:
                self._serve_event(key.data, events)
            elif key.fileobj is self._listener:
                self._accept()
        if time.monotonic() >= self._next_tick:
            self._next_tick = time.monotonic() + self.tick_interval_s
            with self.lock:
                self.service.core.tick()

    def _serve_event(self, conn: _Conn, events: int) -> None:
        """One connection's event; a failure drops that connection only."""
        try:
            self._on_event(conn, events)
        except Exception:
            self._errors.warn("dropping an RPC connection after an error", exc_info=True)
            self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, or the peer reset already
                log.warning("accept failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, authed=self.token is None)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, _READ, conn)

    def _on_event(self, conn: _Conn, events: int) -> None:
        if events & _WRITE:
            self._flush(conn)
        elif events & _READ:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        try:
            frames = conn.decoder.feed(data)
        except RemoteProtocolError as exc:
            log.warning("dropping an RPC client: %s", exc)
            conn.closing = True
            self._send(conn, encode_frame(encode_reply(0, int(E.INVALID_PARAMS), str(exc))))
            return
        frames = self._authenticate(conn, frames)
        if frames:
            replies = self._handle(frames)
            self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))

    def _authenticate(self, conn: _Conn, frames: list[bytes]) -> list[bytes]:
        """Frames left to serve. A connection to a master with a shared token must start with
        an auth frame carrying it; otherwise it gets one error reply (request id 0) and is
        closed. A master without a token ignores a leading auth frame."""
        if conn.authed or not frames:
            return frames[1:] if frames and auth_token(frames[0]) is not None else frames
        offered = auth_token(frames[0])
        if offered is not None and self.token is not None and hmac.compare_digest(
                offered.encode(), self.token.encode()):
            conn.authed = True
            return frames[1:]
        log.warning("refusing an RPC client: wrong or missing shared token")
        conn.closing = True
        self._send(conn, encode_frame(encode_reply(
            0, int(E.INVALID_PARAMS), "authentication failed: wrong or missing shared token")))
        return []

    def _handle(self, frames: list[bytes]) -> list[bytes]:
        handle = self.service.handle
        with self.lock:
            replies = [handle(frame) for frame in frames]
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
        if conn.out:
            return
        if conn.closing:
            self._drop(conn)
        else:
            self._sel.modify(conn.sock, _READ, conn)

    def _drop(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
