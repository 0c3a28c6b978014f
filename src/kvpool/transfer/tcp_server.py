"""The target side of the tcp transport: accepts peers and serves their READ/WRITE frames.

Every access is checked against the registry and the region's fence; a descriptor outside the
registered ranges, or planned against a stale fence, gets its own error status and its bytes are
discarded, so the other descriptors of the frame proceed. A write admitted by a region's fence
stays counted as in flight until its bytes are in (or the frame failed), so `set_fence` can wait
for it. A malformed frame or a failed handshake closes that connection only.

Bounds, so hostile or broken peers cost little: the whole handshake has one deadline
(`handshake_timeout_s`), a frame in progress `timeout_s` per read (and a write's payload must
keep arriving at MIN_PAYLOAD_BYTES_PER_S after `timeout_s`, on the bytes received: `Pace`), an idle authenticated
connection `idle_timeout_s` (optional); at most `max_connections_per_address` connections per
remote address (at the limit the one of that address idle longest, in the handshake or
between frames, is closed for the newcomer); and accept() failing for want of fds or memory
backs off and retries.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpool.errors import KvpoolError, ProtocolError, RemoteProtocolError
from kvpool.log import RateLimitedLog, get_logger
from kvpool.transfer.auth import INITIATOR, TARGET, check_proof, new_nonce, nonce_of, proof
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.decoder import Control, FrameStart
from kvpool.transfer.fence import Fence
from kvpool.transfer.memory import Buffer, MemoryRegistry
from kvpool.transfer.protocol import HEADER_BYTES, FrameType, Status, encode_control, encode_header
from kvpool.transfer.wire import (
    MIN_PAYLOAD_BYTES_PER_S,
    SCRATCH_BYTES,
    FrameReader,
    Pace,
    recv_control,
    send_views,
)

log = get_logger("transfer.tcp")
_DISCARD = memoryview(bytearray(1 << 20))
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RETRY_ACCEPT = _EXHAUSTED | {errno.ECONNABORTED, errno.EINTR, errno.EPROTO, errno.EPERM}
_BACKOFF_S = 0.1
_STATUS_BYTE = {int(status): bytes([status]) for status in Status}
_HANDSHAKE, _IDLE, _BUSY, _EVICTED = "handshake", "idle", "busy", "evicted"
_WARN_INTERVAL_S = 10.0


class TcpTarget:
    def __init__(self, registry: MemoryRegistry, config: TransferConfig,
                 describe: Callable[[], dict[str, Any]]) -> None:
        self._registry = registry
        self._config = config
        self._token = config.token
        self._describe = describe
        self._listener = socket.create_server((config.host, config.port), backlog=128, reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self.name = f"{config.host}:{self.port}"  # our segment name, which the initiator dialed
        self._per_address: dict[str, int] = {}
        self._accept_log = RateLimitedLog(log, _WARN_INTERVAL_S)
        self._conns: set[socket.socket] = set()
        self._phase: dict[socket.socket, tuple[str, float, str]] = {}
        """conn -> (phase, since when, remote address): who may give way at the limit."""
        self._evictions = RateLimitedLog(log, _WARN_INTERVAL_S)
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
        """Accept until closed. Running out of fds or memory backs off and retries (the
        pending peers wait in the backlog), so the listener outlives a burst of load."""
        while not self._closed:
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self._closed or exc.errno not in _RETRY_ACCEPT:
                    return
                self._back_off(exc)
                continue
            self._admit(conn, str(addr[0]))

    def _back_off(self, exc: OSError) -> None:
        if exc.errno in _EXHAUSTED:
            self._accept_log.warn("listener %s cannot accept (%s); retrying every %gs",
                                  self.name, exc.strerror, _BACKOFF_S)
            time.sleep(_BACKOFF_S)

    def _admit(self, conn: socket.socket, address: str) -> None:
        """Serve `conn` on its own thread. When its address already has its share, its
        connection that has made no progress the longest (in the handshake, or idle between
        frames) gives way, so connections that never finish cannot lock out the peers of
        that address (on one host, every peer); with every one busy, `conn` is refused."""
        with self._lock:
            if self._per_address.get(address, 0) >= self._config.max_connections_per_address \
                    and not self._evict_idle(address):
                log.debug("refusing another connection from %s", address)
                conn.close()
                return
            self._per_address[address] = self._per_address.get(address, 0) + 1
            self._conns.add(conn)
            self._phase[conn] = (_HANDSHAKE, time.monotonic(), address)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, address), name="kvpool-tcp-conn",
                             daemon=True).start()
        except (RuntimeError, OSError) as exc:  # out of threads: refuse this peer, keep accepting
            log.warning("cannot serve a new peer: %s", exc)
            self._release(conn, address)

    def _evict_idle(self, address: str) -> bool:
        """Shut down the connection from `address` that has waited longest in the handshake
        or between frames (its thread then releases it); False if all are busy. Under _lock."""
        idle = [(phase != _HANDSHAKE, since, c) for c, (phase, since, a) in self._phase.items()
                if a == address and phase in (_HANDSHAKE, _IDLE)]
        if not idle:
            return False
        victim = min(idle, key=lambda x: x[:2])[2]
        self._phase[victim] = (_EVICTED, 0.0, address)
        self._evictions.warn("connections from %s at the limit (%d): closing the one idle "
                             "longest for a new one", address,
                             self._config.max_connections_per_address)
        try:
            victim.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True

    def _set_phase(self, conn: socket.socket, phase: str) -> None:
        with self._lock:
            entry = self._phase.get(conn)
            if entry is not None and entry[0] != _EVICTED:  # only idle ones need the time
                self._phase[conn] = (phase, time.monotonic() if phase != _BUSY else 0.0, entry[2])

    def _release(self, conn: socket.socket, address: str) -> None:
        with self._lock:
            self._phase.pop(conn, None)
            self._conns.discard(conn)
            left = self._per_address.get(address, 1) - 1
            if left:
                self._per_address[address] = left
            else:
                self._per_address.pop(address, None)
        _shutdown(conn)

    def _serve(self, conn: socket.socket, address: str) -> None:
        try:
            if self._handshake(conn):
                self._set_phase(conn, _IDLE)
                reader = self._reader(conn)
                while self._serve_frame(conn, reader):
                    self._set_phase(conn, _IDLE)
        except ProtocolError as exc:
            log.warning("dropping peer after protocol error: %s", exc)
            _try_send(conn, encode_control(FrameType.ERROR, f"protocol error: {exc}"))
        except (OSError, KvpoolError):
            pass
        except Exception:  # a bug must cost this connection only, never the target
            log.exception("dropping peer after an unexpected error")
        finally:
            self._release(conn, address)

    def _reader(self, conn: socket.socket) -> FrameReader:
        """Frames are read under kernel timeouts (see kvpool.transfer.wire); the reader tells
        a stalled frame (timeout_s) from an idle connection (idle_timeout_s)."""
        return FrameReader(conn, self._config.timeout_s, self._config.idle_timeout_s,
                           self._config.request_poll_us)

    def _handshake(self, conn: socket.socket) -> bool:
        """The whole handshake (kvpool.transfer.auth) must end within handshake_timeout_s; the
        initiator has proved it knows the token before any buffer registered here is reachable
        or the segment descriptor is sent."""
        deadline = time.monotonic() + self._config.handshake_timeout_s
        hello = recv_control(conn, deadline)
        header, body = hello.header, hello.body
        if header.type != FrameType.HELLO:
            raise RemoteProtocolError(f"expected HELLO, got {header.type.name}")
        if self._token is not None and not self._authenticate(conn, nonce_of(body), deadline):
            _try_send(conn, encode_control(FrameType.ERROR, "authentication failed: token mismatch"))
            return False
        conn.settimeout(None)
        send_views(conn, [encode_control(FrameType.HELLO_OK, self._describe())])
        return True

    def _authenticate(self, conn: socket.socket, nonce: str, deadline: float) -> bool:
        assert self._token is not None
        own_nonce = new_nonce()
        challenge = {"nonce": own_nonce, "proof": proof(self._token, TARGET, nonce, own_nonce, self.name)}
        send_views(conn, [encode_control(FrameType.CHALLENGE, challenge)])
        auth = recv_control(conn, deadline)
        if auth.header.type != FrameType.AUTH:
            raise RemoteProtocolError(f"expected AUTH, got {auth.header.type.name}")
        presented = auth.body.get("proof") if isinstance(auth.body, dict) else None
        return check_proof(self._token, INITIATOR, nonce, own_nonce, self.name, presented)

    def _serve_frame(self, conn: socket.socket, reader: FrameReader) -> bool:
        """Serve one frame; False when the initiator closed the connection between frames.
        Once a frame has begun every read and write times out after timeout_s, so a stalled
        peer cannot hold a fence (or this thread) forever; between frames idle_timeout_s.
        The first read takes what is there (an initiator sends nothing more until it has the
        reply): header, descriptors and a small payload in one recv."""
        start = reader.next_event(SCRATCH_BYTES)
        if start is None:
            return False
        if not isinstance(start, FrameStart) or start.header.type not in (FrameType.WRITE, FrameType.READ):
            kind = start.header.type.name if isinstance(start, FrameStart | Control) else "data"
            raise RemoteProtocolError(f"unexpected {kind} frame from an initiator")
        self._set_phase(conn, _BUSY)
        if start.header.type == FrameType.WRITE:
            self._serve_write(conn, reader, start)
        else:
            self._serve_read(conn, reader, start)
        return True

    def _serve_write(self, conn: socket.socket, reader: FrameReader, start: FrameStart) -> None:
        header = start.header
        statuses = bytearray(header.count)
        admitted: list[tuple[Fence, int, int]] = []
        try:
            views = self._admit_writes(start, statuses, admitted)
            reader.finish_frame(views, Pace(self._config.timeout_s, MIN_PAYLOAD_BYTES_PER_S))
        finally:
            for region, token, count in admitted:
                region.leave(token, count)
        send_views(conn, [encode_header(FrameType.WRITE_ACK, header.count, header.request_id,
                                        header.count), statuses], HEADER_BYTES + header.count)

    def _serve_read(self, conn: socket.socket, reader: FrameReader, start: FrameStart) -> None:
        header, addrs, lengths, fences = start.header, start.addrs, start.lengths, start.fences
        reader.finish_frame([])
        if header.count == 1:  # the one-request path: no loop, one reply buffer
            status, view = self._resolve(addrs[0], lengths[0], fences[0])
            payload = lengths[0] if view is not None else 0
            head = encode_header(FrameType.READ_RESP, 1, header.request_id, 1 + payload)
            send_views(conn, [head + _STATUS_BYTE[status], view] if view is not None else
                       [head + _STATUS_BYTE[status]], HEADER_BYTES + 1 + payload)
            return
        statuses = bytearray(header.count)
        views, payload = self._admit_reads(start, statuses)
        total = header.count + payload
        head = encode_header(FrameType.READ_RESP, header.count, header.request_id, total)
        send_views(conn, [head, statuses, *views], HEADER_BYTES + total)

    def _admit_reads(self, start: FrameStart,
                     statuses: bytearray) -> tuple[list[memoryview], int]:
        """The source ranges a READ frame's reply sends, in order, and their bytes; a
        refused descriptor (its status set in `statuses`) sends none. Each descriptor is
        checked against the registry; the fence is checked once per run of descriptors
        into one region under one fence value. A read holds nothing in flight (the fence
        only admits it), so one check for the run admits what one check per descriptor
        would: every byte is sent after all of them, in either case."""
        views: list[memoryview] = []
        payload = 0
        find, last = self._registry.find, None  # (find remembers the last buffer it found)
        admitted = -1  # the fence value last admitted into `last`
        for i, (addr, length, fence) in enumerate(
                zip(start.addrs, start.lengths, start.fences, strict=True)):
            buf = find(addr, length)  # per descriptor: an inner region answers for itself
            if buf is None:
                statuses[i] = Status.OUT_OF_RANGE
                continue
            if buf is not last:
                last, admitted = buf, -1
            if fence != admitted:
                if buf.fence.enter(fence, False) is None:
                    statuses[i] = Status.FENCED
                    continue
                admitted = fence
            at = addr - buf.addr
            views.append(buf.view[at : at + length])
            payload += length
        return views, payload

    def _admit_writes(self, start: FrameStart, statuses: bytearray,
                      admitted: list[tuple[Fence, int, int]]) -> list[memoryview]:
        """Where a WRITE frame's payload goes, in order: each descriptor's target range, or
        discard space for one refused (its status set in `statuses`). The descriptors of a
        run into one region under one fence are admitted together, all or none, by one
        check of the region's fence (one lock round trip in and out, not one per
        descriptor); each admission is appended to `admitted` as (fence, token, count)."""
        addrs, lengths, fences = start.addrs, start.lengths, start.fences
        bufs: list[Buffer | None] = []
        find = self._registry.find  # per descriptor: an inner region answers for itself
        for i, (addr, length) in enumerate(zip(addrs, lengths, strict=True)):
            buf = find(addr, length)
            if buf is None:
                statuses[i] = Status.OUT_OF_RANGE
            elif buf.readonly:
                statuses[i] = Status.READ_ONLY
            bufs.append(buf if statuses[i] == Status.OK else None)
        i, count = 0, len(bufs)
        while i < count:
            run_buf, fence, j = bufs[i], fences[i], i + 1
            if run_buf is not None:
                while j < count and bufs[j] is run_buf and fences[j] == fence:
                    j += 1
                token = run_buf.fence.enter(fence, True, j - i)
                if token is None:
                    statuses[i:j] = bytes([Status.FENCED]) * (j - i)
                    bufs[i:j] = [None] * (j - i)
                else:
                    admitted.append((run_buf.fence, token, j - i))
            i = j
        views: list[memoryview] = []
        for addr, length, target in zip(addrs, lengths, bufs, strict=True):
            if target is None:
                views.extend(_discard_views(length))
            else:
                at = addr - target.addr
                views.append(target.view[at : at + length])
        return views

    def _resolve(self, addr: int, length: int, fence: int) -> tuple[int, memoryview | None]:
        """Status and target view of one READ descriptor."""
        buf = self._registry.find(addr, length)
        if buf is None:
            return Status.OUT_OF_RANGE, None
        if buf.fence.enter(fence, False) is None:
            return Status.FENCED, None
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
