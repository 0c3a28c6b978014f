"""Bookings shared by the processes of one proxy (`kvpool proxy --workers N`), so that each
process's conductor sees the whole proxy's load on every worker, not its own share of it.

Each process books its own requests on its `LiveCluster` as one process does; every booking
event (booked, prefill done, decode started, finished) is also told to the other processes
(`SharedBookings.outbox`, sent by serve/peer_link.py), which book the same request on their
own view (`apply`): a remote `Booking` (`remote=True`) on the same workers by URL, with the
same predicted transfer and prefill seconds and the same tokens, queued behind what that
view has queued there (as the booking process queued it behind what its view had), its fetch
booked on the source's NIC, released by the same events. A message whose numbers are not
finite and non-negative, or that books an id the peer booked already, is counted and dropped.
So a request booked on one process queues on that prefill worker in every process's view, and
the decode load, the admission checks and early rejection count it everywhere. A decode leg
resumed on another worker moves the booking's decode load there in every view.

Messages (msgpack arrays; the first field is the kind, the second the sender's index and
incarnation):

    ["b", peer, inc, rid, prefill_url, decode_url, input_len, output_len, prefix_len,
     local_prefix_len, transfer_s, prefill_s, tbt_s,
     source_url | None]                                    booked (the source: where the
                                                           prefix is fetched from)
    ["p", peer, inc, rid]                                  its prefill ended
    ["d", peer, inc, rid]                                  its decode started
    ["m", peer, inc, rid, decode_url]                      its decode moved there (a
                                                           failed leg resumed)
    ["f", peer, inc, rid]                                  finished (or failed)
    ["h", peer, inc, [rid, ...]]                           heartbeat, every HEARTBEAT_S,
                                                           with the open bookings' ids

Datagrams to a busy process can be dropped (its socket's queue is short): a booking whose id a
heartbeat no longer lists is released here, so a lost "f" leaks nothing past the next beat (a
heartbeat lists at most HEARTBEAT_IDS ids; past that, none, and nothing is released by it).
A peer whose heartbeat has not come for SILENT_S, or that comes back as another incarnation
(it was restarted), has every booking it made released in this view (`expire`): a dead
process's requests are gone with it. A booking whose workers this process does not have in
rotation is not booked (it is released in that process's view, and the next poll here corrects
nothing: queues are predictions). Sans-I/O: time is the caller's `now`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpool.conductor import Accepted, DecodeChoice, PrefillChoice, RequestInfo
from kvpool.errors import InvalidArgument
from kvpool.log import get_logger
from kvpool.serve.cluster import Booking, LiveCluster

log = get_logger("serve.shared_bookings")
HEARTBEAT_S = 1.0
SILENT_S = 5.0
HEARTBEAT_IDS = 6000
"""Open bookings a heartbeat lists at most (a datagram of about 54 KiB, peer_link's bound)."""
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[Any])
REMOTE_IDS = 1 << 40
"""A remote request's id in this view: -(peer * REMOTE_IDS + its id there), never a local
one (those count up from 1)."""


@dataclass
class _Peer:
    incarnation: int
    last_heard_s: float
    bookings: dict[int, Booking] = field(default_factory=dict)


class SharedBookings:
    def __init__(self, cluster: LiveCluster, index: int, incarnation: int) -> None:
        self.cluster, self.index, self.incarnation = cluster, index, incarnation
        self.outbox: list[bytes] = []
        """Messages for every other process, in order (taken by the link)."""
        self.peers: dict[int, _Peer] = {}
        self.num_bad = 0
        """Messages that could not be read (malformed, or of an unknown kind)."""
        self._open: set[int] = set()
        """This process's bookings not finished yet (listed in its heartbeats)."""

    # -- this process's events ---------------------------------------------------------------

    def booked(self, b: Booking) -> None:
        self._open.add(b.req.request_id)
        c = b.decision.prefill
        source = None if c.source_id is None else self.cluster.prefill_urls[c.source_id]
        self._send("b", b.req.request_id, b.prefill.url, b.decode.url, b.req.input_len,
                   b.req.output_len, c.prefix_len, c.local_prefix_len, c.transfer_s,
                   c.prefill_s, b.decision.decode.tbt_s, source)

    def prefill_done(self, b: Booking) -> None:
        self._send("p", b.req.request_id)

    def decode_started(self, b: Booking) -> None:
        self._send("d", b.req.request_id)

    def decode_moved(self, b: Booking) -> None:
        self._send("m", b.req.request_id, b.decode.url)

    def finished(self, b: Booking) -> None:
        self._open.discard(b.req.request_id)
        self._send("f", b.req.request_id)

    def heartbeat(self) -> None:
        listed = sorted(self._open) if len(self._open) <= HEARTBEAT_IDS else None
        self.outbox.append(_ENCODER.encode(["h", self.index, self.incarnation, listed]))

    def _send(self, kind: str, *fields: Any) -> None:
        self.outbox.append(_ENCODER.encode([kind, self.index, self.incarnation, *fields]))

    # -- the others' events ------------------------------------------------------------------

    def apply(self, raw: bytes, now: float) -> None:
        """One message from another process; a malformed one is counted and dropped."""
        try:
            msg = _DECODER.decode(raw)
            kind, peer_index, incarnation = str(msg[0]), int(msg[1]), int(msg[2])
            if peer_index == self.index:
                raise InvalidArgument("a message from this process's own index")
            peer = self._peer(peer_index, incarnation, now)
            if kind == "b":
                self._book(peer, peer_index, msg[3:], now)
            elif kind in ("p", "d", "f"):
                self._event(peer, kind, int(msg[3]), now)
            elif kind == "m":
                self._moved(peer, int(msg[3]), str(msg[4]), now)
            elif kind == "h":
                if len(msg) > 3 and msg[3] is not None:
                    self._keep_only(peer, {int(rid) for rid in msg[3]}, now)
            else:
                raise InvalidArgument(f"unknown kind {kind!r}")
        except (msgspec.DecodeError, IndexError, TypeError, ValueError, OverflowError,
                InvalidArgument) as exc:
            self.num_bad += 1
            log.warning("a malformed message from a peer process: %s", exc)

    def _peer(self, index: int, incarnation: int, now: float) -> _Peer:
        peer = self.peers.get(index)
        if peer is not None and peer.incarnation != incarnation:
            self._release(index, peer, now, "was restarted")
            peer = None
        if peer is None:
            peer = self.peers[index] = _Peer(incarnation, now)
        peer.last_heard_s = now
        return peer

    def _book(self, peer: _Peer, peer_index: int, f: Sequence[Any], now: float) -> None:
        rid, prefill_url, decode_url = int(f[0]), str(f[1]), str(f[2])
        counts, seconds = [int(x) for x in f[3:7]], [float(x) for x in f[7:10]]
        if min(rid, *counts) < 0 or not all(0.0 <= x < math.inf for x in seconds):
            raise InvalidArgument(f"a booking's numbers out of range: {list(f[:10])}")
        if rid in peer.bookings:
            raise InvalidArgument(f"request {rid} booked twice")
        p, d = self.cluster.workers.get(prefill_url), self.cluster.workers.get(decode_url)
        if p is None or d is None or not (p.alive and d.alive) or p.prefill_load is None \
                or d.decode_load is None:
            return  # not in this view's rotation: nothing to queue it on
        p_id, d_id = p.prefill_load.instance_id, d.decode_load.instance_id  # alive: in view
        req = RequestInfo(-(peer_index * REMOTE_IDS + rid), counts[0], counts[1], ())
        queue_s = max(0.0, p.prefill_load.busy_until_s - now)  # behind what this view queued
        source = self._source(f)
        wait_s = 0.0 if source is None else \
            max(0.0, self.cluster.view.prefill[source].nic_busy_until_s - now)
        choice = PrefillChoice(p_id, counts[2], counts[3], source, queue_s, seconds[0],
                               seconds[1], wait_s)
        booking = self.cluster.book(req, Accepted(choice, DecodeChoice(d_id, seconds[2])), now,
                                    remote=True)
        peer.bookings[rid] = booking

    def _source(self, f: Sequence[Any]) -> int | None:
        """The booking's fetch source in this view (its NIC is booked too), if in rotation."""
        if len(f) < 11 or f[10] is None:
            return None
        w = self.cluster.workers.get(str(f[10]))
        return w.prefill_load.instance_id if w is not None and w.alive and \
            w.prefill_load is not None else None

    def _event(self, peer: _Peer, kind: str, rid: int, now: float) -> None:
        b = peer.bookings.get(rid)
        if b is None:
            return
        if kind == "p":
            self.cluster.prefill_done(b, now)
        elif kind == "d":
            self.cluster.decode_start(b, now)
        else:
            self.cluster.finish(b, now)
            del peer.bookings[rid]

    def _moved(self, peer: _Peer, rid: int, decode_url: str, now: float) -> None:
        """The peer's booking decodes on `decode_url` now; one this view cannot move there
        (the worker is not in its rotation) is released, as one booked there would not be."""
        b = peer.bookings.get(rid)
        if b is None:
            return
        to = self.cluster.workers.get(decode_url)
        if to is not None and to.alive and to.decode_load is not None:
            self.cluster.move_decode(b, to, now)
        if b.decode is not to:
            self.cluster.finish(b, now)
            del peer.bookings[rid]

    def _keep_only(self, peer: _Peer, open_ids: set[int], now: float) -> None:
        """Release the peer's bookings its heartbeat no longer lists (their "f" was lost)."""
        for rid in [rid for rid in peer.bookings if rid not in open_ids]:
            self.cluster.finish(peer.bookings.pop(rid), now)

    # -- silence -------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Release what peers silent for SILENT_S had booked."""
        for index, peer in list(self.peers.items()):
            if now - peer.last_heard_s >= SILENT_S:
                self._release(index, peer, now, f"has been silent for {SILENT_S:g} s")
                del self.peers[index]

    def _release(self, index: int, peer: _Peer, now: float, why: str) -> None:
        if peer.bookings:
            log.warning("proxy process %d %s: releasing its %d bookings", index, why,
                        len(peer.bookings))
        for b in peer.bookings.values():
            self.cluster.finish(b, now)
        peer.bookings.clear()

    def num_remote(self) -> int:
        return sum(len(p.bookings) for p in self.peers.values())
