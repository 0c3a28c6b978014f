"""Loopback helpers for tests: kvpool's own (kvpool.launch), with the tests' shorter wait."""

from __future__ import annotations

from kvpool.launch import wait as launch_wait
from kvpool.launch.ports import free_port

__all__ = ["free_port", "wait_port"]


def wait_port(port: int, host: str = "127.0.0.1", timeout_s: float = 15.0) -> None:
    """Block until something accepts connections on host:port, or raise TimeoutError."""
    launch_wait.wait_port(port, host, timeout_s)
