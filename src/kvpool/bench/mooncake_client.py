"""The client side of `kvpool bench mooncake-api`: one workload written against Mooncake's
Python API, run unchanged on either implementation (`mooncake` = the real wheel, `kvpool` =
kvpool.compat). Started as a child process by kvpool.bench.mooncake_api:

    python -m kvpool.bench.mooncake_client node IMPL MASTER DRAM_BYTES
    python -m kvpool.bench.mooncake_client serve IMPL MASTER PROTOCOL

`node` contributes memory and waits for stdin to close. `serve` is a pure client (every byte
crosses to the node process, over `PROTOCOL`): it announces itself with one JSON line, then
runs one round of the workload per JSON command read from stdin and answers each with one
JSON line of measurements, so the parent can interleave the implementations round by round.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.bench.common import Measurement, rate, warm_up

_MODULES = {"mooncake": "mooncake", "kvpool": "kvpool.compat.mooncake"}
RELEASE_S = 0.25
"""Pause after remove_all, outside the timing: kvpool reuses force-removed memory once the
read leases (200 ms in this bench) end."""

EXIST_CALLS = 200
"""Batched is_exist calls a measurement makes at least (the phase's batches again and again):
a phase of 3 or 4 batches took well under a millisecond, too short to time."""


@dataclass(frozen=True)
class Round:
    """One round of the workload (a command on stdin)."""

    tag: str
    single_sizes: list[int]
    single_ops: int
    batch_sizes: list[int]
    batch: int
    phase_bytes: int
    transfer_s: float = 0.0
    handicap_us: float = 0.0
    """kvpool only: spin this long before each timed call (the guard's test)."""
    min_s: float = 0.0
    """Each measurement lasts at least this long (`Phase`)."""
    put_cap_bytes: int = 0
    """How many bytes one put measurement may write to last `min_s` (0: its keys only)."""


class Phase:
    """The keys of one phase: `count` made up front. A put measurement that used them all
    before its time was up takes new ones (`make(i)`), up to `cap`; the measurements after
    it (reads, is_exist) go over every key that was put, and again while their time lasts.
    A few calls are too short to time on a shared machine: a phase of 4 batched calls took
    6 ms, and its rounds' ratios spread 0.8-2.4x (docs/perf.md)."""

    def __init__(self, make: Callable[[int], Any], count: int, cap: int = 0) -> None:
        self.keys = [make(i) for i in range(count)]
        self._make, self._cap = make, max(cap, count)

    def key(self, i: int, new: bool) -> Any:
        """The key of call `i`: with `new` (a put), a key not yet used, or None when the
        cap is reached; otherwise the keys in turn."""
        keys = self.keys
        if i < len(keys):
            return keys[i]
        if not new:
            return keys[i % len(keys)]
        if len(keys) >= self._cap:
            return None
        keys.append(self._make(i))
        return keys[i]


def load(impl: str) -> tuple[Any, Any]:
    """(store module, engine module) of the implementation."""
    base = _MODULES[impl]
    return importlib.import_module(f"{base}.store"), importlib.import_module(f"{base}.engine")


def node(impl: str, master: str, dram: int) -> None:
    store_mod, _ = load(impl)
    store = store_mod.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", dram, 16 << 20, "tcp", "", master)
    print(json.dumps({"ready": rc == 0, "rc": rc}), flush=True)
    sys.stdin.read()
    store.close()


class Workload:
    def __init__(self, impl: str, master: str, protocol: str, buffer_bytes: int) -> None:
        self.impl, self.protocol = impl, protocol
        self.store_mod, self.engine_mod = load(impl)
        self.store = self.store_mod.MooncakeDistributedStore()
        if self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, protocol, "",
                            master) != 0:
            raise RuntimeError(f"{impl} store setup failed")
        self.buf = np.random.default_rng(0).integers(0, 255, buffer_bytes, dtype=np.uint8)
        self.ptr = int(self.buf.ctypes.data)
        self.store.register_buffer(self.ptr, self.buf.nbytes)
        self.values = {size: self.buf[:size].tobytes() for size in (4096, 65536)}
        self.handicap_s = 0.0
        self.min_s = 0.0

    def run(self, r: Round) -> list[Measurement]:
        self.handicap_s = r.handicap_us / 1e6 if self.impl == "kvpool" else 0.0
        self.min_s = r.min_s
        out: list[Measurement] = []
        for size in r.single_sizes:
            out += self._single(size, r.single_ops, f"{r.tag}-s{size}", r.put_cap_bytes // size)
        for size in r.batch_sizes:
            out += self._batched(size, r.batch, r.phase_bytes, f"{r.tag}-b{size}",
                                 r.put_cap_bytes // (size * r.batch))
        if r.transfer_s > 0 and self.protocol == "tcp":  # the engine phase runs over tcp
            for size in r.batch_sizes:
                out += _transfer_phase(self.engine_mod, self.impl, size, r.batch, r.transfer_s)
        return out

    def _measure(self, op: str, mode: str, size: int, phase: Phase,
                 call: Callable[[Any], Any], per_call: int, moved: int,
                 warm: Callable[[], object], new: bool = False,
                 min_calls: int = 0) -> list[Measurement]:
        """Run `call` on the phase's keys (a key or a batch each; `new`: keys not used
        before, as a put needs), each answering True or what went wrong, after `warm` ran
        untimed (common.warm_up): on all of them at least (and `min_calls` times), and on
        until the round's `min_s` has passed (`Phase`). A failure is reported on stderr and
        the measurement left out of this round."""
        warm_up(warm)
        if self.handicap_s > 0:
            call = _handicapped(call, self.handicap_s)
        calls, elapsed, failed = timed_calls(phase, call, new, max(min_calls, len(phase.keys)),
                                             self.min_s)
        if failed is not None:
            print(f"{self.impl} {op} {mode} {size} failed on {str(failed[0])[:80]}: "
                  f"{str(failed[1])[:200]}", file=sys.stderr, flush=True)
            return []
        return [Measurement("mooncake-api-store", self.impl, self.protocol, op, mode, size,
                           moved * calls / elapsed / 1e9, per_call * calls / elapsed)]

    def _single(self, size: int, ops: int, tag: str, cap: int) -> list[Measurement]:
        s, ptr, dst = self.store, self.ptr, self.ptr + size
        value = self.values.get(size) or self.buf[:size].tobytes()
        zc = Phase(lambda i: f"{tag}-z{i}", ops, cap)
        by = Phase(lambda i: f"{tag}-v{i}", ops, cap)
        s.put_from(f"{tag}-warm", ptr, size)

        def warm() -> object:
            return s.get_into(f"{tag}-warm", dst, size)
        out = [
            *self._measure("put_from", "single", size, zc,
                          lambda k: s.put_from(k, ptr, size) == 0, 1, size, warm, new=True),
            *self._measure("get_into", "single", size, zc,
                          lambda k: s.get_into(k, dst, size) == size, 1, size, warm),
            *self._measure("put", "single", size, by, lambda k: s.put(k, value) == 0, 1, size,
                           warm, new=True),
            *self._measure("get", "single", size, by, lambda k: len(s.get(k)) == size, 1, size,
                           warm),
            *self._measure("is_exist", "single", size, zc, lambda k: s.is_exist(k) == 1, 1, 0,
                           warm),
        ]
        self._clear()
        return out

    def _batched(self, size: int, batch: int, phase_bytes: int, tag: str,
                 cap: int) -> list[Measurement]:
        s = self.store
        keys = Phase(lambda i: [f"{tag}-{i}-{j}" for j in range(batch)],
                     max(3, phase_bytes // (size * batch)), cap)
        ptrs = [self.ptr + j * size for j in range(batch)]
        sizes = [size] * batch
        warm_keys = [f"{tag}-warm-{j}" for j in range(batch)]
        s.batch_put_from(warm_keys, ptrs, sizes)

        def warm() -> object:
            return s.batch_get_into(warm_keys, ptrs, sizes)
        out = [
            *self._measure("put_from", "batched", size, keys, lambda k: _all(
                s.batch_put_from(k, ptrs, sizes), 0), batch, size * batch, warm, new=True),
            *self._measure("get_into", "batched", size, keys, lambda k: _all(
                s.batch_get_into(k, ptrs, sizes), size), batch, size * batch, warm),
            *self._measure("is_exist", "batched", size, keys,
                           lambda k: _all(s.batch_is_exist(k), 1), batch, 0, warm,
                           min_calls=EXIST_CALLS),
        ]
        self._clear()
        return out

    def _clear(self) -> None:
        self.store.remove_all(True)
        time.sleep(RELEASE_S)

    def close(self) -> None:
        self.store.close()


def timed_calls(phase: Phase, call: Callable[[Any], Any], new: bool, at_least: int,
                min_s: float, clock: Callable[[], float] = time.perf_counter,
                ) -> tuple[int, float, tuple[Any, Any] | None]:
    """`call` on the phase's keys (`Phase.key`), `at_least` times and on until `min_s` has
    passed (or a put ran out of new keys): (calls, seconds, None), or with the first
    (key, answer) whose answer was not True (the calls stop there)."""
    calls = 0
    start = clock()
    while (key := phase.key(calls, new)) is not None:
        got = call(key)
        if got is not True:
            return calls, clock() - start, (key, got)
        calls += 1
        if calls >= at_least and clock() - start >= min_s:
            break
    return calls, clock() - start, None


def _handicapped(call: Callable[[Any], Any], seconds: float) -> Callable[[Any], Any]:
    """`call` after a busy wait of `seconds` (a deliberately slower client)."""
    def slow(key: Any) -> Any:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass
        return call(key)
    return slow


def _all(results: list[int], want: int) -> Any:
    """True when every result is `want`, else the results."""
    return True if all(r == want for r in results) else results


def _transfer_phase(engine_mod: Any, impl: str, size: int, batch: int,
                    min_time_s: float) -> list[Measurement]:
    a, b = engine_mod.TransferEngine(), engine_mod.TransferEngine()
    for te in (a, b):
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"{impl} TransferEngine.initialize failed")
    src = np.ones(size * batch, np.uint8)
    dst = np.zeros(size * batch, np.uint8)
    a.register_memory(src.ctypes.data, src.nbytes)
    b.register_memory(dst.ctypes.data, dst.nbytes)
    target = f"127.0.0.1:{b.get_rpc_port()}"
    srcs = [src.ctypes.data + j * size for j in range(batch)]
    dsts = [dst.ctypes.data + j * size for j in range(batch)]
    out = []
    for op, fn in (("write", a.batch_transfer_sync_write), ("read", a.batch_transfer_sync_read)):
        def call(fn: Any = fn) -> None:
            if fn(target, srcs, dsts, [size] * batch) != 0:
                raise RuntimeError(f"{impl} transfer failed")
        gbps, reqs = rate(call, size * batch, batch, min_time_s)
        out.append(Measurement("mooncake-api-transfer", impl, "tcp", op, "batched", size,
                               gbps, reqs))
    if hasattr(a, "close"):
        a.close(), b.close()
    return out


def serve(impl: str, master: str, protocol: str, buffer_bytes: int) -> None:
    work = Workload(impl, master, protocol, buffer_bytes)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        found = work.run(Round(**json.loads(line)))
        print(json.dumps([asdict(m) for m in found]), flush=True)
    work.close()


def main(argv: list[str]) -> int:
    role, impl, master = argv[:3]
    if role == "node":
        node(impl, master, int(argv[3]))
    else:
        serve(impl, master, argv[3], int(argv[4]))
    return 0


if __name__ == "__main__":
    import os

    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # the real wheel's threads can hang a normal interpreter exit
