"""mooncake.engine.TransferEngine on kvpool: the call pattern of vLLM's MooncakeConnector and
SGLang's PD disaggregation (P2P handshake, register every KV tensor, push pages with
batch_transfer_sync_write), across real processes, plus Mooncake's return codes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.compat.mooncake.engine import TransferEngine, TransferOpcode
from tests.compat.kv import PAGE_BYTES, kv_cache, merge_runs, page_digest
from tests.support.procs import running, spawn_python
from tests.support.wait import wait_for

DECODE_SIDE = """
import sys
import torch
from kvpool.compat.mooncake.engine import TransferEngine
from tests.compat.kv import kv_cache, page_digest
te = TransferEngine()
assert te.initialize("127.0.0.1", sys.argv[1], "tcp", "") == 0
cache = torch.zeros_like(kv_cache(32, seed=0))
assert te.batch_register_memory([cache.data_ptr()], [cache.numel() * 2]) == 0
print(te.get_rpc_port(), cache.data_ptr(), flush=True)
for line in sys.stdin:
    pages = [int(p) for p in line.split()]
    print(page_digest(cache, pages), flush=True)
"""


@pytest.fixture
def engine() -> TransferEngine:
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield te
    te.close()


def _push(engine: TransferEngine, target: str, src: torch.Tensor, dst_base: int,
          src_pages: list[int], dst_pages: list[int]) -> int:
    runs = merge_runs(src_pages, dst_pages)
    return engine.batch_transfer_sync_write(
        target, [src.data_ptr() + s * PAGE_BYTES for s, _, _ in runs],
        [dst_base + d * PAGE_BYTES for _, d, _ in runs], [n * PAGE_BYTES for _, _, n in runs])


@pytest.mark.parametrize("metadata", ["P2PHANDSHAKE", "http"])
def test_prefill_pushes_kv_pages_to_decode_process(engine: TransferEngine, metadata: str,
                                                   request: pytest.FixtureRequest) -> None:
    if metadata == "http":
        master = request.getfixturevalue("master")
        metadata = master.http_metadata
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
    with running(spawn_python(DECODE_SIDE, metadata)) as child:
        assert child.stdout is not None and child.stdin is not None
        port, base = (int(x) for x in child.stdout.readline().split())
        target = f"127.0.0.1:{port}"
        assert engine.send_probe(target) == 0
        prefill = kv_cache(16, seed=11)
        assert engine.register_memory(prefill.data_ptr(), prefill.numel() * 2) == 0
        src_pages, dst_pages = [3, 4, 5, 9, 0], [10, 11, 12, 20, 31]
        assert len(merge_runs(src_pages, dst_pages)) == 3
        assert _push(engine, target, prefill, base, src_pages, dst_pages) == 0
        child.stdin.write(" ".join(map(str, dst_pages)).encode() + b"\n")
        child.stdin.flush()
        assert child.stdout.readline().decode().strip() == page_digest(prefill, src_pages)
        # a page beyond the peer's registered cache fails the whole batch with -1
        assert _push(engine, target, prefill, base, [1, 2], [30, 32]) == -1
        # read back one page with the opposite verb
        back = torch.zeros_like(prefill[:1])
        assert engine.register_memory(back.data_ptr(), PAGE_BYTES) == 0
        assert engine.transfer_sync_read(target, back.data_ptr(), base + 20 * PAGE_BYTES,
                                         PAGE_BYTES) == 0
        assert torch.equal(back[0], prefill[9])
    if metadata != "P2PHANDSHAKE":
        engine.close()


def test_async_batches_and_status(engine: TransferEngine) -> None:
    peer = TransferEngine()
    assert peer.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        src = (np.arange(1 << 16) % 251).astype(np.uint8)
        dst = np.zeros(1 << 16, np.uint8)
        assert engine.register_memory(src.ctypes.data, src.nbytes) == 0
        assert peer.register_memory(dst.ctypes.data, dst.nbytes) == 0
        target = f"127.0.0.1:{peer.get_rpc_port()}"
        half = 1 << 15
        ids = [engine.batch_transfer_async_write(target, [src.ctypes.data], [dst.ctypes.data],
                                                 [half]),
               engine.transfer_submit_write(target, src.ctypes.data + half,
                                            dst.ctypes.data + half, half)]
        assert 0 not in ids
        assert engine.get_batch_transfer_status(ids) == 0
        assert np.array_equal(src, dst)
        bid = engine.batch_transfer_async(target, [src.ctypes.data], [dst.ctypes.data], [16],
                                          TransferOpcode.Read)
        status = wait_for(lambda: engine.transfer_check_status(bid) or None, 5.0,
                          "the transfer to end", 0.005)
        assert status == 1
        assert engine.transfer_check_status(bid) == -1  # forgotten once reported
        bad = engine.batch_transfer_async_write(target, [src.ctypes.data], [1 << 20], [16])
        assert engine.get_batch_transfer_status([bad]) == -1
        assert engine.batch_transfer_async_read(target, [1], [2, 3], [4]) == 0  # mismatch
        assert engine.transfer_sync(target, src.ctypes.data, dst.ctypes.data, 8,
                                    TransferOpcode.Write) == 0
        assert engine.batch_transfer_sync(target, [], [], [], TransferOpcode.Write) == 0
    finally:
        peer.close()


def test_memory_codes(engine: TransferEngine) -> None:
    buf = np.zeros(4096, np.uint8)
    addr = buf.ctypes.data
    assert engine.register_memory(addr, 4096) == 0
    assert engine.register_memory(addr, 4096) == -7
    assert engine.register_memory(addr + 100, 10) == -7
    assert engine.register_memory(0, 10) == -1
    assert engine.get_first_buffer_address(f"127.0.0.1:{engine.get_rpc_port()}") == addr
    assert engine.unregister_memory(addr) == 0
    assert engine.unregister_memory(addr) == -3
    assert engine.batch_register_memory([addr], [4096, 1]) == -1
    assert engine.batch_register_memory([addr, addr + 2048], [2048, 2048]) == 0
    assert engine.batch_unregister_memory([addr, addr + 2048]) == 0
    # all or nothing: the second region overlaps the first, so neither stays registered
    assert engine.batch_register_memory([addr, addr + 1024], [2048, 2048]) == -7
    assert engine.unregister_memory(addr) == -3
    managed = engine.allocate_managed_buffer(8192)
    assert managed != 0
    assert engine.write_bytes_to_buffer(managed, b"hello", 5) == 0
    assert engine.read_bytes_from_buffer(managed, 5) == b"hello"
    assert engine.write_bytes_to_buffer(addr, b"x", 1) == -1  # unregistered now
    assert engine.free_managed_buffer(managed, 8192) == 0
    assert engine.allocate_managed_buffer(0) == 0


def test_failures_are_codes_not_exceptions(engine: TransferEngine) -> None:
    buf = np.zeros(64, np.uint8)
    assert engine.register_memory(buf.ctypes.data, 64) == 0
    assert engine.transfer_sync_write("127.0.0.1:1", buf.ctypes.data, 4096, 8) == -1
    assert engine.send_probe("127.0.0.1:1") != 0
    assert engine.send_probe("not-a-segment") != 0
    me = f"127.0.0.1:{engine.get_rpc_port()}"
    assert engine.transfer_sync_write(me, 4096, buf.ctypes.data, 8) == -1  # unregistered src
    assert engine.batch_transfer_sync_write(me, [buf.ctypes.data], [], [8]) == -1
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1  # twice
    fresh = TransferEngine()
    assert fresh.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -1
    assert fresh.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0  # falls back
    fresh.close()


def test_positional_only_and_keyword_names(engine: TransferEngine) -> None:
    with pytest.raises(TypeError):
        TransferEngine().initialize(local_hostname="127.0.0.1")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        engine.unregister_memory(buffer_addr=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        engine.transfer_sync_write(target="x", buffer=1, peer_buffer_address=2,  # type: ignore[call-arg]
                                   length=3)
    assert engine.transfer_sync_write(target_hostname="127.0.0.1:1", buffer=1,
                                      peer_buffer_address=2, length=3) == -1
    assert engine.register_memory(buffer_addr=4096 * 1024, capacity=0) == -1


def test_concurrent_pushes_from_a_thread_pool(engine: TransferEngine) -> None:
    """vLLM and SGLang push from a thread pool into one peer; every page must land intact."""
    from concurrent.futures import ThreadPoolExecutor

    peer = TransferEngine()
    assert peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        src, dst = kv_cache(32, seed=21), torch.zeros_like(kv_cache(32, seed=0))
        assert engine.register_memory(src.data_ptr(), src.numel() * 2) == 0
        assert peer.register_memory(dst.data_ptr(), dst.numel() * 2) == 0
        target = f"127.0.0.1:{peer.get_rpc_port()}"
        plans = [([p, p + 1], [31 - p, 30 - p]) for p in range(0, 32, 4)]
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda plan: _push(engine, target, src, dst.data_ptr(), *plan),
                                  plans))
        assert codes == [0] * len(plans)
        for s, d in plans:
            assert page_digest(dst, d) == page_digest(src, s)
    finally:
        peer.close()
