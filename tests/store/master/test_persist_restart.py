"""A real master with --state-dir, SIGKILLed and restarted: every acknowledged object is
served again, with its bytes, once the store nodes (still holding them) mount again."""

from __future__ import annotations

import time
from pathlib import Path

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.cluster import Cluster, content, store_cluster


def wait_readable(cluster: Cluster, acked: dict[str, int], timeout_s: float = 20.0) -> float:
    """Seconds until every acked object reads back with its bytes (asserts they do)."""
    t0 = time.monotonic()
    keys = sorted(acked)
    with StoreClient(ClientConfig(master=cluster.address)) as store:
        while True:
            got = store.get_batch(keys)
            if all(g.code == E.OK for g in got) or time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.05)
        for key, g in zip(keys, got, strict=True):
            assert g.code == E.OK, (key, g.code)
            assert g.data == content(key, acked[key]), key
    return time.monotonic() - t0


def test_sigkill_and_restart_keeps_every_object(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_cluster(2, "16MiB", "--state-dir", str(state)) as cluster:
        acked: dict[str, int] = {}
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            keys = [f"obj-{i}" for i in range(200)]
            sizes = [1000 + 37 * i for i in range(200)]
            for i in range(0, 200, 50):
                batch = keys[i:i + 50]
                results = store.put_batch(batch, [content(k, s) for k, s in
                                                  zip(batch, sizes[i:i + 50], strict=True)],
                                          ReplicateConfig(replica_num=1 + (i // 50) % 2))
                assert all(r.ok for r in results)
            acked = dict(zip(keys, sizes, strict=True))
            assert store.remove("obj-0") in (E.OK, E.OBJECT_HAS_LEASE)
            assert store.remove("obj-0", force=True) in (E.OK, E.OBJECT_NOT_FOUND)
            del acked["obj-0"]
        cluster.kill_master()
        (log_file,) = state.glob("log.*")
        with open(log_file, "ab") as f:
            f.write(b"\x40\x00\x00\x00torn")   # a record cut short by the crash
        cluster.start_master()
        cluster.wait_segments(2)
        wait_readable(cluster, acked)
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            assert store.get("obj-0").code == E.OBJECT_NOT_FOUND
            assert store.put("after", b"x" * 5000).ok
            assert store.get("after").data == b"x" * 5000
        cluster.check_integrity()
        cluster.kill_master()   # and once more: the log of the second run replays too
        cluster.start_master()
        cluster.wait_segments(2)
        wait_readable(cluster, acked)
        cluster.check_integrity()
