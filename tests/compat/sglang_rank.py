"""One tensor-parallel rank of SGLang's HiCache L3 `MooncakeStore` backend, replayed call for
call against `mooncake.store` (kvpool's, through the import below): setup with 8 positional
arguments, warm-up, a host pool from `MooncakeHostMemAllocator` registered whole, exists-then-
put of pages, reads back into a second pool, the prefix `batch_exists`, and detach (a no-op
`close()`, then the backend is dropped and left to its destructor).

    python sglang_rank.py RANK TP_SIZE LAYOUT SETUP_JSON
LAYOUT: "mha" (page-first pool, keys "<hash>_<rank>_k|v", one buffer per key) or "mla"
(layer-first pool, keys "<hash>__k" shared by all ranks, one piece per layer). Prints one JSON
line per step; waits for a line on stdin before detaching and before exiting.
"""

import ctypes
import gc
import json
import sys
import uuid

import torch

from kvpool.compat.mooncake.store import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
)

NUM_LAYERS, PAGE_SIZE, HEAD_NUM, HEAD_DIM, NUM_PAGES = 4, 4, 2, 8, 6
rank, tp_size, layout, setup_args = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                     json.loads(sys.argv[4]))


def say(**fields):
    print(json.dumps(fields), flush=True)


def host_pool(allocator, fill):
    """mha: [2, pages*PAGE_SIZE, layers, heads, dim] (page-first);
    mla: [layers, pages*PAGE_SIZE, 1, heads*dim] (layer-first)."""
    tokens = NUM_PAGES * PAGE_SIZE
    dims = ((2, tokens, NUM_LAYERS, HEAD_NUM, HEAD_DIM) if layout == "mha"
            else (NUM_LAYERS, tokens, 1, HEAD_NUM * HEAD_DIM))
    size = 2
    for d in dims:
        size *= d
    ptr = allocator.alloc(size)
    assert ptr
    pool = torch.frombuffer((ctypes.c_byte * size).from_address(ptr), dtype=torch.uint8,
                            count=size).view(torch.bfloat16).view(dims)
    pool.copy_(torch.arange(pool.numel(), dtype=torch.float32).reshape(dims) * fill)
    return pool, ptr, size


def page_meta(pool, ptr, pages):
    """(keys, pointers, sizes) the way the backend lays pages out for the store."""
    item = 2
    if layout == "mha":
        per_page = PAGE_SIZE * NUM_LAYERS * HEAD_NUM * HEAD_DIM * item
        v_base = ptr + pool.shape[1] * NUM_LAYERS * HEAD_NUM * HEAD_DIM * item
        keys, ptrs, sizes = [], [], []
        for p in pages:
            keys += [f"page{p}_{rank}_k", f"page{p}_{rank}_v"]
            ptrs += [ptr + p * per_page, v_base + p * per_page]
            sizes += [per_page, per_page]
        return keys, ptrs, sizes
    per_layer_page = PAGE_SIZE * HEAD_NUM * HEAD_DIM * item
    layer_stride = pool.shape[1] * HEAD_NUM * HEAD_DIM * item
    keys = [f"page{p}__k" for p in pages]
    ptrs = [[ptr + layer * layer_stride + p * per_layer_page for layer in range(NUM_LAYERS)]
            for p in pages]
    return keys, ptrs, [[per_layer_page] * NUM_LAYERS for _ in pages]


class Backend:
    def __init__(self):
        self.store = MooncakeDistributedStore()
        ret = self.store.setup(*setup_args, None)
        assert ret == 0, ret
        key, value = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex, bytes(4 * 1024)
        assert self.store.put(key, value) == 0
        assert self.store.is_exist(key) == 1 and self.store.get(key) == value

    def batch_set(self, keys, ptrs, sizes):
        exist = self.store.batch_is_exist(keys)
        todo = [i for i, e in enumerate(exist) if e != 1]
        results = [0] * len(keys)
        if todo:
            args = ([keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo])
            put = (self.store.batch_put_from_multi_buffers(*args, ReplicateConfig())
                   if layout == "mla" else self.store.batch_put_from(*args))
            for i, r in zip(todo, put, strict=True):
                results[i] = r
        return results, len(todo)

    def batch_get(self, keys, ptrs, sizes):
        if layout == "mla":
            return self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        return self.store.batch_get_into(keys, ptrs, sizes)

    def close(self):
        pass  # as SGLang's: "the destructor does it"


backend = Backend()
say(step="setup", hostname=backend.store.get_hostname())
allocator = MooncakeHostMemAllocator()
pool, ptr, size = host_pool(allocator, 1 if layout == "mla" else rank + 1)  # MLA: same KV
assert backend.store.register_buffer(ptr, size) == 0
keys, ptrs, sizes = page_meta(pool, ptr, range(NUM_PAGES))
results, written = backend.batch_set(keys, ptrs, sizes)
say(step="set", results=results, written=written)
say(step="set_again", results=backend.batch_set(keys, ptrs, sizes)[0])
sys.stdin.readline()   # every rank has stored its pages (MLA ranks write the same keys)
back, back_ptr, back_size = host_pool(allocator, 0)
assert backend.store.register_buffer(back_ptr, back_size) == 0
got = backend.batch_get(*page_meta(back, back_ptr, range(NUM_PAGES)))
say(step="get", results=got, equal=bool(torch.equal(back, pool)))
prefix = keys[:4] + ["page-missing_k"] + keys[4:]
say(step="exists", results=backend.store.batch_is_exist(prefix))
sys.stdin.readline()
backend.close()        # HiCacheController.detach_storage_backend
backend = None
gc.collect()
say(step="detached")
sys.stdin.readline()
