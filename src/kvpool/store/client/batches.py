"""How the client cuts keyed batches into master RPCs, and reads what comes back: pure
functions, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.store.wire.codes import ErrorCode

RPC_BATCH_KEY_BYTES = 16 << 20
"""Bytes of keys per master RPC: a quarter of the frame limit, leaving room for the other
per-key arguments and for the reply."""


def key_chunks(keys: Sequence[str], max_keys: int) -> list[tuple[int, int]]:
    """[lo, hi) index ranges cutting `keys` into runs of at most `max_keys` keys and
    RPC_BATCH_KEY_BYTES bytes of UTF-8 (counting 64 bytes of framing per key)."""
    if len(keys) <= max_keys and \
            4 * sum(map(len, keys)) + 64 * len(keys) <= RPC_BATCH_KEY_BYTES:
        return [(0, len(keys))] if keys else []  # at most 4 UTF-8 bytes per character
    chunks, lo, size = [], 0, 0
    for i, key in enumerate(keys):
        n = len(key.encode()) + 64
        if i > lo and (i - lo >= max_keys or size + n > RPC_BATCH_KEY_BYTES):
            chunks.append((lo, i))
            lo, size = i, 0
        size += n
    if lo < len(keys):
        chunks.append((lo, len(keys)))
    return chunks


def refusal_code(status: int | None) -> ErrorCode:
    """The code of a whole-request refusal; RPC_FAIL when there is none to pass on."""
    if status is None or status == 0 or status not in ErrorCode._value2member_map_:
        return ErrorCode.RPC_FAIL
    return ErrorCode(status)

