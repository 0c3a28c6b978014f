"""An incremental, sans-I/O frame decoder: feed any bytes, pull events.

Used for the control path and by tests that feed frames one byte at a time or fuzz them. The
data-plane drivers use the same pure functions (`decode_header`, `decode_descriptors`) but move
payloads with `recv_into` instead of buffering them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpool.errors import RemoteProtocolError
from kvpool.transfer.protocol import (
    CONTROL_TYPES,
    HEADER_BYTES,
    Header,
    decode_control,
    decode_descriptors,
    decode_header,
)


@dataclass(frozen=True, slots=True)
class FrameStart:
    """A frame's header and (for WRITE/READ) its descriptors; payload follows as Data events."""

    header: Header
    addrs: list[int]
    lengths: list[int]
    fences: list[int]


@dataclass(frozen=True, slots=True)
class Data:
    data: bytes


@dataclass(frozen=True, slots=True)
class FrameEnd:
    header: Header


@dataclass(frozen=True, slots=True)
class Control:
    header: Header
    body: dict[str, Any] | str


class NeedData:
    """Sentinel event: feed more bytes."""


NEED_DATA = NeedData()
Event = FrameStart | Data | FrameEnd | Control | NeedData


class FrameDecoder:
    """Turns a byte stream into events. After a RemoteProtocolError the decoder is dead."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._header: Header | None = None
        self._payload_left = 0
        self._in_payload = False
        self._dead = False

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_event(self) -> Event:
        if self._dead:
            raise RemoteProtocolError("decoder already failed; drop the connection")
        try:
            return self._step()
        except RemoteProtocolError:
            self._dead = True
            raise

    def _step(self) -> Event:
        if self._in_payload:
            return self._payload_event()
        if self._header is None:
            if len(self._buf) < HEADER_BYTES:
                return NEED_DATA
            self._header = decode_header(bytes(self._buf[:HEADER_BYTES]))
            del self._buf[:HEADER_BYTES]
        return self._body_event(self._header)

    def _body_event(self, header: Header) -> Event:
        if header.type in CONTROL_TYPES:
            if len(self._buf) < header.payload_len:
                return NEED_DATA
            payload = bytes(self._buf[: header.payload_len])
            del self._buf[: header.payload_len]
            self._header = None
            return Control(header, decode_control(header, payload))
        need = header.descriptor_bytes
        if len(self._buf) < need:
            return NEED_DATA
        addrs, lengths, fences = decode_descriptors(bytes(self._buf[:need]), header) if need else ([], [], [])
        del self._buf[:need]
        self._in_payload, self._payload_left = True, header.payload_len
        return FrameStart(header, addrs, lengths, fences)

    def _payload_event(self) -> Event:
        assert self._header is not None
        if self._payload_left == 0:
            header, self._header, self._in_payload = self._header, None, False
            return FrameEnd(header)
        if not self._buf:
            return NEED_DATA
        take = min(self._payload_left, len(self._buf))
        chunk = bytes(self._buf[:take])
        del self._buf[:take]
        self._payload_left -= take
        return Data(chunk)
