"""Microbenchmark of the master alone (`kvpool bench store --master-only`).

Two views of the same metadata path:
- "service": frames handled in this process by MasterService (decode, core, encode), the
  master's own cost per request with no network (request frames are encoded beforehand);
- "rpc": the same requests to a `kvpool master` process over loopback TCP, from one client
  (and a put_start+put_end+lookup loop from several client processes);
- "tcp-echo" / "zmq-echo": bare echo round trips, the floor of any RPC over that transport.
Single-key rates count requests per second; batched rates count keys per second.
"""

from __future__ import annotations

import gc
import importlib.util
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

from kvpool.store.client.rpc import RpcClient
from kvpool.store.master.core import MasterCore
from kvpool.store.master.metrics import MasterMetrics
from kvpool.store.master.service import MasterService
from kvpool.store.wire import messages as m

BATCH = 128
SIZE = 4096
Call = Callable[..., Any]


def _requests(keys: list[str]) -> list[tuple[str, m.Msg]]:
    """(name, request) of the five measured requests for one group of keys."""
    return [
        ("put_start", m.PutStartMsg(keys=keys, sizes=[SIZE] * len(keys))),
        ("put_end", m.PutEndMsg(keys=keys)),
        ("get_replicas", m.GetReplicasMsg(keys=keys)),
        ("exists", m.ExistsMsg(keys=keys)),
        ("remove", m.RemoveMsg(keys=keys, force=True)),
    ]


def _run(system: str, call: Call, seconds: float, prefix: str,
         prepare: Callable[[m.Msg], Any] | None = None,
         execute: Callable[[Any], Any] | None = None) -> Iterator[dict[str, Any]]:
    """Time each op over groups of keys. `prepare` turns a request into what `execute`
    takes, outside the timed loop (the service bench pre-encodes its frames)."""
    prepare = prepare or (lambda request: request)
    execute = execute or call
    call(m.MountMsg(endpoint="127.0.0.1:1", base_addr=4096, size=1 << 44, tier=1))
    for mode, per_call in (("single", 1), (f"batch{BATCH}", BATCH)):
        count = _calibrate(call, per_call, seconds, f"{prefix}-cal-{mode}")
        groups = [[f"{prefix}-{mode}-{i}-{j}" for j in range(per_call)] for i in range(count)]
        for index, op in enumerate(("put_start", "put_end", "get_replicas", "exists", "remove")):
            prepared = [prepare(_requests(keys)[index][1]) for keys in groups]
            t0 = time.perf_counter()
            for request in prepared:
                execute(request)
            elapsed = time.perf_counter() - t0
            rate = count * per_call / elapsed
            yield {"system": system, "op": op, "mode": mode, "rate": round(rate, 1),
                   "unit": "requests/s" if per_call == 1 else "keys/s",
                   "keys": count * per_call, "seconds": round(elapsed, 4)}


def _calibrate(call: Call, per_call: int, seconds: float, prefix: str) -> int:
    """Number of calls of one op that take about seconds / 5 (five ops are measured)."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.1:
        call(m.ExistsMsg(keys=[f"{prefix}-{n}-{j}" for j in range(per_call)]))
        n += 1
    return max(10, int(n * (seconds / 5) / 0.1))


def bench_master(seconds: float = 2.0, num_clients: int = 4) -> Iterator[dict[str, Any]]:
    yield from _service_bench(seconds)
    yield from _rpc_bench(seconds, num_clients)


def _service_bench(seconds: float) -> Iterator[dict[str, Any]]:
    from kvpool.store.master.server import tune_gc_for_master
    previous = tune_gc_for_master()  # as `kvpool master` runs
    try:
        yield from _service_bench_tuned(seconds)
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


def _service_bench_tuned(seconds: float) -> Iterator[dict[str, Any]]:
    core = MasterCore()
    service = MasterService(core, MasterMetrics(core, threading.Lock()).observe)

    def encode(msg: m.Msg) -> bytes:
        msg.req_id, msg.client_id = 1, "bench"
        return m.encode_msg(msg)
    yield from _run("master-service", lambda msg: service.handle(encode(msg)), seconds, "svc",
                    prepare=encode, execute=service.handle)
    core.check_integrity()


def _rpc_bench(seconds: float, num_clients: int) -> Iterator[dict[str, Any]]:
    from kvpool.launch.store import start_master
    with ExitStack() as stack:
        _, master, _ = start_master(stack)
        with RpcClient(master, "bench") as client:
            yield from _run("master-rpc", client.call, seconds, "rpc")
        if num_clients > 1:
            yield _concurrent(master, num_clients, seconds)
    yield from _echo_floors(seconds, num_clients)


_CLIENT = """
import sys, time
from kvpool.bench.store_master import client_loop
print(client_loop(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def client_loop(address: str, name: str, seconds: float) -> float:
    """Single-key put_start, put_end and lookup in a loop; returns requests per second."""
    with RpcClient(address, name) as client:
        client.call(m.MountMsg(endpoint=f"127.0.0.1:{name}", base_addr=4096, size=1 << 40,
                               tier=1))
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            key = [f"{name}-{n}"]
            client.call(m.PutStartMsg(keys=key, sizes=[SIZE]))
            client.call(m.PutEndMsg(keys=key))
            client.call(m.GetReplicasMsg(keys=key))
            n += 3
        return n / (time.perf_counter() - t0)


_TCP_ECHO_SERVER = """
import selectors, socket, sys
lsock = socket.create_server(("127.0.0.1", int(sys.argv[1])))
lsock.setblocking(False)
sel = selectors.DefaultSelector()
sel.register(lsock, selectors.EVENT_READ)
while True:
    for key, _ in sel.select():
        if key.fileobj is lsock:
            conn, _ = lsock.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)
            continue
        data = key.fileobj.recv(65536)
        if data:
            key.fileobj.sendall(data)
        else:
            sel.unregister(key.fileobj)
            key.fileobj.close()
"""
_TCP_ECHO_CLIENT = """
import socket, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
frame = (64).to_bytes(4, "little") + b"x" * 64
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[2]):
    sock.sendall(frame)
    got = 0
    while got < len(frame):
        got += len(sock.recv(65536))
    n += 1
print(n / (time.perf_counter() - t0))
"""
_ZMQ_ECHO_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind("tcp://127.0.0.1:" + sys.argv[1])
while True:
    sock.send_multipart(sock.recv_multipart())
"""
_ZMQ_ECHO_CLIENT = """
import sys, time, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect("tcp://127.0.0.1:" + sys.argv[1])
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[2]):
    sock.send(b"x" * 64)
    sock.recv()
    n += 1
print(n / (time.perf_counter() - t0))
"""


def echo_floors() -> list[tuple[str, str, str]]:
    """(system, server script, client script) of the echo floors measured here: a raw TCP
    echo of 64-byte length-prefixed frames (the master's transport), and a bare pyzmq
    ROUTER/DEALER echo when pyzmq is installed (the transport it replaced)."""
    floors = [("tcp-echo", _TCP_ECHO_SERVER, _TCP_ECHO_CLIENT)]
    if importlib.util.find_spec("zmq") is not None:
        floors.append(("zmq-echo", _ZMQ_ECHO_SERVER, _ZMQ_ECHO_CLIENT))
    return floors


def _echo_floors(seconds: float, num_clients: int) -> Iterator[dict[str, Any]]:
    """Round trips of bare echo servers on this machine, one Python thread each: the
    ceiling of any request/reply over that transport here, for reading the master-rpc
    rates."""
    from kvpool.launch.children import running
    from kvpool.launch.ports import free_port
    from kvpool.launch.wait import wait_port
    for system, server, client in echo_floors():
        port = free_port()
        with running([sys.executable, "-c", server, str(port)], stderr=subprocess.DEVNULL):
            wait_port(port)
            for clients in sorted({1, num_clients}):
                procs = [subprocess.Popen([sys.executable, "-c", client, str(port),
                                           str(seconds / 2)], stdout=subprocess.PIPE)
                         for _ in range(clients)]
                rate = sum(float(p.communicate()[0]) for p in procs)
                yield {"system": system, "op": "round trip", "mode": f"x{clients}",
                       "rate": round(rate, 1), "unit": "requests/s", "clients": clients,
                       "seconds": seconds / 2}


def _concurrent(address: str, num_clients: int, seconds: float) -> dict[str, Any]:
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, address, f"c{i}", str(seconds)],
                              stdout=subprocess.PIPE) for i in range(num_clients)]
    rate = sum(float(p.communicate()[0]) for p in procs)
    return {"system": "master-rpc", "op": "start+end+get", "mode": f"single x{num_clients}",
            "rate": round(rate, 1), "unit": "requests/s", "clients": num_clients,
            "seconds": seconds}
