"""The workload of the fault benchmark and the fault tests: objects whose bytes derive from
their key (`content`), a ledger of acknowledged objects that checks every byte read back, and a
put load on a thread. Their processes (etcd, masters, store nodes, HA pairs) are
kvpool.launch's (etcd, store)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.launch.wait import wait_for
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E


def content(key: str, size: int) -> bytes:
    """The bytes stored under `key`: derived from the key alone, so any reader can check them."""
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // 64 + 1))[:size]


def tally_reads(store: Any, keys: list[str], size: int) -> dict[str, Any]:
    """Read each of `keys` with `store.get`: the count of each result code, and how many
    reads were OK but not `content(key, size)` (must be 0)."""
    codes: dict[str, int] = {}
    wrong = 0
    for key in keys:
        got = store.get(key)
        codes[got.code.name] = codes.get(got.code.name, 0) + 1
        wrong += bool(got.ok and got.data != content(key, size))
    return {"codes": codes, "wrong": wrong}


@dataclass
class Ledger:
    """Objects whose put was acknowledged, and every outcome seen on the way."""

    prefix: str
    acked: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    wrong_bytes: int = 0
    next_index: int = 0

    def note_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def put_one(self, store: StoreClient, replicas: int = 1) -> bool:
        """Put a fresh key and read it back; True when the put was acknowledged."""
        key = f"{self.prefix}-{self.next_index}"
        size = 1000 + (self.next_index % 64) * 97
        self.next_index += 1
        res = store.put(key, content(key, size), ReplicateConfig(replica_num=replicas))
        if not res.ok:
            self.note_error(f"put:{res.code.name}")
            return False
        self.acked[key] = size
        got = store.get(key)
        if got.ok and got.data != content(key, size):
            self.wrong_bytes += 1
        elif not got.ok:
            self.note_error(f"get:{got.code.name}")
        return True

    def get_one(self, store: StoreClient, n: int) -> bool:
        """Read the n-th acknowledged object (modulo their number) and check its bytes."""
        keys = list(self.acked)
        key = keys[n % len(keys)]
        got = store.get(key)
        if not got.ok:
            self.note_error(f"get:{got.code.name}")
        elif got.data != content(key, self.acked[key]):
            self.wrong_bytes += 1
        return got.ok

    def put_until(self, store: StoreClient, count: int, timeout_s: float = 60.0,
                  replicas: int = 1) -> float | None:
        """Put until `count` more are acknowledged; monotonic time of the first one."""
        first, done, deadline = None, 0, time.monotonic() + timeout_s
        while done < count and time.monotonic() < deadline:
            if self.put_one(store, replicas):
                done += 1
                first = first or time.monotonic()
            else:
                time.sleep(0.01)
        return first

    def check_all(self, store: StoreClient, timeout_s: float = 30.0) -> tuple[int, int]:
        """(lost, wrong): wait up to `timeout_s` for every acknowledged object to read back;
        count those that never did and those read with other bytes."""
        keys = sorted(self.acked)
        deadline = time.monotonic() + timeout_s
        while True:
            got = store.get_batch(keys)
            if all(g.ok for g in got) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return lost_and_wrong(keys, [g.code for g in got], [g.data for g in got], self.acked)


def lost_and_wrong(keys: Sequence[str], codes: Sequence[E], data: Sequence[bytes | None],
                   sizes: dict[str, int]) -> tuple[int, int]:
    lost = sum(1 for c in codes if c != E.OK)
    wrong = sum(1 for k, c, d in zip(keys, codes, data, strict=True)
                if c == E.OK and d != content(k, sizes[k]))
    return lost, wrong


def wait_until(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    """True once `predicate` holds, False after `timeout_s` (the measurement goes on and
    counts what failed)."""
    try:
        return wait_for(predicate, timeout_s, step_s=step_s)
    except TimeoutError:
        return False


class PutLoad(threading.Thread):
    """Puts (and reads back) fresh keys on `ledger` until `stop_event`; once `max_objects`
    are acknowledged it reads old ones instead (so the pool never evicts). The times of every
    successful and every failed operation."""

    def __init__(self, store: StoreClient, ledger: Ledger, max_objects: int = 1500) -> None:
        super().__init__(daemon=True, name="faults-load")
        self.store, self.ledger, self.max_objects = store, ledger, max_objects
        self.stop_event = threading.Event()
        self.failures: list[float] = []
        self.successes: list[float] = []

    def run(self) -> None:
        n = 0
        while not self.stop_event.is_set():
            n += 1
            if len(self.ledger.acked) < self.max_objects:
                ok = self.ledger.put_one(self.store)
            else:
                ok = self.ledger.get_one(self.store, n)
            (self.successes if ok else self.failures).append(time.monotonic())
            if not ok:
                time.sleep(0.01)
