"""Leader election against a real etcd: one leader per term, terms grow, a silent leader
loses its lease and a standby takes over; the deposed one refuses to serve."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.clock import VirtualClock
from kvpool.store.config import MasterConfig
from kvpool.store.master.core import MasterCore
from kvpool.store.master.election import LeaderElection
from kvpool.store.master.persist import Journal, PersistConfig, PersistentService
from kvpool.store.wire.codes import Tier
from kvpool.store.wire.leader import Etcd, leader_resolver, parse_endpoints, read_leader
from kvpool.store.wire.protocol import Op, decode_reply, encode_request
from tests.support.etcd import etcd_server


@pytest.fixture(scope="module")
def etcd() -> Iterator[str]:
    with etcd_server() as endpoint:
        yield endpoint


def test_parse_endpoints_accepts_mooncake_and_url_forms() -> None:
    assert parse_endpoints("etcd://h1:2379;h2:2380") == [("h1", 2379), ("h2", 2380)]
    assert parse_endpoints("h1:1,h2") == [("h1", 1), ("h2", 2379)]


def test_one_leader_per_term_and_takeover_after_expiry(etcd: str) -> None:
    client = Etcd(parse_endpoints(etcd))
    a = LeaderElection(client, "127.0.0.1:1111", ttl_s=2, cluster_id="t1")
    b = LeaderElection(client, "127.0.0.1:2222", ttl_s=2, cluster_id="t1")
    assert a.try_acquire() and a.is_leader()
    assert not b.try_acquire()
    assert read_leader(client, "t1") == ("127.0.0.1:1111", a.term)
    assert a.renew()
    t0 = time.monotonic()
    stop = threading.Event()
    term = b.campaign(stop, poll_s=0.1)   # a stops renewing: its lease expires
    took = time.monotonic() - t0
    assert term == a.term + 1 and b.is_leader()
    assert 1.0 < took < 6.0
    assert not a.renew() and not a.is_leader()
    assert read_leader(client, "t1") == ("127.0.0.1:2222", term)
    resolve = leader_resolver(f"etcd://{etcd}")
    assert resolve is not None
    b.resign()
    assert read_leader(client, "t1") is None


def test_a_deposed_master_answers_nothing(tmp_path: Path) -> None:
    core = MasterCore(MasterConfig(), VirtualClock())
    journal = Journal(PersistConfig(str(tmp_path)), core)
    service = PersistentService(core, journal)
    leading = [True]
    journal.fence = lambda: leading[0]
    frame = encode_request(Op.MOUNT, 1, "c", "127.0.0.1:9", 4096, 1 << 20, int(Tier.DRAM), 5)
    assert decode_reply(service.handle(frame)).status == 0
    leading[0] = False
    reply = decode_reply(service.handle(encode_request(Op.PING, 2, "c")))
    assert reply.status != 0 and "not the leader" in reply.result


def test_master_flags_mooncake_spellings(tmp_path: Path) -> None:
    from kvpool.cli import ha_flags
    from kvpool.cli.main import build_parser
    from kvpool.errors import ConfigError

    args = build_parser().parse_args(["master", "--enable_ha=true",
                                      "--etcd_endpoints=h1:2379;h2:2379"])
    assert args.enable_ha is True and ha_flags.wants_persistence(args)
    assert parse_endpoints(args.etcd_endpoints) == [("h1", 2379), ("h2", 2379)]
    assert ha_flags.persist_config(args) == PersistConfig("", etcd="h1:2379;h2:2379")
    args = build_parser().parse_args(["master", "--enable_ha=true"])
    with pytest.raises(ConfigError, match="--etcd_endpoints"):
        ha_flags.persist_config(args)
    args = build_parser().parse_args(["master", "--state-dir", str(tmp_path),
                                      "--persist-fsync", "interval"])
    assert not args.enable_ha
    assert ha_flags.persist_config(args) == PersistConfig(str(tmp_path), "interval")
    assert not ha_flags.wants_persistence(build_parser().parse_args(["master"]))


def test_a_dead_etcd_endpoint_is_skipped(etcd: str) -> None:
    from tests.support.net import free_port

    client = Etcd(parse_endpoints(f"127.0.0.1:{free_port()};{etcd}"))
    a = LeaderElection(client, "127.0.0.1:3333", ttl_s=2, cluster_id="t2")
    assert a.try_acquire()
    resolve = leader_resolver(f"etcd://127.0.0.1:{free_port()};{etcd}")
    assert resolve is not None
    assert resolve() is None   # cluster "kvpool" has no leader
    resolve = leader_resolver(f"etcd://{etcd}/t2")
    assert resolve is not None and resolve() == ("127.0.0.1", 3333)
    a.resign()
