"""Reads from a remembered place (store/client/early.py), against an in-process master and a
store-node client over real sockets: a single-key get reads the bytes from where the key's
last lookup found them while the master answers a new lookup, and serves them only when
that answer vouches for them."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.early import EARLY_READ_MAX_BYTES, Places
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.master.server import MasterServer
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import GetResult, ReplicaDesc, ReplicaState, Tier
from tests.store.client.test_client import start_master
from tests.store.cluster import content

MIB = 1 << 20
LEASE_S = 0.05


@pytest.fixture
def master() -> Iterator[MasterServer]:
    m = start_master(lease_ttl_s=LEASE_S)
    yield m
    m.stop()


@pytest.fixture
def store(master: MasterServer, node: StoreClient) -> Iterator[StoreClient]:
    with StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB,
                                  rpc_timeout_s=0.5)) as c:
        assert c.put("warm", b"w").ok   # the node is a peer its engine knows (a read can begin)
        yield c


@pytest.fixture
def writer(master: MasterServer, node: StoreClient) -> Iterator[StoreClient]:
    """Another client, whose puts and removes `store` does not see."""
    with StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB)) as c:
        yield c


def early(c: StoreClient) -> tuple[int, int]:
    return c.stats.early_reads, c.stats.early_reads_refused


def test_a_get_after_a_lookup_reads_early_and_serves_the_objects_bytes(
        store: StoreClient, writer: StoreClient) -> None:
    value = content("k", 5000)
    assert writer.put("k", value).ok
    assert store.get("k").data == value               # the ordinary way: the place is kept
    assert early(store) == (0, 0)
    assert store.get("k").data == value
    out = np.zeros(5000, np.uint8)
    store.register_buffer(out)
    assert store.get_into("k", out.ctypes.data, 5000).ok and out.tobytes() == value
    assert early(store) == (2, 0)
    out[:] = 0
    parts = [[(out.ctypes.data, 2000), (out.ctypes.data + 2000, 3000)]]  # two parts: ordinary
    assert store.batch_get_into_parts(["k"], parts)[0].ok and out.tobytes() == value
    big = content("big", EARLY_READ_MAX_BYTES + 1)    # too large to read early
    assert writer.put("big", big).ok and store.get("big").data == big
    assert store.get("big").data == big
    assert [g.data for g in store.get_batch(["k", "k"])] == [value, value]  # a batch: ordinary
    assert early(store) == (2, 0)


def test_a_clients_own_put_is_read_early_at_once(store: StoreClient) -> None:
    """Where its single-key put placed an object, two-phase (a size's first put) or through a
    reservation (the next ones), is where the lookup then finds it."""
    values = [content(f"v{i}", 3000) for i in range(3)]
    for i, value in enumerate(values):
        assert store.put(f"k{i}", value).ok
    out = np.zeros(3000, np.uint8)
    store.register_buffer(out)
    assert store.put_from("z", out.ctypes.data, 3000).ok
    assert [store.get(f"k{i}").data for i in range(3)] == values
    assert store.get_into("z", out.ctypes.data, 3000).ok
    assert early(store) == (4, 0)
    assert all(r.ok for r in store.put_batch(["b1", "b2"], values[:2]))   # a batch: not kept
    assert store.get("b1").data == values[0] and early(store) == (4, 0)


def test_another_objects_bytes_at_a_remembered_place_are_never_served(
        master: MasterServer, store: StoreClient, writer: StoreClient) -> None:
    old, new, other = content("old", 4096), content("new", 4096), content("other", 4096)
    assert writer.put("k", old).ok
    (place,) = store.replica_desc("k").replicas        # a lookup: the place is kept
    assert writer.remove("k", force=True) == E.OK
    time.sleep(4 * LEASE_S)                            # its lease over, the place is free
    assert writer.put("other", other).ok
    assert master.core.get_replicas(["other"])[0].replicas[0].addr == place.addr
    assert writer.put("k", new).ok
    assert store.get("k").data == new                  # read early from `other`'s bytes
    assert early(store) == (1, 1)
    assert store.stats.checksum_mismatches == 0 and master.core.stats.damaged_dropped == 0
    assert store.get("other").data == other


def test_damaged_bytes_at_the_place_are_refused_then_reported_by_the_ordinary_read(
        master: MasterServer, store: StoreClient) -> None:
    value = content("c", 5000)
    assert store.put("c", value).ok
    (rep,) = store.replica_desc("c").replicas          # on the node (this process's memory)
    ctypes.c_ubyte.from_address(rep.addr + 10).value ^= 0xFF
    assert store.get("c") == GetResult(E.CHECKSUM_MISMATCH)
    assert early(store) == (1, 1)
    assert (store.stats.checksum_mismatches, store.stats.damaged_dropped) == (1, 1)
    assert store.get("c").code == E.OBJECT_NOT_FOUND


def test_no_early_reads_from_the_clients_own_segment(master: MasterServer,
                                                     node: StoreClient) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=MIB)) as me:
        assert me.put("mine", b"m" * 100, ReplicateConfig(preferred_segment=me.endpoint)).ok
        assert me.get("mine").data == b"m" * 100 and me.get("mine").data == b"m" * 100
        assert early(me) == (0, 0)


def test_a_key_removed_since_its_last_lookup_is_not_found(store: StoreClient,
                                                          writer: StoreClient) -> None:
    assert writer.put("k", b"v" * 100).ok
    assert store.get("k").ok
    assert writer.remove("k", force=True) == E.OK
    assert store.get("k") == GetResult(E.OBJECT_NOT_FOUND)
    assert early(store) == (1, 1)
    assert store.get("k") == GetResult(E.OBJECT_NOT_FOUND)  # forgotten: no early read
    assert early(store) == (1, 1)


def test_bytes_read_early_are_not_served_without_the_masters_answer(
        master: MasterServer, node: StoreClient) -> None:
    """The master holds the lookup past the call's timeout: the bytes read meanwhile are
    right, yet the get fails with the lookup's code."""
    with StoreClient(ClientConfig(master=master.address, rpc_timeout_s=0.3)) as c:
        value = content("k", 3000)
        assert c.put("k", value).ok and c.get("k").data == value
        with master.lock:
            assert c.get("k") == GetResult(E.RPC_TIMEOUT)
        assert early(c) == (2, 1)
        assert c.get("k").data == value


@pytest.mark.parametrize("flag", ["verify_checksums", "early_reads"])
def test_no_early_reads_without_checksum_verification_or_when_turned_off(
        master: MasterServer, node: StoreClient, flag: str) -> None:
    with StoreClient(ClientConfig(master=master.address, **{flag: False})) as c:
        assert c.put("k", b"x" * 64).ok
        assert c.get("k").data == b"x" * 64 and c.get("k").data == b"x" * 64
        assert early(c) == (0, 0)


def test_places_keep_the_latest_single_key_lookups_of_small_checksummed_objects() -> None:
    def replica(size: int) -> ReplicaDesc:
        return ReplicaDesc("s", "h:1", 4096, size, Tier.DRAM, ReplicaState.COMPLETE, 9)
    places = Places(limit=2)
    for key in ("a", "b", "c"):
        places.remember(key, 10, 7, replica(10))
    assert len(places) == 2 and places.get("a") is None
    assert places.get("c") == (10, 7, replica(10))
    places.remember("b", 10, 7, None)                       # not found
    places.remember("c", 10, None, replica(10))             # no checksum
    places.remember("d", EARLY_READ_MAX_BYTES + 1, 7, replica(EARLY_READ_MAX_BYTES + 1))
    assert len(places) == 0
    places.remember("e", EARLY_READ_MAX_BYTES, 7, replica(EARLY_READ_MAX_BYTES))
    places.forget(["e"])
    assert places.get("e") is None


def test_a_batched_lookup_is_not_remembered(store: StoreClient, writer: StoreClient) -> None:
    assert all(r.ok for r in writer.put_batch(["a", "b"], [b"1" * 10, b"2" * 10]))
    assert [g.data for g in store.get_batch(["a", "b"])] == [b"1" * 10, b"2" * 10]
    assert store._places.get("a") is None and store._places.get("b") is None
    assert store.get("a").data == b"1" * 10 and store._places.get("a") is not None


def test_a_clients_own_removes_and_batched_upserts_forget_places(store: StoreClient) -> None:
    assert store.put("k", b"v" * 10).ok
    assert store.remove("k", force=True) == E.OK
    assert store.get("k") == GetResult(E.OBJECT_NOT_FOUND) and early(store) == (0, 0)
    for remove in (lambda: store.remove_all(True), lambda: store.remove_regex("^a", True)):
        assert store.put("a", b"v" * 10).ok and store._places.get("a") is not None
        assert remove() >= 1 and store._places.get("a") is None
    assert store.put("b", b"1" * 10).ok and store.put("c", b"2" * 10).ok
    assert all(r.ok for r in store.put_batch(["b", "c"], [b"3" * 10, b"4" * 10], upsert=True))
    assert store._places.get("b") is None and store._places.get("c") is None
    assert store.upsert("b", b"5" * 10).ok and store._places.get("b") is not None
    assert store.get("b").data == b"5" * 10 and early(store) == (1, 0)
