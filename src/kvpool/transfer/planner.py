"""How requests to one peer become frames: slicing of large requests and coalescing of small ones.

Pure policy over lengths: no sockets. A request larger than `slice_bytes` travels as several
slices (spread by the connection pool); requests up to it are packed together into frames of at
most `frame_bytes` payload and `frame_requests` descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.transfer.batch import Batch, OpCode
from kvpool.transfer.config import TransferConfig
from kvpool.transfer.tcp_client import Frame


@dataclass(frozen=True, slots=True)
class Piece:
    index: int
    """Index of the request in its batch."""
    target_addr: int
    length: int
    view: memoryview
    """The local side of the transfer (source of a write, destination of a read)."""


def count_slices(length: int, slice_bytes: int) -> int:
    return max(1, -(-length // slice_bytes))


def plan_frames(op: OpCode, batch: Batch, pieces: list[Piece], config: TransferConfig) -> list[Frame]:
    frames: list[Frame] = []
    current = Frame(op, batch, [], [], [], [])
    current_bytes = 0
    for piece in pieces:
        if piece.length > config.slice_bytes:
            frames.extend(_slices(op, batch, piece, config.slice_bytes))
            continue
        current.indices.append(piece.index)
        current.addrs.append(piece.target_addr)
        current.lengths.append(piece.length)
        current.views.append(piece.view)
        current_bytes += piece.length
        if current_bytes >= config.frame_bytes or len(current.indices) >= config.frame_requests:
            frames.append(current)
            current, current_bytes = Frame(op, batch, [], [], [], []), 0
    if current.indices:
        frames.append(current)
    return frames


def _slices(op: OpCode, batch: Batch, piece: Piece, slice_bytes: int) -> list[Frame]:
    return [
        Frame(op, batch, [piece.index], [piece.target_addr + offset],
              [min(slice_bytes, piece.length - offset)],
              [piece.view[offset : offset + slice_bytes]])
        for offset in range(0, piece.length, slice_bytes)
    ]
