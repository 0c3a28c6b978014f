"""The metadata server's state file: the frame codec fed byte by byte and cut at every
length, the durable backend reopened after puts, deletes, compaction and damage, and
`kvpool metadata --state-file` SIGKILLed (idle and in the middle of a stream of writes)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from kvpool.errors import MetadataError
from kvpool.metadata.durable import DurableBackend, load_state
from kvpool.metadata.journal import DeleteRecord, PutRecord, decode_frames, encode_frame, replay
from tests.support.net import free_port, wait_port
from tests.support.procs import python_env

RECORDS = [PutRecord("a", b"1"), PutRecord("b", b"\x00" * 300), DeleteRecord("a"),
           PutRecord("c/\u00e9", b""), PutRecord("b", b"new")]


def test_every_cut_of_a_log_replays_a_prefix_of_its_changes() -> None:
    frames = [encode_frame(r) for r in RECORDS]
    data = b"".join(frames)
    ends = [sum(len(f) for f in frames[:i + 1]) for i in range(len(frames))]
    for cut in range(len(data) + 1):
        records, good = decode_frames(data[:cut])
        whole = sum(1 for e in ends if e <= cut)
        assert records == RECORDS[:whole] and good == (ends[whole - 1] if whole else 0)
    assert replay(RECORDS) == {"b": b"new", "c/\u00e9": b""}


def test_a_flipped_byte_stops_replay_at_that_frame() -> None:
    data = bytearray(b"".join(encode_frame(r) for r in RECORDS))
    second = len(encode_frame(RECORDS[0]))
    for pos in range(second, second + len(encode_frame(RECORDS[1]))):
        damaged = bytearray(data)
        damaged[pos] ^= 0x40
        records, good = decode_frames(bytes(damaged))
        assert records == RECORDS[:1] and good == second, pos


def test_reopen_restores_puts_and_deletes(tmp_path: Path) -> None:
    path = tmp_path / "meta.state"
    with DurableBackend(path) as store:
        store.put("k1", b"v1")
        store.put("k2", b"v2")
        assert store.put_within("k3", b"x" * 10, 1000)
        assert not store.put_within("k4", b"x" * 2000, 1000)
        assert store.delete("k1") and not store.delete("nope")
        store.put("k2", b"v2b")
    with DurableBackend(path) as store:
        assert {k: store.get(k) for k in store.keys()} == {"k2": b"v2b", "k3": b"x" * 10}
        assert store.total_bytes == 13


def test_torn_tail_is_dropped_and_the_file_rewritten_clean(tmp_path: Path) -> None:
    path = tmp_path / "meta.state"
    with DurableBackend(path) as store:
        store.put("kept", b"yes")
    with open(path, "ab") as f:
        f.write(encode_frame(PutRecord("torn", b"z" * 100))[:-7])
    with DurableBackend(path) as store:
        assert store.keys() == ["kept"]
        store.put("after", b"1")
    assert load_state(path) == {"kept": b"yes", "after": b"1"}


def test_file_is_compacted_past_twice_the_live_data(tmp_path: Path) -> None:
    path = tmp_path / "meta.state"
    with DurableBackend(path, fsync=False) as store:
        for i in range(3000):
            store.put(f"k{i % 10}", bytes([i % 256]) * 1000)
        assert path.stat().st_size < 2 * 10_000 + (1 << 20) + 2000
    assert load_state(path) == {f"k{i}": bytes([(2990 + i) % 256]) * 1000 for i in range(10)}
    assert not path.with_name(path.name + ".tmp").exists()


def test_unwritable_state_file_refuses_the_change(tmp_path: Path) -> None:
    store = DurableBackend(tmp_path / "meta.state")
    store.put("a", b"1")
    import os
    os.close(store._fd)                # the disk goes away under the server
    with pytest.raises(MetadataError, match="cannot write metadata state file"):
        store.put("b", b"2")
    assert store.get("b") is None and store.get("a") == b"1"
    store._fd = -1


def start(state: Path, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "metadata", "--port", str(port),
                             "--state-file", str(state)], env=python_env(), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_port(port, timeout_s=30)
    return proc


def test_sigkilled_server_restarts_with_every_key(tmp_path: Path) -> None:
    state, port = tmp_path / "meta.state", free_port()
    url = f"http://127.0.0.1:{port}/metadata"
    proc = start(state, port)
    try:
        for i in range(20):
            assert httpx.put(url, params={"key": f"seg/{i}"}, content=f"v{i}".encode()).is_success
        assert httpx.delete(url, params={"key": "seg/3"}).status_code == 200
        proc.kill()
        proc.wait()
        proc = start(state, port)
        for i in range(20):
            got = httpx.get(url, params={"key": f"seg/{i}"})
            assert (got.status_code, got.content) == ((404, got.content) if i == 3
                                                      else (200, f"v{i}".encode()))
    finally:
        proc.kill()
        proc.wait()


def write_until_refused(url: str, w: int, acked: dict[str, bytes],
                        last_sent: dict[str, bytes], lock: threading.Lock) -> None:
    """Overwrite keys w{w}/0..19 with fresh values until the server stops answering."""
    rng = random.Random(w)
    with httpx.Client(timeout=5) as http:
        for n in range(100_000):
            key, value = f"w{w}/{rng.randrange(20)}", f"{w}-{n}-".encode() * rng.randrange(1, 300)
            with lock:
                last_sent[key] = value
            try:
                ok = http.put(url, params={"key": key}, content=value).status_code == 200
            except httpx.HTTPError:
                return
            if ok:
                with lock:
                    acked[key] = value


def test_sigkill_in_the_middle_of_writes_keeps_every_acknowledged_one(tmp_path: Path) -> None:
    """Four writers PUT and overwrite keys as fast as they can; the server is SIGKILLed
    under them. Every value acknowledged with 200 (the latest per key) is there after the
    restart; a value whose PUT got no answer is there with its bytes or not at all."""
    state, port = tmp_path / "meta.state", free_port()
    url = f"http://127.0.0.1:{port}/metadata"
    proc = start(state, port)
    acked: dict[str, bytes] = {}
    last_sent: dict[str, bytes] = {}
    lock = threading.Lock()

    threads = [threading.Thread(target=write_until_refused, args=(url, w, acked, last_sent, lock))
               for w in range(4)]
    try:
        for t in threads:
            t.start()
        threading.Event().wait(1.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for t in threads:
            t.join(30)
        proc = start(state, port)
        assert len(acked) > 10
        with httpx.Client(timeout=5) as http:
            for key, sent in last_sent.items():   # each key has one writer, one PUT at a time
                got = http.get(url, params={"key": key})
                found = got.content if got.status_code == 200 else None
                assert found in (sent, acked.get(key)), (key, got.status_code)
    finally:
        proc.kill()
        proc.wait()
