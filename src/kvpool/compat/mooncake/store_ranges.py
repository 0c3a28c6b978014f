"""Sessions and byte ranges of the compat store, as SGLang's layer-wise direct path uses them:

    store.batch_get_session_start(keys)            -> [0 | <0]  look replicas up once
    for layer in layers:                              (and hold their read leases)
        store.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, src_offsets)
    store.batch_get_session_end(keys)              -> 0

Mooncake's results: a ranged get answers the bytes read per key; -600 for a key without a
started session, a range past the object's end, unregistered memory or mismatched lists;
-800 when no replica could be read. `get_into_ranges` needs no session. Put sessions
(`batch_put_session_start`, `batch_put_from_multi_buffer_ranges`, `batch_put_session_end` /
`_revoke`): the object is invisible until its session ends.

kvpool differences (docs/mooncake.md): a put session assembles the object in this process and
stores it at `batch_put_session_end` (the pool's space is claimed then, not at start); a get
session whose read lease ran out looks its replicas up again instead of reading stale ones
(-707, the session over, when the key holds another value by then); ranged reads take DRAM
replicas only and are not checked against the object's checksum (only whole-object reads are).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

from kvpool.compat.mooncake.store_base import INVALID, needs_setup, per_key
from kvpool.compat.mooncake.store_tensors import StoreTensors
from kvpool.compat.mooncake.types import ReplicateConfig
from kvpool.store.client.plan import Copy, dram_first
from kvpool.store.config import ReplicateConfig as NativeReplicateConfig
from kvpool.store.wire.codes import ErrorCode, LookupResult, PutResult, ReplicaDesc
from kvpool.transfer import OpCode

E = ErrorCode
TRANSFER_FAIL = int(E.TRANSFER_FAIL)
LEASE_EXPIRED = int(E.LEASE_EXPIRED)
Range = tuple[int, int, int]
"""(local address, offset in the object, length)."""


class _GetSession:
    def __init__(self, look: LookupResult, started_s: float) -> None:
        self.look = look
        self.started_s = started_s


class StoreRanges(StoreTensors):
    def __init__(self) -> None:
        super().__init__()
        self._ranges_lock = threading.Lock()
        self._get_sessions: dict[str, _GetSession] = {}
        self._put_sessions: dict[str, tuple[bytearray, ReplicateConfig | None]] = {}

    def close(self) -> int:
        with self._ranges_lock:
            self._get_sessions.clear()
            self._put_sessions.clear()
        return super().close()

    # -- get sessions ----------------------------------------------------------------------

    @needs_setup(per_key)
    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """0 per key whose replicas are now cached (and leased), else its lookup's code
        (-704 for a key that cannot exist, as in Mooncake)."""
        found, t0 = self.client.leased_lookup(list(keys))
        looks = [look if look.code is not E.INVALID_PARAMS else LookupResult(E.OBJECT_NOT_FOUND)
                 for look in found]
        with self._ranges_lock:
            for key, look in zip(keys, looks, strict=True):
                if look.code is E.OK:
                    self._get_sessions[key] = _GetSession(look, t0)
        return [int(look.code) for look in looks]

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        with self._ranges_lock:
            for key in keys:
                self._get_sessions.pop(key, None)
        return 0

    def _session_look(self, key: str) -> _GetSession | None:
        with self._ranges_lock:
            session = self._get_sessions.get(key)
        if session is None:
            return None
        if session.look.lease_over(session.started_s, self.client.clock.now()):
            # the lease ran out: never read stale copies
            (fresh,), t0 = self.client.leased_lookup([key])
            if fresh.code is not E.OK:
                return None
            if (fresh.size, fresh.checksum) != (session.look.size, session.look.checksum):
                with self._ranges_lock:  # another value now: its ranges would not be the
                    self._get_sessions.pop(key, None)  # session's object (-707, start again)
                return _GetSession(LookupResult(E.LEASE_EXPIRED), t0)
            session = _GetSession(fresh, t0)
            with self._ranges_lock:
                self._get_sessions[key] = session
        return session

    @needs_setup(per_key)
    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Object i's ranges (src_offsets[i][k], sizes[i][k]) into ptrs[i][k]; bytes read
        per key, or a negative code."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets):
            return [INVALID] * len(keys)
        ranges = [_ranges(p, s, o) for p, s, o in
                  zip(all_buffer_ptrs, all_sizes, all_src_offsets, strict=True)]
        sessions = [self._session_look(key) for key in keys]
        return self._read_ranges([None if s is None else s.look for s in sessions], ranges,
                                 [0.0 if s is None else s.started_s for s in sessions])

    @needs_setup(per_key)
    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """For buffer i, object all_keys[i][j], range k: bytes read (or a negative code)."""
        n = len(buffer_ptrs)
        if not n == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            return [[[INVALID]] for _ in range(n)]
        names = list(dict.fromkeys(key for keys in all_keys for key in keys))
        looks, t0 = self.client.leased_lookup(names)
        found = dict(zip(names, looks, strict=True))
        out: list[list[list[int]]] = []
        for i, keys in enumerate(all_keys):
            dsts, srcs, sizes = all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            if not len(keys) == len(dsts) == len(srcs) == len(sizes):
                out.append([[INVALID] for _ in keys])  # Mooncake fails the whole buffer
                continue
            out.append([self._read_key_ranges(found[key], t0, buffer_ptrs[i], dsts[j], srcs[j],
                                              sizes[j]) for j, key in enumerate(keys)])
        return out

    def _read_key_ranges(self, look: LookupResult, t0: float, base: int, dsts: Sequence[int],
                         srcs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """One object's ranges into one buffer, a result per range (per dst offset); `t0`:
        when its lease began."""
        ranges = _ranges([base + d for d in dsts], sizes, srcs, keep_empty=True)
        if ranges is None:
            return [INVALID] * max(1, len(dsts))
        if look.code is not E.OK:
            missing = look.code in (E.OBJECT_NOT_FOUND, E.INVALID_PARAMS)  # -704 as Mooncake
            return [int(E.OBJECT_NOT_FOUND) if missing else int(look.code)] * len(ranges)
        return [self._read_ranges([look], [[r]], [t0])[0] if r[2] else 0 for r in ranges]

    def _read_ranges(self, looks: Sequence[LookupResult | None],
                     ranges: Sequence[list[Range] | None], leased: Sequence[float]) -> list[int]:
        """Each object's ranges from its closest replica that answers: bytes read per object,
        or a negative code; -707 (LEASE_EXPIRED) when its lease (begun at `leased[i]`) ran
        out before its bytes were in: its replica's memory may hold another object's by then
        (ranged reads have no checksum to tell)."""
        out = [INVALID] * len(looks)
        todo: dict[int, list[ReplicaDesc]] = {}
        for i, (look, rs) in enumerate(zip(looks, ranges, strict=True)):
            if look is None or rs is None:
                continue
            if look.code is not E.OK:  # a session whose object changed (-707)
                out[i] = int(look.code)
                continue
            if not all(0 <= off and off + n <= look.size for _, off, n in rs):
                continue
            if not self._registered([(local, n) for local, _, n in rs]):
                continue
            todo[i] = dram_first(look.replicas, self.client.endpoint, self.client.host)
            out[i] = TRANSFER_FAIL
        while todo:
            copies = {i: [Copy(local, n, q[0].endpoint, q[0].addr + off, q[0].fence)
                          for local, off, n in ranges[i] or ()] for i, q in todo.items()}
            failed = self.client._run_copies(OpCode.READ, copies)
            for i in set(todo) - failed:
                out[i] = sum(n for _, _, n in ranges[i] or ())
            todo = {i: todo[i][1:] for i in failed if len(todo[i]) > 1}
        now = self.client.clock.now()
        return [LEASE_EXPIRED if n >= 0 and look is not None and look.lease_over(begun, now)
                else n for n, look, begun in zip(out, looks, leased, strict=True)]

    # -- put sessions ----------------------------------------------------------------------

    @needs_setup(per_key)
    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int],
                                config: ReplicateConfig | None = None) -> list[int]:
        """0 per key now open for ranged writes; -705 when the key is stored already."""
        if len(keys) != len(sizes):
            return [INVALID] * len(keys)
        stored = self.client.batch_exists(list(keys))
        out = []
        with self._ranges_lock:
            for key, size, status in zip(keys, sizes, stored, strict=True):
                if status is E.OK:
                    out.append(int(E.OBJECT_ALREADY_EXISTS))
                elif type(size) is not int or size <= 0 or key in self._put_sessions:
                    out.append(INVALID)
                else:
                    self._put_sessions[key] = (bytearray(size), config)
                    out.append(0)
        return out

    @needs_setup(per_key)
    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Copy each piece to its offset in the session's object; bytes written per key."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets):
            return [INVALID] * len(keys)
        return [self._write_ranges(key, _ranges(p, s, o)) for key, p, s, o in
                zip(keys, all_buffer_ptrs, all_sizes, all_dst_offsets, strict=True)]

    def _write_ranges(self, key: str, ranges: list[Range] | None) -> int:
        with self._ranges_lock:
            session = self._put_sessions.get(key)
        if session is None or ranges is None:
            return INVALID
        data = session[0]
        if not all(0 <= off and off + n <= len(data) for _, off, n in ranges) or \
                not self._registered([(local, n) for local, _, n in ranges]):
            return INVALID
        base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
        for local, off, n in ranges:
            ctypes.memmove(base + off, local, n)
        return sum(n for _, _, n in ranges)

    @needs_setup(per_key)
    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Store each session's object (now readable); its put's code per key:
        OBJECT_ALREADY_EXISTS when another client put the key while the session was open
        (the session's bytes are not stored; space is claimed only here, see
        docs/mooncake.md)."""
        with self._ranges_lock:
            sessions = [self._put_sessions.pop(key, None) for key in keys]
        return [INVALID if session is None else self._end_session(key, *session)
                for key, session in zip(keys, sessions, strict=True)]

    def _end_session(self, key: str, data: bytearray, config: ReplicateConfig | None) -> int:
        stored: list[bool] = []

        def put(idx: list[int], cfg: NativeReplicateConfig) -> list[PutResult]:
            results = self.client.put_batch([key], [memoryview(data)], cfg, False)
            stored[:] = [not r.already_existed for r in results]
            return results
        code = self._put(1, config, put)[0]
        return int(E.OBJECT_ALREADY_EXISTS) if code == 0 and stored == [False] else code

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        with self._ranges_lock:
            gone = [self._put_sessions.pop(key, None) for key in keys]
        return [0 if g is not None else INVALID for g in gone]


def _ranges(ptrs: Sequence[int], sizes: Sequence[int], offsets: Sequence[int],
            keep_empty: bool = False) -> list[Range] | None:
    """(local, offset, length) triples, without the empty ones unless `keep_empty`
    (Mooncake skips them); None when the lists differ in length, hold a negative length, or
    nothing but empty ones."""
    if not len(ptrs) == len(sizes) == len(offsets) or not len(ptrs):
        return None
    out = [(int(p), int(o), int(n)) for p, n, o in zip(ptrs, sizes, offsets, strict=True)]
    if any(n < 0 for _, _, n in out):
        return None
    return out if keep_empty else [r for r in out if r[2]] or None
