"""Run an ASGI app with uvicorn in a background thread (admin HTTP of the master)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from kvpool.errors import StoreError
from kvpool.metadata.http_serving import HttpLimits, QuietServer, uvicorn_config


class HttpServerThread:
    """Raises StoreError when it cannot listen on host:port."""

    def __init__(self, app: Any, host: str, port: int, limits: HttpLimits | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise StoreError(f"admin HTTP cannot listen on {host}:{port}: "
                             f"{exc.strerror or exc}") from None
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        config = uvicorn_config(app, limits or HttpLimits())
        self._server = QuietServer(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]},
                                        name=f"kvpool-http-{self.port}", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise StoreError(f"HTTP server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving and close the socket (also when never started)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(5)
        self._sock.close()
