"""Router: turns submitted requests into work for the local, shm and tcp transports.

Per target segment it looks up the descriptor once, then per request picks the route: a local
copy for our own segment, shm when the target range lies in a same-host peer's shared buffer
(protocol "auto"/"shm"), tcp frames otherwise ("auto"; with "shm" such a request fails). Failures found here (unregistered local memory,
unknown segment) fail only the requests concerned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvpool.errors import KvpoolError
from kvpool.transfer import batch as _batch
from kvpool.transfer.batch import DONE, Batch, OpCode, RequestState, RequestStatus, TransferRequest
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.memory import MemoryRegistry
from kvpool.transfer.peers import PeerDirectory
from kvpool.transfer.planner import Pieces, count_slices, fits_one_frame, plan_frames
from kvpool.transfer.protocol import Status
from kvpool.transfer.segment import SegmentDescriptor
from kvpool.transfer.shm import Checked, ShmItem, ShmPeer, ShmTransport, copy_one
from kvpool.transfer.tcp_client import PeerLink, PendingRead, failure_text
from kvpool.transfer.traffic import Traffic

_ADDR_LIMIT = 1 << 64
_NO_SHM = ("protocol 'shm' is forced, but the target range is not in a shared buffer of a live "
           "same-host peer (protocol 'auto' would use tcp)")


class Router:
    def __init__(self, config: TransferConfig, registry: MemoryRegistry, peers: PeerDirectory,
                 me: str) -> None:
        self._config = config
        self._registry = registry
        self._peers = peers
        self._me = me
        self._shm = ShmTransport()
        self._links: dict[str, PeerLink] = {}
        self._shm_peers: dict[str, ShmPeer] = {}
        self._lock = threading.Lock()
        self.traffic = Traffic()

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
            shm_peers, self._shm_peers = list(self._shm_peers.values()), {}
        for link in links:
            link.close()
        for peer in shm_peers:
            peer.close()
        self._shm.close()

    def dispatch(self, batch: Batch, requests: list[TransferRequest], inline: bool = False) -> None:
        """Start the requests. With `inline` (sync callers) the caller's thread does part of the
        work: a small shm copy, or the first tcp frame, instead of handing it to a thread."""
        slice_bytes = self._config.slice_bytes
        first = batch.add([count_slices(r.length, slice_bytes) for r in requests])
        groups: dict[tuple[str, OpCode], list[int]] = {}
        for offset, req in enumerate(requests):
            groups.setdefault((req.target, req.op), []).append(offset)
        for (target, op), offsets in groups.items():
            items = [(first + i, requests[i]) for i in offsets]
            try:
                self._dispatch_group(batch, op, target, items, inline)
            except Exception as exc:  # never leave a request PENDING behind an error
                batch.complete([index for index, _ in items], f"{target}: {exc!r}")

    def run_one(self, req: TransferRequest) -> RequestStatus | None:
        """Run one request to a peer in the calling thread, without a batch: the fixed cost of
        a batch, a plan and a frame object was half the time of a 4 KiB round trip
        (docs/perf.md). The same checks as `dispatch`, the same transports, the same wire. None
        when the request needs the general path: our own segment, several tcp slices, nothing
        cached about the peer yet, or any failure before the transport (so it is reported in
        the general path's words)."""
        one = self._one(req)
        if one is None or isinstance(one, RequestStatus):
            return one
        link, local = one
        self.traffic.add("tcp", req.target, 1, req.length)
        return _one_status(link.exchange(req.op, [req.target_addr], [req.length], [local],
                                         [req.fence]))

    def begin_read(self, req: TransferRequest) -> BegunRead | None:
        """A READ `run_one` would run, in two steps (`BegunRead`): over tcp its frame goes out
        now on an idle pooled connection, over shm it is copied now. None where `run_one`
        gives None, and over tcp when no idle connection to the peer is at hand."""
        one = self._one(req) if req.op == OpCode.READ else None
        if one is None:
            return None
        if isinstance(one, RequestStatus):  # copied over shm
            return BegunRead(None, one)
        link, local = one
        pending = link.begin_read(req.target_addr, req.length, local, req.fence)
        if pending is None:
            return None
        self.traffic.add("tcp", req.target, 1, req.length)
        if isinstance(pending, str):
            return BegunRead(None, RequestStatus(RequestState.FAILED, pending))
        return BegunRead(pending, None)

    def _one(self, req: TransferRequest) -> tuple[PeerLink, memoryview] | RequestStatus | None:
        """A request `run_one` may run: its peer's link and local view for tcp, or its status
        once copied over shm; None where it needs the general path."""
        if req.target == self._me or not (0 <= req.target_addr < _ADDR_LIMIT and
                                          0 < req.length < _ADDR_LIMIT and
                                          0 <= req.fence < _ADDR_LIMIT):
            return None
        descriptor = self._peers.cached(req.target)
        buf = self._registry.find(req.local_addr, req.length)
        if descriptor is None or buf is None or (req.op == OpCode.READ and buf.readonly):
            return None
        start = req.local_addr - buf.addr
        local = buf.view[start : start + req.length]
        shm_peer = self._shm_peer_for(req.target, descriptor) if self._config.protocol != "tcp" else None
        remote = shm_peer.resolve(req.target_addr, req.length) if shm_peer else None
        if remote is not None:
            self.traffic.add("shm", req.target, 1, req.length)
            reason = copy_one(req.op, (0, local, remote[0], remote[1], req.fence),
                              self._shm.pool)
            return DONE if reason is None else RequestStatus(RequestState.FAILED, reason)
        if self._config.protocol == "shm" or req.length > self._config.slice_bytes:
            return None
        return self._link(req.target, descriptor), local

    def run_frame(self, requests: list[TransferRequest],
                  on_done: Callable[[int], None] | None = None,
                  on_sent: Callable[[int], None] | None = None) -> list[RequestStatus] | None:
        """Run requests that travel as one tcp frame to one peer in the calling thread,
        without a batch, a plan or frame objects (a batch of 32 small objects spent more time
        in them than in its frame: docs/perf.md). The same checks, wire and hooks as
        `dispatch` with `inline`: `on_sent` as each read's bytes are in (a write's: once the
        frame is in the socket), `on_done` for each request that succeeded. None when the
        general path is needed: several peers or ops, our own segment, shm, a request the
        planner would slice or a second frame, nothing cached about the peer yet, or any
        request failing a check (so it is reported in the general path's words)."""
        op, target, protocol = requests[0].op, requests[0].target, self._config.protocol
        descriptor = self._peers.cached(target)
        if target == self._me or descriptor is None or protocol == "shm" \
                or (protocol != "tcp" and descriptor.same_host()):
            return None
        try:  # a field of the wrong type: the batch path fails that request, not the call
            lengths = [r.length for r in requests]
            views = self._frame_views(op, target, requests) \
                if fits_one_frame(lengths, self._config) else None
        except (TypeError, ValueError):
            return None
        if views is None:
            return None
        self.traffic.add("tcp", target, len(requests), sum(lengths))
        sent, arrived = _frame_hooks(op, on_sent, len(requests))
        outcome = self._link(target, descriptor).exchange(
            op, [r.target_addr for r in requests], lengths, views,
            [r.fence for r in requests], sent, arrived)
        if isinstance(outcome, str):
            return [RequestStatus(RequestState.FAILED, outcome)] * len(requests)
        out = [DONE if s == Status.OK else RequestStatus(RequestState.FAILED, failure_text(s))
               for s in outcome]
        if on_done is not None:
            for index, status in enumerate(out):
                if status is DONE:
                    _batch.notify_done(on_done, index)
        return out

    def _frame_views(self, op: OpCode, target: str,
                     requests: list[TransferRequest]) -> list[memoryview] | None:
        """The local view of each request, or None when any fails a check `dispatch` makes."""
        views: list[memoryview] = []
        for req in requests:
            view = self._view(req, op) if req.target == target and req.op == op else None
            if not isinstance(view, memoryview):
                return None
            views.append(view)
        return views

    def _dispatch_group(self, batch: Batch, op: OpCode, target: str,
                        items: list[tuple[int, TransferRequest]], inline: bool) -> None:
        if target == self._me:
            self._dispatch_local(batch, op, items, inline)
            return
        try:
            descriptor = self._peers.lookup(target)
        except KvpoolError as exc:
            batch.complete([index for index, _ in items], f"{target}: {exc}")
            return
        shm_peer = self._shm_peer_for(target, descriptor)
        shm_items: list[ShmItem] = []
        pieces = Pieces()
        checked: Checked = {}
        for index, req in items:
            local = self._local_view(batch, index, req, op)
            if local is None:
                continue
            remote = shm_peer.resolve(req.target_addr, req.length, checked) if shm_peer else None
            if remote is not None:
                shm_items.append((index, local, remote[0], remote[1], req.fence))
            elif self._config.protocol == "shm":
                batch.complete([index], f"{target}: {_NO_SHM}")
            else:
                pieces.add(index, req.target_addr, req.length, local, req.fence)
        if shm_items and shm_peer is not None:
            self.traffic.add("shm", target, len(shm_items), sum(i[1].nbytes for i in shm_items))
            self._shm.run(op, batch, shm_items, shm_peer, inline)
        if pieces.indices:
            self.traffic.add("tcp", target, len(pieces.indices), sum(pieces.lengths))
            link = self._link(target, descriptor)
            frames = plan_frames(op, batch, pieces, self._config, whole=inline)
            link.run_inline(frames) if inline else link.send(frames)

    def _dispatch_local(self, batch: Batch, op: OpCode, items: list[tuple[int, TransferRequest]],
                        inline: bool) -> None:
        copies: list[ShmItem] = []
        for index, req in items:
            local = self._local_view(batch, index, req, op)
            if local is None:
                continue
            target = self._registry.find(req.target_addr, req.length)
            if target is None or (op == OpCode.WRITE and target.readonly):
                batch.complete([index], "target range is not inside a writable registered buffer")
                continue
            start = req.target_addr - target.addr
            copies.append((index, local, target.view[start : start + req.length], target.fence, req.fence))
        if copies:
            self.traffic.add("local", self._me, len(copies), sum(c[1].nbytes for c in copies))
            self._shm.run(op, batch, copies, None, inline)

    def _local_view(self, batch: Batch, index: int, req: TransferRequest,
                    op: OpCode) -> memoryview | None:
        """The local side of `req`, or None after failing it (or completing it: empty)."""
        view = self._view(req, op)
        if isinstance(view, str):
            batch.complete([index], view)
            return None
        if req.length == 0:
            batch.complete([index], whole=True)
            return None
        return view

    def _view(self, req: TransferRequest, op: OpCode) -> memoryview | str:
        """The local side of `req`, or why it fails. The registry is asked for every request
        (it remembers the last buffer it found: a batch walks through one), so a region
        registered inside a larger buffer answers for itself."""
        if not (0 <= req.target_addr < _ADDR_LIMIT and 0 <= req.length < _ADDR_LIMIT
                and 0 <= req.fence < _ADDR_LIMIT):
            return f"invalid target address {req.target_addr}, length {req.length} " \
                   f"or fence {req.fence}"
        buf = self._registry.find(req.local_addr, req.length)
        if buf is None:
            return f"local range {req.local_addr:#x}+{req.length} is not registered"
        if op == OpCode.READ and buf.readonly:
            return "local buffer is read-only; cannot read into it"
        start = req.local_addr - buf.addr
        return buf.view[start : start + req.length]

    def _shm_peer_for(self, target: str, descriptor: SegmentDescriptor) -> ShmPeer | None:
        if self._config.protocol == "tcp" or not descriptor.same_host():
            return None
        peer = self._shm_peers.get(target)
        if peer is None or (peer.descriptor is not descriptor and peer.descriptor != descriptor):
            with self._lock:  # replaced only when the peer published a new descriptor
                peer = self._shm_peers.get(target)
                if peer is None or peer.descriptor != descriptor:
                    if peer is not None:
                        peer.close()  # copies in flight keep their mappings until they end
                    peer = self._shm_peers[target] = ShmPeer(descriptor, self._config.timeout_s)
        if not peer.watch.alive():
            self._peers.refresh(target)  # a restarted peer has new buffers (rate-limited lookup)
            return None
        return peer

    def _link(self, target: str, descriptor: SegmentDescriptor) -> PeerLink:
        link = self._links.get(target)
        if link is None:
            with self._lock:
                link = self._links.get(target)
                if link is None:
                    link = PeerLink(descriptor.host, descriptor.port, self._config, self._me)
                    self._links[target] = link
        return link


def _frame_hooks(op: OpCode, on_sent: Callable[[int], None] | None, count: int) -> tuple[
        Callable[[], None] | None, Callable[[int, int], None] | None]:
    """A frame's `sent` (a write) or `arrived` (a read) callback reporting its requests to
    `on_sent`, as a batch's frame would."""
    if on_sent is None:
        return None, None
    hook = on_sent

    def arrived(lo: int, hi: int) -> None:
        for index in range(lo, hi):
            _batch.notify_done(hook, index)
    if op == OpCode.WRITE:
        return lambda: arrived(0, count), None
    return None, arrived


class BegunRead:
    """A READ begun by `Router.begin_read`: over tcp its frame is out (`pending`), over shm
    it is done (`done`). `finish()` gives the request's status (taking a tcp reply);
    `abandon()` gives a tcp reply up (`PendingRead.abandon`). One of them, once."""

    __slots__ = ("_pending", "_done")

    def __init__(self, pending: PendingRead | None, done: RequestStatus | None) -> None:
        self._pending, self._done = pending, done

    @property
    def timed_out(self) -> bool:
        """The peer did not answer within the timeout (known once `finish` returned)."""
        return self._pending is not None and self._pending.timed_out

    def finish(self) -> RequestStatus:
        if self._pending is None:
            assert self._done is not None
            return self._done
        return _one_status(self._pending.finish())

    def abandon(self) -> None:
        if self._pending is not None:
            self._pending.abandon()


def _one_status(outcome: list[Status] | str) -> RequestStatus:
    """A one-request frame's outcome (`PeerLink.exchange`) as the request's status."""
    if isinstance(outcome, str):
        return RequestStatus(RequestState.FAILED, outcome)
    return DONE if outcome[0] == Status.OK else \
        RequestStatus(RequestState.FAILED, failure_text(outcome[0]))
