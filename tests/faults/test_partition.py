"""A store node partitioned away and back, with real network namespaces (see netns.py).

Master, client and node A run in namespace A, node B in namespace B; every transfer is tcp.
Objects with replica_num=2 (one replica on each node) and objects only on B are stored; the
link is cut. Reads of the replicated objects fall back to A's replica; reads of B-only objects
fail with an error code; no read returns wrong bytes. Past the client ttl the master drops B.
The link comes back: B's next heartbeat is refused (UNKNOWN_CLIENT), it mounts again, and new
objects placed on it are served."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from kvpool.launch.children import stop
from tests.faults.netns import ADDR_A, ADDR_B, NetnsPair
from tests.support.procs import python_env
from tests.support.require import missing

CLIENT = r"""
import json, sys, time
import httpx
from kvpool.bench.faults_procs import content, tally_reads
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig

master, admin, addr_b = sys.argv[1], sys.argv[2], sys.argv[3]
def segments():
    return httpx.get(f"http://{admin}/segments", timeout=5).json()
def count_segments():
    try:
        return len(segments())
    except httpx.HTTPError:
        return -1     # the master is still starting
def wait_segments(n, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while count_segments() != n:
        assert time.monotonic() < deadline, f"expected {n} segments"
        time.sleep(0.1)
def on_b():
    (seg,) = [s for s in segments() if str(s["endpoint"]).startswith(addr_b)]
    return ReplicateConfig(preferred_segment=str(seg["endpoint"]))
def read(keys, size):
    return tally_reads(store, keys, size)
def put(keys, size, cfg):
    return sum(store.put(k, content(k, size), cfg).ok for k in keys)
both = [f"r{i}" for i in range(30)]
only_b = [f"b{i}" for i in range(10)]
wait_segments(2)
store = StoreClient(ClientConfig(master=master, local_hostname=sys.argv[4], protocol="tcp",
                                 rpc_timeout_s=2.0, transfer_timeout_s=2.0))
for line in sys.stdin:
    step = line.strip()
    if step == "put":
        out = {"both": put(both, 3000, ReplicateConfig(replica_num=2)),
               "only_b": put(only_b, 2000, on_b())}
    elif step == "read":
        out = {"both": read(both, 3000), "only_b": read(only_b, 2000)}
    elif step == "dropped":
        wait_segments(1)
        out = {"both": read(both, 3000), "only_b": read(only_b, 2000)}
    elif step == "healed":
        wait_segments(2)
        fresh = [f"n{i}" for i in range(10)]
        out = {"put_b": put(fresh, 2500, on_b()), "fresh": read(fresh, 2500),
               "both": read(both, 3000)}
    else:
        break
    print(json.dumps(out), flush=True)
store.close()
"""


@pytest.fixture
def netns() -> Iterator[NetnsPair]:
    try:
        pair = NetnsPair.create()
    except PermissionError as exc:
        missing(f"network namespaces unavailable (needs root and `ip`): {exc}")
    try:
        yield pair
    finally:
        pair.delete()


def spawn(stack: ExitStack, argv: list[str], **kw: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, env=python_env(), text=True, **kw)  # type: ignore[call-overload]
    stack.callback(stop, proc, 5.0)
    return proc  # type: ignore[no-any-return]


def kvpool_in(pair: NetnsPair, ns: str, *args: str) -> list[str]:
    return pair.cmd(ns, sys.executable, "-m", "kvpool", *args)


def ask(client: subprocess.Popen[str], step: str) -> dict:  # type: ignore[type-arg]
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(step + "\n")
    client.stdin.flush()
    line = client.stdout.readline()
    assert line, f"the client died during {step!r}"
    return json.loads(line)  # type: ignore[no-any-return]


def test_partitioned_node_never_serves_wrong_bytes_and_returns(netns: NetnsPair) -> None:
    rpc, admin = 50151, 50152     # inside namespace A: nothing else listens there
    master = f"{ADDR_A}:{rpc}"
    with ExitStack() as stack:
        spawn(stack, kvpool_in(netns, netns.a, "master", "--host", ADDR_A, "--insecure",
                               "--rpc_port", str(rpc), "--metrics_port", str(admin),
                               "--no-http-metadata", "--client-ttl", "2"))
        for ns, addr in ((netns.a, ADDR_A), (netns.b, ADDR_B)):
            spawn(stack, kvpool_in(netns, ns, "store-node", "--dram", "16MiB", "--master",
                                   master, "--host", addr, "--insecure", "--protocol", "tcp",
                                   "--heartbeat-interval", "0.2"))
        time.sleep(1.0)
        client = spawn(stack, netns.cmd(netns.a, sys.executable, "-c", textwrap.dedent(CLIENT),
                                        master, f"{ADDR_A}:{admin}", ADDR_B, ADDR_A),
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert ask(client, "put") == {"both": 30, "only_b": 10}
        assert ask(client, "read") == {"both": {"codes": {"OK": 30}, "wrong": 0},
                                       "only_b": {"codes": {"OK": 10}, "wrong": 0}}
        netns.cut()
        cut = ask(client, "read")
        assert cut["both"] == {"codes": {"OK": 30}, "wrong": 0}, cut
        assert cut["only_b"]["wrong"] == 0 and "OK" not in cut["only_b"]["codes"], cut
        dropped = ask(client, "dropped")
        assert dropped["both"] == {"codes": {"OK": 30}, "wrong": 0}, dropped
        assert dropped["only_b"] == {"codes": {"OBJECT_NOT_FOUND": 10}, "wrong": 0}, dropped
        netns.heal()
        healed = ask(client, "healed")
        assert healed == {"put_b": 10, "fresh": {"codes": {"OK": 10}, "wrong": 0},
                          "both": {"codes": {"OK": 30}, "wrong": 0}}, healed
        print(f"\npartition: cut {cut}; after ttl {dropped}; healed {healed}")
