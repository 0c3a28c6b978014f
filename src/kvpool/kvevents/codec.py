"""vLLM's KV-event payload: msgpack bytes <-> `EventBatch`. Pure functions, no sockets.

Wire layout (the third frame of a `[topic, seq, payload]` ZMQ message)::

    payload  = msgpack array [ts: float64, events: array, data_parallel_rank: int|nil]
               (engines from before data parallelism wrote only the first two)
    event    = map form (vLLM 0.24 on, at the latest: tagged maps)
                   {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...}
               array form (vLLM 0.20 and before: tagged arrays)
                   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium]

The tag is the event class name, under the key "type" in the map form and first in the array
form. In the map form a field whose value is its default (None) is left out, except the
fields that have no default in vLLM's classes (`REQUIRED[tag]` leading ones), which are
always written. Arrays are written whole (msgspec writes every field of an array-like struct).
Older engines had fewer fields; the decoder accepts any layout from the oldest on and ignores
fields it does not know.

`decode_batch` returns an `EventBatch` or raises `RemoteProtocolError` (the publisher sent
something that is not an event batch); it never raises anything else. An event whose tag it
does not know becomes `UnknownEvent(tag)` so a newer engine's extra event types do not cost
the batch.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvpool.errors import InvalidArgument, RemoteProtocolError
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

Form = Literal["map", "array"]

FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}
"""Each event's fields in vLLM's declaration order (the array form's positions)."""

REQUIRED = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}
"""How many leading fields vLLM 0.32 always writes in the map form (no default in its classes)."""

ARRAY_FIELDS = {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 0}
"""The array form's layout (vLLM 0.11's classes): this many leading fields, all written."""

MIN_FIELDS = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
"""How many leading fields the oldest layout had; fewer is malformed."""

_TYPES: dict[str, type] = {
    "BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared
}
_TAG_OF = {cls: tag for tag, cls in _TYPES.items()}


class UnknownEvent(msgspec.Struct, frozen=True):
    """An event whose tag this decoder does not know (kept so the rest of the batch counts)."""

    tag: str


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch, form: Form = "map") -> bytes:
    """The payload vLLM would publish for `batch`: map form as vLLM 0.32, array form as 0.11.

    Raises InvalidArgument for an array-form event with fields that layout does not have.
    """
    events = [_encode_event(e, form) for e in batch.events if not isinstance(e, UnknownEvent)]
    return _encoder.encode([float(batch.ts), events, batch.data_parallel_rank])


def _encode_event(event: Any, form: Form) -> Any:
    tag = _TAG_OF[type(event)]
    names = FIELDS[tag]
    values = [getattr(event, name) for name in names]
    required = REQUIRED[tag]
    if form == "map":
        fields = {n: v for i, (n, v) in enumerate(zip(names, values, strict=True)) if i < required or v is not None}
        return {"type": tag, **fields}
    width = ARRAY_FIELDS[tag]
    extra = [n for n, v in zip(names[width:], values[width:], strict=True) if v is not None]
    if extra:
        raise InvalidArgument(f"{tag} fields {extra} have no place in the array form; use form='map'")
    return [tag, *values[:width]]


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload of either form. Raises RemoteProtocolError, naming what is wrong."""
    try:
        wire = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError) as exc:
        raise RemoteProtocolError(f"KV event payload is not msgpack: {exc}") from None
    if not isinstance(wire, list) or not 2 <= len(wire) <= 3:
        raise RemoteProtocolError(
            f"KV event batch must be an array [ts, events, dp_rank?], got {_describe(wire)}"
        )
    ts, events = wire[0], wire[1]
    rank = wire[2] if len(wire) == 3 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise RemoteProtocolError(f"KV event batch ts must be a number, got {_describe(ts)}")
    if not isinstance(events, list):
        raise RemoteProtocolError(f"KV event batch events must be an array, got {_describe(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise RemoteProtocolError(f"KV event batch data_parallel_rank must be an int, got {rank!r}")
    decoded = [_decode_event(i, e) for i, e in enumerate(events)]
    return EventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank)  # type: ignore[arg-type]


def _decode_event(index: int, wire: Any) -> Any:
    if isinstance(wire, dict):
        tag = wire.get("type")
        fields = {k: v for k, v in wire.items() if k != "type"}
    elif isinstance(wire, list) and wire:
        tag = wire[0]
        fields = dict(zip(FIELDS.get(tag, ()) if isinstance(tag, str) else (), wire[1:], strict=False))
        if isinstance(tag, str) and tag in FIELDS and len(wire) - 1 < MIN_FIELDS[tag]:
            raise RemoteProtocolError(
                f"KV event {index} ({tag}) has {len(wire) - 1} fields, needs {MIN_FIELDS[tag]}"
            )
    else:
        raise RemoteProtocolError(f"KV event {index} must be a map or an array, got {_describe(wire)}")
    if not isinstance(tag, str):
        raise RemoteProtocolError(f"KV event {index} has no string tag, got {_describe(tag)}")
    cls = _TYPES.get(tag)
    if cls is None:
        return UnknownEvent(tag)
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:
        raise RemoteProtocolError(f"KV event {index} ({tag}): {exc}") from None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
