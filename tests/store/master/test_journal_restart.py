"""A real master whose state directory is damaged: a disk that fills up (a real tmpfs) and
empties again, then a SIGKILL; a snapshot deleted under a later log. Every acknowledged
object is served exact after the restart (or the master refuses to start), and no put the
master failed is ever readable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.wire.codes import ErrorCode as E
from tests.store.cluster import content, store_cluster
from tests.store.master.test_persist_restart import wait_readable
from tests.support.procs import python_env
from tests.support.tmpfs import fill, small_tmpfs

SIZE = 2000


def _put_all(store: StoreClient, keys: list[str]) -> tuple[dict[str, int], list[str]]:
    """(acked key -> size, failed keys) of one put per key."""
    acked, failed = {}, []
    for key in keys:
        if store.put(key, content(key, SIZE)).ok:
            acked[key] = SIZE
        else:
            failed.append(key)
    return acked, failed


@pytest.mark.slow  # three master starts: about 13 s
def test_a_full_disk_fails_puts_unseen_and_later_puts_survive_a_kill(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small") as state, \
            store_cluster(1, "16MiB", "--state-dir", str(state)) as cluster:
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            acked, failed = _put_all(store, [f"early{i}" for i in range(20)])
            assert not failed
            filler = fill(state, leave_bytes=4096)
            more, failed = _put_all(store, [f"k{i}" for i in range(300)])
            acked |= more
            assert len(failed) > 200, len(failed)  # the disk filled up within 100 puts
            assert all(g.code == E.OBJECT_NOT_FOUND for g in store.get_batch(failed))
            journal = cluster.admin("/journal").json()
            assert journal["write_failures"] == len(failed)
            assert "No space left" in journal["write_error"]
            filler.unlink()
            more, refused = _put_all(store, [f"after{i}" for i in range(150)])
            assert not refused
            acked |= more
        cluster.kill_master()
        cluster.start_master()
        cluster.wait_segments(1)
        wait_readable(cluster, acked)
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            assert all(g.code == E.OBJECT_NOT_FOUND for g in store.get_batch(failed))
        replay = cluster.admin("/journal").json()["replay"]
        assert (replay["corrupt_runs"], replay["torn_tail_bytes"]) == (0, 0)
        cluster.check_integrity()


@pytest.mark.slow  # four master starts: about 14 s
def test_a_deleted_snapshot_stops_the_master_unless_recover_partial(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with store_cluster(1, "16MiB", "--state-dir", str(state)) as cluster:
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            first, _ = _put_all(store, [f"first{i}" for i in range(20)])
        cluster.kill_master()
        cluster.start_master()  # the snapshot now holds first*, the log comes after it
        cluster.wait_segments(1)
        with StoreClient(ClientConfig(master=cluster.address)) as store:
            second, _ = _put_all(store, [f"second{i}" for i in range(10)])
        cluster.kill_master()
        (state / "snapshot").unlink()
        refused = subprocess.run([sys.executable, "-m", "kvpool", *cluster.master_args],
                                 env=python_env(), capture_output=True, text=True,
                                 timeout=60, check=False)
        assert refused.returncode == 2, refused.stderr
        assert "snapshot is missing" in refused.stderr
        assert "--recover-partial" in refused.stderr
        cluster.master_args = (*cluster.master_args, "--recover-partial")
        cluster.start_master()
        cluster.wait_segments(1)
        wait_readable(cluster, second)  # what the remaining log holds, exact
        assert cluster.admin("/journal").json()["replay"]["problems"]
