"""A shared token on the master's RPC: a challenge-response that never sends the token, and
bounded resources for connections that have not authenticated (or went idle)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.errors import AuthError, RpcError
from kvpool.store.client.rpc import RpcClient
from kvpool.store.master.rpc_limits import RpcLimits
from kvpool.store.master.server import MasterServer, MasterServerConfig
from kvpool.store.wire.auth import (
    AUTH_MAGIC,
    Kind,
    ServerHandshake,
    decode_message,
    encode_message,
    proof,
)
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.messages import PingMsg, decode_msg
from kvpool.store.wire.protocol import Op, decode_reply, encode_request
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool

TOKEN = "s3cret-token-value"


def _master(token: str | None, **limits: float) -> MasterServer:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False,
                                token=token, rpc_limits=RpcLimits(**limits))  # type: ignore[arg-type]
    return MasterServer(config)


@pytest.fixture
def guarded() -> Iterator[MasterServer]:
    with _master(TOKEN, handshake_timeout_s=0.5, max_connections=8, max_handshakes=4) as m:
        yield m


def _raw(master: MasterServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", master.rpc_port), timeout=5)


def _frames_until_eof(sock: socket.socket) -> list[bytes]:
    decoder, frames = FrameDecoder(), []
    try:
        while chunk := sock.recv(65536):
            frames += decoder.feed(chunk)
    except ConnectionResetError:
        pass
    return frames


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_server_handshake_accepts_only_the_right_proof() -> None:
    server = ServerHandshake(TOKEN)
    challenge = decode_message(server.receive(encode_message(Kind.HELLO)))
    assert challenge is not None and challenge[0] is Kind.CHALLENGE and len(challenge[1]) == 32
    with pytest.raises(AuthError, match="unexpected handshake message PROOF"):
        ServerHandshake(TOKEN).receive(encode_message(Kind.PROOF, b"x" * 32))
    wrong = ServerHandshake(TOKEN)
    wrong.receive(encode_message(Kind.HELLO))
    with pytest.raises(AuthError, match="wrong shared token"):
        wrong.receive(encode_message(Kind.PROOF, proof("guess", challenge[1])))
    assert decode_message(server.receive(encode_message(Kind.PROOF, proof(TOKEN, challenge[1])))) \
        == (Kind.OK, b"")
    assert server.done
    other = ServerHandshake(TOKEN)
    other.receive(encode_message(Kind.HELLO))   # a fresh nonce: the old proof is worthless
    with pytest.raises(AuthError):
        other.receive(encode_message(Kind.PROOF, proof(TOKEN, challenge[1])))
    for frame in (encode_request(Op.PING, 1, "c"), AUTH_MAGIC + TOKEN.encode()):
        with pytest.raises(AuthError, match="authentication failed"):
            ServerHandshake(TOKEN).receive(frame)


def test_right_token_is_served(guarded: MasterServer) -> None:
    with RpcClient(guarded.address, "ok", token=TOKEN) as client:
        assert client.call(PingMsg()) == "pong"
        assert client.call(PingMsg()) == "pong"


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_is_refused(guarded: MasterServer, token: str | None) -> None:
    with RpcClient(guarded.address, "bad", timeout_s=3, token=token) as client:
        with pytest.raises(RpcError, match="authentication failed"):
            client.call(PingMsg())
    with RpcClient(guarded.address, "ok", token=TOKEN) as client:  # others still served
        assert client.call(PingMsg()) == "pong"


def test_the_token_never_crosses_the_wire() -> None:
    """A fake master records every byte a client sends during a full handshake."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def fake_master() -> None:
        conn, _ = listener.accept()
        decoder = FrameDecoder()
        server = ServerHandshake(TOKEN)
        while not server.done:
            data = conn.recv(4096)
            received.extend(data)
            for frame in decoder.feed(data):
                conn.sendall(encode_frame(server.receive(frame)))
        data = conn.recv(4096)
        received.extend(data)
        req = decoder.feed(data)[0]
        conn.sendall(encode_frame(decode_reply_bytes(req)))
        conn.close()

    thread = threading.Thread(target=fake_master, daemon=True)
    thread.start()
    with RpcClient(f"127.0.0.1:{listener.getsockname()[1]}", "c", token=TOKEN) as client:
        assert client.call(PingMsg()) == "pong"
    thread.join(5)
    listener.close()
    assert received and TOKEN.encode() not in bytes(received)


def decode_reply_bytes(request: bytes) -> bytes:
    from kvpool.store.wire.protocol import encode_reply
    return encode_reply(decode_msg(request).req_id, 0, "pong")


def test_old_style_token_frame_is_refused(guarded: MasterServer) -> None:
    sock = _raw(guarded)
    sock.sendall(encode_frame(AUTH_MAGIC + TOKEN.encode()))
    reply = decode_reply(_frames_until_eof(sock)[0])
    assert (reply.req_id, reply.status) == (0, -600)
    assert "authentication failed" in str(reply.result)
    sock.close()


def test_refused_connection_is_closed_after_the_error(guarded: MasterServer) -> None:
    sock = _raw(guarded)
    sock.sendall(encode_frame(encode_request(Op.PING, 7, "raw")))
    reply = decode_reply(_frames_until_eof(sock)[0])
    assert (reply.req_id, reply.status) == (0, -600)
    assert "requires the shared token" in str(reply.result)
    sock.close()


def test_a_large_frame_before_authentication_is_refused_at_its_header(
        guarded: MasterServer) -> None:
    sock = _raw(guarded)
    sock.sendall(struct.pack("<I", 1 << 20) + b"\x00" * 100)  # formerly buffered up to 64 MiB
    reply = decode_reply(_frames_until_eof(sock)[0])
    assert (reply.req_id, reply.status) == (0, -600)
    assert reply.result == f"frame of {1 << 20} bytes exceeds 4096"
    sock.close()


def test_handshake_deadline_closes_silent_and_slow_peers(guarded: MasterServer) -> None:
    silent = _raw(guarded)
    slow = _raw(guarded)
    slow.sendall(encode_frame(encode_message(Kind.HELLO)))   # then never the proof
    start = time.monotonic()
    assert _closed_within(silent, 5) and _closed_within(slow, 5)
    assert time.monotonic() - start < 3
    silent.close(), slow.close()
    with RpcClient(guarded.address, "ok", token=TOKEN) as client:
        assert client.call(PingMsg()) == "pong"


def test_connections_in_the_handshake_are_capped(guarded: MasterServer) -> None:
    waiting = [_raw(guarded) for _ in range(4)]
    time.sleep(0.1)
    extra = _raw(guarded)                    # the oldest handshake gives way
    assert _closed_within(waiting[0], 0.3)  # long before its 0.5 s handshake deadline
    for sock in (*waiting, extra):
        sock.close()
    time.sleep(0.2)
    with RpcClient(guarded.address, "ok", token=TOKEN) as client:
        assert client.call(PingMsg()) == "pong"


def test_slow_handshakes_cannot_lock_clients_out(guarded: MasterServer) -> None:
    """Formerly the handshake slots, held by peers that never finish, refused everyone."""
    slow = []
    with RpcClient(guarded.address, "ok", token=TOKEN, timeout_s=2) as client:
        for _ in range(3):
            slow += [_raw(guarded) for _ in range(6)]   # more than the 4 slots, again and again
            time.sleep(0.05)
            assert client.call(PingMsg()) == "pong"       # a new connection each time
            client._disconnect()
    for sock in slow:
        sock.close()


def test_connections_are_capped() -> None:
    """At the cap a newcomer replaces the longest idle connection, whose client reconnects
    on its next call; idle connections cannot lock clients out."""
    with _master(None, max_connections=3, max_handshakes=3) as master:
        clients = [RpcClient(master.address, f"c{i}") for i in range(3)]
        assert [c.call(PingMsg()) for c in clients] == ["pong"] * 3
        hogs = [_raw(master) for _ in range(3)]
        time.sleep(0.2)
        assert master._rpc is not None and master._rpc.num_connections == 3
        assert [c.call(PingMsg()) for c in clients] == ["pong"] * 3
        assert all(_closed_within(h, 2) for h in hogs)
        for client in clients:
            client.close()
        for hog in hogs:
            hog.close()


def test_idle_connections_are_closed_and_clients_reconnect() -> None:
    with _master(TOKEN, idle_timeout_s=0.3) as master:
        with RpcClient(master.address, "c", token=TOKEN) as client:
            assert client.call(PingMsg()) == "pong"
            assert master._rpc is not None and master._rpc.num_connections == 1
            time.sleep(0.8)
            assert master._rpc.num_connections == 0
            assert client.call(PingMsg()) == "pong"   # a new connection, a new handshake


def test_master_without_token_answers_the_handshake() -> None:
    with _master(None) as master, RpcClient(master.address, "c", token="any") as client:
        assert client.call(PingMsg()) == "pong"


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_unauthenticated_floods_do_not_grow_the_master() -> None:
    rpc, admin = free_port(), free_port()
    proc = spawn_kvpool("master", "--rpc-port", str(rpc), "--admin-port", str(admin),
                        "--no-http-metadata", "--token", TOKEN)
    with running(proc):
        wait_port(rpc), wait_port(admin)
        before = _rss_bytes(proc.pid)
        socks = [socket.create_connection(("127.0.0.1", rpc)) for _ in range(8)]
        junk = struct.pack("<I", 60 << 20) + b"\x01" * (8 << 20)
        for sock in socks:
            try:
                sock.sendall(junk)   # formerly buffered: +480 MiB for 8 such peers
            except OSError:
                pass                 # the master hung up at the header
        time.sleep(0.5)
        assert _rss_bytes(proc.pid) - before < 32 << 20
        for sock in socks:
            sock.close()
        with RpcClient(f"127.0.0.1:{rpc}", "ok", token=TOKEN) as client:
            assert client.call(PingMsg()) == "pong"
