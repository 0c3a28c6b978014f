"""The calls the engines make that kvpool added for them: get and put sessions with ranged
reads and writes (SGLang's layer-wise direct path), `get_into_ranges`,
`batch_is_exist_no_lease` (vLLM after 0.33), `setup_dummy` (SGLang's standalone storage) and
`bind_to_numa_node` (LMCache). Values match the real wheel where it has the call (the
differential script checks the same sequences live)."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

from kvpool.compat.mooncake.store import MooncakeDistributedStore, bind_to_numa_node
from tests.compat.conftest import LEASE_MS, Master, StoreFactory

MIB = 1 << 20


def _buffer(n: int, fill: int) -> tuple[ctypes.Array[ctypes.c_ubyte], int]:
    raw = (ctypes.c_ubyte * n)(*[(i * 7 + fill) % 256 for i in range(n)])
    return raw, ctypes.addressof(raw)


def test_layer_wise_load_as_sglang_direct_linker(store: MooncakeDistributedStore) -> None:
    """Pages of 4 layers, one object per page holding [layer0 | layer1 | ...]; the loader
    thread starts a session, reads each layer's slice of every page into that layer's host
    buffer, and ends the session in `finally`."""
    num_layers, page_bytes, keys = 4, 256, [f"page-{i}" for i in range(6)]
    src_raw, src = _buffer(num_layers * page_bytes * len(keys), 1)
    assert store.register_buffer(src, len(src_raw)) == 0
    obj = num_layers * page_bytes
    assert store.batch_put_from(keys, [src + i * obj for i in range(len(keys))],
                                [obj] * len(keys)) == [0] * len(keys)
    layers = [_buffer(page_bytes * len(keys), 0) for _ in range(num_layers)]
    for _, ptr in layers:
        assert store.register_buffer(ptr, page_bytes * len(keys)) == 0
    results: list[object] = []

    def load() -> None:
        started = store.batch_get_session_start(keys)
        try:
            assert list(started) == [0] * len(keys)
            for layer, (_, ptr) in enumerate(layers):
                got = store.batch_get_into_multi_buffer_ranges(
                    keys, [[ptr + i * page_bytes] for i in range(len(keys))],
                    [[page_bytes]] * len(keys), [[layer * page_bytes]] * len(keys))
                results.append(list(got))
        finally:
            results.append(store.batch_get_session_end(keys))

    worker = threading.Thread(target=load)
    worker.start()
    worker.join(30)
    assert results == [[page_bytes] * len(keys)] * num_layers + [0]
    for layer, (raw, _) in enumerate(layers):
        for i in range(len(keys)):
            start = i * obj + layer * page_bytes
            assert bytes(raw[i * page_bytes:(i + 1) * page_bytes]) == \
                bytes(src_raw[start:start + page_bytes])


def test_session_codes_and_lease(store: MooncakeDistributedStore) -> None:
    raw, ptr = _buffer(4096, 3)
    assert store.register_buffer(ptr, 4096) == 0
    assert store.put_from("a", ptr, 1000) == 0
    dst_raw, dst = _buffer(1024, 0)
    assert store.register_buffer(dst, 1024) == 0
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst]], [[8]], [[0]]) == [-600]
    assert store.batch_get_session_start(["a", "missing", ""]) == [0, -704, -704]
    assert store.remove("a") == -706  # the session holds a read lease
    time.sleep(LEASE_MS / 1000 + 0.3)  # the lease ran out: ranged reads look up again
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst]], [[8]], [[992]]) == [8]
    assert bytes(dst_raw[:8]) == bytes(raw[992:1000])
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst]], [[8]], [[993]]) == [-600]
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst + 2000]], [[8]], [[0]]) \
        == [-600]  # unregistered memory
    assert store.batch_get_session_end(["a", "never-started"]) == 0


def test_put_sessions(store: MooncakeDistributedStore) -> None:
    raw, ptr = _buffer(512, 5)
    assert store.register_buffer(ptr, 512) == 0
    assert store.put("old", b"x") == 0
    assert store.batch_put_session_start(["n1", "n2", "old"], [64, 32, 1]) == [0, 0, -705]
    assert store.batch_put_from_multi_buffer_ranges(
        ["n1", "n2", "nosession"], [[ptr + 32, ptr], [ptr + 100], [ptr]],
        [[32, 32], [32], [1]], [[32, 0], [0], [0]]) == [64, 32, -600]
    assert store.batch_put_from_multi_buffer_ranges(["n1"], [[ptr]], [[8]], [[60]]) == [-600]
    assert store.batch_is_exist(["n1", "n2"]) == [0, 0]
    assert store.batch_put_session_end(["n1"]) == [0]
    assert store.batch_put_session_revoke(["n2", "n2"]) == [0, -600]
    assert store.batch_put_session_end(["n2"]) == [-600]
    assert store.batch_put_session_start(["z", "z2"], [0, 8]) == [-600, 0]
    assert store.batch_put_session_start(["z2"], [8]) == [-600]  # already open
    assert store.get("n1") == bytes(raw[0:32]) + bytes(raw[32:64])
    assert store.batch_is_exist(["n1", "n2"]) == [1, 0]


def test_a_put_session_that_lost_its_key_to_another_put_says_so(
        store: MooncakeDistributedStore) -> None:
    """Another client puts the key while the session is open: the session's end answers
    -705 (its bytes are not stored) instead of 0 over the other client's value."""
    raw, ptr = _buffer(64, 9)
    assert store.register_buffer(ptr, 64) == 0
    assert store.batch_put_session_start(["k"], [64]) == [0]
    assert store.batch_put_from_multi_buffer_ranges(["k"], [[ptr]], [[64]], [[0]]) == [64]
    assert store.put("k", b"the other client's") == 0
    assert store.batch_put_session_end(["k"]) == [-705]
    assert store.get("k") == b"the other client's"


def test_get_into_ranges(store: MooncakeDistributedStore) -> None:
    raw, ptr = _buffer(256, 9)
    dst_raw, dst = _buffer(256, 0)
    assert store.register_buffer(ptr, 256) == 0 and store.register_buffer(dst, 256) == 0
    assert store.batch_put_from(["x", "y"], [ptr, ptr + 128], [128, 128]) == [0, 0]
    got = store.get_into_ranges([dst], [["x", "y", "missing"]], [[[0, 16], [64], [128]]],
                                [[[0, 100], [5], [0]]], [[[16, 28], [8], [4]]])
    assert got == [[[16, 28], [8], [-704]]]
    assert bytes(dst_raw[16:44]) == bytes(raw[100:128])
    assert bytes(dst_raw[64:72]) == bytes(raw[133:141])
    assert store.get_into_ranges([dst], [["x"]], [[[0]]], [[[125]]], [[[8]]]) == [[[-600]]]
    assert store.get_into_ranges([dst], [["x"]], [[[0, 1]]], [[[0]]], [[[8]]]) == [[[-600] * 2]]
    assert store.get_into_ranges([dst, dst], [["x"]], [[[0]]], [[[0]]], [[[8]]]) == \
        [[[-600]], [[-600]]]
    assert store.get_into_ranges([dst], [["x", "y"]], [[[0]]], [[[0]]], [[[8]]]) == \
        [[[-600], [-600]]]  # lists shorter than the keys fail the whole buffer
    assert store.get_into_ranges([dst], [[""]], [[[0]]], [[[0]]], [[[8]]]) == [[[-704]]]


def test_exist_without_lease(store: MooncakeDistributedStore) -> None:
    """vLLM's scheduler-side lookups must not pin what they only ask about."""
    assert store.put("k", b"v") == 0 and store.put("leased", b"v") == 0
    assert store.batch_is_exist_no_lease(["k", "missing", ""]) == [1, 0, 0]
    assert store.remove("k") == 0  # no lease was granted
    assert store.batch_is_exist(["leased"]) == [1]
    assert store.remove("leased") == -706


def test_setup_dummy_joins_as_a_pure_client(master: Master, monkeypatch: pytest.MonkeyPatch,
                                           make_store: StoreFactory) -> None:
    owner = make_store(segment=16 * MIB)
    dummy = MooncakeDistributedStore()
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    assert dummy.setup_dummy(8 * MIB, 4 * MIB, "127.0.0.1:50052") == -1  # nowhere to go
    monkeypatch.setenv("MOONCAKE_MASTER", master.address)
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    try:
        assert dummy.setup_dummy(8 * MIB, 4 * MIB, "127.0.0.1:50052") == 0
        assert dummy.put("warm", bytes(4096)) == 0 and owner.get("warm") == bytes(4096)
        assert dummy.is_exist("warm") == 1
    finally:
        assert dummy.close() == 0


def test_bind_to_numa_node_keeps_working() -> None:
    before = os.sched_getaffinity(0)
    try:
        bind_to_numa_node(0)
        assert os.sched_getaffinity(0)
        bind_to_numa_node(4096)  # no such node: left as it was
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("call", ["session", "get_into_ranges"])
def test_a_ranged_read_that_outlives_its_lease_is_refused(store: MooncakeDistributedStore,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          call: str) -> None:
    """The reader is held up between its lookup and its copy past the read lease while the
    object is removed and another put may take its memory: the read answers -707 (lease
    expired), never the byte count over bytes that may be another object's (ranged reads
    have no checksum to tell)."""
    raw, ptr = _buffer(64 * 1024, 5)
    dst_raw, dst = _buffer(64 * 1024, 0)
    assert store.register_buffer(ptr, len(raw)) == 0 and store.register_buffer(dst, len(dst_raw)) == 0
    assert store.put_from("a", ptr, 32 * 1024) == 0
    run_copies = store.client._run_copies

    def late(*args: object, **kw: object) -> object:
        assert store.remove("a", force=True) == 0
        assert store.put_from("filler", ptr + 32 * 1024, 32 * 1024) == 0
        time.sleep(LEASE_MS / 1000 + 0.2)
        return run_copies(*args, **kw)  # type: ignore[arg-type]

    if call == "session":
        assert store.batch_get_session_start(["a"]) == [0]
        monkeypatch.setattr(store.client, "_run_copies", late)
        got: object = store.batch_get_into_multi_buffer_ranges(["a"], [[dst]], [[4096]], [[0]])
        assert got == [-707]
    else:
        monkeypatch.setattr(store.client, "_run_copies", late)
        got = store.get_into_ranges([dst], [["a"]], [[[0]]], [[[0]]], [[[4096]]])
        assert got == [[[-707]]]


def test_a_session_never_reads_another_value_of_its_object(store: MooncakeDistributedStore) -> None:
    """A session whose lease ran out looks its object up again: if the key holds another
    value by then (another checksum), its ranges would build an object that never existed
    (first layers of one value, later layers of another): -707, and the session is over."""
    raw, ptr = _buffer(8192, 1)
    dst_raw, dst = _buffer(4096, 0)
    assert store.register_buffer(ptr, 8192) == 0 and store.register_buffer(dst, 4096) == 0
    assert store.put_from("a", ptr, 4096) == 0
    assert store.batch_get_session_start(["a"]) == [0]
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst]], [[2048]], [[0]]) == [2048]
    time.sleep(LEASE_MS / 1000 + 0.3)  # a slow layer: the session's lease ran out
    ctypes.memset(ptr + 4096, 0x5A, 4096)
    assert store.upsert_from("a", ptr + 4096, 4096) == 0  # the same size, other bytes
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst + 2048]], [[2048]],
                                                    [[2048]]) == [-707]
    assert store.batch_get_into_multi_buffer_ranges(["a"], [[dst]], [[8]], [[0]]) == [-600]
    assert bytes(dst_raw[:2048]) == bytes(raw[:2048])


def test_ranged_reads_take_dram_replicas_only() -> None:
    """A copy loaded from disk is listed after its disk replica: a ranged read never sends a
    READ to the disk replica's address (nothing of the object is there)."""
    from types import SimpleNamespace

    from kvpool.clock import VirtualClock
    from kvpool.compat.mooncake.store_ranges import StoreRanges
    from kvpool.store.wire.codes import ErrorCode, Tier
    from tests.store.master.test_ssd_tiering import load, offloaded

    clock = VirtualClock()
    core, ssd_id, key = offloaded(clock, promote_after=5)
    load(core, ssd_id, key, clock)
    look = core.get_replicas([key])[0]
    assert look.code is ErrorCode.OK and [r.tier for r in look.replicas] == [Tier.SSD, Tier.DRAM]
    targets: list[tuple[str, int]] = []

    def run_copies(op, copies, arrivals=None):  # type: ignore[no-untyped-def]
        targets.extend((c.target, c.target_addr) for cs in copies.values() for c in cs)
        return set()

    ranges = StoreRanges.__new__(StoreRanges)
    ranges._client = SimpleNamespace(endpoint="127.0.0.1:1", host="127.0.0.1", clock=clock,
                                     _run_copies=run_copies)
    ranges._registered = lambda parts: True  # type: ignore[method-assign]
    assert ranges._read_ranges([look], [[(0x1000, 0, 64)]], [clock.now()]) == [64]
    dram = look.replicas[1]
    assert targets == [(dram.endpoint, dram.addr)]
