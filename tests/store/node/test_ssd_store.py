"""The node's disk store on real files: round trips, and every kind of bad file is discarded,
never served."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from kvpool.store.node.ssd import HEADER_BYTES, SsdStore, file_name

PAYLOAD = bytes(range(256)) * 40


def stored(tmp_path: Path, keys: tuple[str, ...] = ("a", "b")) -> SsdStore:
    store = SsdStore(str(tmp_path))
    for i, key in enumerate(keys):
        data = PAYLOAD + key.encode()
        store.write(key, memoryview(data), xxhash.xxh3_64_intdigest(data), gen=100 + i)
    store.check_integrity()
    return store


def read(store: SsdStore, key: str, gen: int) -> bytes | None:
    out = bytearray(len(PAYLOAD) + len(key.encode()))
    return bytes(out) if store.read_into(key, gen, memoryview(out)) else None


def test_round_trip_and_scan(tmp_path: Path) -> None:
    store = stored(tmp_path)
    assert read(store, "a", 100) == PAYLOAD + b"a"
    again = SsdStore(str(tmp_path))
    scan = again.scan()
    assert sorted(e.key for e in scan.entries) == ["a", "b"] and scan.num_discarded == 0
    assert again.entries["b"].gen == 101
    assert read(again, "b", 101) == PAYLOAD + b"b"
    again.check_integrity()


def test_generation_guards_read_and_delete(tmp_path: Path) -> None:
    store = stored(tmp_path)
    assert read(store, "a", 999) is None            # another generation: not served, kept
    assert not store.delete("a", gen=999)
    assert read(store, "a", 100) is not None
    assert store.delete("a", gen=100) and not os.path.exists(store.path("a"))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_corrupt_truncated_torn_and_temporary_files_are_discarded(tmp_path: Path) -> None:
    store = stored(tmp_path, ("payload", "key", "short", "empty", "good"))
    flip(store.path("payload"), os.path.getsize(store.path("payload")) - 3)
    flip(store.path("key"), HEADER_BYTES)             # a bit of the key
    os.truncate(store.path("short"), os.path.getsize(store.path("short")) - 1)
    os.truncate(store.path("empty"), 10)               # torn inside the header
    (tmp_path / (file_name("tmp") + ".tmp123")).write_bytes(b"partial")
    (tmp_path / ".lock").write_bytes(b"")              # not ours: left alone
    scan = SsdStore(str(tmp_path)).scan()
    assert [e.key for e in scan.entries] == ["good"] and scan.num_discarded == 5
    assert sorted(os.listdir(tmp_path)) == sorted([".lock", file_name("good")])


def test_a_file_corrupted_after_the_scan_fails_its_read(tmp_path: Path) -> None:
    store = stored(tmp_path)
    flip(store.path("a"), os.path.getsize(store.path("a")) - 1)
    assert read(store, "a", 100) is None
    assert "a" not in store.entries and not os.path.exists(store.path("a"))
    assert store.num_discarded == 1


def test_a_file_under_another_keys_name_is_discarded(tmp_path: Path) -> None:
    store = stored(tmp_path)
    os.rename(store.path("a"), store.path("zzz"))
    scan = SsdStore(str(tmp_path)).scan()
    assert [e.key for e in scan.entries] == ["b"] and scan.num_discarded == 1


def test_one_node_per_directory(tmp_path: Path) -> None:
    import pytest

    from kvpool.errors import ConfigError
    from kvpool.store.node.ssd_worker import _lock_dir

    fd = _lock_dir(str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="in use"):
            _lock_dir(str(tmp_path))
    finally:
        os.close(fd)
    os.close(_lock_dir(str(tmp_path)))   # free again once the holder is gone


def test_fsync_mode_round_trips_through_a_temporary_file(tmp_path: Path) -> None:
    store = SsdStore(str(tmp_path), fsync=True)
    data = PAYLOAD + b"f"
    store.write("f", memoryview(data), xxhash.xxh3_64_intdigest(data), gen=7)
    assert sorted(os.listdir(tmp_path)) == [file_name("f")]    # no temporary left
    assert read(store, "f", 7) is not None
    store.check_integrity()


def test_an_overwrite_in_place_replaces_the_older_generation(tmp_path: Path) -> None:
    store = stored(tmp_path)
    data = PAYLOAD[::-1] + b"a"
    store.write("a", memoryview(data), xxhash.xxh3_64_intdigest(data), gen=555)
    assert read(store, "a", 100) is None                         # the old generation: gone
    out = bytearray(len(data))
    assert store.read_into("a", 555, memoryview(out)) and bytes(out) == data
    store.check_integrity()
    os.truncate(tmp_path / file_name("a"), HEADER_BYTES + 1 + 10)  # torn by a crash
    assert SsdStore(str(tmp_path)).scan().num_discarded == 1
