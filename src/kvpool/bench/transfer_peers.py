"""Target processes for `kvpool bench transfer`: run as `python -m kvpool.bench.transfer_peers KIND BYTES`.

Each prints one JSON line describing where to send data, then serves until its stdin closes.
KIND: `kvpool` (a TransferEngine with a managed buffer), `mooncake` (the real Mooncake engine),
`raw` (a plain socket sink: the loopback anchor).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading

RAW_HEADER = struct.Struct("<II")  # message bytes, message count; the sink acks each round


def _announce(info: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()


def serve_kvpool(size: int) -> None:
    from kvpool.transfer import TransferConfig, TransferEngine

    with TransferEngine(TransferConfig(protocol="auto")) as engine:
        buf = engine.allocate_managed(size)
        _announce({"segment": engine.segment_name, "addr": buf.addr, "length": size})
        sys.stdin.read()


def serve_mooncake(size: int) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from mooncake.engine import TransferEngine as MooncakeEngine

    engine = MooncakeEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake engine failed to initialize")
    addr = engine.allocate_managed_buffer(size)
    _announce({"segment": f"127.0.0.1:{engine.get_rpc_port()}", "addr": addr, "length": size})
    sys.stdin.read()


def raw_offsets(size: int, count: int, arena: int) -> list[int]:
    """Where the raw anchor's `count` messages of `size` bytes lie in an arena of `arena`
    bytes: one after another, from the start again where the next would not fit."""
    per_round = max(1, arena // size)
    return [(i % per_round) * size for i in range(count)]


def serve_raw(size: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    _announce({"port": listener.getsockname()[1], "length": size})
    threading.Thread(target=_raw_accept, args=(listener, size), daemon=True).start()
    sys.stdin.read()


def _raw_accept(listener: socket.socket, size: int) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sink = memoryview(bytearray(size))
    head = bytearray(RAW_HEADER.size)
    while conn.recv_into(head, RAW_HEADER.size, socket.MSG_WAITALL) == RAW_HEADER.size:
        msg_bytes, count = RAW_HEADER.unpack(head)
        for at in raw_offsets(msg_bytes, count, size):  # distinct places, as the initiator's
            view, left = sink[at:at + msg_bytes], msg_bytes
            while left:
                got = conn.recv_into(view[msg_bytes - left :], left)
                if not got:
                    return
                left -= got
        conn.sendall(b"k")


def main() -> None:
    kind, size = sys.argv[1], int(sys.argv[2])
    {"kvpool": serve_kvpool, "mooncake": serve_mooncake, "raw": serve_raw}[kind](size)


if __name__ == "__main__":
    main()
