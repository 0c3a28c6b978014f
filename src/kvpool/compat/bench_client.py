"""The client side of `kvpool bench mooncake-api`: one workload written against Mooncake's
Python API, run unchanged on either implementation (`mooncake` = the real wheel, `kvpool` =
kvpool.compat). Started as a child process by kvpool.compat.bench:

    python -m kvpool.compat.bench_client node IMPL MASTER DRAM_BYTES
    python -m kvpool.compat.bench_client client IMPL MASTER SIZES BATCH PHASE_BYTES MIN_TIME_S

`node` contributes memory and waits for stdin to close; `client` prints one JSON line with the
measurements (a pure client: every byte crosses to the node process over tcp).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from kvpool.bench.common import Measurement, rate

_MODULES = {"mooncake": "mooncake", "kvpool": "kvpool.compat.mooncake"}


def load(impl: str) -> tuple[Any, Any]:
    """(store module, engine module) of the implementation."""
    base = _MODULES[impl]
    return importlib.import_module(f"{base}.store"), importlib.import_module(f"{base}.engine")


def node(impl: str, master: str, dram: int) -> None:
    store_mod, _ = load(impl)
    store = store_mod.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", dram, 16 << 20, "tcp", "", master)
    print(json.dumps({"ready": rc == 0, "rc": rc}), flush=True)
    sys.stdin.read()
    store.close()


def _store_phase(store: Any, impl: str, size: int, batch: int, phase_bytes: int,
                 ptr: int, tag: str) -> list[Measurement]:
    iters = max(3, phase_bytes // (size * batch))
    keys = [[f"{tag}-{size}-{i}-{j}" for j in range(batch)] for i in range(iters)]
    ptrs = [ptr + j * size for j in range(batch)]
    sizes = [size] * batch
    out = []
    for op, call in (("put", lambda k: store.batch_put_from(k, ptrs, sizes)),
                     ("get", lambda k: store.batch_get_into(k, ptrs, sizes)),
                     ("exist", lambda k: store.batch_is_exist(k))):
        start = time.perf_counter()
        for k in keys:
            results = call(k)
            expected = 1 if op == "exist" else (0 if op == "put" else size)
            if any(r != expected for r in results):
                raise RuntimeError(f"{impl} {op} failed: {results[:4]}")
        elapsed = time.perf_counter() - start
        moved = 0 if op == "exist" else size * batch * iters
        out.append(Measurement("mooncake-api-store", impl, "tcp", op, "batched", size,
                               moved / elapsed / 1e9, batch * iters / elapsed))
    store.remove_all(True)
    return out


def _transfer_phase(engine_mod: Any, impl: str, size: int, batch: int,
                    min_time_s: float) -> list[Measurement]:
    a, b = engine_mod.TransferEngine(), engine_mod.TransferEngine()
    for te in (a, b):
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"{impl} TransferEngine.initialize failed")
    src = np.ones(size * batch, np.uint8)
    dst = np.zeros(size * batch, np.uint8)
    a.register_memory(src.ctypes.data, src.nbytes)
    b.register_memory(dst.ctypes.data, dst.nbytes)
    target = f"127.0.0.1:{b.get_rpc_port()}"
    srcs = [src.ctypes.data + j * size for j in range(batch)]
    dsts = [dst.ctypes.data + j * size for j in range(batch)]
    out = []
    for op, fn in (("write", a.batch_transfer_sync_write), ("read", a.batch_transfer_sync_read)):
        def call(fn: Any = fn) -> None:
            if fn(target, srcs, dsts, [size] * batch) != 0:
                raise RuntimeError(f"{impl} transfer failed")
        gbps, reqs = rate(call, size * batch, batch, min_time_s)
        out.append(Measurement("mooncake-api-transfer", impl, "tcp", op, "batched", size,
                               gbps, reqs))
    if hasattr(a, "close"):
        a.close(), b.close()
    return out


def client(impl: str, master: str, sizes: list[int], batch: int, phase_bytes: int,
           min_time_s: float) -> list[Measurement]:
    store_mod, engine_mod = load(impl)
    store = store_mod.MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) != 0:
        raise RuntimeError(f"{impl} store setup failed")
    buf = np.random.default_rng(0).integers(0, 255, max(sizes) * batch, dtype=np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    results: list[Measurement] = []
    for size in sizes:
        results += _store_phase(store, impl, size, batch, phase_bytes, buf.ctypes.data, "k")
    store.close()
    for size in sizes:
        results += _transfer_phase(engine_mod, impl, size, batch, min_time_s)
    return results


def main(argv: list[str]) -> int:
    role, impl, master = argv[:3]
    if role == "node":
        node(impl, master, int(argv[3]))
        return 0
    sizes = [int(s) for s in argv[3].split(",")]
    found = client(impl, master, sizes, int(argv[4]), int(argv[5]), float(argv[6]))
    print(json.dumps([asdict(m) for m in found]), flush=True)
    return 0


if __name__ == "__main__":
    import os

    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # the real wheel's threads can hang a normal interpreter exit
