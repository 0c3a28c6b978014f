"""Fixtures for transfer tests: targets in other processes, initiator engines."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvpool.transfer import TransferConfig, TransferEngine
from tests.support.procs import python_env, wait_stopped

TARGET = os.path.join(os.path.dirname(__file__), "target_proc.py")
BUFFER_BYTES = 8 << 20


@dataclass
class Target:
    proc: subprocess.Popen[str]
    segment: str
    managed: int
    plain: int
    size: int

    def command(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def fill(self, addr: int, length: int, seed: int) -> None:
        assert self.command(f"fill {addr} {length} {seed}") == "ok"

    def digest(self, addr: int, length: int) -> str:
        return self.command(f"digest {addr} {length}")

    def set_fence(self, addr: int, fence: int) -> None:
        assert self.command(f"fence {addr} {fence}") == "ok"

    @contextmanager
    def stopped(self) -> Iterator[None]:
        """The target process stopped (SIGSTOP, taken effect) for the block, and resumed
        (SIGCONT) however the block ends."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            wait_stopped(self.proc.pid)
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_target(size: int = BUFFER_BYTES, **config: Any) -> Target:
    proc = subprocess.Popen([sys.executable, TARGET, json.dumps(config), str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=python_env())
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError("transfer target process failed to start")
    info = json.loads(line)
    return Target(proc, info["segment"], info["managed"], info["plain"], info["size"])


def sha(data: np.ndarray | memoryview | bytes) -> str:
    return hashlib.sha256(memoryview(data).cast("B") if not isinstance(data, bytes) else data).hexdigest()


@pytest.fixture
def target_factory() -> Iterator[Callable[..., Target]]:
    started: list[Target] = []

    def make(**config: Any) -> Target:
        target = start_target(**config)
        started.append(target)
        return target

    yield make
    for target in started:
        target.stop()


@pytest.fixture(params=["tcp", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every conformance test runs once per transport."""
    return str(request.param)


@pytest.fixture
def target(target_factory: Callable[..., Target]) -> Target:
    return target_factory()


@pytest.fixture
def engine(transport: str) -> Iterator[TransferEngine]:
    protocol = "tcp" if transport == "tcp" else "auto"
    with TransferEngine(TransferConfig(protocol=protocol, timeout_s=5.0)) as eng:
        yield eng


def remote_base(target: Target, transport: str) -> int:
    """Where the transport under test lands: shm needs the peer's managed (shared) buffer."""
    return target.managed if transport == "shm" else target.plain
