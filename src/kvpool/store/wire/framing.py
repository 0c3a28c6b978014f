"""Length-prefixed frames over a byte stream (sans-I/O).

The master's control plane carries one msgpack message (see protocol.py) per frame:

    +----------------------+----------------------------+
    | length: u32 LE (4 B) | payload: `length` bytes    |
    +----------------------+----------------------------+

`encode_frame` builds a frame; `FrameDecoder.feed` takes whatever bytes a socket delivered
(any split, one byte at a time included) and returns the payloads completed so far. A length
over the decoder's limit is the peer's fault: RemoteProtocolError, after which the decoder
refuses further input (the stream cannot be resynchronized; drop the connection).
"""

from __future__ import annotations

import struct

from kvpool.errors import LocalProtocolError, RemoteProtocolError
from kvpool.store.wire.protocol import MAX_FRAME_BYTES

HEADER = struct.Struct("<I")
HEADER_BYTES = HEADER.size
_unpack_header = HEADER.unpack_from
_pack_header = HEADER.pack


def encode_frame(payload: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Header + payload. LocalProtocolError when the payload exceeds `max_frame_bytes`."""
    if len(payload) > max_frame_bytes:
        raise LocalProtocolError(f"frame of {len(payload)} bytes exceeds {max_frame_bytes}")
    return _pack_header(len(payload)) + payload


class FrameDecoder:
    """Reassembles frames from stream chunks. Not thread-safe (one per connection)."""

    __slots__ = ("max_frame_bytes", "_buf", "_error")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if not 0 <= max_frame_bytes < 1 << 32:
            raise LocalProtocolError(f"max_frame_bytes must fit in 32 bits, got "
                                     f"{max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._error: str | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)

    @property
    def pending_frame_bytes(self) -> int:
        """Total size (header included) of the frame being received, or 0 before its header."""
        if len(self._buf) < HEADER_BYTES:
            return 0
        return HEADER_BYTES + _unpack_header(self._buf)[0]

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """The payloads completed by `data`, in order. Raises RemoteProtocolError for an
        oversized length (then and on every later call); frames completed before the bad
        header in the same chunk are lost with it."""
        if self._error is not None:
            raise RemoteProtocolError(self._error)
        if self._buf:
            self._buf += data
            buf: bytes | bytearray | memoryview = self._buf
        else:
            buf = data
        frames, pos = self._split(buf)
        if pos == len(buf):
            self._buf = bytearray()
        elif pos or buf is not self._buf:
            self._buf = bytearray(buf[pos:])
        return frames

    def _split(self, buf: bytes | bytearray | memoryview) -> tuple[list[bytes], int]:
        frames: list[bytes] = []
        pos, end_of_data = 0, len(buf)
        while end_of_data - pos >= HEADER_BYTES:
            size = _unpack_header(buf, pos)[0]
            if size > self.max_frame_bytes:
                self._error = f"frame of {size} bytes exceeds {self.max_frame_bytes}"
                self._buf = bytearray()
                raise RemoteProtocolError(self._error)
            end = pos + HEADER_BYTES + size
            if end > end_of_data:
                break
            frames.append(bytes(buf[pos + HEADER_BYTES:end]))
            pos = end
        return frames, pos

