"""HA with a real etcd and real processes: two masters, two store nodes and a client all
given `etcd://...`; the leader is SIGKILLed during a put/get workload, the standby takes
over, and every acknowledged object reads back with its bytes."""

from __future__ import annotations

import signal
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from kvpool.errors import RpcError
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.rpc import RpcClient
from kvpool.store.client.store_client import StoreClient
from kvpool.store.wire.codes import ErrorCode as E
from kvpool.store.wire.leader import Etcd, parse_endpoints, read_leader
from kvpool.store.wire.protocol import Op
from tests.store.cluster import content
from tests.support.etcd import etcd_server
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool
from tests.support.wait import wait_for

TTL_S = 2


def start_master(stack: ExitStack, etcd: str,
                 state: Path | None) -> tuple[subprocess.Popen[bytes], int, int]:
    """An HA master journaling to the shared `state` directory, or to etcd when None."""
    rpc, admin = free_port(), free_port()
    shared = ["--state-dir", str(state)] if state is not None else []
    proc = stack.enter_context(running(spawn_kvpool(
        "master", "--enable_ha=true", f"--etcd_endpoints={etcd}", *shared,
        "--rpc_port", str(rpc), "--metrics_port", str(admin), "--no-http-metadata",
        "--ha-lease-ttl", str(TTL_S), "--recovery-grace", "20")))
    return proc, rpc, admin


def wait_leader(etcd: Etcd, not_term: int = 0, timeout_s: float = 20) -> tuple[str, int]:
    def leader() -> tuple[str, int] | None:
        found = read_leader(etcd)
        return found if found is not None and found[1] != not_term else None

    return wait_for(leader, timeout_s, "a leader elected", 0.05)


def put_until(store: StoreClient, acked: dict[str, int], start: int, count: int,
              timeout_s: float = 30) -> tuple[int, float | None]:
    """Put fresh keys until `count` were acknowledged; (next index, time of the first
    acknowledged put)."""
    deadline = time.monotonic() + timeout_s
    first = None
    i = start
    done = 0
    while done < count and time.monotonic() < deadline:
        key, size = f"ha-{i}", 2000 + (i % 50) * 100
        i += 1
        if store.put(key, content(key, size)).ok:
            acked[key] = size
            done += 1
            first = first or time.monotonic()
            got = store.get(key)
            assert got.code != E.OK or got.data == content(key, size)
        else:
            time.sleep(0.02)
    assert done == count, f"only {done} of {count} puts acknowledged"
    return i, first


def read_all(store: StoreClient, acked: dict[str, int], timeout_s: float = 20) -> float:
    t0 = time.monotonic()
    keys = sorted(acked)
    while True:
        got = store.get_batch(keys)
        if all(g.code == E.OK for g in got) or time.monotonic() - t0 > timeout_s:
            break
        time.sleep(0.05)
    missing = [k for k, g in zip(keys, got, strict=True) if g.code != E.OK]
    assert not missing, f"{len(missing)} acknowledged objects lost: {missing[:5]}"
    for key, g in zip(keys, got, strict=True):
        assert g.data == content(key, acked[key]), key
    return time.monotonic() - t0


@pytest.mark.parametrize("journal", [pytest.param("dir", marks=pytest.mark.slow), "etcd"])
def test_leader_sigkill_standby_serves_every_acknowledged_object(tmp_path: Path,
                                                                 journal: str) -> None:
    """Masters sharing a state directory, or nothing but etcd (the journal lives there)."""
    state = tmp_path if journal == "dir" else None
    with etcd_server() as ep, ExitStack() as stack:
        etcd = Etcd(parse_endpoints(ep))
        address = f"etcd://{ep}"
        a = start_master(stack, ep, state)
        first_addr, term1 = wait_leader(etcd)
        b = start_master(stack, ep, state)
        leader, standby = (a, b) if first_addr.endswith(f":{a[1]}") else (b, a)
        wait_port(standby[2])
        metrics = httpx.get(f"http://127.0.0.1:{standby[2]}/metrics").text
        assert 'kvpool_master_role{role="standby"} 1.0' in metrics
        for _ in range(2):
            stack.enter_context(running(spawn_kvpool(
                "store-node", "--dram", "16MiB", "--master", address,
                "--heartbeat-interval", "0.2")))
        wait_port(leader[2])
        wait_for(lambda: len(httpx.get(f"http://127.0.0.1:{leader[2]}/segments").json()) >= 2,
                 20.0, "2 segments mounted", 0.05)
        acked: dict[str, int] = {}
        with StoreClient(ClientConfig(master=address, rpc_timeout_s=1.0)) as store:
            nxt, _ = put_until(store, acked, 0, 100)
            killed = time.monotonic()
            leader[0].kill()
            leader[0].wait()
            nxt, first_ok = put_until(store, acked, nxt, 50)
            assert first_ok is not None
            readable = read_all(store, acked)
        new_addr, term2 = wait_leader(etcd, term1)
        assert term2 == term1 + 1 and new_addr.endswith(f":{standby[1]}")
        metrics = httpx.get(f"http://127.0.0.1:{standby[2]}/metrics").text
        assert 'kvpool_master_role{role="leader"} 1.0' in metrics
        assert f"kvpool_master_term {float(term2)}" in metrics
        print(f"\nfailover ({journal} journal): first acknowledged put {first_ok - killed:.2f}s after SIGKILL "
              f"(lease ttl {TTL_S}s); all {len(acked)} acknowledged objects readable "
              f"{readable:.2f}s later; 0 lost")


def test_a_paused_leader_is_deposed_and_refuses_to_serve(tmp_path: Path) -> None:
    """SIGSTOP the leader past its lease: the standby takes over; resumed, the old leader
    answers nothing, exits with code 3, and the new leader's objects all survive it."""
    with etcd_server() as ep, ExitStack() as stack:
        etcd = Etcd(parse_endpoints(ep))
        address = f"etcd://{ep}"
        a = start_master(stack, ep, tmp_path)
        _, term1 = wait_leader(etcd)
        b = start_master(stack, ep, tmp_path)
        stack.enter_context(running(spawn_kvpool(
            "store-node", "--dram", "16MiB", "--master", address, "--heartbeat-interval",
            "0.2")))
        acked: dict[str, int] = {}
        with StoreClient(ClientConfig(master=address, rpc_timeout_s=1.0)) as store:
            nxt, _ = put_until(store, acked, 0, 20)
            old = RpcClient(f"127.0.0.1:{a[1]}", "probe", timeout_s=1.0)
            assert old.call_unchecked(Op.PING) == "pong"
            a[0].send_signal(signal.SIGSTOP)
            _, term2 = wait_leader(etcd, term1)
            nxt, _ = put_until(store, acked, nxt, 20)
            a[0].send_signal(signal.SIGCONT)
            with pytest.raises(RpcError):
                old.call_unchecked(Op.PING)
            old.close()
            assert a[0].wait(15) == 3
            nxt, _ = put_until(store, acked, nxt, 20)
            read_all(store, acked)
        assert term2 == term1 + 1 and b[0].poll() is None
