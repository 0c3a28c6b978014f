"""The sans-I/O framing: exact encodings, byte-at-a-time decoding, and fuzzing."""

from __future__ import annotations

import struct

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.errors import LocalProtocolError, RemoteProtocolError
from kvpool.transfer.decoder import NEED_DATA, Control, Data, FrameDecoder, FrameEnd, FrameStart
from kvpool.transfer.protocol import (
    DESCRIPTOR_BYTES,
    HEADER_BYTES,
    MAGIC,
    FrameType,
    Status,
    decode_descriptors,
    decode_header,
    decode_statuses,
    encode_control,
    encode_descriptors,
    encode_header,
)


def write_frame(addrs: list[int], payloads: list[bytes], rid: int = 7,
                fences: list[int] | None = None) -> bytes:
    lengths = [len(p) for p in payloads]
    return (encode_header(FrameType.WRITE, len(addrs), rid, sum(lengths))
            + encode_descriptors(addrs, lengths, fences) + b"".join(payloads))


def drain(decoder: FrameDecoder) -> list[object]:
    events = []
    while (event := decoder.next_event()) is not NEED_DATA:
        events.append(event)
    return events


def test_header_layout_is_exact() -> None:
    raw = encode_header(FrameType.READ, 3, 0x0102, 0)
    assert len(raw) == HEADER_BYTES == 28
    assert raw[:4] == b"KVP2" and raw[4] == FrameType.READ
    assert struct.unpack_from("<I", raw, 8)[0] == 3
    assert struct.unpack_from("<Q", raw, 12)[0] == 0x0102
    header = decode_header(raw)
    assert (header.type, header.count, header.request_id, header.payload_len) == (FrameType.READ, 3, 0x102, 0)
    assert header.descriptor_bytes == 72


def test_descriptor_layout_is_exact() -> None:
    raw = encode_descriptors([0x1000, 0x2000], [3, 5], [0, 2**64 - 1])
    assert len(raw) == 2 * DESCRIPTOR_BYTES == 48
    assert struct.unpack("<6Q", raw) == (0x1000, 3, 0, 0x2000, 5, 2**64 - 1)
    many = encode_descriptors(list(range(20)), [1] * 20, [7] * 20)  # the numpy path
    assert struct.unpack_from("<3Q", many, 24 * 19) == (19, 1, 7)


def test_write_frame_fed_one_byte_at_a_time() -> None:
    frame = write_frame([0x1000, 0x2000], [b"abc", b"defgh"], fences=[0, 2**63 + 5])
    frame += encode_control(FrameType.HELLO, {"token": "t", "peer": "a:1"})
    decoder = FrameDecoder()
    events: list[object] = []
    for byte in frame:
        decoder.feed(bytes([byte]))
        events.extend(drain(decoder))
    start = events[0]
    assert isinstance(start, FrameStart)
    assert start.addrs == [0x1000, 0x2000] and start.lengths == [3, 5]
    assert start.fences == [0, 2**63 + 5]
    data = b"".join(e.data for e in events if isinstance(e, Data))
    assert data == b"abcdefgh"
    assert isinstance(events[-2], FrameEnd)
    control = events[-1]
    assert isinstance(control, Control) and control.body == {"token": "t", "peer": "a:1"}


def test_whole_stream_at_once_gives_same_events() -> None:
    frame = write_frame([1, 2, 3], [b"x" * 10, b"", b"y" * 3])
    decoder = FrameDecoder()
    decoder.feed(frame)
    events = drain(decoder)
    assert [type(e).__name__ for e in events] == ["FrameStart", "Data", "FrameEnd"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: b"XXXX" + f[4:], "bad magic"),
        (lambda f: f[:4] + bytes([99]) + f[5:], "unknown frame type"),
        (lambda f: f[:20] + struct.pack("<Q", 999) + f[28:], "sum to"),
    ],
)
def test_malformed_frames_raise_remote_protocol_error(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    decoder = FrameDecoder()
    decoder.feed(mutate(write_frame([1], [b"abcd"])))
    with pytest.raises(RemoteProtocolError, match=message):
        drain(decoder)
    with pytest.raises(RemoteProtocolError, match="already failed"):
        decoder.next_event()


def test_header_limits_are_enforced() -> None:
    with pytest.raises(LocalProtocolError):
        encode_header(FrameType.WRITE, 1 << 20, 1, 0)
    read_with_payload = struct.pack("<4sBBHIQQ", MAGIC, FrameType.READ, 0, 0, 1, 1, 5)
    with pytest.raises(RemoteProtocolError, match="no payload"):
        decode_header(read_with_payload)
    huge_control = struct.pack("<4sBBHIQQ", MAGIC, FrameType.HELLO, 0, 0, 0, 1, 1 << 30)
    with pytest.raises(RemoteProtocolError, match="too large"):
        decode_header(huge_control)
    with pytest.raises(RemoteProtocolError):
        decode_header(b"short")


def test_descriptors_and_statuses_round_trip() -> None:
    header = decode_header(encode_header(FrameType.READ, 2, 1, 0))
    assert decode_descriptors(encode_descriptors([5, 2**63], [1, 2]), header) == ([5, 2**63], [1, 2], [0, 0])
    assert decode_descriptors(encode_descriptors([5, 6], [1, 2], [3, 4]), header)[2] == [3, 4]
    big = decode_header(encode_header(FrameType.READ, 30, 1, 0))
    fences = [i * 2**58 for i in range(30)]
    assert decode_descriptors(encode_descriptors(list(range(30)), [1] * 30, fences), big)[2] == fences
    with pytest.raises(LocalProtocolError):
        encode_descriptors([1, 2], [1, 2], [0])
    assert decode_statuses(bytes([0, 1, 2, 3])) == [Status.OK, Status.OUT_OF_RANGE, Status.READ_ONLY,
                                                     Status.FENCED]
    with pytest.raises(RemoteProtocolError):
        decode_statuses(bytes([200]))
    with pytest.raises(RemoteProtocolError):
        decode_descriptors(b"\0" * 8, header)


def test_control_payload_must_be_a_json_object() -> None:
    raw = encode_header(FrameType.HELLO_OK, 0, 0, 3) + b"[1]"
    decoder = FrameDecoder()
    decoder.feed(raw)
    with pytest.raises(RemoteProtocolError, match="JSON object"):
        drain(decoder)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=17))
def test_fuzzed_garbage_gives_clean_errors(garbage: bytes, chunk: int) -> None:
    decoder = FrameDecoder()
    try:
        for i in range(0, len(garbage), chunk):
            decoder.feed(garbage[i : i + chunk])
            drain(decoder)
    except RemoteProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=40), st.integers(0, 2**64 - 1)), min_size=1, max_size=12),
       st.integers(1, 17))
def test_fuzzed_valid_frames_round_trip_in_any_chunking(items: list[tuple[bytes, int]], chunk: int) -> None:
    payloads, fences = [p for p, _ in items], [f for _, f in items]
    frame = write_frame(list(range(len(items))), payloads, fences=fences)
    decoder = FrameDecoder()
    events: list[object] = []
    for i in range(0, len(frame), chunk):
        decoder.feed(frame[i : i + chunk])
        events.extend(drain(decoder))
    start = events[0]
    assert isinstance(start, FrameStart) and start.fences == fences
    assert b"".join(e.data for e in events if isinstance(e, Data)) == b"".join(payloads)
    assert isinstance(events[-1], FrameEnd)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), min_size=1, max_size=8), st.integers(0, 400), st.integers(0, 255))
@example([b"ab"], 8, 0)  # count 0 with a payload: refused
@example([b"a", b"b"], 4, FrameType.WRITE_ACK)  # a WRITE turned into a valid WRITE_ACK
@example([b"", b""], 4, FrameType.READ)  # ... or into a valid READ
def test_fuzzed_mutations_of_valid_frames(payloads: list[bytes], position: int, value: int) -> None:
    frame = bytearray(write_frame(list(range(len(payloads))), payloads, fences=[3] * len(payloads)))
    frame[position % len(frame)] = value
    decoder = FrameDecoder()
    decoder.feed(bytes(frame))
    try:
        events = drain(decoder)
    except RemoteProtocolError:
        return
    for event in events:  # whatever decodes is self-consistent
        if not isinstance(event, FrameStart):
            continue
        if event.header.type == FrameType.WRITE:
            assert sum(event.lengths) == event.header.payload_len
        elif event.header.type == FrameType.READ:
            assert len(event.lengths) == event.header.count and event.header.payload_len == 0
        else:  # a reply: one status per descriptor, then data
            assert len(event.statuses) == event.header.count <= event.header.payload_len


def _read_resp(statuses: list[int], payloads: list[bytes], rid: int = 4) -> bytes:
    data = b"".join(p for p, s in zip(payloads, statuses, strict=True) if s == Status.OK)
    return encode_header(FrameType.READ_RESP, len(statuses), rid, len(statuses) + len(data)) + bytes(statuses) + data


def test_driver_reads_only_what_the_decoder_wants_and_moves_payloads_itself() -> None:
    """The way the tcp drivers use the decoder: read bytes_wanted() at most, then recv_into the
    payload and report it; no payload byte passes through the decoder."""
    stream = memoryview(write_frame([1, 2], [b"abc", b"defg"], fences=[5, 6])
                        + _read_resp([0, 3, 0], [b"xy", b"zz", b"w"]))
    decoder, pos = FrameDecoder(), 0
    starts, payloads = [], []
    while pos < len(stream):
        event = decoder.next_event()
        if event is NEED_DATA:
            want = decoder.bytes_wanted()
            decoder.receive_data(stream[pos : pos + min(want, 5)])  # short reads, never past want
            pos += min(want, 5)
        elif isinstance(event, FrameStart):
            starts.append(event)
            payloads.append(bytes(stream[pos : pos + event.payload_bytes]))  # "recv_into"
            pos += event.payload_bytes
            decoder.payload_received(event.payload_bytes)
            assert isinstance(decoder.next_event(), FrameEnd)
    assert decoder.at_boundary
    assert [s.fences for s in starts] == [[5, 6], []]
    assert starts[1].statuses == [Status.OK, Status.FENCED, Status.OK]
    assert payloads == [b"abcdefg", b"xyw"]


def test_payload_received_outside_a_payload_is_local_misuse() -> None:
    decoder = FrameDecoder()
    with pytest.raises(LocalProtocolError):
        decoder.payload_received(1)
    decoder.feed(write_frame([1], [b"abcd"]))
    assert isinstance(decoder.next_event(), FrameStart)
    with pytest.raises(LocalProtocolError):
        decoder.payload_received(4)  # two payload bytes are already buffered
    with pytest.raises(LocalProtocolError):
        FrameDecoder().payload_received(0)


def test_reply_with_unknown_status_is_a_remote_error() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_header(FrameType.WRITE_ACK, 2, 1, 2) + bytes([0, 77]))
    with pytest.raises(RemoteProtocolError, match="status"):
        drain(decoder)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Status)), st.binary(max_size=30)), min_size=1, max_size=10),
       st.integers(1, 9), st.integers(0, 200), st.integers(0, 255))
def test_fuzzed_read_replies(items: list[tuple[Status, bytes]], chunk: int, position: int, value: int) -> None:
    frame = _read_resp([int(s) for s, _ in items], [p for _, p in items])
    decoder = FrameDecoder()
    events: list[object] = []
    for i in range(0, len(frame), chunk):
        decoder.feed(frame[i : i + chunk])
        events.extend(drain(decoder))
    start = events[0]
    assert isinstance(start, FrameStart) and start.statuses == [s for s, _ in items]
    assert b"".join(e.data for e in events if isinstance(e, Data)) == b"".join(
        p for s, p in items if s == Status.OK)
    mutated = bytearray(frame)
    mutated[position % len(mutated)] = value
    decoder = FrameDecoder()
    decoder.feed(bytes(mutated))
    try:
        drain(decoder)
    except RemoteProtocolError:
        pass
