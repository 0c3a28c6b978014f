"""TransferEngine: one per process; registers memory and moves bytes between segments.

Life of a transfer (see docs/structure.md): submit -> resolve local buffer -> find the peer's
descriptor (cache, directory or handshake) -> route (local copy, shm, or tcp frames) -> transport
reports per-request outcomes to the batch -> status / wait.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

from kvpool.errors import (
    InvalidArgument,
    KvpoolError,
    MemoryRegistrationError,
    TransferError,
    TransferTimeout,
)
from kvpool.log import get_logger
from kvpool.metadata import MetadataBackend, connect_metadata
from kvpool.transfer.batch import (
    Batch,
    OpCode,
    RequestState,
    RequestStatus,
    TransferRequest,
    notify_done,
)
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.fence import Fence, check_fence
from kvpool.transfer.memory import (
    SHM_TAG_BITS,
    Buffer,
    MemoryRegistry,
    SharedMemoryArena,
    buffer_of,
    shm_prefix,
    view_at,
)
from kvpool.transfer.peers import PeerDirectory
from kvpool.transfer.protocol import FENCED_REASON
from kvpool.transfer.routing import BegunRead, Router
from kvpool.transfer.segment import SegmentDescriptor, ShmRegion, host_identity, segment_key
from kvpool.transfer.shm import copy_bytes
from kvpool.transfer.shm_sweep import sweep_stale_shm
from kvpool.transfer.tcp_server import TcpTarget
from kvpool.transfer.traffic import RouteCount

log = get_logger("transfer.engine")


class TransferEngine:
    """Usage: ``with TransferEngine(TransferConfig()) as te: ...``. Thread-safe."""

    def __init__(self, config: TransferConfig | None = None) -> None:
        self.config = config or TransferConfig()
        self.registry = MemoryRegistry()
        # a random tag, not id(self): an engine started again in this process could get the
        # old one's id, and its files the old names, which a peer still holding the old
        # descriptor would then map at the old addresses
        self._arena = SharedMemoryArena(shm_prefix(secrets.randbits(SHM_TAG_BITS)))
        self._batches: dict[int, Batch] = {}
        self._batch_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._backend: MetadataBackend | None = None
        self._target: TcpTarget | None = None
        self._router: Router | None = None
        self.segment_name = ""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> TransferEngine:
        """Listen, connect to the directory and publish the segment; on failure everything
        started so far is closed again before the error propagates."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> TransferEngine:
        sweep_stale_shm()
        self._target = TcpTarget(self.registry, self.config, lambda: self.descriptor().to_dict())
        self.segment_name = self._target.name
        self._backend = connect_metadata(self.config.metadata,
                                         timeout_s=self.config.connect_timeout_s,
                                         token=self.config.token or "")  # "": none, not $KVPOOL_TOKEN
        peers = PeerDirectory(self._backend, self.config, self.segment_name)
        self._router = Router(self.config, self.registry, peers, self.segment_name)
        self._target.start()
        self.publish()
        return self

    def close(self) -> None:
        if self._router is not None:
            self._router.close()
        for batch in list(self._batches.values()):
            batch.fail_open("transfer engine is closed")
        if self._backend is not None:  # first, while the port is ours: once the listener is
            try:                       # closed, a successor may bind it and publish
                self._backend.delete(segment_key(self.segment_name))
            except KvpoolError as exc:
                log.warning("could not unpublish %s: %s", self.segment_name, exc)
        if self._target is not None:
            self._target.close()
        if self._backend is not None:
            self._backend.close()
        self._arena.close()

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def descriptor(self) -> SegmentDescriptor:
        regions = tuple(ShmRegion(b.addr, b.length, b.shm_name)
                        for b in self.registry.buffers() if b.shm_name)
        return SegmentDescriptor(self.segment_name, self.config.host, self._port, host_identity(),
                                 os.getpid(), regions)

    @property
    def _port(self) -> int:
        if self._target is None:
            raise TransferError("transfer engine is not started")
        return self._target.port

    def publish(self) -> None:
        """Write this engine's segment descriptor to the directory (again): after a directory
        restart, say. Raises MetadataError when the directory cannot take it; a no-op with
        P2PHANDSHAKE (peers ask the engine itself)."""
        if self._backend is not None:
            self._backend.put(segment_key(self.segment_name), self.descriptor().to_json())

    # -- memory ----------------------------------------------------------------------------

    def register(self, obj: Any, fence: int = 0) -> Buffer:
        """Register a bytes-like object, numpy array, mmap or CPU tensor; kept alive while
        registered. A nonzero `fence` makes the region refuse requests planned against another
        fence (see `set_fence`)."""
        buf = buffer_of(obj)
        return self._add(Buffer(buf.addr, buf.length, buf.view, buf.readonly, owner=buf.owner,
                                fence=Fence(check_fence(fence))))

    def register_address(self, addr: int, length: int, fence: int = 0) -> Buffer:
        """Register raw memory the caller keeps alive until `unregister(addr)`."""
        return self._add(Buffer(addr, length, view_at(addr, length), fence=Fence(check_fence(fence))))

    def _add(self, buf: Buffer) -> Buffer:
        """Registering an already registered range again returns it; a nonzero fence given
        then replaces the region's fence (0 keeps it: remove a fence with set_fence)."""
        found = self.registry.add(buf)
        if found is not buf and buf.fence.value not in (0, found.fence.value):
            self._set_fence(found, buf.fence.value)
        return found

    def set_fence(self, addr: int, fence: int) -> None:
        """Change the fence of the region registered at `addr` (0 removes it).

        On return the new fence is in force on every route and no write admitted under the
        old fence is still copying into the region, in this process or (for managed buffers)
        in a same-host peer. Raises MemoryRegistrationError if no region starts at `addr`,
        InvalidArgument for a fence outside 0..2**64-1, and TransferTimeout when that cannot
        be had within 2 x timeout_s; `region.fence.value` then says which fence is in force:
        - the old one, for a managed buffer a same-host writer keeps locked (stopped between
          its fence check and the end of its copy): nothing was changed;
        - the new one otherwise, but a write admitted under the old fence (over tcp, or an
          own-segment copy) may still be copying.
        A region whose fence could not be set cleanly must not be handed out under the new
        fence; `renew_managed` gives a managed buffer that can.
        """
        self._set_fence(self.registry.at(addr), fence)

    def _set_fence(self, buf: Buffer, fence: int) -> None:
        check_fence(fence)
        timeout_s = self.config.timeout_s * 2
        self._arena.publish_fence(buf.addr, fence, timeout_s)
        buf.fence.set(fence, timeout_s)

    def renew_managed(self, buf: Buffer, fence: int) -> Buffer:
        """The managed buffer `buf` under a new `fence`, with no write admitted under the old
        fence still copying into it: `buf` itself when `set_fence` manages that, else (a
        writer stalled mid-copy past 2 x timeout_s) a fresh managed buffer of the same length
        under `fence`, published, with `buf` freed first, so a late write lands in memory that
        nobody reads. Contents are not kept either way. Raises what `allocate_managed` raises
        when there is no memory for the fresh buffer (`buf` is freed by then)."""
        try:
            self.set_fence(buf.addr, fence)
            return buf
        except TransferTimeout as exc:
            log.warning("cannot re-fence the managed buffer at %#x (%s); replacing it",
                        buf.addr, exc)
        self.free_managed(buf)
        return self.allocate_managed(buf.length, fence)

    def unregister(self, addr: int) -> None:
        """Stop serving the region registered at `addr`. On return no write admitted into it
        (over tcp, or an own-segment copy) is still copying, so the caller may reuse the
        memory; TransferTimeout if one still is after 2 x timeout_s (a writer stalled
        mid-frame: the memory must not be reused yet). Reads from it that started before
        may still be sending. MemoryRegistrationError when no region starts at `addr`, or
        when it is a managed buffer (same-host peers write those through the file: free it
        with `free_managed`)."""
        if self.registry.at(addr).shm_name is not None:
            raise MemoryRegistrationError(f"the buffer at {addr:#x} is a managed buffer: "
                                          "free it with free_managed, not unregister")
        self.registry.remove(addr).fence.retire(self.config.timeout_s * 2)

    def allocate_managed(self, length: int, fence: int = 0) -> Buffer:
        """Shared-memory buffer, registered and published so same-host peers can memcpy it;
        `fence` as in `register` (same-host writers read it from the file's header page)."""
        buf = self.registry.add(self._arena.allocate(length, check_fence(fence)))
        self.publish()
        return buf

    def free_managed(self, buf: Buffer | int) -> None:
        addr = buf if isinstance(buf, int) else buf.addr
        self.registry.remove(addr)
        self._arena.free(addr)
        self.publish()

    def copy_local(self, op: OpCode, local_addr: int, target_addr: int, length: int,
                   fence: int = 0) -> None:
        """Copy within this process between two registered ranges, in the calling thread: WRITE
        copies local -> target, READ target -> local (the own-segment route of a transfer,
        as a call that raises). Raises InvalidArgument for a negative length,
        MemoryRegistrationError when either range is not inside one registered buffer or the
        destination is read-only, TransferError when the target region's fence refuses
        `fence`. Unregistered memory is never touched."""
        if length < 0:
            raise InvalidArgument(f"length must be >= 0, got {length}")
        write = op == OpCode.WRITE
        _, local = self._registered(local_addr, length, not write, "local")
        target_buf, target = self._registered(target_addr, length, write, "target")
        token = target_buf.fence.enter(check_fence(fence), write)
        if token is None:
            raise TransferError(f"{target_addr:#x}+{length}: {FENCED_REASON}")
        try:
            if write:
                copy_bytes(target, local)
            else:
                copy_bytes(local, target)
        finally:
            target_buf.fence.leave(token)

    def _registered(self, addr: int, length: int, writable: bool, side: str) -> tuple[Buffer, memoryview]:
        """The registered buffer holding [addr, addr+length) and a view of that range."""
        buf = self.registry.find(addr, length) if 0 < addr < 1 << 64 else None
        if buf is None:
            raise MemoryRegistrationError(f"{side} range {addr:#x}+{length} is not inside a "
                                          "registered buffer; register it first")
        if writable and buf.readonly:
            raise MemoryRegistrationError(f"{side} range {addr:#x}+{length} is registered read-only")
        start = addr - buf.addr
        return buf, buf.view[start : start + length]

    # -- batches ---------------------------------------------------------------------------

    def allocate_batch(self, capacity: int) -> int:
        if capacity <= 0:
            raise InvalidArgument(f"batch capacity must be > 0, got {capacity}")
        batch_id = next(self._batch_ids)
        with self._lock:
            self._batches[batch_id] = Batch(capacity)
        return batch_id

    def submit(self, batch_id: int, requests: list[TransferRequest]) -> None:
        """Start the requests; outcomes appear in `status(batch_id)`. Never blocks on peers."""
        self._started_router().dispatch(self._batch(batch_id), requests)

    def status(self, batch_id: int) -> list[RequestStatus]:
        return self._batch(batch_id).status()

    def wait(self, batch_id: int, timeout_s: float | None = None) -> list[RequestStatus]:
        """Wait until every request finished; on timeout the unfinished ones are failed."""
        batch = self._batch(batch_id)
        return self._finish(batch, timeout_s)

    def _finish(self, batch: Batch, timeout_s: float | None) -> list[RequestStatus]:
        """Wait for `batch` (default 2 x timeout_s); requests unfinished by then are failed,
        once their frames have stopped moving bytes (Batch.give_up)."""
        limit = self.config.timeout_s * 2 if timeout_s is None else timeout_s
        self._settle(batch, batch.wait(limit), f"not finished within {limit:g}s")
        return batch.status()

    def _settle(self, batch: Batch, finished: bool, reason: str) -> None:
        """Before a batch's caller has its memory back (blocking): a batch not `finished` in
        time is failed with `reason`, and a failed one's frames are stopped."""
        stopped = batch.settle(self.config.timeout_s) if finished else \
            batch.give_up(reason, self.config.timeout_s)
        if not stopped:
            log.error("a frame of a failed batch still runs %gs after it was stopped: its "
                      "memory may still be written", self.config.timeout_s)

    def free_batch(self, batch_id: int) -> None:
        with self._lock:
            if self._batches.pop(batch_id, None) is None:
                raise InvalidArgument(f"unknown batch id {batch_id}")

    def _batch(self, batch_id: int) -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise InvalidArgument(f"unknown batch id {batch_id} (freed or never allocated)")
        return batch

    def traffic(self) -> dict[str, dict[str, RouteCount]]:
        """What this engine sent down each route so far: route ("local", "shm", "tcp") ->
        target segment -> requests and bytes (kvpool.transfer.traffic)."""
        return self._started_router().traffic.snapshot()

    def _started_router(self) -> Router:
        if self._router is None:
            raise TransferError("transfer engine is not started: use start() or a with-block")
        return self._router

    # -- sync and asyncio helpers ------------------------------------------------------------

    def transfer_sync(self, requests: list[TransferRequest], timeout_s: float | None = None,
                      on_done: Callable[[int], None] | None = None,
                      on_sent: Callable[[int], None] | None = None) -> list[RequestStatus]:
        """Run requests to completion; returns per-request status, never raises for peer
        failures. `on_done(index)`: called for each request that succeeded, as soon as it
        did, in the thread that moved its bytes (see Batch), before this returns.
        `on_sent(index)`: a write's bytes are all in a tcp socket, its answer not yet in, or
        a read's bytes are in while the rest of its frame is not (see Batch; it may not be
        called for a request, and never is on the one-request path). `timeout_s` bounds the
        wait for frames on worker threads; the frame the caller's thread runs itself (all of
        it for one request, or requests that make one frame) is bounded by `config.timeout_s`
        per read and write instead."""
        if not requests:
            return []
        router = self._router or self._started_router()
        if len(requests) == 1 and (status := router.run_one(requests[0])) is not None:
            if on_done is not None and status.ok:
                notify_done(on_done, 0)
            return [status]
        if len(requests) > 1 and (statuses := router.run_frame(requests, on_done, on_sent)):
            return statuses
        batch = Batch(len(requests), on_done, on_sent)
        router.dispatch(batch, requests, inline=True)
        return self._finish(batch, timeout_s)

    def begin_read(self, req: TransferRequest) -> BegunRead | None:
        """One READ in two steps, for a caller with other work to overlap with its round trip
        (`Router.begin_read`): over tcp its frame is sent now on an idle pooled connection
        and `finish()` takes the reply (or `abandon()` gives it up); over shm it is copied now.
        None when it takes the general path (`transfer_sync`): our own segment, a request to
        slice, a peer not yet known or without an idle connection, or not a READ."""
        return (self._router or self._started_router()).begin_read(req)

    async def async_transfer(self, requests: list[TransferRequest]) -> list[RequestStatus]:
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        batch = Batch(len(requests))
        self._started_router().dispatch(batch, requests)
        batch.on_finish(lambda: _call_soon(loop, done))
        try:
            await asyncio.wait_for(asyncio.shield(done), self.config.timeout_s * 2)
            finished = True
        except TimeoutError:
            finished = False
        if not finished or batch.failed:  # (off the loop: stopping frames waits for them)
            await loop.run_in_executor(None, self._settle, batch, finished,
                                       "not finished within the timeout")
        return batch.status()

    def write(self, target: str, local_addr: int, target_addr: int, length: int, fence: int = 0) -> None:
        self._raise_failed(self.transfer_sync(
            [TransferRequest(OpCode.WRITE, local_addr, length, target, target_addr, fence)]))

    def read(self, target: str, local_addr: int, target_addr: int, length: int, fence: int = 0) -> None:
        self._raise_failed(self.transfer_sync(
            [TransferRequest(OpCode.READ, local_addr, length, target, target_addr, fence)]))

    def batch_write(self, target: str, items: list[tuple[int, int, int]], fence: int = 0) -> None:
        """items: (local_addr, target_addr, length), all planned against `fence`. Raises
        TransferError if any failed (a stale fence included)."""
        self._raise_failed(self._run(OpCode.WRITE, target, items, fence))

    def batch_read(self, target: str, items: list[tuple[int, int, int]], fence: int = 0) -> None:
        self._raise_failed(self._run(OpCode.READ, target, items, fence))

    async def async_write(self, target: str, items: list[tuple[int, int, int]], fence: int = 0) -> None:
        self._raise_failed(await self.async_transfer(_requests(OpCode.WRITE, target, items, fence)))

    async def async_read(self, target: str, items: list[tuple[int, int, int]], fence: int = 0) -> None:
        self._raise_failed(await self.async_transfer(_requests(OpCode.READ, target, items, fence)))

    def _run(self, op: OpCode, target: str, items: list[tuple[int, int, int]],
             fence: int = 0) -> list[RequestStatus]:
        return self.transfer_sync(_requests(op, target, items, fence))

    @staticmethod
    def _raise_failed(statuses: list[RequestStatus]) -> None:
        if len(statuses) == 1 and statuses[0].state == RequestState.DONE:
            return
        failed = [(i, s.reason) for i, s in enumerate(statuses) if not s.ok]
        if failed:
            first, reason = failed[0]
            raise TransferError(f"{len(failed)} of {len(statuses)} requests failed; #{first}: {reason}")


def _requests(op: OpCode, target: str, items: list[tuple[int, int, int]],
              fence: int = 0) -> list[TransferRequest]:
    return [TransferRequest(op, local, length, target, remote, fence) for local, remote, length in items]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    if not loop.is_closed():  # the awaiting coroutine may be long gone
        loop.call_soon_threadsafe(_resolve, future)
