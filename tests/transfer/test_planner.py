"""Slicing and coalescing of requests into frames, with exact frame contents."""

from __future__ import annotations

import random

from kvpool.transfer.batch import Batch, OpCode, RequestState
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.planner import Pieces, count_slices, fits_one_frame, plan_frames

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
    config = TransferConfig(slice_bytes=8192, frame_bytes=8192, small_frame_bytes=8192)
    frames = plan_frames(OpCode.READ, Batch(10), pieces(5000, 5000, 100), config)
    assert [f.indices for f in frames] == [[0, 1], [2]]


def test_a_batch_within_the_small_frame_limit_is_one_frame_whatever_its_sizes() -> None:
    default = TransferConfig()
    four = plan_frames(OpCode.WRITE, Batch(4), pieces(*[1 << 20] * 4), default)
    assert [f.indices for f in four] == [[0, 1, 2, 3]]  # not four frames of 1 MiB
    five = plan_frames(OpCode.WRITE, Batch(5), pieces(*[1 << 20] * 5), default)
    assert [f.indices for f in five] == [[0], [1], [2], [3], [4]]  # over 4 MiB: frame_bytes
    sliced = plan_frames(OpCode.WRITE, Batch(2), pieces((1 << 20) + 1, 10), default)
    assert len(sliced) == 3  # a sliced request keeps the old rules


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
    large = plan_frames(OpCode.READ, Batch(20), pieces(*[4096] * 9), config)  # over 32 KiB
    assert [f.indices for f in large] == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]  # frame_bytes
    mixed = plan_frames(OpCode.READ, Batch(40), pieces(*[1024] * 7, 4096, *[1024] * 25), config)
    assert [len(f.indices) for f in mixed] == [8, 25]  # a large one: frame_bytes, then small
    default = TransferConfig()
    assert plan_frames(OpCode.READ, Batch(32), pieces(*[65536] * 32), default)[0].indices == \
        list(range(32))


def test_one_frame_exactly_when_the_plan_is_one_frame() -> None:
    """fits_one_frame (the frame fast path's test) agrees with plan_frames everywhere."""
    rng = random.Random(5)
    configs = [CONFIG, TransferConfig(), TransferConfig(slice_bytes=4096, frame_bytes=16384,
                                                       small_frame_bytes=65536, frame_requests=8)]
    sizes = [1, 100, 1024, 4095, 4096, 4097, 8192, 8193, 20000, 65536, 1 << 20, (1 << 20) + 1]
    seen = {True: 0, False: 0}
    for _ in range(3000):
        config = rng.choice(configs)
        lengths = [rng.choice(sizes) for _ in range(rng.randint(1, 12))]
        one = len(plan_frames(OpCode.READ, Batch(12), pieces(*lengths), config)) == 1
        assert fits_one_frame(lengths, config) == one, (lengths, config)
        seen[one] += 1
    assert min(seen.values()) > 100  # both answers were exercised
    assert not fits_one_frame([], CONFIG) and not fits_one_frame([0, 10], CONFIG)
