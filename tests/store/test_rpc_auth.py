"""A shared token on the master's RPC: every connection must present it first."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from kvpool.errors import RpcError
from kvpool.store.framing import FrameDecoder, auth_token, encode_auth, encode_frame
from kvpool.store.master import MasterServer, MasterServerConfig
from kvpool.store.protocol import Op, decode_reply, encode_request
from kvpool.store.rpc_client import RpcClient


@pytest.fixture
def guarded() -> Iterator[MasterServer]:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False, token="s3cret")
    with MasterServer(config) as master:
        yield master


def test_auth_frame_round_trip() -> None:
    frame = encode_auth("tök")
    decoded = FrameDecoder().feed(frame)
    assert [auth_token(f) for f in decoded] == ["tök"]
    assert auth_token(encode_request(Op.PING, 1, "c")) is None


def test_right_token_is_served(guarded: MasterServer) -> None:
    with RpcClient(guarded.address, "ok", token="s3cret") as client:
        assert client.call(Op.PING) == "pong"
        assert client.call(Op.PING) == "pong"


@pytest.mark.parametrize("token", ["wrong", None])
def test_wrong_or_missing_token_is_refused(guarded: MasterServer, token: str | None) -> None:
    with RpcClient(guarded.address, "bad", timeout_s=3, token=token) as client:
        with pytest.raises(RpcError, match="authentication failed"):
            client.call(Op.PING)
    with RpcClient(guarded.address, "ok", token="s3cret") as client:  # others still served
        assert client.call(Op.PING) == "pong"


def test_refused_connection_is_closed_after_the_error(guarded: MasterServer) -> None:
    sock = socket.create_connection(("127.0.0.1", guarded.rpc_port), timeout=5)
    sock.sendall(encode_frame(encode_request(Op.PING, 7, "raw")))
    decoder, frames = FrameDecoder(), []
    while chunk := sock.recv(65536):
        frames += decoder.feed(chunk)
    reply = decode_reply(frames[0])
    assert (reply.req_id, reply.status) == (0, -600)
    assert "authentication failed" in str(reply.result)
    sock.close()


def test_master_without_token_ignores_an_auth_frame() -> None:
    config = MasterServerConfig(rpc_port=0, admin_port=0, enable_http_metadata=False, token=None)
    with MasterServer(config) as master, RpcClient(master.address, "c", token="any") as client:
        assert client.call(Op.PING) == "pong"
