"""etcd's one command line (kvpool.launch.etcd) and the etcd that keeps its ports and data
across a kill and a start and dies with its parent, over a real etcd."""

from __future__ import annotations

import shutil
from contextlib import ExitStack

import httpx
import pytest

from kvpool.errors import KvpoolError
from kvpool.launch.etcd import EtcdProcess, etcd_argv
from tests.launch.orphans import kill_parent_of


def test_one_member_cluster_on_one_address() -> None:
    assert etcd_argv("hosts", "/d", "10.0.0.4", binary="/bin/etcd") == [
        "/bin/etcd", "--name", "hosts", "--data-dir", "/d",
        "--listen-client-urls", "http://10.0.0.4:2379",
        "--advertise-client-urls", "http://10.0.0.4:2379",
        "--listen-peer-urls", "http://10.0.0.4:2380",
        "--initial-advertise-peer-urls", "http://10.0.0.4:2380",
        "--initial-cluster", "hosts=http://10.0.0.4:2380"]


def test_no_etcd_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(KvpoolError, match="no `etcd` command: install the Debian package"):
        etcd_argv("x", "/d")


def test_etcd_comes_back_on_its_ports_with_its_data() -> None:
    with ExitStack() as stack:
        etcd = EtcdProcess(stack).start()
        url = f"http://{etcd.endpoint}/v3/kv/put"
        put = httpx.post(url, json={"key": "a2V5", "value": "dmFsdWU="}, timeout=5)
        assert put.status_code == 200
        etcd.kill()
        etcd.start()
        got = httpx.post(f"http://{etcd.endpoint}/v3/kv/range", json={"key": "a2V5"}, timeout=5)
        assert got.json()["kvs"][0]["value"] == "dmFsdWU="


def test_etcd_dies_with_the_process_that_started_it() -> None:
    said = kill_parent_of("""
        from contextlib import ExitStack
        from kvpool.launch.etcd import EtcdProcess
        stack = ExitStack()
        etcd = EtcdProcess(stack).start()
        assert etcd.proc is not None
        said = {"pid": etcd.proc.pid, "data_dir": etcd.data_dir}
    """)
    shutil.rmtree(str(said["data_dir"]))  # its parent, killed, could not
