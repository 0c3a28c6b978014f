"""The disk tier with real processes, counted: nothing put through a pool five times its
DRAM is lost when the disk has room, and /metrics counts every promotion."""

from __future__ import annotations

import time
from pathlib import Path

from kvpool.store import StoreClient
from kvpool.store.wire.codes import ErrorCode
from tests.store.cluster import content
from tests.store.node.test_ssd_cluster import SSD_WAIT_S, metric, put_paced, ssd_cluster
from tests.support.wait import wait_for

E = ErrorCode
SMALL = 4096
BATCH = 64


def put_batches(client: StoreClient, keys: list[str], timeout_s: float = 60.0) -> int:
    """Put every key in batches, retrying NO_AVAILABLE_HANDLE; the number of retries."""
    deadline, retries = time.monotonic() + timeout_s, 0
    for lo in range(0, len(keys), BATCH):
        todo = keys[lo:lo + BATCH]
        while todo:
            codes = [r.code for r in client.put_batch(todo, [content(k, SMALL) for k in todo])]
            assert set(codes) <= {E.OK, E.NO_AVAILABLE_HANDLE}, codes
            todo = [k for k, c in zip(todo, codes, strict=True) if c != E.OK]
            retries += len(todo)
            assert time.monotonic() < deadline, f"{len(todo)} puts found no room"
            if todo:
                time.sleep(0.01)
    return retries


def test_nothing_is_lost_through_five_times_dram_with_an_ample_disk(tmp_path: Path) -> None:
    keys = [f"small-{i}" for i in range(5 * (4 << 20) // SMALL)]  # 20 MiB, 4 MiB of DRAM
    with ssd_cluster(tmp_path) as (cluster, client):
        retries = put_batches(client, keys)
        not_found = wrong = 0
        for lo in range(0, len(keys), BATCH):
            chunk = keys[lo:lo + BATCH]
            for key, got in zip(chunk, client.get_batch(chunk), strict=True):
                not_found += got.code == E.OBJECT_NOT_FOUND
                assert got.code in (E.OK, E.OBJECT_NOT_FOUND), (key, got.code)
                wrong += got.ok and got.data != content(key, SMALL)
        assert (not_found, wrong) == (0, 0), f"{retries} put retries"
        assert metric(cluster, "kvpool_master_evicted_objects") == 0   # none dropped
        assert metric(cluster, "kvpool_master_ssd_copied_ahead") > 0
        assert client.stats.checksum_mismatches == 0
        cluster.check_integrity()


def test_every_promotion_is_counted(tmp_path: Path) -> None:
    keys = [f"promo-{i}" for i in range(40)]             # 10 MiB through 4 MiB of DRAM
    with ssd_cluster(tmp_path, promote_after=2) as (cluster, client):
        put_paced(client, keys)
        wait_for(lambda: metric(cluster, "kvpool_master_ssd_offloads") >= 16,
                 SSD_WAIT_S, "offloads")
        disk_only = [k for k in keys if [r["tier"] for r in cluster.admin(
            "/query_key", key=k).json()["replicas"]] == ["SSD"]][:6]
        assert disk_only
        before = metric(cluster, "kvpool_master_ssd_promotions")
        for key in disk_only:
            first = client.get(key)                      # loads a transient copy
            assert first.code == E.OK and first.data == content(key, 256 * 1024)
        assert metric(cluster, "kvpool_master_ssd_promotions") == before
        for key in disk_only:                            # the second read promotes
            assert client.get(key).ok
        assert metric(cluster, "kvpool_master_ssd_promotions") == before + len(disk_only)
        cluster.check_integrity()
