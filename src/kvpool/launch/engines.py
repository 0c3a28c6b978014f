"""kvpool workers over a store of their own, for the benchmarks that measure the engine
(`kvpool bench engine`, `bench engine-disagg`): one master, one store node, then the workers,
started together. Each is waited for by its own announcement (kvpool.launch.ready: the master
once it listens, the node once its memory is mounted, a worker once it serves), not by polling
its port; each is stopped when the caller's ExitStack closes."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from kvpool.launch.ports import free_port
from kvpool.launch.store import start_all_ready, start_master, start_ready

WORKER_START_S = 120.0
"""How long a worker may take to load its model and serve."""


@dataclass(frozen=True)
class Engines:
    master: str
    """The master's RPC address."""
    urls: list[str]
    """Each worker's base URL, in the order asked for."""


def start_engines(stack: ExitStack, workers: Sequence[Sequence[str]], dram: str = "2GiB",
                  timeout_s: float = WORKER_START_S) -> Engines:
    """A master, a store node of `dram`, and `kvpool worker --master M --port P ARGS` for
    each ARGS of `workers` on a fresh port, returned once every one is ready. The workers log
    warnings and up to stderr, as a benchmark's own children do."""
    _, master, _ = start_master(stack)
    start_ready(stack, "store-node", "--dram", dram, "--master", master, what="the store node")
    ports = [free_port() for _ in workers]
    start_all_ready(stack, [("worker", "--master", master, "--port", str(port), *args)
                            for port, args in zip(ports, workers, strict=True)],
                    "a worker", timeout_s, log_level="WARNING", show_errors=True)
    return Engines(master, [f"http://127.0.0.1:{port}" for port in ports])
