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
    record("upsert", [store.upsert("z", b"xx"), store.get("z").decode()])
    record("put_parts", [store.put_parts("pp", b"ab", b"cd", bytearray(b"ef")),
                         store.get("pp").decode()])
    handle = store.get_buffer("pp")
    record("get_buffer", [handle.size(), len(handle), bytes(memoryview(handle)).decode()])
    record("put_batch", [store.put_batch(["pb1", "pb2"], [b"1", b"22"]),
                         store.put_batch(["pb3"], [b"1", b"2"])])
    record("get_batch", [v.decode() for v in store.get_batch(["pb1", "missing", "pb2"])])
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
    record("unregister", [store.unregister_buffer(src), store.unregister_buffer(src)])
    record("remove_all", store.remove_all(True))
    record("health", store.health_check())
    record("close", [store.close(), store.health_check()])


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
engine_calls()
record("implementation", MooncakeDistributedStore.__module__.split(".")[0])
sys.stdout.write("RESULT " + json.dumps(out, sort_keys=True) + "\n")
sys.stdout.flush()
os._exit(0)
