"""The wire between the processes of one proxy (`kvpool proxy --workers N`): one Unix datagram
socket per process, `FOLDER/proxy-I.sock`, in a folder only this user can open (the parent
makes it with mode 0700). Each booking event of this process goes at once to every other
process's socket (serve/shared_bookings.py says what); what arrives is applied to this
process's view on its event loop. A peer that is down (no socket yet, or gone) misses what is
sent meanwhile: its heartbeat silence releases its bookings in the others' views, and its own
view starts from its own bookings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
from pathlib import Path

from kvpool.clock import Clock
from kvpool.serve.cluster import Booking, LiveCluster
from kvpool.serve.shared_bookings import HEARTBEAT_S, SharedBookings

MAX_DATAGRAM = 64 << 10


def peer_socket(folder: Path, index: int) -> Path:
    return folder / f"proxy-{index}.sock"


class PeerLink:
    """A BookingSink for the cluster: each event recorded by `shared` and sent at once."""

    def __init__(self, shared: SharedBookings, folder: Path, count: int, clock: Clock) -> None:
        self.shared, self.folder, self.count, self.clock = shared, folder, count, clock
        self.others = [str(peer_socket(folder, i)) for i in range(count) if i != shared.index]
        self.sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_unsent = 0
        """Datagrams a peer could not take (down, or its buffer full)."""

    @classmethod
    def attach(cls, cluster: LiveCluster, folder: Path, index: int, count: int,
               clock: Clock) -> PeerLink:
        """The link of process `index` of `count`, told of `cluster`'s own bookings."""
        link = cls(SharedBookings(cluster, index, random.getrandbits(48)), folder, count, clock)
        cluster.sink = link
        return link

    # -- the cluster's events -----------------------------------------------------------------

    def booked(self, b: Booking) -> None:
        self.shared.booked(b)
        self.flush()

    def prefill_done(self, b: Booking) -> None:
        self.shared.prefill_done(b)
        self.flush()

    def decode_started(self, b: Booking) -> None:
        self.shared.decode_started(b)
        self.flush()

    def decode_moved(self, b: Booking) -> None:
        self.shared.decode_moved(b)
        self.flush()

    def finished(self, b: Booking) -> None:
        self.shared.finished(b)
        self.flush()

    # -- sockets -------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind this process's socket and read it on the running loop; heartbeats from now."""
        path = peer_socket(self.folder, self.shared.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # this index's previous incarnation's
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.setblocking(False)
        self.sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._read)
        self._task = loop.create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None

    def flush(self) -> None:
        sock, out = self.sock, self.shared.outbox
        if sock is None:
            out.clear()  # not started: nobody to tell yet
            return
        for msg in out:
            for path in self.others:
                try:
                    sock.sendto(msg, path)
                except OSError:  # the peer is down or behind: its silence is handled there
                    self.num_unsent += 1
        out.clear()

    def _read(self) -> None:
        assert self.sock is not None
        now = self.clock.now()
        while True:
            try:
                raw = self.sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            self.shared.apply(raw, now)

    async def _beat(self) -> None:
        while True:
            self.shared.heartbeat()
            self.flush()
            self.shared.expire(self.clock.now())
            await asyncio.sleep(HEARTBEAT_S)
