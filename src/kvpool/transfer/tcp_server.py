"""The target side of the tcp transport: accepts peers and serves their READ/WRITE frames.

Every access is checked against the registry and the region's fence; a descriptor outside the
registered ranges, or planned against a stale fence, gets its own error status and its bytes are
discarded, so the other descriptors of the frame proceed. A write admitted by a region's fence
stays counted as in flight until its bytes are in (or the frame failed), so `set_fence` can wait
for it.
A malformed frame or a failed handshake closes that connection only.
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable
from typing import Any

from kvpool.errors import KvpoolError, ProtocolError, RemoteProtocolError
from kvpool.log import get_logger
from kvpool.transfer.fence import Fence
from kvpool.transfer.memory import Buffer, MemoryRegistry
from kvpool.transfer.protocol import (
    HEADER_BYTES,
    FrameType,
    Header,
    Status,
    decode_control,
    decode_descriptors,
    decode_header,
    encode_control,
    encode_header,
)
from kvpool.transfer.wire import recv_exact, recv_into_views, send_views

log = get_logger("transfer.tcp")
_DISCARD = memoryview(bytearray(1 << 20))
HANDSHAKE_TIMEOUT_S = 10.0


class TcpTarget:
    def __init__(self, registry: MemoryRegistry, host: str, port: int, token: str | None,
                 describe: Callable[[], dict[str, Any]], frame_timeout_s: float = 10.0) -> None:
        self._registry = registry
        self._frame_timeout_s = frame_timeout_s
        self._token = token
        self._describe = describe
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvpool-tcp-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        _shutdown(self._listener)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            _shutdown(conn)
        if self._thread.ident is not None:  # close() may follow a start() that failed early
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _addr = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn,), name="kvpool-tcp-conn",
                                 daemon=True).start()
            except RuntimeError as exc:  # out of threads: refuse this peer, keep accepting
                log.warning("cannot serve a new peer: %s", exc)
                with self._lock:
                    self._conns.discard(conn)
                _shutdown(conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._handshake(conn):
                while self._serve_frame(conn):
                    pass
        except ProtocolError as exc:
            log.warning("dropping peer after protocol error: %s", exc)
            _try_send(conn, encode_control(FrameType.ERROR, f"protocol error: {exc}"))
        except (OSError, KvpoolError):
            pass
        except Exception:  # a bug must cost this connection only, never the target
            log.exception("dropping peer after an unexpected error")
        finally:
            with self._lock:
                self._conns.discard(conn)
            _shutdown(conn)

    def _handshake(self, conn: socket.socket) -> bool:
        """HELLO must arrive within HANDSHAKE_TIMEOUT_S; the token is checked before any
        buffer registered here is reachable."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        header = decode_header(recv_exact(conn, HEADER_BYTES))
        if header.type != FrameType.HELLO:
            raise RemoteProtocolError(f"expected HELLO, got {header.type.name}")
        body = decode_control(header, bytes(recv_exact(conn, header.payload_len)))
        conn.settimeout(None)
        token = body.get("token") if isinstance(body, dict) else None
        if self._token is not None and not hmac.compare_digest(str(token or ""), self._token):
            _try_send(conn, encode_control(FrameType.ERROR, "authentication failed: token mismatch"))
            return False
        send_views(conn, [encode_control(FrameType.HELLO_OK, self._describe())])
        return True

    def _serve_frame(self, conn: socket.socket) -> bool:
        raw = conn.recv(HEADER_BYTES, socket.MSG_WAITALL)
        if not raw:
            return False
        if len(raw) < HEADER_BYTES:
            raise RemoteProtocolError("connection closed inside a frame header")
        header = decode_header(raw)
        conn.settimeout(self._frame_timeout_s)  # a stalled frame must not hold a fence forever
        if header.type == FrameType.WRITE:
            self._serve_write(conn, header)
        elif header.type == FrameType.READ:
            self._serve_read(conn, header)
        else:
            raise RemoteProtocolError(f"unexpected {header.type.name} frame from an initiator")
        conn.settimeout(None)
        return True

    def _serve_write(self, conn: socket.socket, header: Header) -> None:
        addrs, lengths, fences = decode_descriptors(recv_exact(conn, header.descriptor_bytes), header)
        statuses = bytearray(header.count)
        views: list[memoryview] = []
        admitted: list[tuple[Fence, int]] = []
        cache: list[Buffer | None] = [None]
        try:
            for i, (addr, length, fence) in enumerate(zip(addrs, lengths, fences, strict=True)):
                status, view = self._resolve(addr, length, fence, admitted, cache)
                statuses[i] = status
                views.extend([view] if view is not None else _discard_views(length))
            recv_into_views(conn, views)
        finally:
            for region, token in admitted:
                region.leave(token)
        send_views(conn, [encode_header(FrameType.WRITE_ACK, header.count, header.request_id,
                                        header.count), statuses])

    def _serve_read(self, conn: socket.socket, header: Header) -> None:
        addrs, lengths, fences = decode_descriptors(recv_exact(conn, header.descriptor_bytes), header)
        statuses = bytearray(header.count)
        views: list[bytes | bytearray | memoryview] = []
        cache: list[Buffer | None] = [None]
        for i, (addr, length, fence) in enumerate(zip(addrs, lengths, fences, strict=True)):
            status, view = self._resolve(addr, length, fence, None, cache)
            statuses[i] = status
            if view is not None:
                views.append(view)
        total = header.count + sum(v.nbytes for v in views if isinstance(v, memoryview))
        head = encode_header(FrameType.READ_RESP, header.count, header.request_id, total)
        send_views(conn, [head, statuses, *views])

    def _resolve(self, addr: int, length: int, fence: int, admitted: list[tuple[Fence, int]] | None,
                 cache: list[Buffer | None]) -> tuple[int, memoryview | None]:
        """Status and target view of one descriptor; `cache[0]` is the last buffer hit. A write
        (`admitted` is a list) admitted by the region's fence is appended to `admitted`."""
        buf = cache[0]
        if buf is None or not buf.contains(addr, length):
            buf = cache[0] = self._registry.find(addr, length)
        if buf is None:
            return Status.OUT_OF_RANGE, None
        if admitted is not None and buf.readonly:
            return Status.READ_ONLY, None
        token = buf.fence.enter(fence, admitted is not None)
        if token is None:
            return Status.FENCED, None
        if admitted is not None:
            admitted.append((buf.fence, token))
        start = addr - buf.addr
        return Status.OK, buf.view[start : start + length]


def _discard_views(length: int) -> list[memoryview]:
    full, rest = divmod(length, _DISCARD.nbytes)
    return [_DISCARD] * full + ([_DISCARD[:rest]] if rest else [])


def _try_send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:
        pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
