"""A script written for Mooncake, and only for Mooncake: it imports `mooncake.store` and
`mooncake.engine`, runs the calls the vLLM / SGLang / LMCache connectors make, and prints every
return value as one JSON object. The tests run it unchanged against the real wheel and against
kvpool (through `kvpool mooncake activate`) and compare the two outputs.

Environment: MOONCAKE_MASTER (host:port), MOONCAKE_TE_META_DATA_SERVER (default P2PHANDSHAKE).
"""

import ctypes
import json
import os
import sys

from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

out = {}


def record(name, value):
    out[name] = value


def buffer(n, fill):
    raw = (ctypes.c_ubyte * n)(*[(i * 7 + fill) % 256 for i in range(n)])
    return raw, ctypes.addressof(raw)


def store_calls():
    store = MooncakeDistributedStore()
    meta = os.environ.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE")
    record("setup", store.setup("127.0.0.1", meta, 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp",
                                "", os.environ["MOONCAKE_MASTER"]))
    key_calls(store)
    src, registered = buffer_calls(store)  # the memory lives until the store is closed
    value_calls(store)
    record("unregister", [store.unregister_buffer(src), store.unregister_buffer(src)])
    record("remove_all", store.remove_all(True))
    record("health", store.health_check())
    record("close", [store.close(), store.health_check()])


def key_calls(store):
    """Bytes in and out by key, existence, removal, refusals."""
    record("put", [store.put("k1", b"hello"), store.put("k1", b"other")])
    record("get", [store.get("k1").decode(), store.get("missing").decode()])
    record("get_buffer_missing", store.get_buffer("missing") is None)
    record("is_exist", [store.is_exist("k1"), store.is_exist("missing")])
    record("batch_is_exist", store.batch_is_exist(["k1", "missing"]))
    record("remove_leased", store.remove("k1"))
    record("remove_force", store.remove("k1", force=True))
    record("remove_missing", store.remove("missing"))
    record("get_size_missing", store.get_size("missing"))
    record("bad_puts", [store.put("empty", b""), store.put("", b"x")])


def buffer_calls(store):
    """Registered buffers: zero-copy puts and gets, single, batched and multi-buffer, with
    the sizes that do not fit. The source buffer's address, and both buffers (registered)."""
    src_raw, src = buffer(4096, 3)
    dst_raw, dst = buffer(8192, 0)
    record("register", [store.register_buffer(src, 4096), store.register_buffer(dst, 8192),
                        store.register_buffer(src, 4096)])
    record("put_from", store.put_from("z", src, 4096))
    record("get_into", store.get_into("z", dst, 8192))
    record("get_into_bytes_equal", bytes(dst_raw[:4096]) == bytes(src_raw))
    record("get_into_small", store.get_into("z", dst, 100))
    record("get_into_missing", store.get_into("missing", dst, 100))
    record("batch_mismatch", [store.batch_get_into(["z", "q"], [dst], [4096]),
                              store.batch_put_from(["z", "q"], [src], [4096])])
    record("batch_put_from", store.batch_put_from(["b1", "b2"], [src, src + 100], [100, 200]))
    record("batch_get_into", store.batch_get_into(["b2", "missing", "b1"],
                                                  [dst, dst + 1000, dst + 2000], [200, 10, 100]))
    record("multi_put", store.batch_put_from_multi_buffers(
        ["m1", "m2"], [[src, src + 100], [src + 200]], [[100, 50], [300]]))
    record("multi_get", store.batch_get_into_multi_buffers(
        ["m1", "m2", "missing"], [[dst, dst + 1000], [dst + 2000], [dst + 3000]],
        [[100, 50], [300], [10]]))
    record("multi_bytes_equal", bytes(dst_raw[:100]) + bytes(dst_raw[1000:1050])
           == bytes(src_raw[:150]))
    record("multi_small", store.batch_get_into_multi_buffers(["m1"], [[dst, dst + 1000]],
                                                             [[100, 40]]))
    record("multi_mismatch", [store.batch_get_into_multi_buffers(["m1", "m2"], [[dst]], [[150]]),
                              store.batch_put_from_multi_buffers(["x1", "x2"], [[src]], [[10]])])
    record("multi_empty_piece", [  # an empty layer among the pieces is skipped
        store.batch_put_from_multi_buffers(["m3"], [[src, src + 100, src + 200]],
                                           [[100, 0, 50]]),
        store.get_size("m3"),
        store.batch_get_into_multi_buffers(["m3"], [[dst, dst + 1000, dst + 2000]],
                                           [[100, 0, 50]]),
        bytes(dst_raw[:100]) + bytes(dst_raw[2000:2050]) == bytes(src_raw[:100])
        + bytes(src_raw[200:250])])
    return src, (src_raw, dst_raw)


def value_calls(store):
    """Upserts, parts, buffer handles, batches, regex and batch removal, replica
    descriptors, a replicate config, a keyword the wheel refuses."""
    record("upsert", [store.upsert("z", b"xx"), store.get("z").decode()])
    record("put_parts", [store.put_parts("pp", b"ab", b"cd", bytearray(b"ef")),
                         store.get("pp").decode()])
    handle = store.get_buffer("pp")
    record("get_buffer", [handle.size(), len(handle), bytes(memoryview(handle)).decode()])
    record("put_batch", [store.put_batch(["pb1", "pb2"], [b"1", b"22"]),
                         store.put_batch(["pb3"], [b"1", b"2"])])
    record("get_batch", [v.decode() for v in store.get_batch(["pb1", "missing", "pb2"])])
    record("put_batch_one_empty", [  # all or nothing: an empty value stores no item
        store.put_batch(["pe1", "pe2", "pe3"], [b"a", b"", b"c"]),
        store.batch_is_exist(["pe1", "pe2", "pe3"])])
    record("regex", [store.put("rx1", b"1"), store.put("rx2", b"2"),
                     store.remove_by_regex("^rx"), store.remove_by_regex("^rx"),
                     store.remove_by_regex("[", True)])
    record("batch_remove", [store.batch_remove(["pb1", "missing"]),
                            store.batch_remove(["pb2"], force=True)])
    record("replica_desc_missing", store.get_replica_desc("missing"))
    desc = store.get_replica_desc("pp")
    record("replica_desc", [len(desc), desc[0].is_memory_replica(),
                            desc[0].get_memory_descriptor().buffer_descriptor.size,
                            desc[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
                            .rsplit(":", 1)[0]])
    record("batch_replica_desc_keys", sorted(store.batch_get_replica_desc(["pp", "missing"])))
    config = ReplicateConfig()
    config.replica_num = 1
    record("put_with_config", store.put(key="cfg", value=b"v", config=config))
    try:
        store.get(key="cfg")
        record("get_keyword", "accepted")
    except TypeError:
        record("get_keyword", "TypeError")


def tensor_calls():
    import torch

    store = MooncakeDistributedStore()
    store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "",
                os.environ["MOONCAKE_MASTER"])
    kv = torch.arange(2 * 32 * 2 * 16, dtype=torch.float32).reshape(2, 32, 2, 16).half()
    record("tensor_put", [store.put_tensor("t1", kv), store.put_tensor("t1", kv * 2)])
    got = store.get_tensor("t1")
    record("tensor_get", [got is not None and bool(torch.equal(got, kv)),
                          str(got.dtype), list(got.shape), store.get_tensor("missing") is None])
    record("tensor_batch_put", store.batch_put_tensor(["t2", "t3"], [kv[0], kv[1].float()]))
    got = store.batch_get_tensor(["t2", "missing", "t3"])
    record("tensor_batch_get", [bool(torch.equal(got[0], kv[0])), got[1] is None,
                                bool(torch.equal(got[2], kv[1].float()))])
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    record("tensor_register", store.register_buffer(buf.data_ptr(), buf.numel()))
    into = store.get_tensor_into("t1", buf.data_ptr(), buf.numel())
    record("tensor_get_into", [into is not None and bool(torch.equal(into, kv)),
                               store.get_tensor_into("missing", buf.data_ptr(), 1 << 16) is None])
    record("tensor_remove_all", store.remove_all(True))
    store.close()


def edge_calls():
    store = MooncakeDistributedStore()
    store.setup("127.0.0.1", "P2PHANDSHAKE", 32 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "",
                os.environ["MOONCAKE_MASTER"])
    raw, ptr = buffer(4096, 9)
    record("edge_register_empty", [store.register_buffer(ptr, 0), store.register_buffer(ptr, 4096)])
    record("edge_duplicate_keys_in_batch", store.batch_put_from(["d", "d"], [ptr, ptr + 10],
                                                                [10, 10]))
    record("edge_duplicate_stored_once", store.get_size("d"))
    record("edge_duplicate_upserts", [  # an upsert batch naming a key twice stores one value
        store.batch_upsert_from(["u", "u"], [ptr, ptr + 10], [10, 20]),
        store.get_size("u"),
        store.upsert_batch(["v", "v"], [b"first", b"second!"]),
        store.get("v").decode()])
    record("edge_get_into_zero", store.get_into("d", ptr + 100, 0))
    config = ReplicateConfig()
    config.replica_num = 0
    record("edge_zero_replicas", store.put("r0", b"abc", config))
    record("edge_empty_batches", [store.batch_remove([]), store.put_batch([], []),
                                  store.batch_put_from([], [], []), store.batch_is_exist([]),
                                  store.batch_get_into([], [], [])])
    record("edge_regex_everything", [store.put("q1", b"1"), store.remove_by_regex(".*", True),
                                     store.get_size("q1"), store.remove_all(True)])
    store.close()


def range_calls():
    """Get and put sessions, ranged reads and writes (SGLang's layer-wise direct path)."""
    store = MooncakeDistributedStore()
    store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "",
                os.environ["MOONCAKE_MASTER"])
    src_raw, src = buffer(4096, 3)
    dst_raw, dst = buffer(8192, 0)
    store.register_buffer(src, 4096)
    store.register_buffer(dst, 8192)
    record("rg_put", [store.put_from("r1", src, 1000), store.put_from("r2", src + 1000, 500)])
    record("rg_no_session", store.batch_get_into_multi_buffer_ranges(["r1"], [[dst]], [[10]],
                                                                     [[5]]))
    record("rg_start", store.batch_get_session_start(["r1", "r2", "missing"]))
    record("rg_ranges", store.batch_get_into_multi_buffer_ranges(
        ["r1", "r2"], [[dst, dst + 100], [dst + 200]], [[10, 20], [30]], [[5, 100], [0]]))
    record("rg_bytes_equal", [bytes(dst_raw[0:10]) == bytes(src_raw[5:15]),
                              bytes(dst_raw[100:120]) == bytes(src_raw[100:120]),
                              bytes(dst_raw[200:230]) == bytes(src_raw[1000:1030])])
    record("rg_errors", [
        store.batch_get_into_multi_buffer_ranges(["r1"], [[dst]], [[10]], [[995]]),
        store.batch_get_into_multi_buffer_ranges(["missing"], [[dst]], [[10]], [[0]]),
        store.batch_get_into_multi_buffer_ranges(["r1", "r2"], [[dst]], [[10]], [[0]]),
        store.batch_get_into_multi_buffer_ranges(["r1"], [[dst, dst + 10]], [[10]], [[0]])])
    record("rg_leased", store.remove("r2"))
    record("rg_end", [store.batch_get_session_end(["r1", "r2"]),
                      store.batch_get_session_end(["nothing"])])
    record("rg_after_end", store.batch_get_into_multi_buffer_ranges(["r1"], [[dst]], [[10]],
                                                                    [[5]]))
    record("rg_put_start", store.batch_put_session_start(["w1", "w2", "r1"], [100, 50, 1000]))
    record("rg_put_ranges", store.batch_put_from_multi_buffer_ranges(
        ["w1", "w2"], [[src, src + 10], [src + 20]], [[10, 90], [50]], [[0, 10], [0]]))
    record("rg_put_invisible", store.batch_is_exist(["w1", "w2"]))
    record("rg_put_end", [store.batch_put_session_end(["w1"]),
                          store.batch_put_session_revoke(["w2"])])
    record("rg_put_visible", [store.batch_is_exist(["w1", "w2"]),
                              store.get("w1") == bytes(src_raw[:100])])
    record("rg_get_into_ranges", store.get_into_ranges(
        [dst], [["r1", "w1"]], [[[0, 50], [100]]], [[[0, 10], [20]]], [[[10, 10], [5]]]))
    record("rg_get_into_ranges_bytes", [bytes(dst_raw[50:60]) == bytes(src_raw[10:20]),
                                        bytes(dst_raw[100:105]) == bytes(src_raw[20:25])])
    record("rg_edges", [
        store.batch_get_session_start(["r1", ""]),
        store.get_into_ranges([dst], [["r1", "missing"]], [[[0], [8]]], [[[0], [0]]],
                              [[[8], [8]]]),
        store.get_into_ranges([dst], [["r1"]], [[[0]]], [[[998]]], [[[8]]]),
        store.get_into_ranges([dst], [["r1"]], [[[0, 1]]], [[[0]]], [[[8]]]),
        store.get_into_ranges([dst, dst], [["r1"]], [[[0]]], [[[0]]], [[[8]]]),
        store.batch_put_session_start(["z1", "z2"], [0, 8]),
        store.batch_put_session_start(["z2"], [8]),
        store.batch_put_from_multi_buffer_ranges(["zz"], [[src]], [[1]], [[0]]),
        store.batch_put_from_multi_buffer_ranges(["z2"], [[src]], [[8]], [[4]]),
        store.batch_put_session_end(["zz"]), store.batch_put_session_revoke(["zz"]),
        store.batch_put_session_end(["z2"]), store.batch_put_session_revoke(["z2"]),
        store.get_into_ranges([dst], [["r1", "w1"]], [[[0]]], [[[0]]], [[[8]]]),
        store.get_into_ranges([dst], [[""]], [[[0]]], [[[0]]], [[[8]]]),
        store.get_into_ranges([dst], [["r1"]], [[[0]]], [[[0]]], [[[0]]])])
    record("rg_remove_all", store.remove_all(True))
    store.close()


def tensor_variant_calls():
    """Tensor-parallel shards, tensors from buffers, and the object layout itself: a hash of
    the raw bytes each implementation stores for the same tensors."""
    import hashlib

    import torch

    store = MooncakeDistributedStore()
    store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * 1024 * 1024, 16 * 1024 * 1024, "tcp", "",
                os.environ["MOONCAKE_MASTER"])
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    record("tp_put", [store.put_tensor_with_tp("tp", full, 0, 2, 0),
                      store.put_tensor_with_tp("tq", full, 0, 3, 1),
                      store.put_tensor_with_tp("bad", full, 0, 4, 1),
                      store.put_tensor_with_tp("one", full, 0, 1, 0),
                      store.put_tensor_with_tp("tp", full * 2, 0, 2, 0)])
    record("tp_exist", [store.is_exist(k) for k in ("tp", "tp_tp_0", "tp_tp_1", "one",
                                                    "one_tp_0", "bad_tp_0")])
    got = [store.get_tensor_with_tp("tp", 1, 2), store.get_tensor_with_tp("tq", 2, 3, 1),
           store.get_tensor_with_tp("one", 0, 1), store.get_tensor_with_tp("tp", 5, 2)]
    record("tp_get", [got[0].tolist(), got[1].tolist(), got[2].tolist(), got[3] is None])
    record("tp_batch", [store.batch_put_tensor_with_tp(["b1", "b2"], [full, full + 1], 0, 2, 1),
                        [None if t is None else t.tolist()
                         for t in store.batch_get_tensor_with_tp(["b1", "b2", "no"], 1, 2)]])
    record("tp_raw_sha", [hashlib.sha256(store.get(k)).hexdigest()[:16]
                          for k in ("tp_tp_0", "tp_tp_1", "tq_tp_2", "one", "b2_tp_1")])
    plain = [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.tensor(3),
             torch.zeros(0, 4, dtype=torch.int8), torch.arange(12).reshape(3, 4).t()]
    record("tensor_raw_sha", [store.put_tensor(f"p{i}", t) for i, t in enumerate(plain)]
           + [hashlib.sha256(store.get(f"p{i}")).hexdigest()[:16] for i in range(len(plain))])
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    ptr = buf.data_ptr()
    record("tf_register", store.register_buffer(ptr, buf.numel()))
    size = store.get_into("p0", ptr, 4096)
    record("tf_put", [size, store.put_tensor_from("f0", ptr, size),
                      store.put_tensor_from("f1", ptr, 100),
                      store.batch_put_tensor_from(["f2", "f3"], [ptr, ptr + 1], [size, size]),
                      store.get_tensor("f0").tolist() == plain[0].tolist()])
    record("tp_into", [store.get_tensor_with_tp_into("tq", ptr, 4096, 1, 3, 1).tolist(),
                       [None if t is None else t.tolist() for t in
                        store.batch_get_tensor_with_tp_into(["tp", "no"], [ptr, ptr + 8192],
                                                            [4096, 4096], 0, 2)]])
    size = store.get_into("tq_tp_1", ptr, 4096)  # a shard object, header and data
    whole = store.get_into("one", ptr + 8192, 4096)
    record("tp_more", [
        store.pub_tensor_with_tp("pt", full, ReplicateConfig(), 0, 2, 1),
        store.batch_pub_tensor_with_tp(["pb"], [full], ReplicateConfig(), 0, 2, 0),
        store.put_tensor_with_tp_from("ptf", ptr + 8192, whole, 0, 2, 1),
        store.batch_put_tensor_with_tp_from(["pbf"], [ptr + 8192], [whole], 0, 3, 1),
        store.upsert_tensor_from("f0", ptr, size), store.batch_upsert_tensor_from(["f9"], [ptr],
                                                                                   [size]),
        store.upsert_pub_tensor("f0", full), store.batch_upsert_pub_tensor(["f8"], [full * 2]),
        [None if t is None else t.tolist() for t in
         [store.get_tensor_with_tp("pt", 1, 2), store.get_tensor_with_tp("pb", 0, 2),
          store.get_tensor_with_tp("ptf", 1, 2), store.get_tensor_with_tp("pbf", 2, 3),
          store.get_tensor("f0"), store.get_tensor("f9"), store.get_tensor("f8")]]])
    record("tp_remove_all", store.remove_all(True))
    record("close_twice", [store.close(), store.close()])


def engine_calls():
    a, b = TransferEngine(), TransferEngine()
    record("te_init", [a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""),
                       b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")])
    src_raw, src = buffer(4096, 5)
    dst_raw, dst = buffer(4096, 0)
    record("te_register", [a.register_memory(src, 4096), b.register_memory(dst, 4096),
                           a.register_memory(src, 4096)])
    target = f"127.0.0.1:{b.get_rpc_port()}"
    record("te_write", a.transfer_sync_write(target, src, dst, 1024))
    record("te_batch_write", a.batch_transfer_sync_write(target, [src + 1024, src + 2048],
                                                         [dst + 1024, dst + 2048], [1024, 1024]))
    record("te_mismatch", a.batch_transfer_sync_write(target, [src], [dst, dst], [1]))
    record("te_empty", a.batch_transfer_sync_write(target, [], [], []))
    batch_id = a.batch_transfer_async_write(target, [src + 3072], [dst + 3072], [1024])
    record("te_async", [batch_id != 0, a.get_batch_transfer_status([batch_id])])
    record("te_bytes_equal", bytes(dst_raw) == bytes(src_raw))
    record("te_read", a.transfer_sync_read(target, src, dst, 16))
    record("te_probe", [a.send_probe(target), a.send_probe("127.0.0.1:1") != 0])
    record("te_unregister", [a.unregister_memory(src), a.unregister_memory(src)])


store_calls()
tensor_calls()
edge_calls()
range_calls()
tensor_variant_calls()
engine_calls()
record("implementation", MooncakeDistributedStore.__module__.split(".")[0])
sys.stdout.write("RESULT " + json.dumps(out, sort_keys=True) + "\n")
sys.stdout.flush()
os._exit(0)
