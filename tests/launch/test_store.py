"""The store's children (kvpool.launch.store): a `kvpool` child dies with the process that
started it, however that one ends."""

from __future__ import annotations

from tests.launch.orphans import kill_parent_of


def test_a_kvpool_child_dies_with_its_parent_even_on_sigkill() -> None:
    kill_parent_of("""
        from kvpool.launch.ports import free_port
        from kvpool.launch.store import spawn_kvpool
        from kvpool.launch.wait import wait_port
        port = free_port()
        child = spawn_kvpool("metadata", "--port", str(port))
        wait_port(port, timeout_s=30, procs=[child])
        said = {"pid": child.pid}
    """)
