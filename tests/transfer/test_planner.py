"""Slicing and coalescing of requests into frames, with exact frame contents."""

from __future__ import annotations

from kvpool.transfer.batch import Batch, OpCode, RequestState
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.planner import Pieces, count_slices, plan_frames

CONFIG = TransferConfig(slice_bytes=8192, frame_bytes=8192, frame_requests=3)


def pieces(*lengths: int) -> Pieces:
    buf = memoryview(bytearray(sum(lengths)))
    out, offset = Pieces(), 0
    for i, length in enumerate(lengths):
        out.add(i, 0x10000 + offset, length, buf[offset : offset + length])
        offset += length
    return out


def test_small_requests_coalesce_up_to_the_descriptor_limit() -> None:
    frames = plan_frames(OpCode.WRITE, Batch(10), pieces(100, 100, 100, 100), CONFIG)
    assert [f.indices for f in frames] == [[0, 1, 2], [3]]
    assert frames[0].addrs == [0x10000, 0x10064, 0x100C8]


def test_frames_close_at_the_byte_limit() -> None:
    frames = plan_frames(OpCode.READ, Batch(10), pieces(5000, 5000, 100), CONFIG)
    assert [f.indices for f in frames] == [[0, 1], [2]]


def test_large_requests_are_sliced() -> None:
    frames = plan_frames(OpCode.WRITE, Batch(10), pieces(20000, 10), CONFIG)
    assert [(f.indices, f.addrs, f.lengths) for f in frames] == [
        ([0], [0x10000], [8192]), ([0], [0x12000], [8192]), ([0], [0x14000], [3616]), ([1], [0x14E20], [10]),
    ]
    assert count_slices(20000, 8192) == 3 and count_slices(0, 8192) == 1


def test_partial_success_of_a_sliced_request_is_failure() -> None:
    batch = Batch(2)
    batch.add([3, 1])
    batch.complete([0])
    batch.complete([1])
    batch.complete([0], "peer closed the connection")
    batch.complete([0])
    assert [s.state for s in batch.status()] == [RequestState.FAILED, RequestState.DONE]
    assert batch.status()[0].reason == "peer closed the connection"
    assert batch.finished


def test_small_requests_fill_larger_frames_than_large_ones() -> None:
    config = TransferConfig(slice_bytes=8192, frame_bytes=8192, small_frame_bytes=32768)
    small = plan_frames(OpCode.READ, Batch(20), pieces(*[1024] * 20), config)
    assert [len(f.indices) for f in small] == [20]  # 20 KiB of requests under 2 KiB: one frame
    large = plan_frames(OpCode.READ, Batch(20), pieces(*[4096] * 5), config)
    assert [f.indices for f in large] == [[0, 1], [2, 3], [4]]  # 4 KiB each: frame_bytes
    mixed = plan_frames(OpCode.READ, Batch(20), pieces(*[1024] * 7, 4096, 1024), config)
    assert [f.indices for f in mixed] == [list(range(8)), [8]]  # a large one: frame_bytes
    default = TransferConfig()
    assert plan_frames(OpCode.READ, Batch(32), pieces(*[65536] * 32), default)[0].indices == \
        list(range(32))
