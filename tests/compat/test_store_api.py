"""MooncakeDistributedStore semantics against a real kvpool master: return values, byte
counts, immutability, leases, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.compat.mooncake.store import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)
from tests.compat.conftest import LEASE_MS, StoreFactory
from tests.support.wait import wait_for


def registered(store: MooncakeDistributedStore, nbytes: int, fill: int | None = None) -> np.ndarray:
    arr = np.zeros(nbytes, np.uint8) if fill is None else \
        (np.arange(nbytes) * 7 + fill).astype(np.uint8)
    assert store.register_buffer(arr.ctypes.data, arr.nbytes) == 0
    return arr


def test_put_get_and_immutability(store: MooncakeDistributedStore) -> None:
    assert store.put("k", b"first") == 0
    assert store.put("k", b"second, longer") == 0  # put never overwrites
    assert store.get("k") == b"first"
    assert store.upsert("k", b"second, longer") == 0  # upsert does
    assert store.get("k") == b"second, longer"
    assert store.get_size("k") == 14
    assert store.get("missing") == b""
    assert store.get_buffer("missing") is None
    assert store.get_size("missing") == -704


def test_bytes_batches_parts_and_buffers(store: MooncakeDistributedStore) -> None:
    assert store.put_batch(["a", "b"], [b"1", bytearray(b"22")]) == 0
    assert store.put_batch(["c"], [b"1", b"2"]) == -600
    assert store.get_batch(["a", "missing", "b"]) == [b"1", b"", b"22"]
    assert store.put_parts("p", b"ab", memoryview(b"cd"), np.frombuffer(b"ef", np.uint8)) == 0
    assert store.get("p") == b"abcdef"
    handle = store.get_buffer("p")
    assert isinstance(handle, BufferHandle)
    assert (handle.size(), len(handle), bytes(memoryview(handle))) == (6, 6, b"abcdef")
    assert handle.ptr() != 0
    got = store.batch_get_buffer(["p", "missing"])
    assert bytes(got[0] or b"") == b"abcdef" and got[1] is None
    assert store.upsert_parts("p", b"x", b"y") == 0 and store.get("p") == b"xy"
    assert store.upsert_batch(["a", "b"], [b"9", b"99"]) == 0
    assert store.get_batch(["a", "b"]) == [b"9", b"99"]


def test_bad_values_and_keys(store: MooncakeDistributedStore) -> None:
    assert store.put("empty", b"") == -600
    assert store.put("", b"x") == -600
    assert store.put("has space", b"x") == -600
    assert store.is_exist("") == 0
    assert store.batch_is_exist([]) == []
    assert store.put("obj", 12345) == -600  # not a buffer


def test_zero_copy_roundtrip_and_sizes(store: MooncakeDistributedStore) -> None:
    src = registered(store, 4096, fill=3)
    dst = registered(store, 8192)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == -600  # already registered
    assert store.register_buffer(src.ctypes.data + 100, 10) == -600  # overlaps
    assert store.put_from("z", src.ctypes.data, 4096) == 0
    assert store.get_into("z", dst.ctypes.data, 8192) == 4096
    assert bytes(dst[:4096]) == bytes(src)
    assert store.get_into("z", dst.ctypes.data, 100) == -600  # buffer too small
    assert store.get_into("missing", dst.ctypes.data, 100) == -704
    assert store.batch_put_from(["z1", "z2"], [src.ctypes.data, src.ctypes.data + 10],
                                [10, 20]) == [0, 0]
    assert store.batch_get_into(["z2", "missing", "z1"],
                                [dst.ctypes.data, dst.ctypes.data + 100, dst.ctypes.data + 200],
                                [20, 10, 10]) == [20, -704, 10]
    assert bytes(dst[:20]) == bytes(src[10:30]) and bytes(dst[200:210]) == bytes(src[:10])
    assert store.upsert_from("z1", src.ctypes.data + 1, 10) == 0
    assert store.get_into("z1", dst.ctypes.data, 10) == 10 and bytes(dst[:10]) == bytes(src[1:11])
    assert store.batch_upsert_from(["z1"], [src.ctypes.data], [5]) == [0]
    assert store.get_size("z1") == 5


def test_list_length_mismatch_is_per_item_negative(store: MooncakeDistributedStore) -> None:
    buf = registered(store, 1024, fill=1)
    p = buf.ctypes.data
    assert store.batch_put_from(["a", "b"], [p], [10]) == [-600, -600]
    assert store.batch_get_into(["a", "b"], [p, p], [10]) == [-600, -600]
    assert store.batch_put_from_multi_buffers(["a", "b"], [[p]], [[10]]) == [-600, -600]
    assert store.batch_get_into_multi_buffers(["a", "b"], [[p], [p]], [[10]]) == [-600, -600]
    assert store.batch_put_from_multi_buffers(["a", "b"], [[p, p + 10], [p]], [[10], [5]]) \
        == [-600, 0]  # inner mismatch fails only that key
    assert store.get_size("b") == 5


def test_unregistered_buffers_are_refused(store: MooncakeDistributedStore) -> None:
    loose = np.ones(256, np.uint8)
    buf = registered(store, 256, fill=5)
    assert store.put_from("u", loose.ctypes.data, 256) == -600
    assert store.put_from("u", buf.ctypes.data, 256) == 0
    assert store.get_into("u", loose.ctypes.data, 256) == -600
    assert store.batch_get_into_multi_buffers(["u"], [[buf.ctypes.data, loose.ctypes.data]],
                                              [[128, 128]]) == [-600]
    assert store.unregister_buffer(buf.ctypes.data) == 0
    assert store.unregister_buffer(buf.ctypes.data) == -600
    assert store.get_into("u", buf.ctypes.data, 256) == -600


def test_exist_remove_lease_and_force(store: MooncakeDistributedStore) -> None:
    assert store.put("leased", b"v") == 0
    assert store.is_exist("leased") == 1  # the lookup grants a read lease
    assert store.batch_is_exist(["leased", "missing"]) == [1, 0]
    assert store.remove("leased") == -706
    assert store.remove("missing") == -704
    wait_for(lambda: store.remove("leased") != -706, LEASE_MS / 1000 * 3,
             "the lease to expire", 0.05)
    assert store.is_exist("leased") == 0
    assert store.put("held", b"v") == 0 and store.get("held") == b"v"
    assert store.remove("held", force=True) == 0
    assert store.put("b1", b"1") == 0 and store.put("b2", b"2") == 0
    assert store.batch_remove(["b1", "missing"]) == [0, -704]
    assert store.batch_remove(["b2"], force=True) == [0]


def test_remove_all_and_regex(store: MooncakeDistributedStore) -> None:
    for key in ("rx1", "rx2", "other"):
        assert store.put(key, b"v") == 0
    assert store.remove_by_regex("^rx") == 2
    assert store.remove_by_regex("^rx") == 0
    assert store.remove_by_regex("[") == -600
    assert store.put("x", b"v") == 0 and store.get("x") == b"v"  # leased now
    assert store.remove_all() == 1  # "other"; "x" is leased
    assert store.remove_all(True) == 1
    assert store.batch_is_exist(["other", "x"]) == [0, 0]


def test_replica_descriptors(store: MooncakeDistributedStore) -> None:
    assert store.put("r", b"abc") == 0
    (desc,) = store.get_replica_desc("r")
    assert desc.is_memory_replica() and not desc.is_disk_replica()
    assert desc.status == ReplicaStatus.COMPLETE
    buf = desc.get_memory_descriptor().buffer_descriptor
    assert (buf.size, buf.transport_endpoint) == (3, store.get_hostname())
    assert store.get_replica_desc("missing") == []
    assert list(store.batch_get_replica_desc(["r", "missing"])) == ["r"]


def test_replicate_config_fields() -> None:
    cfg = ReplicateConfig()
    assert (cfg.replica_num, cfg.with_hard_pin, cfg.preferred_segment) == (1, False, "")
    assert cfg.preferred_segments == [] and cfg.soft_pin_action == SoftPinAction.PRESERVE
    assert hasattr(cfg, "soft_pin_ttl_ms") and hasattr(cfg, "group_ids")
    cfg.replica_num = 2
    cfg.soft_pin_action = SoftPinAction.ENABLE
    native = cfg.to_native()
    assert (native.replica_num, native.with_soft_pin) == (2, True)
    with pytest.raises(AttributeError):
        cfg.no_such_field = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        ReplicateConfig(no_such_field=1)


def test_bad_replicate_config_and_best_effort_replicas(store: MooncakeDistributedStore) -> None:
    bad = ReplicateConfig()
    bad.replica_num = 0
    assert store.put("k", b"v", bad) == -600
    two = ReplicateConfig(replica_num=2)
    assert store.put("k", b"v", config=two) == 0  # one segment: one replica, as in Mooncake
    assert len(store.get_replica_desc("k")) == 1


def test_wrong_keywords_raise_type_error(store: MooncakeDistributedStore) -> None:
    with pytest.raises(TypeError):
        store.put("k", b"v", cfg=ReplicateConfig())  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.get(key="k")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.is_exist(key="k")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        store.batch_get_into(keys=["k"], ptrs=[1], sizes=[1])  # type: ignore[call-arg]
    assert store.put(key="kw", value=b"v", config=ReplicateConfig()) == 0
    assert store.get_into(key="kw", buffer_ptr=1, size=1) == -600


def test_lifecycle_codes(make_store: StoreFactory) -> None:
    store = make_store()
    assert store.health_check() == 0
    host, port = store.get_hostname().rsplit(":", 1)
    assert host == "127.0.0.1" and 12300 <= int(port) <= 14300
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", "x:1") == -1  # twice
    assert store.close() == 0
    assert store.health_check() == 1
    assert store.close() == 0
    assert store.get("k") == b"" and store.put("k", b"v") == -600
    assert store.batch_is_exist(["a", "b"]) == [-600, -600]


def test_health_check_sees_a_dead_master() -> None:
    from tests.compat.conftest import start_master
    from tests.support.procs import stop

    rpc, _, proc = start_master()
    store = MooncakeDistributedStore()
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "",
                           f"127.0.0.1:{rpc}") == 0
        assert store.health_check() == 0
        stop(proc)
        assert store.health_check() == 2
    finally:
        stop(proc)
        store.close()


def test_preferred_segment_is_the_callers_hostname(make_store: StoreFactory) -> None:
    """LMCache's prefer_local_alloc sets preferred_segment = store.get_hostname()."""
    a, b = make_store(), make_store()
    for store in (a, b):
        cfg = ReplicateConfig()
        cfg.preferred_segment = store.get_hostname()
        for i in range(4):
            assert store.put(f"local-{store.get_hostname()}-{i}", b"v" * 100, cfg) == 0
            (desc,) = store.get_replica_desc(f"local-{store.get_hostname()}-{i}")
            endpoint = desc.get_memory_descriptor().buffer_descriptor.transport_endpoint
            assert endpoint == store.get_hostname()


def test_host_mem_allocator_backs_registered_tensors(store: MooncakeDistributedStore) -> None:
    """SGLang's MooncakeHostTensorAllocator: alloc an address, view it as a tensor, register."""
    import ctypes

    import torch

    from kvpool.compat.mooncake.store import MooncakeHostMemAllocator

    allocator = MooncakeHostMemAllocator()
    ptr = allocator.alloc(1 << 16)
    assert ptr != 0 and ptr % 4096 == 0
    assert allocator.alloc(0) == 0
    tensor = torch.frombuffer((ctypes.c_byte * (1 << 16)).from_address(ptr), dtype=torch.uint8)
    tensor[:] = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint8)
    assert store.register_buffer(ptr, 1 << 16) == 0
    assert store.put_from("host", ptr, 1000) == 0
    assert store.get_into("host", ptr + 5000, 1000) == 1000
    assert torch.equal(tensor[5000:6000], tensor[:1000])
    assert store.unregister_buffer(ptr) == 0
    del tensor
    assert allocator.free(ptr) == 0
    assert allocator.free(ptr) == -1


def test_a_buffer_that_is_not_contiguous_is_stored_as_its_bytes(
        store: MooncakeDistributedStore) -> None:
    """Every other byte of a buffer: its own bytes are stored (the wheel 0.3.13 answers 0
    too, but stores the first bytes of the memory underneath, not the view's)."""
    assert store.put("nc", memoryview(bytearray(b"abcdefgh"))[::2]) == 0
    assert store.get("nc") == b"aceg"
    assert store.put("nc-str", "text") == -600  # no buffer at all
