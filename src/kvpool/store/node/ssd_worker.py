"""The store node's disk-tier driver: mounts the disk at the master, registers the files
found there, then polls the master for tasks and runs them one at a time, in order.

One thread, its own master connection (under the node's client id), never on the put path:
the master hands out work (tiering.py), this loop does the disk I/O. Every byte it moves is
checked: an offload hashes the DRAM bytes against the object's checksum before writing them
(a range overwritten meanwhile is not written to disk), a load verifies the file before
copying it into DRAM, and the reader verifies again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
from dataclasses import dataclass

import numpy as np
import xxhash

from kvpool.errors import ConfigError, KvpoolError, RpcError
from kvpool.log import get_logger
from kvpool.store.client.rpc import RpcClient
from kvpool.store.client.store_client import StoreClient
from kvpool.store.node.ssd import SsdStore
from kvpool.store.wire import messages as m
from kvpool.store.wire.codes import ErrorCode
from kvpool.transfer import OpCode, TransferRequest

log = get_logger("store.ssd_worker")
E = ErrorCode
OFFLOAD, LOAD, DELETE = 1, 2, 3   # task kinds (store/master/tier_tasks.py)
DONE, FAILED, FILE_BAD = 0, 1, 2  # task outcomes
REGISTER_BATCH = 1024
DEFAULT_PROMOTE_AFTER = 2


@dataclass(frozen=True)
class SsdConfig:
    root: str
    """Directory of the object files (created if missing; one node per directory)."""
    size_bytes: int
    """Disk space the master may fill (object bytes; each file adds ~48 bytes + the key)."""
    promote_after: int = DEFAULT_PROMOTE_AFTER
    """Reads of an object on disk after which its loaded copy stays in DRAM (1: always).
    With 2, a single scan over cold data does not push hot objects out of DRAM."""
    fsync: bool = False
    """fsync each file before its rename and the directory after (survive power loss)."""
    poll_s: float = 0.01
    """Wait between task polls when there has been nothing to do for `busy_linger_s`."""
    busy_poll_s: float = 0.001
    """Wait between task polls within `busy_linger_s` of the last task (reads come in
    bursts: a get_batch's loads arrive one lookup after another)."""
    busy_linger_s: float = 0.25

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ConfigError(f"--ssd-size must be > 0, got {self.size_bytes}")
        if not 1 <= self.promote_after <= 1 << 20:
            raise ConfigError(f"--ssd-promote-after must be >= 1, got {self.promote_after}")
        if not 0 < self.poll_s <= 10:
            raise ConfigError(f"poll_s must be in (0, 10], got {self.poll_s}")
        if not 0 < self.busy_poll_s <= self.poll_s or not 0 <= self.busy_linger_s <= 60:
            raise ConfigError(f"need 0 < busy_poll_s <= poll_s and busy_linger_s in [0, 60], "
                              f"got {self.busy_poll_s}, {self.busy_linger_s}")


class SsdWorker:
    def __init__(self, client: StoreClient, config: SsdConfig) -> None:
        self.client = client
        self.config = config
        self.store = SsdStore(config.root, config.fsync)
        self._lock_fd = _lock_dir(config.root)
        scan = self.store.scan()
        log.info("disk tier %s: %d objects, %d bad files discarded", config.root,
                 len(scan.entries), scan.num_discarded)
        room = shutil.disk_usage(config.root).free + self.store.used_bytes
        if room < config.size_bytes:  # offloads will fail (and objects be dropped) early
            log.warning("--ssd-size %d exceeds the %d bytes %s can hold", config.size_bytes,
                        room, config.root)
        cfg = client.config
        self._rpc = RpcClient(cfg.master, client.client_id, cfg.rpc_timeout_s, cfg.token)
        self.segment_id: str | None = None
        self._outcomes: list[tuple[int, int]] = []
        """Outcomes of the last batch, sent with the next poll."""
        self._scratch: np.ndarray | None = None
        self._scratch_addr = 0

    def run(self, stop: threading.Event) -> None:
        cfg, last_busy = self.config, -1e9
        while not stop.is_set():
            try:
                busy = self._attach() if self.segment_id is None else self._poll()
            except Exception as exc:  # a bug must not end the disk tier silently: say it, go on
                if isinstance(exc, RpcError | KvpoolError):
                    log.warning("disk tier: %s", exc)
                else:
                    log.exception("disk tier: unexpected failure; polling again in 1 s")
                busy = False
                stop.wait(1.0)
            now = self.client.clock.now()
            if busy:
                last_busy = now
            else:
                stop.wait(cfg.busy_poll_s if now - last_busy < cfg.busy_linger_s
                          else cfg.poll_s)
        self._flush()

    def _flush(self) -> None:
        """Report outcomes not sent yet (best effort: unreported tasks are handed out
        again after redeliver_s, and redoing one is harmless)."""
        if self._outcomes and self.segment_id is not None:
            try:
                self._rpc.call(m.NodeReportMsg(segment_id=self.segment_id,
                                               outcomes=self._outcomes))
                self._outcomes = []
            except (RpcError, KvpoolError) as exc:
                log.warning("disk tier: last outcomes not reported: %s", exc)

    def close(self) -> None:
        self._rpc.close()
        if self._scratch is not None:
            self.client.engine.unregister(self._scratch_addr)
            self._scratch = None
        os.close(self._lock_fd)

    # -- attach and register -------------------------------------------------------------

    def _attach(self) -> bool:
        """Mount the disk and register every file; False while the node's DRAM segment is
        not mounted again yet (after the master forgot us, that goes first)."""
        if self._rpc.call(m.HeartbeatMsg()) == E.UNKNOWN_CLIENT:
            self.client._forgotten = True  # the heartbeat thread mounts DRAM again
        if self.client._forgotten:
            return False
        mounted = self._rpc.call(m.SsdMountMsg(
            endpoint=self.client.endpoint, size=self.config.size_bytes,
            promote_after=self.config.promote_after))
        code, segment_id = mounted.code, mounted.segment_id
        if code != E.OK:
            raise RpcError(f"master refused the disk tier: {ErrorCode(code).name}")
        entries = list(self.store.entries.values())
        refused = 0
        for lo in range(0, len(entries), REGISTER_BATCH):
            chunk = entries[lo:lo + REGISTER_BATCH]
            codes = self._rpc.call(m.SsdRegisterMsg(
                segment_id=segment_id, keys=[e.key for e in chunk],
                sizes=[e.size for e in chunk], checksums=[e.checksum for e in chunk],
                gens=[e.gen for e in chunk]))
            for entry, c in zip(chunk, codes, strict=True):
                if c != E.OK:
                    refused += 1
                    self.store.delete(entry.key, entry.gen)
        self.segment_id = str(segment_id)
        log.info("disk tier mounted as %s: %d objects registered, %d refused", segment_id,
                 len(entries) - refused, refused)
        return True

    # -- tasks ---------------------------------------------------------------------------

    def _poll(self) -> bool:
        segment_id = self.segment_id
        assert segment_id is not None, "polled before the disk was attached"
        due = self._rpc.call(m.NodeTasksMsg(segment_id=segment_id, outcomes=self._outcomes))
        self._outcomes = []  # the master has them (on an error they go with the next poll)
        code, tasks = due.code, due.tasks
        if code != E.OK:
            log.warning("master does not know our disk tier (%s); mounting it again",
                        ErrorCode(code).name)
            self.segment_id = None
            return True
        loads = [(t.task_id, self._run(t)) for t in tasks if t.kind == LOAD]
        others = [t for t in tasks if t.kind != LOAD]
        if loads and others:  # readers wait for loads: report them before the rest
            self._rpc.call(m.NodeReportMsg(segment_id=segment_id, outcomes=loads))
            loads = []
        self._outcomes = loads + [(t.task_id, self._run(t)) for t in others]
        return bool(tasks)  # busy: the next poll, at once, carries the outcomes

    def _run(self, task: m.NodeTask) -> int:
        _, kind, key, endpoint, addr, size, checksum, gen, fence = task
        try:
            if kind == OFFLOAD:
                return self._offload(key, addr, size, checksum, gen, fence)
            if kind == LOAD:
                return self._load(key, endpoint, addr, size, checksum, gen, fence)
            if kind == DELETE:
                self.store.delete(key, gen)
                return DONE
        except (OSError, KvpoolError) as exc:
            log.warning("disk task %d on %r failed: %s", kind, key, exc)
        return FAILED

    def _offload(self, key: str, addr: int, size: int, checksum: int | None, gen: int,
                 fence: int) -> int:
        held = self.store.entries.get(key)
        if held is not None and held.gen != gen:
            # another generation's file holds the key: the master orders a file's DELETE
            # before a new offload of its key, so this offload is older than that file (a
            # task handed out again after its reply was lost): replacing the file would
            # lose the newer copy the master counts on
            log.warning("offload of %r (generation %x) refused: the file holds generation %x",
                        key, gen, held.gen)
            return FAILED
        local, view = self._buffer(size)
        self.client.engine.copy_local(OpCode.READ, local, addr, size, fence)
        actual = xxhash.xxh3_64_intdigest(view)
        if checksum is not None and actual != checksum:
            log.warning("DRAM copy of %r does not match its checksum; not offloaded", key)
            return FAILED
        self.store.write(key, view, actual, gen)
        return DONE

    def _load(self, key: str, endpoint: str, addr: int, size: int, checksum: int | None,
              gen: int, fence: int) -> int:
        local, view = self._buffer(size)
        entry = self.store.entries.get(key)
        if entry is None or (checksum is not None and entry.checksum != checksum) \
                or not self.store.read_into(key, gen, view):
            return FILE_BAD
        engine = self.client.engine
        if endpoint == self.client.endpoint:
            engine.copy_local(OpCode.WRITE, local, addr, size, fence)
            return DONE
        status = engine.transfer_sync([TransferRequest(OpCode.WRITE, local, size, endpoint,
                                                       addr, fence)])[0]
        return DONE if status.ok else FAILED

    def _buffer(self, size: int) -> tuple[int, memoryview]:
        """A registered scratch buffer of at least `size` bytes (grown, never shrunk)."""
        if self._scratch is None or len(self._scratch) < size:
            if self._scratch is not None:
                self.client.engine.unregister(self._scratch_addr)
            self._scratch = np.empty(max(size, 1 << 20), dtype=np.uint8)
            self._scratch_addr = self.client.engine.register(self._scratch).addr
        return self._scratch_addr, self._scratch.data[:size]


def _lock_dir(root: str) -> int:
    """An exclusive lock on `root` for this process (two nodes on one directory would
    delete each other's files)."""
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ConfigError(f"disk tier directory {root} is in use by another process") from None
    return fd
