"""The metadata server's state file format, sans-I/O: a sequence of checksummed frames.

    +-----------+------------------+---------------------------------------+
    | len u32le | xxh3_64 u64le    | payload: msgpack ["P", key, value]    |
    |           | (of the payload) |       or msgpack ["D", key]           |
    +-----------+------------------+---------------------------------------+

`decode_frames(buf)` returns the records of every whole, intact frame from the start and the
length of that good prefix; it stops at the first frame that is short (a write cut off by a
crash) or fails its checksum, so a torn tail costs only the change that was being written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import xxhash

HEADER = struct.Struct("<IQ")
MAX_PAYLOAD = 1 << 31


@dataclass(frozen=True, slots=True)
class PutRecord:
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class DeleteRecord:
    key: str


Record = PutRecord | DeleteRecord


def encode_frame(record: Record) -> bytes:
    if isinstance(record, PutRecord):
        payload = msgpack.packb(["P", record.key, record.value], use_bin_type=True)
    else:
        payload = msgpack.packb(["D", record.key], use_bin_type=True)
    return HEADER.pack(len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def decode_frames(buf: bytes | memoryview) -> tuple[list[Record], int]:
    """(records, bytes consumed by whole intact frames) of `buf`."""
    view = memoryview(buf)
    records: list[Record] = []
    pos = 0
    while pos + HEADER.size <= len(view):
        length, digest = HEADER.unpack_from(view, pos)
        end = pos + HEADER.size + length
        if length > MAX_PAYLOAD or end > len(view):
            break
        payload = bytes(view[pos + HEADER.size:end])
        record = _decode_payload(payload) if xxhash.xxh3_64_intdigest(payload) == digest \
            else None
        if record is None:
            break
        records.append(record)
        pos = end
    return records, pos


def _decode_payload(payload: bytes) -> Record | None:
    try:
        item = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if isinstance(item, list) and len(item) == 3 and item[0] == "P" \
            and isinstance(item[1], str) and isinstance(item[2], bytes):
        return PutRecord(item[1], item[2])
    if isinstance(item, list) and len(item) == 2 and item[0] == "D" and isinstance(item[1], str):
        return DeleteRecord(item[1])
    return None


def replay(records: list[Record]) -> dict[str, bytes]:
    items: dict[str, bytes] = {}
    for record in records:
        if isinstance(record, PutRecord):
            items[record.key] = record.value
        else:
            items.pop(record.key, None)
    return items
