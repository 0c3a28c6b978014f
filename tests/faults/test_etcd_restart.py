"""etcd SIGKILLed and started again under an HA pair with a put load running.

A short outage (well inside the 2 s lease): the leader keeps its term and serves again. A long
one (past the lease): the leader fences itself, exits with code 3 and the standby wins the next
term once etcd is back. Either way terms only grow, at most one master answers as leader, a
deposed leader refuses every request, nothing acknowledged is lost and no read is wrong."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvpool.bench.faults_procs import Ledger, PutLoad
from kvpool.errors import RpcError
from kvpool.launch.etcd import EtcdProcess
from kvpool.launch.store import HaPair, ha_cluster, wait_leader
from kvpool.store.client.rpc import RpcClient
from kvpool.store.client.store_client import StoreClient
from kvpool.store.wire.protocol import Op
from tests.support.wait import wait_for


def answers_as_leader(port: int) -> bool:
    """True when the master on `port` serves a request (a deposed or standby one does not)."""
    probe = RpcClient(f"127.0.0.1:{port}", "probe", timeout_s=1.0)
    try:
        return bool(probe.call_unchecked(Op.PING) == "pong")
    except (RpcError, OSError):
        return False
    finally:
        probe.close()


def watch_terms(pair: HaPair, etcd: EtcdProcess, term1: int, until: float) -> None:
    """Until `until`: the leader's term never goes back and at most one master serves."""
    terms = [term1]
    while time.monotonic() < until:       # past any lease etcd restored
        terms.append(wait_leader(etcd, pair.cluster_id)[1])
        serving = [p for p in pair.rpc_ports if answers_as_leader(p)]
        assert len(serving) <= 1, f"two masters serve at once: {serving}"
        time.sleep(0.2)
    assert terms == sorted(terms), f"terms went back: {terms}"


@pytest.mark.slow  # 16 s and more; the HA failover over etcd stays in the default suite
@pytest.mark.parametrize("down_s", [0.5, 4.0])
def test_etcd_restart_keeps_one_leader_and_every_object(tmp_path: Path, down_s: float) -> None:
    with ExitStack() as stack:
        etcd = EtcdProcess(stack).start()
        pair, leader, term1 = ha_cluster(stack, etcd, "etcd-restart", ttl_s=2)  # journal in etcd
        ledger = Ledger("er")
        with StoreClient(pair.client_config()) as store:
            assert ledger.put_until(store, 20, timeout_s=40) is not None
            load = PutLoad(store, ledger)
            load.start()
            time.sleep(0.5)
            etcd.kill()
            time.sleep(down_s)
            etcd.start()
            back = time.monotonic()
            watch_terms(pair, etcd, term1, until=back + 8)
            new_addr, term2 = wait_leader(etcd, pair.cluster_id)
            done = len(load.successes)
            wait_for(lambda: len(load.successes) >= done + 20, 20.0,
                     "20 more puts acknowledged", 0.1)
            load.stop_event.set()
            load.join(30)
            assert len(load.successes) >= done + 20, "the workload did not resume"
            lost, wrong = ledger.check_all(store)
        assert (lost, wrong, ledger.wrong_bytes) == (0, 0, 0)
        if term2 == term1:
            assert pair.masters[leader].poll() is None and pair.index_of(new_addr) == leader
        else:   # the old leader fenced itself, exited, and refuses everything
            assert term2 == term1 + 1
            assert pair.masters[leader].wait(15) == 3
            assert not answers_as_leader(pair.rpc_ports[leader])
        print(f"\netcd down {down_s}s: term {term1} -> {term2}, {len(ledger.acked)} "
              f"acknowledged, 0 lost; client errors {ledger.errors}")
