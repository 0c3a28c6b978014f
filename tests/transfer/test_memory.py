"""Memory registration of every supported kind, and the registry's lookups."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
import torch

from kvpool.errors import MemoryRegistrationError
from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.memory import (
    SHM_HEADER_BYTES,
    SHM_MAGIC,
    Buffer,
    MemoryRegistry,
    buffer_of,
    pid_namespace,
    view_at,
)
from kvpool.transfer.shm_sweep import sweep_stale_shm


def test_registry_finds_exact_containing_buffer() -> None:
    registry = MemoryRegistry()
    a = np.zeros(100, dtype=np.uint8)
    b = np.zeros(50, dtype=np.uint8)
    ba, bb = registry.add(buffer_of(a)), registry.add(buffer_of(b))
    assert registry.find(ba.addr, 100) is ba
    assert registry.find(ba.addr + 99, 1) is ba
    assert registry.find(ba.addr + 99, 2) is None or registry.find(ba.addr + 99, 2) is bb
    assert registry.find(bb.addr + 10, 40) is bb
    assert registry.find(bb.addr + 10, 41) is None
    registry.remove(ba.addr)
    assert registry.find(ba.addr, 1) is None
    with pytest.raises(MemoryRegistrationError):
        registry.remove(ba.addr)


def test_registry_never_finds_a_buffer_after_its_removal() -> None:
    """`find` remembers the buffer it found last; a removal must make it forget it."""
    registry = MemoryRegistry()
    a, b = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    ba, bb = registry.add(buffer_of(a)), registry.add(buffer_of(b))
    for _ in range(2):  # the second lookup is answered from the remembered buffer
        assert registry.find(ba.addr + 8, 16) is ba
    registry.remove(ba.addr)
    assert registry.find(ba.addr + 8, 16) is None
    assert registry.find(bb.addr, 4096) is bb
    again = registry.add(buffer_of(a))
    assert registry.find(ba.addr + 8, 16) is again


def test_registry_answers_the_innermost_of_overlapping_buffers_every_time() -> None:
    """A read-only range registered inside a larger buffer is found as itself, whatever was
    found before (its read-only flag and fence hold there)."""
    registry = MemoryRegistry()
    whole = np.zeros(8192, dtype=np.uint8)
    outer = registry.add(buffer_of(whole))
    inner = registry.add(Buffer(outer.addr + 4096, 1024, view_at(outer.addr + 4096, 1024),
                                readonly=True))
    for _ in range(2):
        assert registry.find(outer.addr, 16) is outer
        assert registry.find(inner.addr, 16) is inner
    # a range that runs into or out of the inner region is no one region's: refused, never
    # answered by the outer buffer, whose flags do not hold over the inner one
    assert registry.find(inner.addr - 16, 32) is None
    assert registry.find(inner.addr + 1024 - 16, 32) is None
    assert registry.find(outer.addr, 8192) is None
    assert registry.find(inner.addr + 1024, 16) is outer
    assert registry.find(inner.addr - 16, 16) is outer


@pytest.mark.parametrize("inner_first", [True, False])
def test_an_inner_region_at_the_outer_ones_start_answers_for_itself(inner_first: bool) -> None:
    """Whichever was registered first, the inner region sharing the outer one's start answers
    for its range (its fence and read-only flag hold there); `at` and `remove` take the one
    registered last at that address."""
    registry = MemoryRegistry()
    whole = np.zeros(8192, dtype=np.uint8)
    outer_buf = buffer_of(whole)
    inner_buf = Buffer(outer_buf.addr, 4096, view_at(outer_buf.addr, 4096), readonly=True)
    if inner_first:
        inner, outer = registry.add(inner_buf), registry.add(outer_buf)
    else:
        outer, inner = registry.add(outer_buf), registry.add(inner_buf)
    assert registry.find(outer.addr, 16) is inner
    assert registry.find(outer.addr + 4096, 16) is outer
    assert registry.find(outer.addr + 4000, 200) is None  # across the inner one's end
    last = outer if inner_first else inner
    assert registry.at(outer.addr) is last
    assert registry.remove(outer.addr) is last
    assert registry.at(outer.addr) is (inner if inner_first else outer)


def test_register_kinds() -> None:
    arr = np.arange(16, dtype=np.float32)
    assert buffer_of(arr).length == 64
    assert buffer_of(arr).addr == arr.ctypes.data
    ro = buffer_of(b"immutable")
    assert ro.readonly and ro.length == 9
    mm = mmap.mmap(-1, 8192)
    assert buffer_of(mm).length == 8192
    tensor = torch.arange(32, dtype=torch.float16)
    tb = buffer_of(tensor)
    assert (tb.addr, tb.length) == (tensor.data_ptr(), 64)
    raw = (ctypes.c_ubyte * 128)()
    view = view_at(ctypes.addressof(raw), 128)
    view[0] = 42
    assert raw[0] == 42


def test_register_rejects_bad_inputs() -> None:
    with pytest.raises(MemoryRegistrationError):
        buffer_of(np.zeros((4, 4))[:, 1])  # not contiguous
    with pytest.raises(MemoryRegistrationError):
        buffer_of(torch.zeros(4, 4).t())
    with pytest.raises(MemoryRegistrationError):
        buffer_of(12345)
    with pytest.raises(MemoryRegistrationError):
        MemoryRegistry().add(Buffer(0x1000, 0, memoryview(b"")))
    with pytest.raises(MemoryRegistrationError):
        view_at(0, 10)


def test_local_copy_between_own_buffers_of_every_kind() -> None:
    with TransferEngine(TransferConfig()) as engine:
        tensor = torch.arange(1024, dtype=torch.int32)
        dest = np.zeros(4096, dtype=np.uint8)
        src_buf, dst_buf = engine.register(tensor), engine.register(dest)
        engine.write(engine.segment_name, src_buf.addr, dst_buf.addr, 4096)
        assert dest.view(np.int32).tolist() == list(range(1024))
        constant = engine.register(b"read-only!")
        bad = engine.transfer_sync([TransferRequest(OpCode.WRITE, src_buf.addr, 4, engine.segment_name,
                                                    constant.addr)])
        assert not bad[0].ok
        engine.unregister(dst_buf.addr)
        gone = engine.transfer_sync([TransferRequest(OpCode.WRITE, src_buf.addr, 4, engine.segment_name,
                                                     dst_buf.addr)])
        assert not gone[0].ok


def test_managed_buffers_live_in_dev_shm_and_are_removed() -> None:
    with TransferEngine(TransferConfig()) as engine:
        buf = engine.allocate_managed(1 << 16)
        assert buf.shm_name is not None
        raw = open(f"/dev/shm/{buf.shm_name}", "rb").read()
        assert raw[:8] == SHM_MAGIC and len(raw) == SHM_HEADER_BYTES + (1 << 16)
        assert raw[SHM_HEADER_BYTES:] == bytes(1 << 16)
        assert engine.descriptor().shm_regions[0].addr == buf.addr
        engine.free_managed(buf)
        assert not engine.descriptor().shm_regions
        with pytest.raises(FileNotFoundError):
            open(f"/dev/shm/{buf.shm_name}", "rb")


def test_engines_started_again_in_one_process_never_reuse_file_names() -> None:
    """A peer that cached an engine's descriptor maps its files by name: an engine started
    after it in the same process (it may get the old one's id) must name its files anew,
    or the peer would take the new file for the old one at the old address."""
    import gc
    names = []
    for _ in range(12):
        engine = TransferEngine(TransferConfig()).start()
        names.append(engine.allocate_managed(4096).shm_name)
        engine.close()
        del engine
        gc.collect()
    assert len(set(names)) == len(names)


def test_sweep_removes_files_of_dead_processes_of_our_pid_namespace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ours, other = f"{pid_namespace():x}", f"{pid_namespace() + 1:x}"
    (tmp_path / f"kvpool-999999999-{ours}-abc-1").write_bytes(b"x")
    (tmp_path / f"kvpool-1-{ours}-abc-1").write_bytes(b"x")  # pid 1 is alive
    (tmp_path / f"kvpool-999999999-{other}-abc-1").write_bytes(b"x")  # another container's
    (tmp_path / "kvpool-999999999-abc-1").write_bytes(b"x")  # not a name we make
    (tmp_path / "unrelated").write_bytes(b"x")
    assert sweep_stale_shm(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"kvpool-1-{ours}-abc-1", f"kvpool-999999999-{other}-abc-1", "kvpool-999999999-abc-1", "unrelated"])
