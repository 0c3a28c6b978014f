"""A blocking RPC client of the master: one TCP connection, one call in flight.

Frames are length-prefixed msgpack (framing.py); requests are the typed messages of
messages.py, and each call returns its result decoded and checked against the message's
`Reply` type. The connection is opened by the first call
(so a client may be created before its master starts) and reopened by the next call after
it broke; a call never hangs: it raises RpcTimeout when the master is unreachable or silent
for its timeout, RpcError when the connection broke under it (the call may or may not have
taken effect). Replies carry the request id, so a late reply to a call that already timed
out is skipped. Thread-safe (calls are serialized); give each busy thread its own client for
parallelism.
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from kvpool.busypoll import PollWindow, recv_polling
from kvpool.errors import LocalProtocolError, RemoteProtocolError, RpcError, RpcTimeout
from kvpool.store.wire.auth import client_handshake
from kvpool.store.wire.codes import ErrorCode
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.messages import Msg, decode_result, encode_msg
from kvpool.store.wire.protocol import Op, Reply, ReplyHead, decode_reply_head, encode_request

RECV_BYTES = 256 << 10
CONNECT_RETRY_S = 0.05
"""Pause between connection attempts while the master refuses (not started yet)."""
TRUST_IDLE_S = 0.01
"""A connection that carried a reply within this long is not checked for a close by the
master before the next request (one syscall per call saved); a master that closes it in
that window fails one call, as a close between the check and the send always could."""
LEADER_CHECK_S = 0.5
"""With HA masters (an etcd:// address), a call waiting on the master (to connect or for a
reply) looks the leader up this often: when etcd names another, the call goes to it at once.
A leader whose host was cut off answers nothing; without this the call would wait its whole
timeout, though the standby leads a moment after the lease (2-10 s) expires."""


class _LeaderMoved(Exception):
    """The leader this call waits on is no longer etcd's: send it to the new one."""


def parse_address(address: str, default_port: int = 50051) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RpcError(f"bad master address {address!r}: expected HOST:PORT")
    return host, int(port)


def _leader_resolver(address: str) -> Callable[[], tuple[str, int] | None] | None:
    if not address.startswith("etcd://"):
        return None
    from kvpool.store.wire.leader import leader_resolver  # HA only: imports etcd3gw
    return leader_resolver(address)


def _not_sent(op: Op, exc: LocalProtocolError) -> RpcError:
    """Nothing was sent: the request is the caller's fault (too large for a frame)."""
    return RpcError(f"{op.name} request not sent: {exc}", status=int(ErrorCode.INVALID_PARAMS))


def _timeval(seconds: float) -> bytes:
    micros = max(1000, int(seconds * 1e6))
    return struct.pack("ll", micros // 1_000_000, micros % 1_000_000)


class RpcClient:
    def __init__(self, address: str, client_id: str, timeout_s: float = 5.0,
                 token: str | None = None,
                 on_late_reply: Callable[[Reply], None] | None = None,
                 poll_us: int = 0,
                 leader: Callable[[], tuple[str, int] | None] | None = None) -> None:
        """`poll_us`: how long a wait for a reply polls the socket before blocking, while
        replies come that fast (kvpool.busypoll); 0 always blocks. `leader`: where the
        master is now (HA), asked before each connection and every LEADER_CHECK_S of a
        wait; by default etcd's leader for an 'etcd://...' address, else `address`."""
        self._resolve = leader if leader is not None else _leader_resolver(address)
        """With HA: looks the leader up before each connection attempt and during waits."""
        self._host, self._port = parse_address(address) if self._resolve is None else ("", 0)
        self.on_late_reply = on_late_reply
        """Sees each reply to an earlier call that timed out (skipped otherwise): a late
        answer can still carry news, such as the master not knowing this client."""
        self._token = token
        self.address = f"{self._host}:{self._port}" if self._resolve is None else address
        self.client_id = client_id
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder()
        self._frames: list[bytes] = []
        self._sock_timeout = -1.0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._poll = PollWindow(poll_us)
        self._replied_at = 0.0
        """time.monotonic() of the last reply on the open connection."""

    def call(self, msg: Msg, timeout_s: float | None = None) -> Any:
        """The result of request `msg` (typed: `msg.Reply`). RpcTimeout when no reply comes
        in time, RpcError when the master refuses the request (the message says why,
        `status` carries the reply's code), when the request is too large for a frame
        (status INVALID_PARAMS, nothing sent), when the reply does not fit `msg.Reply`, or
        when the connection broke (status None). Stamps `msg` with this client's header."""
        frame_id = next(self._ids)
        msg.req_id, msg.client_id = frame_id, self.client_id
        try:
            frame = encode_frame(encode_msg(msg))
        except LocalProtocolError as exc:
            raise _not_sent(msg.op, exc) from None
        return self._result(type(msg), msg.op, frame, frame_id, timeout_s)

    def call_unchecked(self, op: Op, *fields: Any, timeout_s: float | None = None) -> Any:
        """Request `op` with `fields` as they are, for tests and tools that must send what no
        typed message can (a wrong arity, a bad field): the result comes back as plain
        msgpack values. Raises as `call` does."""
        frame_id = next(self._ids)
        try:
            frame = encode_frame(encode_request(op, frame_id, self.client_id, *fields))
        except LocalProtocolError as exc:
            raise _not_sent(op, exc) from None
        return self._result(Msg, op, frame, frame_id, timeout_s)

    def _result(self, cls: type[Msg], op: Op, frame: bytes, frame_id: int,
                timeout_s: float | None) -> Any:
        """Send `frame` and return its reply's result, decoded against `cls.Reply`."""
        head = self._exchange(frame, frame_id, timeout_s)
        if head.status != 0:
            raise RpcError(f"master refused {op.name} (code {head.status}): "
                           f"{_plain(head.result)}", status=head.status)
        try:
            return decode_result(cls, head.result)
        except RemoteProtocolError as exc:
            raise RpcError(f"malformed reply from {self.address}: {exc}") from None

    def _exchange(self, frame: bytes, frame_id: int, timeout_s: float | None) -> ReplyHead:
        with self._lock:
            if self._closed:
                raise RpcError("RPC client is closed")
            timeout = timeout_s if timeout_s is not None else self.timeout_s
            deadline = time.monotonic() + timeout
            while True:
                try:
                    sock = self._ready_socket(timeout, deadline)
                    self._send(sock, frame, timeout)
                except RpcError:
                    self._disconnect()
                    raise
                try:
                    return self._wait(sock, frame_id, timeout, deadline)
                except _LeaderMoved:  # the deposed leader commits nothing: ask the new one
                    self._disconnect()

    def _wait_slice(self, timeout_s: float) -> float:
        """The socket's timeout for one wait: the call's, or LEADER_CHECK_S with HA."""
        return min(timeout_s, LEADER_CHECK_S) if self._resolve is not None else timeout_s

    def _ready_socket(self, timeout_s: float, deadline: float) -> socket.socket:
        """The open connection, checked for a close by the master since the last call (then,
        and when there is none, a new one), with `timeout_s` as its send/recv timeout."""
        sock = self._sock
        if sock is not None and time.monotonic() - self._replied_at >= TRUST_IDLE_S and \
                not self._still_open(sock):
            self._disconnect()
            sock = None
        if sock is None:
            sock = self._sock = self._connect(timeout_s, deadline)
        if timeout_s != self._sock_timeout:  # kernel timeouts: no poll() per recv
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            _timeval(self._wait_slice(timeout_s)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))
            self._sock_timeout = timeout_s
        return sock

    def _still_open(self, sock: socket.socket) -> bool:
        """False when the master closed or reset the connection while we were idle (so a
        request was never sent on it and is safe to send on a new one). Late replies
        waiting on it are decoded and kept for `_wait` to skip."""
        try:
            data = sock.recv(RECV_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            self._frames += self._decoder.feed(data)
        except RemoteProtocolError:
            return False
        return True

    def _connect(self, timeout_s: float, deadline: float) -> socket.socket:
        while True:
            if self._closed:
                raise RpcError("RPC client is closed")
            remaining = deadline - time.monotonic()
            try:
                if self._resolve is not None:
                    self._host, self._port = self._resolve() or ("", 0)
                    if not self._port:
                        raise OSError("no leader in etcd yet")
                sock = socket.create_connection((self._host, self._port),
                                                timeout=max(0.001, self._wait_slice(remaining)))
                break
            except OSError as exc:
                if time.monotonic() + CONNECT_RETRY_S >= deadline:
                    raise RpcTimeout(f"master {self.address} is not reachable (no connection "
                                     f"within {timeout_s}s: {exc})") from None
                time.sleep(CONNECT_RETRY_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._token is not None:  # the token's proof; it never crosses the wire
            try:
                client_handshake(sock, self._token, max(0.001, deadline - time.monotonic()),
                                 self.address)
            except BaseException:
                sock.close()
                raise
        self._decoder = FrameDecoder()
        self._frames = []
        self._sock_timeout = -1.0
        return sock

    def _send(self, sock: socket.socket, frame: bytes, timeout_s: float) -> None:
        try:
            sock.sendall(frame)
        except (BlockingIOError, TimeoutError):
            raise RpcTimeout(f"master {self.address} did not take a request "
                             f"within {timeout_s}s") from None
        except OSError as exc:
            raise RpcError(f"connection to master {self.address} lost: {exc}") from None

    def _wait(self, sock: socket.socket, frame_id: int, timeout_s: float,
              deadline: float) -> ReplyHead:
        """The reply to `frame_id`. On RpcTimeout the connection stays (its late reply will
        be skipped); on any other RpcError it is closed."""
        try:
            return self._wait_on(sock, frame_id, timeout_s, deadline)
        except RpcTimeout:
            if self._leader_moved():  # a paused deposed leader: never wait on it again
                self._disconnect()
            raise
        except RpcError:
            self._disconnect()
            raise

    def _wait_on(self, sock: socket.socket, frame_id: int, timeout_s: float,
                 deadline: float) -> ReplyHead:
        while True:
            while self._frames:
                reply = self._decode(self._frames.pop(0))
                if reply.req_id == frame_id:
                    self._replied_at = time.monotonic()
                    return reply
                if reply.req_id == 0 and reply.status != 0:  # the master refused the connection
                    raise RpcError(f"master {self.address} refused the connection: "
                                   f"{_plain(reply.result)}")
                if self.on_late_reply is not None:
                    self.on_late_reply(Reply(reply.req_id, reply.status, _plain(reply.result)))
            if time.monotonic() > deadline:  # only late replies of earlier calls arrived
                raise RpcTimeout(f"master {self.address} did not answer within {timeout_s}s")
            try:
                self._frames = self._receive(sock, timeout_s)
            except RpcTimeout:
                if self._resolve is None or time.monotonic() > deadline:
                    raise
                if self._leader_moved():
                    raise _LeaderMoved() from None

    def _receive(self, sock: socket.socket, timeout_s: float) -> list[bytes]:
        try:
            data = recv_polling(sock, max(RECV_BYTES, self._decoder.pending_frame_bytes),
                                self._poll)
        except (BlockingIOError, TimeoutError):
            raise RpcTimeout(
                f"master {self.address} did not answer within {timeout_s}s") from None
        except OSError as exc:
            raise RpcError(f"connection to master {self.address} lost: {exc}") from None
        if not data:
            raise RpcError(f"master {self.address} closed the connection")
        try:
            return self._decoder.feed(data)
        except RemoteProtocolError as exc:
            raise RpcError(f"malformed reply from {self.address}: {exc}") from None

    def _leader_moved(self) -> bool:
        """With an etcd:// address: whether etcd names another leader than the one we
        are connected to."""
        if self._resolve is None:
            return False
        leader = self._resolve()
        return leader is not None and leader != (self._host, self._port)

    def _decode(self, frame: bytes) -> ReplyHead:
        try:
            return decode_reply_head(frame)
        except RemoteProtocolError as exc:
            raise RpcError(f"malformed reply from {self.address}: {exc}") from None

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._frames = []

    def close(self) -> None:
        """Closed for good, at once: a call in flight on another thread (a heartbeat to a
        master that is gone) is not waited for. Its connection is shut down and its
        connection attempts stop, so it ends with RpcError."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile, or never connected
                pass
        with self._lock:
            self._disconnect()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _plain(raw: Any) -> Any:
    """An undecoded result as plain msgpack values (an error message, a late reply)."""
    try:
        return decode_result(Msg, raw)
    except RemoteProtocolError:
        return "<undecodable>"
