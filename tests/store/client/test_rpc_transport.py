"""RpcClient against scripted TCP servers: timeouts, late replies, broken and reset
connections, a master that closed an idle connection, a malformed reply."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kvpool.errors import RpcError, RpcTimeout
from kvpool.store.client.rpc import LEADER_CHECK_S, RpcClient, parse_address
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.messages import PingMsg, decode_msg
from kvpool.store.wire.protocol import encode_reply

Script = Callable[[socket.socket, int], None]


@contextmanager
def scripted_server(script: Script) -> Iterator[tuple[str, list[int]]]:
    """A server that runs `script(conn, index)` on each accepted connection in turn;
    yields its address and the list of connection indexes it accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(len(accepted))
            with conn:
                script(conn, accepted[-1])
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def read_request_ids(conn: socket.socket, count: int) -> list[int]:
    decoder, ids = FrameDecoder(), []
    conn.settimeout(5)
    while len(ids) < count:
        data = conn.recv(65536)
        if not data:
            break
        ids += [decode_msg(f).req_id for f in decoder.feed(data)]
    return ids


def answer(conn: socket.socket, req_id: int, result: object = "pong") -> None:
    conn.sendall(encode_frame(encode_reply(req_id, 0, result)))


def test_late_reply_of_a_timed_out_call_is_skipped() -> None:
    def script(conn: socket.socket, index: int) -> None:
        assert read_request_ids(conn, 1) == [1]     # no answer in time
        assert read_request_ids(conn, 1) == [2]
        answer(conn, 1, "late")
        answer(conn, 2, "second")
        read_request_ids(conn, 1)
    with scripted_server(script) as (address, accepted):
        with RpcClient(address, "c", timeout_s=0.3) as client:
            t0 = time.monotonic()
            with pytest.raises(RpcTimeout, match=r"did not answer within 0.3s"):
                client.call(PingMsg())
            assert 0.25 < time.monotonic() - t0 < 2
            assert client.call(PingMsg()) == "second"
        assert accepted == [0]                        # the same connection throughout


def test_connection_closed_mid_call_fails_that_call_then_reconnects() -> None:
    def script(conn: socket.socket, index: int) -> None:
        ids = read_request_ids(conn, 1)
        if index == 1:
            answer(conn, ids[0])
            read_request_ids(conn, 1)
    with scripted_server(script) as (address, accepted):
        with RpcClient(address, "c", timeout_s=5) as client:
            t0 = time.monotonic()
            with pytest.raises(RpcError, match="closed the connection"):
                client.call(PingMsg())
            assert time.monotonic() - t0 < 2                 # not a timeout: no hang
            assert client.call(PingMsg()) == "pong"
        assert accepted == [0, 1]


def test_idle_connection_closed_by_the_master_is_replaced_silently() -> None:
    def script(conn: socket.socket, index: int) -> None:
        ids = read_request_ids(conn, 1)
        answer(conn, ids[0], f"conn{index}")
        if index == 1:
            read_request_ids(conn, 1)
    with scripted_server(script) as (address, accepted):
        with RpcClient(address, "c") as client:
            assert client.call(PingMsg()) == "conn0"
            time.sleep(0.2)                                   # the server has closed it
            assert client.call(PingMsg()) == "conn1"
        assert accepted == [0, 1]


def test_oversized_reply_is_an_error_and_the_next_call_reconnects() -> None:
    def script(conn: socket.socket, index: int) -> None:
        ids = read_request_ids(conn, 1)
        if index == 0:
            conn.sendall(struct.pack("<I", (64 << 20) + 1))
        else:
            answer(conn, ids[0])
        read_request_ids(conn, 1)
    with scripted_server(script) as (address, accepted):
        with RpcClient(address, "c") as client:
            with pytest.raises(RpcError, match="malformed reply .* exceeds"):
                client.call(PingMsg())
            assert client.call(PingMsg()) == "pong"
        assert accepted == [0, 1]


def test_undecodable_reply_is_an_error() -> None:
    def script(conn: socket.socket, index: int) -> None:
        read_request_ids(conn, 1)
        conn.sendall(encode_frame(b"\xc1"))
        read_request_ids(conn, 1)
    with scripted_server(script) as (address, _):
        with RpcClient(address, "c") as client:
            with pytest.raises(RpcError, match="malformed reply"):
                client.call(PingMsg())


def test_master_refusal_and_closed_client() -> None:
    def script(conn: socket.socket, index: int) -> None:
        ids = read_request_ids(conn, 1)
        conn.sendall(encode_frame(encode_reply(ids[0], -600, "bad arguments")))
        read_request_ids(conn, 1)
    with scripted_server(script) as (address, _):
        client = RpcClient(address, "c")
        with pytest.raises(RpcError, match=r"master refused PING \(code -600\): bad arguments"):
            client.call(PingMsg())
        client.close()
        with pytest.raises(RpcError, match="RPC client is closed"):
            client.call(PingMsg())


def test_unreachable_master_times_out_at_the_call_timeout() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))                  # bound, not listening: refused
        with RpcClient(f"127.0.0.1:{holder.getsockname()[1]}", "c", timeout_s=5) as client:
            t0 = time.monotonic()
            with pytest.raises(RpcTimeout, match=r"not reachable \(no connection within 0.3s"):
                client.call(PingMsg(), timeout_s=0.3)
            assert 0.2 < time.monotonic() - t0 < 2


def call_in_thread(client: RpcClient) -> tuple[threading.Thread, list[BaseException]]:
    failed: list[BaseException] = []

    def call() -> None:
        try:
            client.call(PingMsg())
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failed.append(exc)
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, failed


@pytest.mark.parametrize("master", ["silent", "gone"])
def test_close_ends_a_call_in_flight_at_once(master: str) -> None:
    """A process stopping while its heartbeat waits on a master that is gone (or silent) is
    not held for the call's timeout: close() ends the call with RpcError and returns."""
    def silent(conn: socket.socket, index: int) -> None:
        with contextlib.suppress(OSError):
            read_request_ids(conn, 2)
    with contextlib.ExitStack() as stack:
        if master == "silent":
            address, _ = stack.enter_context(scripted_server(silent))
        else:
            holder = stack.enter_context(socket.socket())
            holder.bind(("127.0.0.1", 0))             # bound, not listening: refused
            address = f"127.0.0.1:{holder.getsockname()[1]}"
        client = RpcClient(address, "c", timeout_s=20)
        thread, failed = call_in_thread(client)
        time.sleep(0.3)
        assert thread.is_alive()                      # waiting on the master
        t0 = time.monotonic()
        client.close()
        thread.join(2)
        assert time.monotonic() - t0 < 1.5
        assert not thread.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], RpcError), failed
        with pytest.raises(RpcError, match="RPC client is closed"):
            client.call(PingMsg())


def test_a_call_waiting_on_a_silent_leader_goes_to_the_new_one_at_once() -> None:
    """HA: the leader's host is cut (it takes the request and answers nothing); once etcd
    names another leader the call is sent there, within LEADER_CHECK_S, not after its whole
    timeout. Without HA the same silence waits the timeout."""
    def silent(conn: socket.socket, index: int) -> None:
        with contextlib.suppress(OSError):
            read_request_ids(conn, 2)

    def serving(conn: socket.socket, index: int) -> None:
        for _ in range(2):
            answer(conn, read_request_ids(conn, 1)[0])
    with scripted_server(silent) as (old, _), scripted_server(serving) as (new, accepted):
        moved_at = time.monotonic() + 0.8
        leaders = {False: parse_address(old), True: parse_address(new)}
        with RpcClient("etcd://unused", "c", timeout_s=10,
                       leader=lambda: leaders[time.monotonic() > moved_at]) as client:
            t0 = time.monotonic()
            assert client.call(PingMsg()) == "pong"
            assert 0.8 < time.monotonic() - t0 < 0.8 + LEADER_CHECK_S + 0.5
            assert client.call(PingMsg()) == "pong"
        assert accepted == [0]
        with RpcClient(old, "c", timeout_s=0.8) as plain:
            with pytest.raises(RpcTimeout, match="did not answer within 0.8s"):
                plain.call(PingMsg())


def test_parse_address() -> None:
    assert parse_address("10.0.0.1:6000") == ("10.0.0.1", 6000)
    assert parse_address("master") == ("master", 50051)
    for bad in ("h:0", "h:65536", "h:x"):
        with pytest.raises(RpcError, match="bad master address"):
            parse_address(bad)
