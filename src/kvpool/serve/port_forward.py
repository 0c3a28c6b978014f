"""A TCP port of this process relayed to a server it reaches another way: `kvpool up --hosts`
serves its proxy inside an emulated host's network namespace, and this forward makes it
reachable at --host:--port on the machine itself, as a container's published port is.

Each accepted connection gets its own upstream connection, made by the caller's `connect()`
(which may switch the calling thread into a namespace: kvpool.launch.netns.in_netns), and two
threads that copy bytes, one each way; an end that closes its sending side is passed on as a
half-close, so HTTP keep-alive, streamed responses and plain request/response all pass through
unchanged. A failed `connect()` closes the client's connection (it sees a reset, as from a
server that is down). `close()` stops accepting and closes every relayed connection.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from kvpool.log import get_logger

log = get_logger("serve.port_forward")

CHUNK_BYTES = 1 << 16


class PortForward:
    def __init__(self, host: str, port: int, connect: Callable[[], socket.socket]) -> None:
        """Listen on `host`:`port` (0: a free one; see `port`); OSError when it is taken."""
        self._connect = connect
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="port-forward", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = self._connect()
        except OSError as exc:
            log.warning("port forward: cannot reach the server (%s)", exc)
            client.close()
            return
        if not self._track(client, upstream):
            return
        back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        back.start()
        _pipe(client, upstream)
        back.join()
        self._untrack(client, upstream)

    def _track(self, *socks: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                for s in socks:
                    s.close()
                return False
            self._open.update(socks)
            return True

    def _untrack(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                self._open.discard(s)
                s.close()

    def close(self) -> None:
        """Stop accepting; close every relayed connection."""
        with self._lock:
            self._closed = True
            socks, self._open = list(self._open), set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
        except OSError:
            pass
        self._listener.close()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)

    def __enter__(self) -> PortForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy `src` to `dst` until `src` ends, then half-close `dst`'s sending side; after a
    reset or any other failure, shut both down (the other direction's copy ends too)."""
    how = socket.SHUT_WR
    try:
        while data := src.recv(CHUNK_BYTES):
            dst.sendall(data)
    except OSError:
        how = socket.SHUT_RDWR
    for s in (dst, src) if how == socket.SHUT_RDWR else (dst,):
        try:
            s.shutdown(how)
        except OSError:
            pass
