"""A blocking RPC client of the master: one zmq DEALER socket, one call in flight.

Replies carry the request id, so a late reply to a call that already timed out is skipped.
Thread-safe (calls are serialized); give each busy thread its own client for parallelism.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import zmq

from kvpool.errors import RemoteProtocolError, RpcError, RpcTimeout
from kvpool.store.protocol import Op, decode_reply, encode_request


def parse_address(address: str, default_port: int = 50051) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RpcError(f"bad master address {address!r}: expected HOST:PORT")
    return host, int(port)


class RpcClient:
    def __init__(self, address: str, client_id: str, timeout_s: float = 5.0) -> None:
        host, port = parse_address(address)
        self.address = f"{host}:{port}"
        self.client_id = client_id
        self.timeout_s = timeout_s
        ctx: Any = zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing while the master is unreachable: a send then times out instead of
        # piling up stale requests (or blocking forever at the high-water mark).
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sndtimeo = -1
        self._sock.connect(f"tcp://{host}:{port}")
        self._rcvtimeo = -1
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def call(self, op: Op, *args: Any, timeout_s: float | None = None) -> Any:
        """The result of `op`; RpcTimeout when no reply comes in time, RpcError when the
        master refuses the request (the message says why)."""
        frame_id = next(self._ids)
        frame = encode_request(op, frame_id, self.client_id, *args)
        with self._lock:
            if self._closed:
                raise RpcError("RPC client is closed")
            timeout = timeout_s if timeout_s is not None else self.timeout_s
            self._send(frame, timeout)
            reply = self._wait(frame_id, timeout)
        if reply.status != 0:
            raise RpcError(f"master refused {op.name} (code {reply.status}): {reply.result}")
        return reply.result

    def _send(self, frame: bytes, timeout_s: float) -> None:
        timeout_ms = max(1, int(timeout_s * 1000))
        if timeout_ms != self._sndtimeo:
            self._sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            self._sndtimeo = timeout_ms
        try:
            self._sock.send(frame, copy=len(frame) < 65536)
        except zmq.Again:
            raise RpcTimeout(f"master {self.address} is not reachable "
                             f"(no connection within {timeout_s}s)") from None

    def _wait(self, frame_id: int, timeout_s: float) -> Any:
        timeout_ms = max(1, int(timeout_s * 1000))
        if timeout_ms != self._rcvtimeo:  # a blocking recv with a timeout: no poller per call
            self._sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo = timeout_ms
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                frame = self._sock.recv()
            except zmq.Again:
                raise RpcTimeout(
                    f"master {self.address} did not answer within {timeout_s}s") from None
            try:
                reply = decode_reply(frame)
            except RemoteProtocolError as exc:
                raise RpcError(f"malformed reply from {self.address}: {exc}") from None
            if reply.req_id == frame_id:
                return reply
            if time.monotonic() > deadline:  # only late replies of earlier calls arrived
                raise RpcTimeout(f"master {self.address} did not answer within {timeout_s}s")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close(0)

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
