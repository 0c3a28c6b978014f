"""The tests' one polling wait is kvpool's own (kvpool.launch.wait.wait_for): a condition on
something real (a process, a socket, a file) checked until it holds or a deadline passes. Waits
on a virtual clock do not poll; they advance it."""

from __future__ import annotations

from kvpool.launch.wait import wait_for

__all__ = ["wait_for"]
