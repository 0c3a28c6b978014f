"""The client library against an in-process master and a store-node client."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.store.client.aio import AsyncStoreClient
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import MasterConfig, ReplicateConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.codes import GetResult
from tests.store.cluster import content
from tests.support.net import free_port
from tests.support.wait import wait_for

MIB = 1 << 20


def start_master(port: int = 0, **cfg: object) -> MasterServer:
    server = MasterServerConfig(rpc_port=port, admin_port=0, enable_http_metadata=False,
                                tick_interval_s=0.05)
    return MasterServer(server, MasterConfig(**cfg)).start()  # type: ignore[arg-type]


@pytest.fixture
def master() -> Iterator[MasterServer]:
    m = start_master(lease_ttl_s=0.5)
    yield m
    m.stop()


@pytest.fixture
def store(master: MasterServer, node: StoreClient) -> Iterator[StoreClient]:
    with StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB)) as c:
        yield c


def test_bytes_api(store: StoreClient, master: MasterServer) -> None:
    assert store.put("a", b"hello").ok
    assert store.get("a").data == b"hello"
    again = store.put("a", b"other")
    assert again.ok and again.already_existed
    assert store.get("a").data == b"hello"
    assert store.upsert("a", b"replaced!").ok
    assert store.get("a").data == b"replaced!"
    assert store.size("a").size == 9
    assert store.exists("a") == E.OK and store.exists("b") == E.OBJECT_NOT_FOUND
    assert store.get("b").code == E.OBJECT_NOT_FOUND and store.get("b").data == b""
    assert store.remove("a") == E.OBJECT_HAS_LEASE
    assert store.remove("a", force=True) == E.OK
    assert store.put_parts("p", b"ab", bytearray(b"cd"), memoryview(b"ef")).ok
    assert store.get("p").data == b"abcdef"
    big = content("big", 3 * MIB)         # larger than the staging buffer
    assert store.put("big", big).ok and store.get("big").data == big
    with master.lock:
        master.core.check_integrity()


def test_batches_and_bad_input(store: StoreClient) -> None:
    keys = [f"k{i}" for i in range(40)]
    vals = [content(k, 100 + i) for i, k in enumerate(keys)]
    assert all(r.ok for r in store.put_batch(keys, vals))
    got = store.get_batch(keys + ["missing", "", "sp ace"])
    assert [g.data for g in got[:40]] == vals
    assert [g.code for g in got[40:]] == [E.OBJECT_NOT_FOUND, E.INVALID_PARAMS,
                                          E.INVALID_PARAMS]
    assert store.batch_exists(["k0", "zz", "x" * 5000]) == [E.OK, E.OBJECT_NOT_FOUND,
                                                           E.INVALID_PARAMS]
    assert [(s.code, s.size) for s in store.batch_size(["k1", "zz"])] == [
        (E.OK, 101), (E.OBJECT_NOT_FOUND, 0)]
    assert [r.code for r in store.put_batch(["x", "y"], [b"1"])] == [E.INVALID_PARAMS] * 2
    assert store.put("", b"x").code == E.INVALID_PARAMS
    assert store.put("empty", b"").code == E.INVALID_PARAMS
    assert store.batch_remove(["k1", "nope"], force=True) == [E.OK, E.OBJECT_NOT_FOUND]
    assert store.remove_regex("^k[0-4]$", force=True) == 4
    assert store.remove_regex("(") == E.INVALID_PARAMS
    assert store.remove_all(force=True) == 35
    bad: Any = ["k2"]  # not a str: INVALID_PARAMS, one key or many, never a TypeError
    assert store.get(bad).code == E.INVALID_PARAMS
    assert store.get_batch([bad])[0].code == E.INVALID_PARAMS
    assert store.size(bad).code == E.INVALID_PARAMS and store.remove(bad) == E.INVALID_PARAMS


def test_zero_copy_numpy_torch_and_raw(store: StoreClient) -> None:
    src = np.frombuffer(content("np", MIB), np.uint8).copy()
    dst = np.zeros(MIB + 100, np.uint8)
    s, d = store.register_buffer(src), store.register_buffer(dst)
    assert store.put_from("np", s.addr, MIB).ok
    read = store.get_into("np", d.addr, dst.nbytes)
    assert read.ok and read.num_bytes == MIB and read.value == MIB
    assert np.array_equal(dst[:MIB], src) and not dst[MIB:].any()
    assert store.get_into("np", d.addr, MIB - 1).code == E.INVALID_PARAMS  # too small
    t = torch.arange(4096, dtype=torch.float32)
    out = torch.zeros_like(t)
    tb, ob = store.register_buffer(t), store.register_buffer(out)
    assert store.put_from("tensor", tb.addr, tb.length).ok
    assert store.get_into("tensor", ob.addr, ob.length).ok
    assert torch.equal(t, out)
    raw = (ctypes.c_ubyte * 4096)()
    ctypes.memset(raw, 7, 4096)
    store.register_buffer(ctypes.addressof(raw), 4096)
    assert store.put_from("raw", ctypes.addressof(raw), 4096).ok
    assert store.get("raw").data == b"\x07" * 4096
    res = store.batch_put_from(["b0", "b1"], [s.addr, s.addr + 10], [10])
    assert [r.code for r in res] == [E.INVALID_PARAMS] * 2


def test_scatter_gather_k_and_v_across_layers(store: StoreClient) -> None:
    layers = 4
    k = [torch.full((16, 8), float(i)) for i in range(layers)]
    v = [torch.full((16, 8), float(-i)) for i in range(layers)]
    bufs = [store.register_buffer(t) for t in k + v]
    parts = [(b.addr, b.length) for b in bufs]
    assert store.batch_put_from_parts(["block"], [parts])[0].ok
    assert store.size("block").size == 2 * layers * 16 * 8 * 4
    k2 = [torch.zeros(16, 8) for _ in range(layers)]
    v2 = [torch.zeros(16, 8) for _ in range(layers)]
    out = [store.register_buffer(t) for t in v2 + k2]   # a different layout on the way back
    (res,) = store.batch_get_into_parts(["block"], [[(b.addr, b.length) for b in out]])
    assert res.ok and res.num_bytes == 2 * layers * 512
    assert all(torch.equal(a, b) for a, b in zip(v2 + k2, k + v, strict=True))
    assert store.batch_get_into_parts(["block"], [[]])[0].code == E.INVALID_PARAMS


def test_own_segment_and_replicas(master: MasterServer, node: StoreClient) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=4 * MIB)) as me:
        mine = ReplicateConfig(preferred_segment=me.endpoint)
        assert me.put("local", b"L" * 5000, mine).ok
        assert [r.endpoint for r in me.replica_desc("local").replicas] == [me.endpoint]
        assert me.get("local").data == b"L" * 5000
        both = ReplicateConfig(replica_num=2)
        assert me.put("two", b"T" * 700, both).ok
        desc = me.replica_desc("two")
        assert sorted(r.endpoint for r in desc.replicas) == sorted([me.endpoint,
                                                                    node.endpoint])
        assert node.get("two").data == b"T" * 700
        assert me.put("three", b"x", ReplicateConfig(replica_num=3)).code \
            == E.NO_AVAILABLE_HANDLE
    assert node.get("local").code == E.OBJECT_NOT_FOUND   # unmounted on close
    assert [r.endpoint for r in node.replica_desc("two").replicas] == [node.endpoint]


def test_master_unreachable_gives_rpc_codes() -> None:
    cfg = ClientConfig(master=f"127.0.0.1:{free_port()}", rpc_timeout_s=0.2)
    with StoreClient(cfg) as c:
        assert c.put("k", b"v").code == E.RPC_TIMEOUT
        assert c.get("k").code == E.RPC_TIMEOUT
        assert c.exists("k") == E.RPC_TIMEOUT
        assert c.remove_all() == E.RPC_TIMEOUT


def test_node_mounts_again_after_master_restart() -> None:
    port = free_port()
    first = start_master(port)
    with StoreClient(ClientConfig(master=f"127.0.0.1:{port}", global_segment_size=MIB,
                                  heartbeat_interval_s=0.1, rpc_timeout_s=0.5)) as n:
        (old,) = first.core.segments.values()
        first.stop()
        second = start_master(port)
        try:
            wait_for(lambda: second.core.segments, 10.0, "the node to mount again", 0.05)
            assert [s.segment_id for s in second.core.segment_infos()] == n.segment_ids
            (new,) = second.core.segments.values()     # fenced anew before mounting again
            assert new.fence not in (0, old.fence)
            assert new.fence == n._segments[new.segment_id].fence.value
        finally:
            second.stop()


def test_asyncio_client(master: MasterServer, node: StoreClient) -> None:
    async def main() -> None:
        client = await AsyncStoreClient.connect(ClientConfig(master=master.address))
        async with client:
            keys = [f"a{i}" for i in range(20)]
            puts = await asyncio.gather(*(client.put(k, content(k, 3000)) for k in keys))
            assert all(p.ok for p in puts)
            gets = await asyncio.gather(*(client.get(k) for k in keys))
            assert [g.data for g in gets] == [content(k, 3000) for k in keys]
            assert await client.exists("a3") == E.OK
            assert (await client.size("a3")).size == 3000
            assert await client.remove("a3", force=True) == E.OK
            assert [g.code for g in await client.get_batch(["a3", "a4"])] == [
                E.OBJECT_NOT_FOUND, E.OK]
    asyncio.run(main())


def test_a_cancelled_async_call_ends_only_once_its_blocking_call_has_returned() -> None:
    """Cancelling the task of an async get_into raises CancelledError only once the thread
    has stopped copying into the caller's buffer (which the caller then reuses)."""
    release, finished = threading.Event(), []

    class Copying:  # the blocking client, copying until released
        def get_into(self, key: str, addr: int, size: int) -> str:
            release.wait(5)
            finished.append(key)
            return "done"

        def close(self) -> None:
            pass

    async def main() -> None:
        client = AsyncStoreClient(Copying())  # type: ignore[arg-type]
        task = asyncio.ensure_future(client.get_into("k", 0, 1))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.2)
        assert not task.done()                     # still copying: the buffer is not back
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == ["k"]
        await client.close()
    asyncio.run(main())


def test_stale_own_replica_is_never_touched(master: MasterServer, node: StoreClient) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=MIB)) as me:
        (sid,) = me.segment_ids
        assert me.put("mine", b"m" * 100, ReplicateConfig(preferred_segment=sid)).ok
        buf = me._segments.pop(sid)        # as if a failed unmount had already freed it
        try:
            assert me.get("mine").code == E.TRANSFER_FAIL
        finally:
            me._segments[sid] = buf
        assert me.get("mine").data == b"m" * 100


def _corrupt_own_replica(me: StoreClient, key: str, at: int = 10) -> None:
    (rep,) = me.replica_desc(key).replicas
    ctypes.c_ubyte.from_address(rep.addr + at).value ^= 0xFF


def test_corrupted_replica_is_refused_and_dropped(master: MasterServer,
                                                  node: StoreClient) -> None:
    """Bytes that fail the checksum are never returned, and the damaged object leaves the
    pool (the master drops it on the reader's report): the next get finds nothing, and a
    put of the same key stores it anew."""
    with StoreClient(ClientConfig(master=master.address, global_segment_size=MIB)) as me:
        mine = ReplicateConfig(preferred_segment=me.endpoint)
        value = content("c", 5000)
        for key in ("c", "z", "p"):
            assert me.put(key, value, mine).ok
        _corrupt_own_replica(me, "c")
        _corrupt_own_replica(me, "z", 4999)
        _corrupt_own_replica(me, "p", 0)
        with StoreClient(ClientConfig(master=master.address,
                                      verify_checksums=False)) as trusting:
            assert trusting.get("c").ok and trusting.get("c").data != value
        assert me.get("c") == GetResult(E.CHECKSUM_MISMATCH)
        out = np.zeros(5000, np.uint8)
        me.register_buffer(out)
        assert me.get_into("z", out.ctypes.data, 5000).code == E.CHECKSUM_MISMATCH
        parts = [[(out.ctypes.data, 2000), (out.ctypes.data + 2000, 3000)]]
        assert me.batch_get_into_parts(["p"], parts)[0].value == int(E.CHECKSUM_MISMATCH)
        assert (me.stats.checksum_mismatches, me.stats.damaged_dropped) == (3, 3)
        assert [r.code for r in me.get_batch(["c", "z", "p"])] == [E.OBJECT_NOT_FOUND] * 3
        assert me.put("c", value, mine).ok and me.get("c").data == value
        assert master.core.stats.damaged_dropped == 3
        master.core.check_integrity()


def test_a_corrupted_replica_falls_back_to_an_intact_one_and_is_dropped(
        master: MasterServer, node: StoreClient) -> None:
    with StoreClient(ClientConfig(master=master.address, global_segment_size=MIB)) as me:
        value = content("two", 3000)
        assert me.put("two", value, ReplicateConfig(replica_num=2)).ok
        own = [r for r in me.replica_desc("two").replicas if r.endpoint == me.endpoint]
        ctypes.c_ubyte.from_address(own[0].addr).value ^= 1
        assert me.get("two").data == value                 # own replica first, then node's
        assert (me.stats.checksum_mismatches, me.stats.damaged_dropped) == (1, 1)
        (left,) = me.replica_desc("two").replicas           # the node's, intact
        assert left.endpoint == node.endpoint
        assert me.get("two").data == value and me.stats.checksum_mismatches == 1
        master.core.check_integrity()


def test_a_readers_own_overlapping_buffers_drop_nothing_from_the_pool(
        master: MasterServer, node: StoreClient) -> None:
    """The destinations of a batched read overlap, so the first object's bytes are partly
    overwritten by the second's: the reader gets CHECKSUM_MISMATCH for it, but the stored
    replica is intact (read again into the client's own memory), so nothing is reported as
    damage and every other client still reads it."""
    with StoreClient(ClientConfig(master=master.address, global_segment_size=MIB)) as me, \
            StoreClient(ClientConfig(master=master.address)) as other:
        mine = ReplicateConfig(preferred_segment=me.endpoint)   # copied in turn, then hashed
        a, b = content("a", 100), content("b", 300)
        assert me.put("a", a, mine).ok and me.put("b", b, mine).ok
        out = np.zeros(1000, np.uint8)
        me.register_buffer(out)
        got = me.batch_get_into(["a", "b"], [out.ctypes.data, out.ctypes.data + 50], [100, 300])
        assert got[0].code == E.CHECKSUM_MISMATCH and got[1].ok
        assert me.stats.damaged_dropped == 0 and master.core.stats.damaged_dropped == 0
        assert other.get("a").data == a and other.get("b").data == b


def test_objects_put_without_checksums_are_read_unverified(master: MasterServer,
                                                           node: StoreClient) -> None:
    with StoreClient(ClientConfig(master=master.address, write_checksums=False)) as c:
        assert c.put("n", b"plain").ok
        assert c.replica_desc("n").checksum is None
        assert c.get("n").data == b"plain"


def test_a_bad_master_address_closes_the_started_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.errors import RpcError
    from kvpool.transfer import TransferEngine
    closed = []
    real_close = TransferEngine.close
    monkeypatch.setattr(TransferEngine, "close", lambda self: (closed.append(self),
                                                               real_close(self))[-1])
    with pytest.raises(RpcError, match="bad master address"):
        StoreClient(ClientConfig(master="127.0.0.1:99999"))
    assert len(closed) == 1


def test_late_replies_reach_the_heartbeat_hook() -> None:
    """A master that stalled answers a timed-out heartbeat late: the hook still sees it."""
    import socket
    import threading

    from kvpool.store.client.rpc import RpcClient
    from kvpool.store.wire.framing import FrameDecoder, encode_frame
    from kvpool.store.wire.messages import decode_msg
    from kvpool.store.wire.protocol import encode_reply
    listener = socket.create_server(("127.0.0.1", 0))
    late: list[object] = []

    def serve() -> None:
        conn, _ = listener.accept()
        decoder, reqs = FrameDecoder(), []
        while len(reqs) < 2:
            reqs += [decode_msg(f) for f in decoder.feed(conn.recv(4096))]
        conn.sendall(encode_frame(encode_reply(reqs[0].req_id, 0, int(E.UNKNOWN_CLIENT))) +
                     encode_frame(encode_reply(reqs[1].req_id, 0, 0)))
        conn.recv(1)
    threading.Thread(target=serve, daemon=True).start()
    from kvpool.errors import RpcTimeout
    from kvpool.store.wire.messages import HeartbeatMsg
    rpc = RpcClient(f"127.0.0.1:{listener.getsockname()[1]}", "c", 0.2, None, late.append)
    with pytest.raises(RpcTimeout):
        rpc.call(HeartbeatMsg())
    assert rpc.call(HeartbeatMsg()) == 0
    assert [(r.req_id, r.result) for r in late] == [(1, int(E.UNKNOWN_CLIENT))]  # type: ignore[attr-defined]
    rpc.close()
    listener.close()


def test_a_failed_revoke_still_ends_the_puts_that_were_written(
        store: StoreClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.errors import RpcFailed
    from kvpool.store.wire.messages import Msg, PutRevokeMsg
    real_run, real_call = store._run_copies, store._call

    def first_copy_fails(op: object, copies: dict, arrivals: object = None  # type: ignore[type-arg]
                         ) -> set[int]:
        real_run(op, copies, arrivals)  # type: ignore[arg-type]
        return {min(copies)}

    def revoke_unreachable(msg: Msg) -> object:
        if isinstance(msg, PutRevokeMsg):
            raise RpcFailed(E.RPC_TIMEOUT)
        return real_call(msg)
    monkeypatch.setattr(store, "_run_copies", first_copy_fails)
    monkeypatch.setattr(store, "_call", revoke_unreachable)
    assert [r.code for r in store.put_batch(["bad", "good"], [b"1" * 100, b"2" * 100])] == [
        E.TRANSFER_FAIL, E.OK]
    monkeypatch.undo()
    assert store.get("good").data == b"2" * 100
    assert store.get("bad").code == E.OBJECT_NOT_FOUND


def test_hasher_matches_the_inline_checksum_on_every_path() -> None:
    from kvpool.store.client.checksum import SPLIT_BYTES, Hasher, HashOnArrival, parts_checksum
    data = np.random.default_rng(1).integers(0, 255, 2 * SPLIT_BYTES, dtype=np.uint8)
    addr = data.ctypes.data
    small = [([(addr + i * 100, 100)], 100) for i in range(5)]
    large = [([(addr, SPLIT_BYTES // 2), (addr + SPLIT_BYTES, SPLIT_BYTES // 2)], SPLIT_BYTES)]
    large += [([(addr + i * MIB, MIB)], MIB) for i in range(8)]
    hasher = Hasher()
    try:
        for items in (small, large):
            want = [parts_checksum(parts, n) for parts, n in items]
            assert hasher.many(items) == want
            arrivals = HashOnArrival(dict(enumerate(items)))
            arrivals.expect([0, 0, 1] + list(range(2, len(items))))  # object 0: two requests
            arrivals.request_done(0)
            assert 0 not in arrivals.hashes  # its second request is still due
            for request in (3, 1):
                arrivals.request_done(request)
            assert arrivals.hashes == {0: want[0], 2: want[2]}  # hashed on arrival
            assert arrivals.complete(range(len(items)), hasher) == dict(enumerate(want))
    finally:
        hasher.close()
    threads = threading.active_count()
    assert hasher.many(large) == [parts_checksum(parts, n) for parts, n in large]
    assert threading.active_count() == threads  # closed: hashed alone, no thread left over
