"""The tcp initiator's connection pool: a sync batch runs its first frame in the caller's
thread and the others on the worker threads, and every one of those connections is kept for
the next batch (none is closed and opened again, handshake included)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest, tcp_client
from tests.transfer.conftest import Target, sha


def test_a_batch_of_more_frames_than_workers_reuses_every_connection(
        target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = tcp_client.Connection.open

    def counted(host: str, port: int, config: TransferConfig, me: str) -> tcp_client.Connection:
        opened.append(f"{host}:{port}")
        return real_open(host, port, config, me)
    monkeypatch.setattr(tcp_client.Connection, "open", counted)
    piece, frames = 4096, 5  # one frame per request: the caller's and four workers'
    config = TransferConfig(protocol="tcp", connections_per_peer=4, frame_bytes=piece,
                            slice_bytes=piece, timeout_s=5.0)
    with TransferEngine(config) as engine:
        local = engine.allocate_managed(piece * frames).numpy()
        local[:] = np.random.default_rng(7).integers(0, 256, local.size, dtype=np.uint8)
        requests = [TransferRequest(OpCode.WRITE, local.ctypes.data + i * piece, piece,
                                    target.segment, target.plain + i * piece)
                    for i in range(frames)]
        for _ in range(10):
            assert all(s.ok for s in engine.transfer_sync(requests))
            assert target.digest(target.plain, piece * frames) == sha(local)
    # at most one connection per frame in flight at once, ever: none closed and reopened
    assert 1 <= len(opened) <= frames
