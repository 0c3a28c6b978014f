"""The machinery under StoreClient: transfer engine, master RPC, mounted segments,
heartbeats, and the write path (the read path is its ReadPath mixin, reads.py)."""

from __future__ import annotations

import os
import secrets
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.errors import (
    KvpoolError,
    MemoryRegistrationError,
    MetadataError,
    RpcError,
    RpcFailed,
    RpcTimeout,
    TransferError,
)
from kvpool.log import get_logger
from kvpool.store.client.batches import key_chunks, refusal_code
from kvpool.store.client.checksum import Hasher, HashOnArrival
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.early import Places
from kvpool.store.client.plan import Copy, Part, copies_for, parts_total, valid_parts
from kvpool.store.client.reads import ReadPath
from kvpool.store.client.reserved import RESERVE_MAX_BYTES, ReservedPuts
from kvpool.store.client.rpc import RpcClient
from kvpool.store.client.staging import StagingArea
from kvpool.store.client.types import ClientStats
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import (
    ErrorCode,
    PutResult,
    PutStartResult,
    ReplicaDesc,
    Tier,
)
from kvpool.store.wire.validate import valid_key
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

E = ErrorCode
log = get_logger("store.client")


def new_fence() -> int:
    """A fresh write fence for one mount: random, non-zero, 64 bits."""
    return secrets.randbits(64) or 1


_NO_SPACE = PutResult(E.NO_AVAILABLE_HANDLE)
_PUT_OK = PutResult(ErrorCode.OK)
_DEFAULT_CFG = ReplicateConfig()


class ClientBase(ReadPath):
    def __init__(self, config: ClientConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock
        self.engine = TransferEngine(TransferConfig(
            host=config.local_hostname, port=config.te_port, metadata=config.metadata,
            protocol=config.protocol, timeout_s=config.transfer_timeout_s,
            token=config.token, reply_poll_us=config.reply_poll_us,
            request_poll_us=config.request_poll_us)).start()
        try:
            self.endpoint: str = self.engine.segment_name
            self.host = self.endpoint.rsplit(":", 1)[0]
            self.stats = ClientStats()
            self.client_id = config.client_id or \
                f"{self.endpoint}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._rpc = RpcClient(config.master, self.client_id, config.rpc_timeout_s,
                                  config.token, poll_us=config.reply_poll_us)
            self._hb_rpc = RpcClient(config.master, self.client_id, config.rpc_timeout_s,
                                     config.token, on_late_reply=self._on_late_heartbeat)
            self._segments: dict[str, Any] = {}  # segment id -> managed Buffer
            self._forgotten = False
            """The master answered UNKNOWN_CLIENT (maybe late): mount everything again."""
            self._publish_due = False
            """Mounted again, but the segment descriptor is not yet published again."""
            self._staging = StagingArea(self.engine, config.local_buffer_size)
            self._hasher = Hasher()
            self._places = Places()
            self._reserved = ReservedPuts(self._call, self._run_copies, self._copies_to,
                                          config.write_checksums, clock, self._placed)
            self._reserved.enabled = config.reserved_puts
        except BaseException:
            self.engine.close()  # a bad master address must not leak the started engine
            raise
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                    name="kvpool-store-heartbeat")
        self._hb.start()
        if config.global_segment_size:
            try:
                self.mount(config.global_segment_size)
            except BaseException:
                self.close()
                raise

    # -- master RPC, segments, liveness ----------------------------------------------------

    def _call(self, msg: m.Msg) -> Any:
        """The result of `msg` (typed: `msg.Reply`), or RpcFailed with the code users see:
        RPC_TIMEOUT, the status of a reply that refused the whole request (a batch over the
        master's limit: INVALID_PARAMS), RPC_FAIL for a broken connection."""
        try:
            return self._rpc.call(msg)
        except RpcTimeout:
            raise RpcFailed(E.RPC_TIMEOUT) from None
        except RpcError as exc:
            log.warning("%s failed: %s", msg.op.name, exc)
            raise RpcFailed(refusal_code(exc.status)) from None

    def _call_keyed(self, keys: Sequence[str], make: Callable[[list[str], int, int], m.Msg],
                    refused: Callable[[ErrorCode], Any],
                    unpack: Callable[[Any], list[Any]] = list) -> list[Any]:
        """Per-key results over `keys`, one RPC per chunk of at most `rpc_batch_keys` keys
        and RPC_BATCH_KEY_BYTES of keys, so no request exceeds the master's batch or frame
        limit. `make(chunk_keys, lo, hi)` builds the request of keys[lo:hi] (slicing any
        per-key columns alike); `unpack` turns one result into its per-key items. The keys
        of a chunk whose call failed get `refused(code)`; the other chunks still run."""
        out: list[Any] = []
        for lo, hi in key_chunks(keys, self.config.rpc_batch_keys):
            try:
                out += unpack(self._call(make(list(keys[lo:hi]), lo, hi)))
            except RpcFailed as exc:
                out += [refused(exc.code)] * (hi - lo)
        return out

    def mount(self, size: int) -> str:
        """Contribute `size` bytes of shared memory to the pool; returns the segment id. The
        memory gets a fresh write fence, which the master hands out with every replica
        there; transfers planned against another fence are refused."""
        fence = new_fence()
        buf = self.engine.allocate_managed(size, fence=fence)
        try:
            reply = self._rpc.call(m.MountMsg(
                endpoint=self.endpoint, base_addr=buf.addr, size=size, tier=int(Tier.DRAM),
                fence=fence))
        except RpcError:
            self.engine.free_managed(buf)
            raise
        if reply.code != 0:
            self.engine.free_managed(buf)
            raise RpcError(f"master refused to mount {size} bytes: code {reply.code}")
        self._segments[reply.segment_id] = buf
        return str(reply.segment_id)

    def unmount(self, segment_id: str, timeout_s: float | None = None) -> ErrorCode:
        """Withdraw a segment from the pool (the master drops the objects on it) and free its
        memory. `timeout_s` bounds the master call (default: `rpc_timeout_s`); the memory is
        freed whatever the master answers (RPC_FAIL or RPC_TIMEOUT: the master drops the
        segment after client_ttl_s)."""
        buf = self._segments.pop(segment_id, None)
        if buf is None:
            return E.SEGMENT_NOT_FOUND
        try:
            code = ErrorCode(self._rpc.call(m.UnmountMsg(segment_id=segment_id),
                                            timeout_s=timeout_s))
        except RpcTimeout:
            code = E.RPC_TIMEOUT
        except RpcError:
            code = E.RPC_FAIL
        self._free_segment(segment_id, buf)
        return code

    def _free_segment(self, segment_id: str, buf: Any) -> None:
        try:
            self.engine.free_managed(buf)
        except MetadataError as exc:  # freed; only the directory could not be told
            log.warning("unmounted %s, but could not publish that: %s", segment_id, exc)

    @property
    def segment_ids(self) -> list[str]:
        return list(self._segments)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                if self._hb_rpc.call(m.HeartbeatMsg()) == E.UNKNOWN_CLIENT:
                    self._forgotten = True
            except RpcError as exc:
                log.debug("heartbeat failed: %s", exc)
            if self._forgotten and not self._stop.is_set():
                self._forgotten = not self._remount() if self._segments else False
            if self._publish_due and not self._forgotten:
                self._publish_due = not self._publish()
            self._revoke_reservations(self._hb_rpc, self._reserved.take_stale(), None)

    @staticmethod
    def _revoke_reservations(rpc: RpcClient, tokens: list[str],
                             timeout_s: float | None) -> None:
        """Best effort: reservations the master is not told about are discarded by it after
        put_discard_timeout_s."""
        if tokens:
            try:
                rpc.call(m.PutRevokeMsg(keys=tokens), timeout_s=timeout_s)
            except RpcError as exc:
                log.debug("could not give back %d reservations: %s", len(tokens), exc)

    def _on_late_heartbeat(self, reply: Any) -> None:
        """A heartbeat answered after its call timed out (the master stalled, then forgot
        us): UNKNOWN_CLIENT there means the same as on time."""
        if reply.status == 0 and reply.result == E.UNKNOWN_CLIENT:
            self._forgotten = True

    def _remount(self) -> bool:
        """Mount every segment again after the master forgot this client (it restarted, or
        declared us dead), and publish the segment descriptor again (a restarted master's
        embedded directory is empty). Each segment first gets a new fence, so writes
        planned against the old mount (or the old master) are refused from then on; a
        segment a stalled writer keeps from being re-fenced is replaced by fresh memory
        (`TransferEngine.renew_managed`). False when the master could not take it yet; the
        next heartbeat tries again."""
        for segment_id, old in list(self._segments.items()):
            log.warning("master forgot us; mounting %s again", segment_id)
            fence = new_fence()
            try:  # never mount under a fence the memory does not enforce
                buf = self.engine.renew_managed(old, fence)
            except KvpoolError as exc:  # no memory for a fresh buffer: the segment is gone
                log.warning("cannot re-fence or replace %s (%s); dropping it", segment_id, exc)
                del self._segments[segment_id]
                continue
            if buf is not old:
                self._segments[segment_id] = buf
            try:
                reply = self._hb_rpc.call(m.MountMsg(
                    endpoint=self.endpoint, base_addr=buf.addr, size=buf.length,
                    tier=int(Tier.DRAM), fence=fence))
            except RpcError as exc:
                log.warning("mounting %s again failed: %s", segment_id, exc)
                return False
            if reply.code != 0:
                log.warning("master refused to mount %s again: code %d", segment_id,
                            reply.code)
                return False
            if reply.segment_id != segment_id:
                self._segments[reply.segment_id] = self._segments.pop(segment_id)
        self._publish_due = True
        self.stats.add(remounts=1)
        return True

    def _publish(self) -> bool:
        """Publish our segment descriptor in the directory again; False (retried at the next
        heartbeat) while the directory cannot take it."""
        try:
            self.engine.publish()
        except KvpoolError as exc:
            log.warning("could not publish segment %s again: %s", self.endpoint, exc)
            return False
        return True

    def close(self) -> None:
        """Stop heartbeating, unmount every segment and release everything, within
        `close_timeout_s` plus the engine's own shutdown: once the master has failed to answer
        (it may be gone), the remaining segments are freed without asking it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._hb_rpc.close()  # a heartbeat waiting on a master that is gone ends now
        deadline = self.clock.now() + self.config.close_timeout_s
        self._hb.join(self.config.close_timeout_s)
        self._revoke_reservations(self._rpc, self._reserved.take_stale(0.0),
                                  max(0.001, deadline - self.clock.now()))
        master_answers = True
        for segment_id in list(self._segments):
            left = deadline - self.clock.now()
            if master_answers and left > 0:
                code = self.unmount(segment_id, timeout_s=left)
                master_answers = code not in (E.RPC_FAIL, E.RPC_TIMEOUT)
            else:
                self._free_segment(segment_id, self._segments.pop(segment_id))
        self._staging.close()
        self._hasher.close()
        self._rpc.close()
        self.engine.close()

    # -- data paths ------------------------------------------------------------------------

    def _own_buffer(self, addr: int, n: int) -> Any:
        for b in list(self._segments.values()):
            if b.addr <= addr and addr + n <= b.addr + b.length:
                return b
        return None

    def _registered(self, parts: Sequence[Part], writable: bool) -> bool:
        """Whether every part lies inside one buffer registered with the engine (writable,
        for reads). The engine refuses anything else, so such an item is the caller's
        INVALID_PARAMS on every route, found before a put starts."""
        find = self.engine.registry.find
        for addr, n in parts:
            buf = find(addr, n) if addr + n < 1 << 64 else None
            if buf is None or (writable and buf.readonly):
                return False
        return True

    def _copy_own(self, op: OpCode, copy: Copy) -> bool:
        """memcpy to or from our own segment through the engine's checked copy, admitted by the
        segment's fence like a peer's request (so a re-mount's set_fence waits for it). False
        for a stale replica (no longer mounted, or fenced), and for local memory unregistered
        since the caller checked it."""
        if self._own_buffer(copy.target_addr, copy.length) is None:
            return False
        try:
            self.engine.copy_local(op, copy.local_addr, copy.target_addr, copy.length,
                                   copy.fence)
        except (TransferError, MemoryRegistrationError):  # fenced, or unregistered meanwhile
            return False
        return True

    def _run_copies(self, op: OpCode, copies: dict[int, list[Copy]],
                    arrivals: HashOnArrival | None = None) -> set[int]:
        """Run every copy; returns the indices whose copies did not all succeed. With
        `arrivals`, objects are hashed as their transfers complete."""
        failed: set[int] = set()
        requests: list[TransferRequest] = []
        owners: list[int] = []
        own = self.endpoint
        for idx, items in copies.items():
            for copy in items:
                if copy.target == own:
                    if not self._copy_own(op, copy):
                        failed.add(idx)      # a stale replica: never touch it
                else:
                    requests.append(copy.request(op))
                    owners.append(idx)
        if requests:
            if arrivals is not None:
                arrivals.expect(owners)
            statuses = self.engine.transfer_sync(
                requests, on_done=arrivals.request_done if arrivals is not None else None,
                on_sent=arrivals.request_sent if arrivals is not None else None)
            for idx, status in zip(owners, statuses, strict=True):
                if not status.ok:
                    failed.add(idx)
        return failed

    def _write(self, keys: Sequence[str], parts: Sequence[Sequence[Part]],
               cfg: ReplicateConfig, upsert: bool) -> list[PutResult]:
        """Two-phase put of each key from its local parts: start, write, end or revoke."""
        if upsert:  # their places move (a single key's new one is kept once it is published)
            self._places.forget(keys)
        results: list[PutResult | None] = [None] * len(keys)
        todo = []
        for i, (key, p) in enumerate(zip(keys, parts, strict=True)):
            if valid_key(key) and valid_parts(p) and self._registered(p, writable=False):
                todo.append(i)
            else:
                results[i] = PutResult(E.INVALID_PARAMS)
        if todo:
            try:
                if not self._write_reserved(todo, keys, parts, cfg, upsert, results):
                    self._write_valid(todo, keys, parts, cfg, upsert, results)
                full = [i for i in todo if results[i] == _NO_SPACE]
                held = self._reserved.take_stale(0.0) if full else []
                if held:  # this client's own reservations hold space: give it back, try again
                    self._revoke_reservations(self._rpc, held, None)
                    for i in full:
                        results[i] = None
                    self._write_valid(full, keys, parts, cfg, upsert, results)
            except RpcFailed as exc:
                results = [r or PutResult(exc.code) for r in results]
        return [r or PutResult(E.RPC_FAIL) for r in results]

    def _write_reserved(self, todo: list[int], keys: Sequence[str],
                        parts: Sequence[Sequence[Part]], cfg: ReplicateConfig, upsert: bool,
                        results: list[PutResult | None]) -> bool:
        """A single-key put through a reservation (client/reserved.py); False when it
        takes the two-phase path instead."""
        if len(todo) != 1 or not self._reserved.enabled or cfg != _DEFAULT_CFG:
            return False
        i = todo[0]
        size = parts_total(parts[i])
        done = self._reserved.put(keys[i], parts[i], size, upsert) \
            if size <= RESERVE_MAX_BYTES else None
        results[i] = done
        return done is not None

    def _write_valid(self, todo: list[int], keys: Sequence[str], parts: Sequence[Sequence[Part]],
                     cfg: ReplicateConfig, upsert: bool, results: list[PutResult | None]) -> None:
        sizes = [parts_total(parts[i]) for i in todo]
        arrivals = HashOnArrival({i: (parts[i], n) for i, n in zip(todo, sizes, strict=True)}
                                 ) if self.config.write_checksums else None
        self._start_copy_end(todo, keys, parts, sizes, cfg, upsert, results, arrivals)

    def _start_copy_end(self, todo: list[int], keys: Sequence[str],
                        parts: Sequence[Sequence[Part]], sizes: list[int], cfg: ReplicateConfig,
                        upsert: bool, results: list[PutResult | None],
                        arrivals: HashOnArrival | None) -> None:
        """PUT_START, the copies, then PUT_END with the checksums (each object hashed as its
        copies complete)."""
        preferred = ([cfg.preferred_segment] if cfg.preferred_segment else []) \
            + list(cfg.preferred_segments)
        started = self._call_keyed(
            [keys[i] for i in todo],
            lambda chunk, lo, hi: m.PutStartMsg(
                keys=chunk, sizes=sizes[lo:hi], replica_num=cfg.replica_num,
                hard_pin=cfg.with_hard_pin, soft_pin=cfg.with_soft_pin, preferred=preferred,
                upsert=upsert),
            PutStartResult)
        copies: dict[int, list[Copy]] = {}
        placed: dict[int, tuple[ReplicaDesc, ...]] = {}
        for i, size, (code, replicas) in zip(todo, sizes, started, strict=True):
            if code == E.OBJECT_ALREADY_EXISTS and not upsert:
                results[i] = PutResult(E.OK, already_existed=True)
            elif code != 0:
                results[i] = PutResult(code)
            else:
                copies[i] = self._copies_to(replicas, parts[i], size)
                placed[i] = replicas
        failed = self._run_copies(OpCode.WRITE, copies, arrivals)
        ok = [i for i in copies if i not in failed]
        if failed:
            for i in failed:
                results[i] = PutResult(E.TRANSFER_FAIL)
            self._revoke([keys[i] for i in failed])
        if ok:
            sum_of = arrivals.complete(ok, self._hasher) if arrivals else {}
            sums = [sum_of.get(i) for i in ok]
            ended = self._call_keyed(
                [keys[i] for i in ok],
                lambda chunk, lo, hi: m.PutEndMsg(keys=chunk, checksums=sums[lo:hi]),
                lambda code: code)
            for i, code in zip(ok, ended, strict=True):
                results[i] = _PUT_OK if code == 0 else PutResult(code)
            if len(keys) == 1 and results[ok[0]] is _PUT_OK:
                self._placed(keys[0], sizes[0], sums[0], placed[ok[0]])

    @staticmethod
    def _copies_to(replicas: Sequence[ReplicaDesc], parts: Sequence[Part],
                   size: int) -> list[Copy]:
        """The copies writing `size` object bytes from `parts` to every replica of a
        PUT_START answer."""
        if len(replicas) == 1:  # the common case
            return copies_for(parts, replicas[0], size)
        return [c for r in replicas for c in copies_for(parts, r, size)]

    def _revoke(self, keys: list[str]) -> None:
        """Give up puts whose copies failed. Best effort: if the master cannot be told, it
        discards them after put_discard_timeout_s; the puts that were written still end."""
        codes = self._call_keyed(keys, lambda chunk, lo, hi: m.PutRevokeMsg(keys=chunk),
                                 RpcFailed)
        failed = [c for c in codes if isinstance(c, RpcFailed)]
        if failed:
            log.warning("could not revoke %d failed puts (%s); the master will discard them",
                        len(failed), failed[0].code.name)
