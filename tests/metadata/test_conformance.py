"""One suite, every backend: memory, HTTP in-process, HTTP child process, real etcd."""

from __future__ import annotations

import threading

import pytest

from kvpool.errors import InvalidArgument, MetadataError
from kvpool.metadata import MetadataBackend

ALL_BYTES = bytes(range(256))
ODD_KEYS = (
    "mooncake/ram/127.0.0.1:12345",
    "a b+c&d=e?f#g%20h",
    "/leading/and/trailing/",
    "ключ/é/中文/😀",
    "semi;colon,comma'quote\"dq<lt>\\back",
    "%2F%25 already-encoded",
    "tab\there",
)


def test_put_get_delete(backend: MetadataBackend, prefix: str) -> None:
    key = prefix + "seg"
    backend.put(key, b'{"name": "seg", "port": 15000}')
    assert backend.get(key) == b'{"name": "seg", "port": 15000}'
    assert backend.delete(key) is True
    assert backend.get(key) is None


def test_absent_key(backend: MetadataBackend, prefix: str) -> None:
    assert backend.get(prefix + "never-written") is None
    assert backend.delete(prefix + "never-written") is False


def test_delete_twice_reports_absent_second_time(backend: MetadataBackend, prefix: str) -> None:
    backend.put(prefix + "k", b"v")
    assert backend.delete(prefix + "k") is True
    assert backend.delete(prefix + "k") is False


def test_overwrite_replaces_value(backend: MetadataBackend, prefix: str) -> None:
    backend.put(prefix + "k", b"first, longer value")
    backend.put(prefix + "k", b"2nd")
    assert backend.get(prefix + "k") == b"2nd"


def test_empty_value_is_a_value(backend: MetadataBackend, prefix: str) -> None:
    backend.put(prefix + "empty", b"")
    assert backend.get(prefix + "empty") == b""
    assert backend.delete(prefix + "empty") is True


def test_binary_value_with_every_byte(backend: MetadataBackend, prefix: str) -> None:
    value = ALL_BYTES + ALL_BYTES[::-1] + b"\x00\r\n\r\n\x00"
    backend.put(prefix + "bin", value)
    assert backend.get(prefix + "bin") == value


def test_bytes_like_values_are_accepted(backend: MetadataBackend, prefix: str) -> None:
    backend.put(prefix + "ba", bytearray(b"\x01\x02"))
    backend.put(prefix + "mv", memoryview(b"\x03\x04"))
    assert backend.get(prefix + "ba") == b"\x01\x02"
    assert backend.get(prefix + "mv") == b"\x03\x04"


def test_large_value_1mib(backend: MetadataBackend, prefix: str) -> None:
    value = ALL_BYTES * 4096  # 1 MiB
    assert len(value) == 1 << 20
    backend.put(prefix + "large", value)
    assert backend.get(prefix + "large") == value


@pytest.mark.parametrize("odd", ODD_KEYS)
def test_keys_with_special_characters_are_stored_verbatim(
    backend: MetadataBackend, prefix: str, odd: str
) -> None:
    key = prefix + odd
    backend.put(key, odd.encode())
    assert backend.get(key) == odd.encode()
    assert backend.delete(key) is True
    assert backend.get(key) is None


def test_keys_equal_after_url_decoding_stay_distinct(backend: MetadataBackend, prefix: str) -> None:
    backend.put(prefix + "a+b", b"plus")
    backend.put(prefix + "a b", b"space")
    backend.put(prefix + "a%2Bb", b"encoded")
    backend.put(prefix + "a%252Bb", b"twice")
    assert backend.get(prefix + "a+b") == b"plus"
    assert backend.get(prefix + "a b") == b"space"
    assert backend.get(prefix + "a%2Bb") == b"encoded"
    assert backend.get(prefix + "a%252Bb") == b"twice"


def test_concurrent_puts_from_threads(backend: MetadataBackend, prefix: str) -> None:
    num_threads, num_puts = 8, 20
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(num_puts):
                backend.put(f"{prefix}{t}/{i}", f"{t}:{i}".encode())
                backend.put(prefix + "shared", f"{t}".encode())
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    for t in range(num_threads):
        for i in range(num_puts):
            assert backend.get(f"{prefix}{t}/{i}") == f"{t}:{i}".encode()
    assert backend.get(prefix + "shared") in {str(t).encode() for t in range(num_threads)}


@pytest.mark.parametrize("bad_key", ["", "   ", None, 7, b"bytes-key"])
def test_bad_keys_are_refused_before_any_io(backend: MetadataBackend, bad_key: object) -> None:
    with pytest.raises(InvalidArgument, match="metadata key"):
        backend.get(bad_key)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="metadata key"):
        backend.put(bad_key, b"v")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="metadata key"):
        backend.delete(bad_key)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_value", ["text", None, 5, [1, 2]])
def test_non_bytes_values_are_refused(
    backend: MetadataBackend, prefix: str, bad_value: object
) -> None:
    with pytest.raises(InvalidArgument, match="metadata value must be bytes"):
        backend.put(prefix + "k", bad_value)  # type: ignore[arg-type]
    assert backend.get(prefix + "k") is None


def test_closed_backend_refuses_calls(backend: MetadataBackend, prefix: str) -> None:
    backend.close()
    backend.close()  # idempotent
    assert backend.closed
    with pytest.raises(MetadataError, match="closed"):
        backend.get(prefix + "k")
    with pytest.raises(MetadataError, match="closed"):
        backend.put(prefix + "k", b"v")
