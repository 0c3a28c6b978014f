"""Validation of user-supplied keys and sizes (shared by the master and the client)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.store.config import MAX_KEY_BYTES
from kvpool.store.wire.codes import Tier


def key_problem(key: object) -> str | None:
    """Why `key` is not acceptable, or None. Keys are 1..4096 bytes of UTF-8 without
    whitespace or control characters."""
    if not isinstance(key, str):
        return f"key must be a str, got {type(key).__name__}"
    if not key:
        return "key must not be empty"
    if len(key) > MAX_KEY_BYTES or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"key is longer than {MAX_KEY_BYTES} bytes"
    if not key.isprintable() or any(c.isspace() for c in key):
        return "key must not contain whitespace or control characters"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "key is not valid UTF-8"
    return None


def valid_key(key: object) -> bool:
    if type(key) is str and 0 < len(key) <= 256 and key.isascii() and key.isprintable() \
            and " " not in key:
        return True  # the common case, decided without building a message
    return key_problem(key) is None


def valid_keys(keys: Sequence[object]) -> bool:
    """valid_key of every key. A batch of short printable ASCII keys is decided in a few
    C calls on their concatenation (each property holds per character, so it holds for
    every key exactly when it holds for the whole); anything else key by key."""
    try:
        joined = "".join(keys)  # type: ignore[arg-type]  # TypeError: not all str
    except TypeError:
        return all(map(valid_key, keys))
    lengths = list(map(len, keys))  # type: ignore[arg-type]
    if joined.isascii() and joined.isprintable() and " " not in joined \
            and (not lengths or (min(lengths) > 0 and max(lengths) <= 256)):
        return True
    return all(map(valid_key, keys))


def valid_size(size: object, max_bytes: int) -> bool:
    return type(size) is int and 0 < size <= max_bytes


def valid_sizes(sizes: Sequence[object], max_bytes: int) -> bool:
    """valid_size of every size, in a few C calls."""
    if not sizes:
        return True
    if set(map(type, sizes)) != {int}:
        return False
    return 0 < min(sizes) and max(sizes) <= max_bytes  # type: ignore[type-var, operator]


ADDRESS_LIMIT = 1 << 64
"""Addresses travel as msgpack uint64: every byte of a segment must lie below this."""
MAX_SEGMENT_BYTES = 1 << 50
"""Largest segment one MOUNT may add (1 PiB)."""
MAX_ENDPOINT_BYTES = 256


def mount_problem(endpoint: str, base_addr: int, size: int, fence: int = 0) -> str | None:
    """Why a MOUNT of [base_addr, base_addr + size) of `endpoint` is not acceptable, or None.
    The range must fit below 2**64, so that every replica address handed out later can be
    encoded in a reply."""
    if not endpoint or len(endpoint) > MAX_ENDPOINT_BYTES or not valid_key(endpoint):
        return f"endpoint must be 1..{MAX_ENDPOINT_BYTES} characters without whitespace"
    if not 0 <= base_addr < ADDRESS_LIMIT:
        return f"base_addr must be in [0, 2**64), got {base_addr}"
    if not 0 < size <= MAX_SEGMENT_BYTES:
        return f"size must be in [1, {MAX_SEGMENT_BYTES}], got {size}"
    if base_addr + size >= ADDRESS_LIMIT:
        return f"segment [{base_addr:#x}, +{size:#x}) does not fit below 2**64"
    if not 0 <= fence < ADDRESS_LIMIT:
        return f"fence must be in [0, 2**64), got {fence}"
    return None


TIER_VALUES = frozenset(int(t) for t in Tier)
