"""The master's durable records: their frame, and the state they add up to.

Sans-I/O: bytes in, state out. A log or snapshot file is a sequence of frames

    +---------+-----------------+---------------------------+
    | len u32 | xxh3_64(payload)| payload (msgpack list)    |
    |  (LE)   |   u64 (LE)      | len bytes                 |
    +---------+-----------------+---------------------------+

A frame delimits itself (length) and proves itself (checksum), so `scan_frames` can tell
the two kinds of damage apart: a frame that fails its checksum or runs past the end is
skipped by looking for the next offset where an intact frame starts (a chance match needs a
64-bit checksum to agree); bytes skipped before a later intact frame are corruption in the
middle, bytes after the last intact frame are the tail (torn when the process died
mid-write). `decode_frames` is the strict reading that stops at the first bad frame.

Payloads (every value the master acknowledged and needs after a restart; leases, pins'
timers, pending puts and clients are not recorded: they are short-lived by design):

    ["H", next_log_seq, term, num_records]          snapshot header (num_records, the
                                                    count of records after it, is absent
                                                    in snapshots of older versions)
    ["S", segment_id, client_id, endpoint, base_addr, size, tier, fence]   mounted
    ["D", segment_id]                               dropped (its objects' replicas vanish)
    ["P", key, size, [[segment_id, offset], ...], checksum|None, hard_pinned]   complete
    ["R", key]                                      removed (or evicted)

Replay semantics make every record a "set": an S for a known segment id from the same
client with the same size keeps that segment's objects (a re-mount under a new fence), from
another client or with another size it drops them (different memory).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from kvpool.errors import RemoteProtocolError

_HEAD = struct.Struct("<IQ")
MAX_RECORD_BYTES = 64 << 20
"""A larger length field is garbage (a torn or overwritten header), not a record."""
_NONZERO = re.compile(rb"[^\0]")


def encode_record(payload: list[Any]) -> bytes:
    body = msgpack.packb(payload, use_bin_type=True)
    return _HEAD.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def _frame_at(data: bytes, pos: int) -> tuple[list[Any], int] | None:
    """(payload, end) of the intact frame starting at `pos`, or None."""
    if pos + _HEAD.size > len(data):
        return None
    length, digest = _HEAD.unpack_from(data, pos)
    end = pos + _HEAD.size + length
    if length > MAX_RECORD_BYTES or end > len(data):
        return None
    body = memoryview(data)[pos + _HEAD.size:end]
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    try:
        payload = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - a checksummed frame we cannot parse is not a record
        return None
    if not isinstance(payload, list) or not payload:
        return None
    return payload, end


def decode_frames(data: bytes) -> tuple[list[list[Any]], int]:
    """(payloads, bytes consumed): every whole, intact frame from the start of `data`, up
    to the first bad one."""
    out: list[list[Any]] = []
    pos = 0
    while (frame := _frame_at(data, pos)) is not None:
        out.append(frame[0])
        pos = frame[1]
    return out, pos


@dataclass(frozen=True, slots=True)
class FrameScan:
    """What `scan_frames` found in one file or value."""

    records: list[list[Any]]
    skipped: list[tuple[int, int]]
    """(offset, num_bytes) of each damaged run followed by an intact frame."""
    tail_bytes: int
    """Bytes after the last intact frame (0 when the data ends on a frame boundary)."""

    @property
    def skipped_bytes(self) -> int:
        return sum(n for _, n in self.skipped)


def scan_frames(data: bytes) -> FrameScan:
    """Every intact frame of `data`, resynchronising after damage (see the module
    docstring). Cost: one header check per byte of a damaged run, plus a checksum where
    a header's length fits."""
    out: list[list[Any]] = []
    skipped: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        frame = _frame_at(data, pos)
        if frame is not None:
            out.append(frame[0])
            pos = frame[1]
            continue
        start = pos
        pos = _next_frame(data, pos + 1)
        if pos >= len(data):
            return FrameScan(out, skipped, len(data) - start)
        skipped.append((start, pos - start))
    return FrameScan(out, skipped, 0)


def _next_frame(data: bytes, pos: int) -> int:
    """The first offset >= `pos` where an intact frame starts, or len(data). Runs of zero
    bytes (what some filesystems leave after a crash) are crossed at once: no frame has a
    zero length field."""
    while pos + _HEAD.size <= len(data):
        if data[pos:pos + 4] == b"\0\0\0\0":
            nonzero = _NONZERO.search(data, pos)
            pos = len(data) if nonzero is None else max(pos + 1, nonzero.start() - 3)
            continue
        if _frame_at(data, pos) is not None:
            return pos
        pos += 1
    return len(data)


@dataclass(frozen=True, slots=True)
class SegRec:
    segment_id: str
    client_id: str
    endpoint: str
    base_addr: int
    size: int
    tier: int
    fence: int

    def record(self) -> list[Any]:
        return ["S", self.segment_id, self.client_id, self.endpoint, self.base_addr,
                self.size, self.tier, self.fence]


@dataclass(frozen=True, slots=True)
class ObjRec:
    key: str
    size: int
    replicas: tuple[tuple[str, int], ...]
    """(segment_id, offset) of each replica."""
    checksum: int | None
    hard_pinned: bool

    def record(self) -> list[Any]:
        return ["P", self.key, self.size, [list(r) for r in self.replicas], self.checksum,
                self.hard_pinned]


@dataclass
class DurableState:
    """What the records add up to: segments and complete objects, by id and key."""

    segments: dict[str, SegRec] = field(default_factory=dict)
    objects: dict[str, ObjRec] = field(default_factory=dict)
    next_log_seq: int = 0
    term: int = 0
    num_records: int | None = None
    """Records the snapshot header promises after it (None: none read, or an older format)."""
    _keys_on: dict[str, set[str]] = field(default_factory=dict)
    """Segment id -> keys with a replica there (so dropping a segment is not a scan)."""

    def _put(self, obj: ObjRec) -> None:
        self._pop(obj.key)
        self.objects[obj.key] = obj
        for segment_id, _ in obj.replicas:
            self._keys_on.setdefault(segment_id, set()).add(obj.key)

    def _pop(self, key: str) -> ObjRec | None:
        obj = self.objects.pop(key, None)
        for segment_id, _ in obj.replicas if obj is not None else ():
            self._keys_on.get(segment_id, set()).discard(key)
        return obj

    def apply(self, payload: list[Any]) -> None:
        """Apply one record; RemoteProtocolError for one this code never writes."""
        try:
            kind = payload[0]
            if kind == "P":
                key, size, reps, checksum, pinned = payload[1:6]
                self._put(ObjRec(key, size, tuple((s, o) for s, o in reps), checksum,
                                 bool(pinned)))
            elif kind == "R":
                self._pop(payload[1])
            elif kind == "S":
                self._mount(SegRec(*payload[1:8]))
            elif kind == "D":
                self.drop_segment(payload[1])
            elif kind == "H":
                self.next_log_seq, self.term = int(payload[1]), int(payload[2])
                self.num_records = int(payload[3]) if len(payload) > 3 else None
            else:
                raise RemoteProtocolError(f"unknown record kind {kind!r}")
        except (ValueError, TypeError, IndexError) as exc:
            raise RemoteProtocolError(f"malformed record {payload!r:.200}: {exc}") from None

    def _mount(self, seg: SegRec) -> None:
        old = self.segments.get(seg.segment_id)
        if old is not None and (old.client_id, old.size) != (seg.client_id, seg.size):
            self.drop_segment(seg.segment_id)
        self.segments[seg.segment_id] = seg

    def drop_segment(self, segment_id: str) -> None:
        """Forget a segment and every replica on it; objects left without one go."""
        self.segments.pop(segment_id, None)
        for key in self._keys_on.pop(segment_id, set()):
            obj = self._pop(key)
            assert obj is not None, f"{key!r} indexed on {segment_id} but not stored"
            left = tuple(r for r in obj.replicas if r[0] != segment_id)
            if left:
                self._put(ObjRec(key, obj.size, left, obj.checksum, obj.hard_pinned))

    def drop_orphans(self) -> int:
        """Remove replicas on unknown segments (and objects left without any); how many
        objects went."""
        before = len(self.objects)
        for segment_id in [s for s in self._keys_on if s not in self.segments]:
            self.drop_segment(segment_id)
        return before - len(self.objects)

    def records(self) -> list[list[Any]]:
        """Records that rebuild this state (a snapshot's body, header excluded)."""
        return [s.record() for s in self.segments.values()] + \
            [o.record() for o in self.objects.values()]
