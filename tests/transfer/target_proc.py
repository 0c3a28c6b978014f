"""A transfer target in its own process, driven over stdin/stdout by the tests.

argv[1]: JSON of TransferConfig fields; argv[2]: buffer size. Prints one JSON line
{segment, managed, plain, size, pid}; then answers commands, one per line:
  fill ADDR LEN SEED   -> "ok"           (pseudo-random bytes from SEED)
  digest ADDR LEN      -> hex sha256
  fence ADDR VALUE     -> "ok"           (set_fence of the region registered at ADDR)
  nest ADDR LEN FENCE RO -> "ok"         (register a region inside the plain buffer, with its
                                          own fence, read-only when RO is 1)
  exhaust              -> "ok N"         (lower RLIMIT_NOFILE and hold fds until EMFILE)
  release              -> "ok"           (close them again)
  quit
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys

import numpy as np

from kvpool.transfer import TransferConfig, TransferEngine
from kvpool.transfer.memory import view_at


def main() -> None:
    config = TransferConfig(**json.loads(sys.argv[1]))
    size = int(sys.argv[2])
    plain = np.zeros(size, dtype=np.uint8)
    held: list[int] = []
    with TransferEngine(config) as engine:
        managed = engine.allocate_managed(size)
        engine.register(plain)
        info = {"segment": engine.segment_name, "managed": managed.addr,
                "plain": int(plain.ctypes.data), "size": size}
        print(json.dumps(info), flush=True)
        for line in sys.stdin:
            parts = line.split()
            if not parts or parts[0] == "quit":
                break
            if parts[0] in ("exhaust", "release"):
                print(_fds(parts[0], held), flush=True)
                continue
            if parts[0] == "fence":
                engine.set_fence(int(parts[1]), int(parts[2]))
                print("ok", flush=True)
                continue
            if parts[0] == "nest":
                inner = view_at(int(parts[1]), int(parts[2]))
                engine.register(inner.toreadonly() if parts[4] == "1" else inner,
                                fence=int(parts[3]))
                print("ok", flush=True)
                continue
            addr, length = int(parts[1]), int(parts[2])
            view = view_at(addr, length)
            if parts[0] == "fill":
                rng = np.random.default_rng(int(parts[3]))
                np.frombuffer(view, dtype=np.uint8)[:] = rng.integers(0, 256, length, dtype=np.uint8)
                print("ok", flush=True)
            else:
                print(hashlib.sha256(view).hexdigest(), flush=True)


def _fds(command: str, held: list[int]) -> str:
    if command == "release":
        while held:
            os.close(held.pop())
        return "ok"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(len(os.listdir("/proc/self/fd")) + 16, hard), hard))
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    return f"ok {len(held)}"


if __name__ == "__main__":
    main()
