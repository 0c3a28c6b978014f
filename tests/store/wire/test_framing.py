"""The length-prefix framing of the master's RPC: byte by byte, any split, fuzzed."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import LocalProtocolError, RemoteProtocolError
from kvpool.store.wire.framing import HEADER_BYTES, FrameDecoder, encode_frame
from kvpool.store.wire.protocol import MAX_FRAME_BYTES


def test_encode_frame_layout() -> None:
    assert encode_frame(b"abc") == b"\x03\x00\x00\x00abc"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame(b"x" * 300)[:4] == b"\x2c\x01\x00\x00"
    assert HEADER_BYTES == 4


def test_encode_frame_refuses_oversized_payload() -> None:
    with pytest.raises(LocalProtocolError, match="frame of 9 bytes exceeds 8"):
        encode_frame(b"x" * 9, max_frame_bytes=8)
    assert encode_frame(b"x" * 8, max_frame_bytes=8) == b"\x08\x00\x00\x00" + b"x" * 8


def test_decoder_byte_by_byte() -> None:
    stream = encode_frame(b"hello") + encode_frame(b"") + encode_frame(b"w" * 70_000)
    decoder = FrameDecoder()
    frames: list[bytes] = []
    pending = []
    for i in range(len(stream)):
        frames += decoder.feed(stream[i:i + 1])
        pending.append(decoder.pending_frame_bytes)
    assert frames == [b"hello", b"", b"w" * 70_000]
    assert decoder.buffered_bytes == 0
    assert pending[:4] == [0, 0, 0, 9]         # known once the 4-byte header is in
    assert pending[12:17] == [0, 0, 0, 0, 70_004]   # the empty frame completed at 12


def test_decoder_many_frames_in_one_chunk_and_a_tail() -> None:
    decoder = FrameDecoder()
    chunk = b"".join(encode_frame(bytes([i]) * i) for i in range(5)) + b"\x02\x00"
    assert decoder.feed(chunk) == [bytes([i]) * i for i in range(5)]
    assert decoder.buffered_bytes == 2
    assert decoder.feed(bytearray(b"\x00\x00ab")) == [b"ab"]
    assert decoder.feed(memoryview(encode_frame(b"m"))) == [b"m"]
    assert decoder.buffered_bytes == 0


def test_oversized_length_is_a_remote_error_and_sticks() -> None:
    decoder = FrameDecoder(max_frame_bytes=16)
    assert decoder.feed(encode_frame(b"x" * 16)) == [b"x" * 16]
    with pytest.raises(RemoteProtocolError, match="frame of 17 bytes exceeds 16"):
        decoder.feed(struct.pack("<I", 17))
    with pytest.raises(RemoteProtocolError, match="frame of 17 bytes exceeds 16"):
        decoder.feed(encode_frame(b"ok"))     # the stream cannot be resynchronized
    assert decoder.buffered_bytes == 0


def test_default_limit_is_the_protocol_limit() -> None:
    decoder = FrameDecoder()
    assert decoder.max_frame_bytes == MAX_FRAME_BYTES
    assert decoder.feed(struct.pack("<I", MAX_FRAME_BYTES)) == []
    with pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(b"\xff\xff\xff\xff")


def test_decoder_limit_must_fit_the_header() -> None:
    with pytest.raises(LocalProtocolError, match="32 bits"):
        FrameDecoder(max_frame_bytes=1 << 32)
    with pytest.raises(LocalProtocolError):
        FrameDecoder(max_frame_bytes=-1)


@settings(max_examples=300, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=8),
       cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=10))
def test_any_split_gives_the_same_frames(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    decoder = FrameDecoder()
    frames: list[bytes] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        frames += decoder.feed(stream[start:end])
    assert frames == payloads
    assert decoder.buffered_bytes == 0


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=200), chunk=st.integers(min_value=1, max_value=64))
def test_garbage_gives_frames_or_a_clean_error(garbage: bytes, chunk: int) -> None:
    decoder = FrameDecoder(max_frame_bytes=100)
    total = 0
    try:
        for start in range(0, len(garbage), chunk):
            frames = decoder.feed(garbage[start:start + chunk])
            assert all(len(f) <= 100 for f in frames)
            total += sum(HEADER_BYTES + len(f) for f in frames)
    except RemoteProtocolError as exc:
        assert "exceeds 100" in str(exc)
        return
    assert total + decoder.buffered_bytes == len(garbage)
