"""A node whose memory a stopped same-host writer keeps locked (between its fence check and its
copy) still mounts again after the master forgets it: under the new fence, in fresh memory."""

from __future__ import annotations

import signal

from kvpool.store.client.config import ClientConfig
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import MasterConfig
from kvpool.store.master.server import MasterServer, MasterServerConfig
from tests.store.cluster import content
from tests.support.net import free_port
from tests.support.procs import running, spawn_python, wait_stopped
from tests.support.wait import wait_for
from tests.transfer.test_fence_renew import LOCKED_WRITER

MIB = 1 << 20


def _master(port: int) -> MasterServer:
    config = MasterServerConfig(rpc_port=port, admin_port=0, enable_http_metadata=False,
                                tick_interval_s=0.05, token=None)
    return MasterServer(config, MasterConfig()).start()


def test_a_stopped_writer_cannot_block_a_remount() -> None:
    port = free_port()
    master = _master(port)
    try:
        node = StoreClient(ClientConfig(master=master.address, global_segment_size=4 * MIB,
                                        local_buffer_size=0, heartbeat_interval_s=0.1,
                                        transfer_timeout_s=0.25, token=None))
        with node:
            (old,) = node._segments.values()
            with running(spawn_python(LOCKED_WRITER, node.engine.descriptor().to_json().decode(),
                                      str(old.addr), str(old.fence.value))) as writer:
                assert writer.stdout is not None
                assert writer.stdout.readline().strip() == b"admitted"
                wait_stopped(writer.pid)
                master.stop()
                master = _master(port)                   # forgets the node
                wait_for(lambda: node.stats.remounts >= 1, 10.0, "the node to remount", 0.05)
                assert node.stats.remounts == 1
                (fresh,) = node._segments.values()
                assert fresh is not old and fresh.fence.value != old.fence.value
                assert [s.base_addr for s in master.core.segment_infos()] == [fresh.addr]
                with StoreClient(ClientConfig(master=master.address, local_buffer_size=MIB,
                                              token=None)) as c:
                    value = content("b", 4096)
                    assert c.put("b", value).ok
                    writer.send_signal(signal.SIGCONT)
                    assert writer.stdout.readline().strip() == b"copied"
                    assert c.get("b").data == value
    finally:
        master.stop()
