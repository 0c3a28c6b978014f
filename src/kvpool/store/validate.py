"""Validation of user-supplied keys and sizes (shared by the master and the client)."""

from __future__ import annotations

from kvpool.store.config import MAX_KEY_BYTES


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


def valid_size(size: object, max_bytes: int) -> bool:
    return type(size) is int and 0 < size <= max_bytes
