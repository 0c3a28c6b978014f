"""Mutual authentication: the token never crosses the wire, and an initiator sends nothing to a
peer that cannot prove it knows the token (e.g. one a poisoned directory entry points at)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.errors import AuthError, RemoteProtocolError
from kvpool.metadata import MetadataServer, connect_metadata
from kvpool.transfer import OpCode, RequestState, TransferConfig, TransferEngine, TransferRequest
from kvpool.transfer.auth import INITIATOR, TARGET, check_proof, new_nonce, nonce_of, proof
from kvpool.transfer.decoder import NEED_DATA, Control, FrameDecoder
from kvpool.transfer.protocol import FrameType, encode_control
from kvpool.transfer.segment import SegmentDescriptor, segment_key
from kvpool.transfer.tcp_client import open_connection
from tests.transfer.conftest import Target, sha

TOKEN = "correct horse battery staple"
MARKER = b"\xa5PAYLOAD-MARKER\x5a" * 256


class FakePeer:
    """A real listener that records what initiators send it and answers as `mode` says:
    "no-auth" (HELLO_OK at once), "bogus" (a CHALLENGE with a made-up proof), or "relay"
    (pipes both ways to `upstream`, a real target)."""

    def __init__(self, mode: str, upstream: tuple[str, int] | None = None) -> None:
        self.mode, self.upstream = mode, upstream
        self.received = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._spawn(self._relay if self.mode == "relay" else self._answer, conn)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            self._record(conn.recv(65536))
            if self.mode == "no-auth":
                reply = encode_control(FrameType.HELLO_OK, {"name": "x", "host": "127.0.0.1", "port": 1,
                                                            "host_id": "elsewhere", "pid": 1})
            else:
                reply = encode_control(FrameType.CHALLENGE, {"nonce": new_nonce(), "proof": "00" * 32})
            conn.sendall(reply)
            while data := conn.recv(65536):
                self._record(data)

    def _relay(self, conn: socket.socket) -> None:
        assert self.upstream is not None
        up = socket.create_connection(self.upstream)
        self._spawn(_pipe, up, conn, None)
        _pipe(conn, up, self._record)

    def _record(self, data: bytes) -> None:
        self.received += data

    def frames_received(self) -> list[object]:
        decoder, events = FrameDecoder(), []
        decoder.feed(bytes(self.received))
        while (event := decoder.next_event()) is not NEED_DATA:
            events.append(event)
        return events

    def close(self) -> None:
        self._listener.close()


def _pipe(src: socket.socket, dst: socket.socket, record: Callable[[bytes], None] | None) -> None:
    try:
        while data := src.recv(65536):
            if record is not None:
                record(data)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def fake_peers() -> Iterator[Callable[..., FakePeer]]:
    made: list[FakePeer] = []

    def make(mode: str, upstream: tuple[str, int] | None = None) -> FakePeer:
        made.append(FakePeer(mode, upstream))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def _assert_only_hello(peer: FakePeer) -> None:
    assert TOKEN.encode() not in peer.received
    assert MARKER[:32] not in peer.received
    events = peer.frames_received()  # one HELLO per connection attempt, nothing else
    assert events and all(isinstance(e, Control) and e.header.type == FrameType.HELLO for e in events)
    assert all("token" not in e.body for e in events if isinstance(e, Control))


@pytest.mark.parametrize("mode", ["no-auth", "bogus"])
def test_impostor_gets_neither_token_nor_payload(mode: str, fake_peers: Callable[..., FakePeer]) -> None:
    peer = fake_peers(mode)
    with TransferEngine(TransferConfig(protocol="tcp", token=TOKEN)) as engine:
        local = engine.allocate_managed(len(MARKER))
        local.view[:] = MARKER
        status = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.addr, len(MARKER),
                                                       f"127.0.0.1:{peer.port}", 0x1000)])[0]
        assert status.state == RequestState.FAILED
        assert "prove it knows the shared token" in (status.reason or "")
        with pytest.raises(AuthError, match="nothing was sent"):
            open_connection("127.0.0.1", peer.port, engine.config, engine.segment_name)
    _assert_only_hello(peer)


def test_poisoned_directory_entry_relaying_to_the_real_target_gets_nothing(
        target_factory: Callable[..., Target], fake_peers: Callable[..., FakePeer]) -> None:
    with MetadataServer(port=0) as server:
        target = target_factory(metadata=server.url, token=TOKEN)
        host, port = target.segment.rsplit(":", 1)
        relay = fake_peers("relay", (host, int(port)))
        backend = connect_metadata(server.url)
        assert backend is not None
        poisoned = SegmentDescriptor(target.segment, "127.0.0.1", relay.port, "elsewhere", 1)
        backend.put(segment_key(target.segment), poisoned.to_json())
        with TransferEngine(TransferConfig(metadata=server.url, protocol="tcp", token=TOKEN)) as engine:
            local = engine.allocate_managed(len(MARKER))
            local.view[:] = MARKER
            before = target.digest(target.plain, len(MARKER))
            status = engine.transfer_sync([TransferRequest(OpCode.WRITE, local.addr, len(MARKER),
                                                           target.segment, target.plain)])[0]
            assert status.state == RequestState.FAILED
            # refused before any connection: the entry names another address than the
            # segment's own (a relay that got through would still fail the token's proof)
            assert "describes" in (status.reason or "")
            assert target.digest(target.plain, len(MARKER)) == before
        backend.close()
    assert relay.received == b""


def test_token_never_crosses_the_wire_with_a_real_target(target_factory: Callable[..., Target],
                                                         fake_peers: Callable[..., FakePeer]) -> None:
    target = target_factory(token=TOKEN)
    host, port = target.segment.rsplit(":", 1)
    tap = fake_peers("relay", (host, int(port)))  # records what a legitimate initiator sends
    with TransferEngine(TransferConfig(protocol="tcp", token=TOKEN)) as engine:
        local = engine.allocate_managed(4096).numpy()
        local[:] = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        engine.write(target.segment, local.ctypes.data, target.plain, 4096)  # through the real one
        assert target.digest(target.plain, 4096) == sha(local)
        with pytest.raises(AuthError):  # through the tap: the name it proves is not the tap's
            open_connection("127.0.0.1", tap.port, engine.config, engine.segment_name)
    assert TOKEN.encode() not in tap.received


def test_proofs_bind_token_role_nonces_and_name() -> None:
    ni, nt = new_nonce(), new_nonce()
    base = proof(TOKEN, TARGET, ni, nt, "127.0.0.1:1")
    assert check_proof(TOKEN, TARGET, ni, nt, "127.0.0.1:1", base)
    for other in (proof("other", TARGET, ni, nt, "127.0.0.1:1"), proof(TOKEN, INITIATOR, ni, nt, "127.0.0.1:1"),
                  proof(TOKEN, TARGET, nt, ni, "127.0.0.1:1"), proof(TOKEN, TARGET, ni, nt, "127.0.0.1:2")):
        assert other != base
    assert not check_proof(TOKEN, TARGET, ni, nt, "127.0.0.1:1", None)
    assert not check_proof(TOKEN, TARGET, ni, nt, "127.0.0.1:1", base[:-1] + ("1" if base[-1] == "0" else "0"))
    for bad in ({}, {"nonce": 5}, {"nonce": "zz" * 32}, {"nonce": "ab"}, "text"):
        with pytest.raises(RemoteProtocolError):
            nonce_of(bad)
