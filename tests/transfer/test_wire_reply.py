"""FrameReader's reply reads: `reply_into` (a one-descriptor READ_RESP with its payload landing
straight in the caller's view, every other reply decoded as next_event would) and
`finish_frame_in_steps` (a large payload reported view by view as it arrives)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.errors import PeerUnavailable
from kvpool.transfer.decoder import Control, FrameEnd, FrameStart
from kvpool.transfer.protocol import HEADER_BYTES, FrameType, Status, encode_control, encode_header
from kvpool.transfer.wire import SCRATCH_BYTES, FrameReader

PREFIX = HEADER_BYTES + 1


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _reply(status: Status, payload: bytes, rid: int = 5) -> bytes:
    return encode_header(FrameType.READ_RESP, 1, rid, 1 + len(payload)) + bytes([status]) + payload


def _payload(size: int) -> bytes:
    return bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))


@pytest.mark.parametrize("size", [1, 4096, SCRATCH_BYTES + 1, 3 << 20])
def test_an_ok_reply_lands_in_the_view(pair: tuple[socket.socket, socket.socket], size: int) -> None:
    a, b = pair
    payload = _payload(size)
    sender = threading.Thread(target=a.sendall, args=(_reply(Status.OK, payload) + b"NEXT",))
    sender.start()
    if size <= SCRATCH_BYTES + 1:
        sender.join()  # all there before the read: one read takes the whole reply
    reader = FrameReader(b, 5.0, None, poll_us=100)
    view = memoryview(bytearray(size))
    start, rest = reader.reply_into(PREFIX, [view])
    assert isinstance(start, FrameStart) and start.statuses == [Status.OK]
    assert start.header.request_id == 5
    assert rest is not None  # payload bytes came in the prefix's read
    if size <= SCRATCH_BYTES + 1:
        assert rest == []
    assert isinstance(reader.finish_frame(rest), FrameEnd)
    assert bytes(view) == payload
    sender.join()
    assert b.recv(16) == b"NEXT"  # nothing past the reply was read


def test_a_prefix_split_over_reads_is_put_together(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    frame = _reply(Status.OK, b"0123456789")
    a.sendall(frame[:7])
    threading.Timer(0.05, a.sendall, args=(frame[7:],)).start()
    reader = FrameReader(b, 5.0, None)
    view = memoryview(bytearray(10))
    start, rest = reader.reply_into(PREFIX, [view])
    assert isinstance(start, FrameStart) and start.statuses == [Status.OK]
    reader.finish_frame(rest if rest is not None else [view])
    assert bytes(view) == b"0123456789"


def test_a_refused_descriptor_leaves_the_view_untouched(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(_reply(Status.FENCED, b""))
    reader = FrameReader(b, 5.0, None)
    view = memoryview(bytearray(b"\xee" * 2))
    start, rest = reader.reply_into(PREFIX, [view])
    assert isinstance(start, FrameStart) and start.statuses == [Status.FENCED]
    assert rest is None and bytes(view) == b"\xee\xee"
    assert isinstance(reader.finish_frame([]), FrameEnd)
    a.sendall(_reply(Status.OK, b"ab", rid=6))  # a target answers only what it was asked
    second, rest = reader.reply_into(PREFIX, [view])  # the connection goes on
    assert isinstance(second, FrameStart) and second.header.request_id == 6
    reader.finish_frame(rest if rest is not None else [view])
    assert bytes(view) == b"ab"


def test_other_replies_are_decoded_in_full(pair: tuple[socket.socket, socket.socket]) -> None:
    """An ERROR frame longer than the prefix comes back whole (its bytes that landed in the
    view are taken back); a READ_RESP whose length differs is left to the caller's check."""
    a, b = pair
    text = "protocol error: " + "x" * 100
    a.sendall(encode_control(FrameType.ERROR, text))
    reader = FrameReader(b, 5.0, None)
    event, rest = reader.reply_into(PREFIX, [memoryview(bytearray(64))])
    assert isinstance(event, Control) and event.body == text and rest is None
    a.sendall(_reply(Status.OK, b"abc"))
    view = memoryview(bytearray(8))
    start, rest = reader.reply_into(PREFIX, [view])
    assert isinstance(start, FrameStart) and start.payload_bytes == 3 and rest is None
    out = memoryview(bytearray(3))
    reader.finish_frame([out])
    assert bytes(out) == b"abc"


def test_a_close_before_or_inside_the_reply(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    reader = FrameReader(b, 5.0, None)
    a.sendall(_reply(Status.OK, b"abcd")[:10])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(PeerUnavailable):
        reader.reply_into(PREFIX, [memoryview(bytearray(4))])
    c, d = socket.socketpair()
    c.close()
    assert FrameReader(d, 5.0, None).reply_into(PREFIX, [memoryview(bytearray(4))]) == (None, None)
    d.close()


def _multi_reply(payloads: list[bytes]) -> bytes:
    body = b"".join(payloads)
    return (encode_header(FrameType.READ_RESP, len(payloads), 9, len(payloads) + len(body))
            + bytes(len(payloads)) + body)


def test_a_large_payload_is_reported_in_steps_of_whole_views(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payloads = [_payload(1000 + i) for i in range(8)]
    sender = threading.Thread(target=a.sendall, args=(_multi_reply(payloads),))
    sender.start()
    reader = FrameReader(b, 5.0, None)
    start = reader.next_event(HEADER_BYTES + 8)  # the statuses only: no payload buffered
    assert isinstance(start, FrameStart) and start.statuses == [Status.OK] * 8
    views = [memoryview(bytearray(b"\xee" * len(p))) for p in payloads]
    steps: list[tuple[int, int]] = []

    def arrived(lo: int, hi: int) -> None:
        assert all(bytes(views[i]) == payloads[i] for i in range(lo, hi))  # in place
        assert all(bytes(v) == b"\xee" * v.nbytes for v in views[hi:])  # not read yet
        steps.append((lo, hi))
    assert isinstance(reader.finish_frame_in_steps(views, arrived, 2500), FrameEnd)
    assert steps == [(0, 3), (3, 6), (6, 8)]  # whole views, at least 2,500 bytes a step
    sender.join()


def test_steps_after_a_greedy_read_finish_whole(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payloads = [b"abc", b"defg"]
    a.sendall(_multi_reply(payloads))
    reader = FrameReader(b, 5.0, None)
    assert isinstance(reader.next_event(SCRATCH_BYTES), FrameStart)  # took the payload too
    views = [memoryview(bytearray(3)), memoryview(bytearray(4))]
    steps: list[tuple[int, int]] = []
    reader.finish_frame_in_steps(views, lambda lo, hi: steps.append((lo, hi)), 1)
    assert steps == [(0, 2)] and [bytes(v) for v in views] == payloads
