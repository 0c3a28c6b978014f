"""kvpool over three emulated hosts (kvpool.serve.hosts): network namespaces on one bridge,
each with a private /dev/shm; master + node on host 0, node + prefill worker on host 1, node +
decode worker + proxy on host 2; emulated engines, a cluster token, every bind on a bridge
address. Needs root; skipped where namespaces or mounts cannot be made (the HA test also
where there is no etcd).

0. With HA masters (host 0 leads, host 1 stands by, etcd on a host of its own): the leader's
   host is cut; the completion sent right after it is served (the workers' store clients
   find the new leader), the standby leads within a few seconds, the 40 objects put with 2 replicas
   before the cut all read back exact and the proxy serves the same tokens; after the heal
   the old leader (deposed, restarted as a standby) never leads beside the new one. It runs
   first, on a cluster of its own that is gone before the others' is made.
1. Completions through the proxy, and a repeated long prompt reuses its KV from the pool
   (local prefix caching off, so any cached token came from the pool, across hosts).
2. Routes: a store client on each host writes and reads objects placed on each node; bytes
   to its own host's node go by shm, to the other hosts' nodes by tcp, and the segment
   descriptors say the hosts apart (host_id), though the three share hostname and boot id.
3. Host 1's link is cut and healed: objects put with 2 replicas before the cut are all read
   back exact during and after it, and the proxy serves the same tokens again after it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.errors import KvpoolError
from kvpool.launch.netns import in_netns
from kvpool.serve.hosts import (
    HA_LEASE_TTL_S,
    HostsCluster,
    HostsSpec,
    MasterRole,
    hosts_cluster,
)
from kvpool.serve.launch import ensure_emulated_model
from tests.support.procs import python_env
from tests.support.require import missing

pytestmark = pytest.mark.slow

BLOCK = 16
WORKER_ARGS = ("--engine", "emulated", "--speed-up", "20", "--block-size", str(BLOCK),
               "--max-model-len", "8192", "--max-prefill-chunk", "8192", "--num-blocks", "512",
               "--no-prefix-caching", "--remote-timeout", "5")
CUT_HOST = 1

PROBE = r"""
import json, sys
import httpx
from kvpool.bench.faults_procs import content, tally_reads
from kvpool.metadata.http_serving import bearer_header
from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.token import env_token
from kvpool.transfer.segment import host_identity, segment_key

mode, master, admin, metadata, me = sys.argv[1:6]
auth = bearer_header(env_token())
endpoints = sorted(s["endpoint"] for s in httpx.get(admin + "/segments", headers=auth).json())
store = StoreClient(ClientConfig(master=master, local_hostname=me, rpc_timeout_s=3.0,
                                 transfer_timeout_s=3.0))
def read(keys, size):
    return tally_reads(store, keys, size)
if mode == "routes":
    out = {"identity": host_identity(), "wrong": 0, "host_ids": {}}
    for ep in endpoints:
        keys = [f"{me}-on-{ep}-{i}" for i in range(4)]
        for k in keys:
            assert store.put(k, content(k, 1 << 16), ReplicateConfig(preferred_segment=ep)).ok
        r = read(keys, 1 << 16)
        out["wrong"] += r["wrong"] + len(keys) - r["codes"].get("OK", 0)
        raw = httpx.get(metadata, params={"key": segment_key(ep)}, headers=auth)
        out["host_ids"][ep] = json.loads(raw.content)["host_id"]
    out["traffic"] = {route: {t: c.num_bytes for t, c in targets.items()}
                      for route, targets in store.engine.traffic().items()}
elif mode == "put":
    keys = [f"two-{i}" for i in range(40)]
    ok = sum(store.put(k, content(k, 20000), ReplicateConfig(replica_num=2)).ok for k in keys)
    places = {k: sorted(r["endpoint"] for r in httpx.get(admin + "/query_key", params={"key": k},
                                                        headers=auth).json()["replicas"])
              for k in keys}
    out = {"ok": ok, "places": places}
else:
    out = read([f"two-{i}" for i in range(40)], 20000)
store.close()
print(json.dumps(out), flush=True)
"""


def emulated(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
             ha: bool) -> Iterator[HostsCluster]:
    if os.geteuid() != 0:
        missing("emulated hosts need root (network and mount namespaces)")
    if ha and shutil.which("etcd") is None:
        missing("no etcd binary (Debian package etcd-server)")
    model = ensure_emulated_model(tiny_model, tmp_path_factory.mktemp("emu") / "m", 8192)
    spec = HostsSpec(model, worker_args=WORKER_ARGS, proxy_args=("--admission", "none"),
                     master_args=("--client-ttl", "3"), ha=ha)
    try:
        with hosts_cluster(spec) as hosts:
            yield hosts
    except KvpoolError as exc:
        if "ip " in str(exc) or "/dev/shm" in str(exc) or "no `ip`" in str(exc):
            missing(f"cannot emulate hosts here: {exc}")
        raise


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[HostsCluster]:
    yield from emulated(tiny_model, tmp_path_factory, ha=False)


@pytest.fixture
def ha_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
               ) -> Iterator[HostsCluster]:
    yield from emulated(tiny_model, tmp_path_factory, ha=True)


def probe(cluster: HostsCluster, index: int, mode: str, admin: str = "") -> dict[str, Any]:
    host = cluster.fabric.hosts[index]
    env = {**python_env(), "KVPOOL_TOKEN": cluster.token}
    out = subprocess.run(host.argv(sys.executable, "-c", textwrap.dedent(PROBE), mode,
                                   cluster.master_address, admin or cluster.admin_url,
                                   cluster.metadata_url, host.addr),
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def complete(cluster: HostsCluster, prompt: list[int], timeout_s: float = 60) -> httpx.Response:
    with in_netns(cluster.fabric.hosts[cluster.proxy_host].netns):
        return httpx.post(cluster.proxy_url + "/v1/completions", timeout=timeout_s, json={
            "model": cluster.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "kvpool_trace": True})


def prompt(seed: int, n: int) -> list[int]:
    return [16 + (seed * 7919 + i * 104729) % 496 for i in range(n)]


def until(what: str, timeout_s: float, check: Callable[[], Any]) -> tuple[Any, float]:
    """(check()'s first truthy answer, seconds it took); AssertionError after `timeout_s`."""
    t0 = time.monotonic()
    while not (got := check()):
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.1)
    return got, time.monotonic() - t0


def read_all(cluster: HostsCluster, admin: str) -> Any:
    got = probe(cluster, 2, "read", admin)
    assert got["wrong"] == 0, got
    return got == {"codes": {"OK": 40}, "wrong": 0}


def served(cluster: HostsCluster, p: list[int]) -> Any:
    try:
        r = complete(cluster, p, timeout_s=20)
    except httpx.HTTPError:
        return None
    return r.json()["kvpool_trace"]["token_ids"] if r.status_code == 200 else None


def sole_leader(cluster: HostsCluster) -> int | None:
    """The host whose master leads, asserting no two do."""
    roles = cluster.master_roles()
    leaders = [i for i, r in roles.items() if r.role == "leader"]
    assert len(leaders) <= 1, roles
    return leaders[0] if leaders else None


def test_the_standby_takes_over_from_a_cut_leader(ha_cluster: HostsCluster) -> None:
    c = ha_cluster
    assert {i: r.role for i, r in c.master_roles().items()} == {0: "leader", 1: "standby"}
    old, new = 0, 1
    old_term = c.master_roles()[old].term
    p = prompt(3, 80)
    tokens = served(c, p)
    assert tokens is not None
    put = probe(c, 2, "put", c.master_admin_url(old))  # host 2 is never cut
    places = put["places"].values()
    assert put["ok"] == 40 and all(len(set(eps)) == 2 for eps in places), put
    assert any(ep.startswith(c.fabric.hosts[old].addr + ":") for eps in places for ep in eps)
    c.fabric.cut(old)
    try:
        t0 = time.monotonic()  # the workers' store clients find the new leader in time
        first = complete(c, p, timeout_s=60)
        first_s = time.monotonic() - t0
        assert first.status_code == 200, first.text
        assert first.json()["kvpool_trace"]["token_ids"] == tokens
        assert first_s < 4 * HA_LEASE_TTL_S  # not the calls' 10 s timeout on the cut leader
        _, failover_s = until("the standby leads", 20, lambda: sole_leader(c) == new)
        _, readable_s = until("every object readable", 30,
                              lambda: read_all(c, c.master_admin_url(new)))
        again, serving_s = until("the proxy serves", 30, lambda: served(c, p))
        assert again == tokens
        new_term = c.master_roles()[new].term
        assert new_term > old_term
    finally:
        c.fabric.heal(old)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * HA_LEASE_TTL_S:  # past the old leader's lease, twice
        roles = c.master_roles()
        assert roles[new] == MasterRole("leader", new_term), roles
        assert roles[old].role != "leader", roles
        time.sleep(0.2)
    until("the old leader stands by", 20, lambda: c.master_roles()[old].role == "standby")
    assert c.master_restarts.get(old, 0) >= 1  # it was deposed (exit 3), not left serving
    assert c.master_roles() == {old: MasterRole("standby"), new: MasterRole("leader", new_term)}
    until("every object readable after the heal", 30,
          lambda: read_all(c, c.master_admin_url(new)))
    print(f"\nthe first completion after the cut: 200 in {first_s:.1f} s; then host {new} "
          f"leads {failover_s:.1f} s later (lease "
          f"ttl {HA_LEASE_TTL_S} s), all 40 objects readable {readable_s:.1f} s later, the "
          f"proxy serving {serving_s:.1f} s after that; restarts {c.master_restarts}")


def test_a_repeated_prompt_reuses_the_pool_across_hosts(cluster: HostsCluster) -> None:
    p = prompt(1, 100)
    first, second = complete(cluster, p), complete(cluster, p)
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # 6 full blocks of 16: the prefill worker (prefix caching off) found them in the pool
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert second.json()["kvpool_trace"]["token_ids"] == first.json()["kvpool_trace"]["token_ids"]


def test_tcp_between_hosts_shm_within_one(cluster: HostsCluster) -> None:
    hosts = cluster.fabric.hosts
    seen = [probe(cluster, host.index, "routes") for host in hosts]
    assert len({s["identity"] for s in seen}) == len(hosts)  # one per private /dev/shm
    for host, s in zip(hosts, seen, strict=True):
        assert s["wrong"] == 0, s
        nodes = s["host_ids"]
        assert len(nodes) == len(hosts), nodes
        mine = [ep for ep in nodes if ep.startswith(host.addr + ":")]
        assert len(mine) == 1 and nodes[mine[0]] == s["identity"], s
        others = sorted(set(nodes) - set(mine))
        assert all(nodes[ep] != s["identity"] for ep in others), s
        traffic = s["traffic"]
        assert set(traffic.get("shm", {})) == set(mine), traffic
        assert set(traffic["tcp"]) == set(others), traffic
        # 4 objects of 64 KiB written and read back per node (a little more may be tcp:
        # nothing else moves bytes in this client)
        assert traffic["shm"][mine[0]] == 8 << 16
        assert all(traffic["tcp"][ep] == 8 << 16 for ep in others), traffic


def test_a_cut_link_loses_nothing_acknowledged(cluster: HostsCluster) -> None:
    cut_addr = cluster.fabric.hosts[CUT_HOST].addr + ":"
    p = prompt(2, 80)
    before = complete(cluster, p)
    assert before.status_code == 200, before.text
    tokens = before.json()["kvpool_trace"]["token_ids"]
    put = probe(cluster, 0, "put")
    assert put["ok"] == 40
    places = put["places"].values()
    assert all(len(set(eps)) == 2 for eps in places), put
    assert any(ep.startswith(cut_addr) for eps in places for ep in eps), put
    cluster.fabric.cut(CUT_HOST)
    try:
        during = probe(cluster, 0, "read")  # every object has a replica off the cut host
        assert during == {"codes": {"OK": 40}, "wrong": 0}, during
        try:
            r = complete(cluster, p, timeout_s=15)  # its prefill worker is on the cut host
            assert r.status_code != 200 or r.json()["kvpool_trace"]["token_ids"] == tokens
        except httpx.HTTPError:
            pass  # failing is fine, wrong tokens are not
        time.sleep(4.0)  # past the master's client ttl (3 s): the cut node is dropped
    finally:
        cluster.fabric.heal(CUT_HOST)
    after = probe(cluster, 0, "read")
    assert after == {"codes": {"OK": 40}, "wrong": 0}, after
    deadline = time.monotonic() + 60
    while True:
        try:
            r = complete(cluster, p, timeout_s=20)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the proxy did not serve again after the heal"
        time.sleep(1.0)
    assert r.json()["kvpool_trace"]["token_ids"] == tokens

