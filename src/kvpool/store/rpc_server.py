"""The master's RPC driver: one thread, one zmq ROUTER socket, the sans-I/O service inside.

Accepts DEALER clients ([identity, frame]) and REQ clients ([identity, b"", frame]). Between
requests, and at least every `tick_interval_s`, it runs the core's timeouts. The core is
guarded by `lock` so the admin HTTP server can read it from its own thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from kvpool.log import get_logger
from kvpool.store.protocol import MAX_FRAME_BYTES
from kvpool.store.service import MasterService

log = get_logger("store.rpc")


class RpcServer:
    def __init__(self, service: MasterService, host: str, port: int,
                 lock: threading.Lock, tick_interval_s: float = 0.1) -> None:
        self.service = service
        self.lock = lock
        self.tick_interval_s = tick_interval_s
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-master-rpc", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)

    def _run(self) -> None:
        # A blocking recv with a timeout: one call per message, and a tick when idle.
        self._sock.setsockopt(zmq.RCVTIMEO, max(1, int(self.tick_interval_s * 1000)))
        next_tick = time.monotonic()
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart(copy=True)
            except zmq.Again:
                frames = None
            except zmq.ZMQError as exc:  # a message over MAXMSGSIZE drops the peer, not us
                log.warning("receive failed: %s", exc)
                frames = None
            if frames is not None and len(frames) >= 2:
                self._reply(frames)
            if time.monotonic() >= next_tick:
                with self.lock:
                    self.service.core.tick()
                next_tick = time.monotonic() + self.tick_interval_s

    def _reply(self, frames: list[bytes]) -> None:
        with self.lock:
            reply = self.service.handle(frames[-1])
        try:
            self._sock.send_multipart([*frames[:-1], reply], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer went away; nothing to do
            log.debug("reply dropped: %s", exc)
