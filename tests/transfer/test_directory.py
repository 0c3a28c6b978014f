"""Finding segments through each metadata backend: HTTP directory, etcd, and P2P handshake."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from kvpool.metadata import MetadataServer, connect_metadata
from kvpool.transfer import OpCode, RequestState, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.segment import SegmentDescriptor, segment_key
from tests.transfer.conftest import Target, sha


def _round_trip(metadata: str, target: Target) -> None:
    with TransferEngine(TransferConfig(metadata=metadata, protocol="tcp")) as engine:
        local = engine.allocate_managed(1 << 20).numpy()
        local[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        engine.write(target.segment, local.ctypes.data, target.plain, 1 << 20)
        assert target.digest(target.plain, 1 << 20) == sha(local)
        missing = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.ctypes.data, 16,
                                                        "127.0.0.1:1", target.plain)])
        assert missing[0].state == RequestState.FAILED
        assert "not in the metadata directory" in (missing[0].reason or "")


def test_http_directory(target_factory: Callable[..., Target]) -> None:
    with MetadataServer(port=0) as server:
        url = server.url
        target = target_factory(metadata=url)
        backend = connect_metadata(url)
        assert backend is not None
        raw = backend.get(segment_key(target.segment))
        assert raw is not None
        descriptor = SegmentDescriptor.from_json(raw)
        assert descriptor.name == target.segment and descriptor.shm_regions[0].addr == target.managed
        _round_trip(url, target)
        target.proc.stdin.close()  # type: ignore[union-attr]
        target.proc.wait(10)
        assert backend.get(segment_key(target.segment)) is None  # unpublished on close
        backend.close()


def test_etcd_directory(etcd_endpoint: str, target_factory: Callable[..., Target]) -> None:
    uri = f"etcd://{etcd_endpoint}"
    target = target_factory(metadata=uri)
    _round_trip(uri, target)
    backend = connect_metadata(etcd_endpoint)  # a bare host:port means etcd
    assert backend is not None
    body = json.loads(backend.get(segment_key(target.segment)) or b"{}")
    assert body["port"] == int(target.segment.rsplit(":", 1)[1])
    backend.close()


def test_p2p_handshake_learns_shared_regions(target: Target) -> None:
    with TransferEngine(TransferConfig(metadata="P2PHANDSHAKE")) as engine:
        local = engine.allocate_managed(4096)
        engine.write(target.segment, local.addr, target.managed, 4096)
        shm_peer = engine._started_router()._shm_peers[target.segment]
        assert shm_peer.descriptor.shm_regions[0].addr == target.managed


def test_an_engine_unpublishes_while_its_port_is_still_its_own() -> None:
    """A successor started on the same port publishes as soon as it can bind it: the
    engine closing must have deleted its descriptor by then, or its late DELETE removes the
    successor's."""
    import socket

    with MetadataServer(port=0) as server:
        engine = TransferEngine(TransferConfig(metadata=server.url, protocol="tcp")).start()
        port = int(engine.segment_name.rsplit(":", 1)[1])
        assert engine._backend is not None
        delete, port_free_at_delete = engine._backend.delete, []

        def checked_delete(key: str) -> bool:
            probe = socket.socket()
            try:
                probe.bind(("127.0.0.1", port))
                port_free_at_delete.append(True)
            except OSError:
                port_free_at_delete.append(False)
            finally:
                probe.close()
            return delete(key)
        engine._backend.delete = checked_delete  # type: ignore[method-assign]
        engine.close()
        assert port_free_at_delete == [False]
        assert connect_metadata(server.url).get(segment_key(engine.segment_name)) is None
