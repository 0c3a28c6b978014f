"""The one polling wait (`wait_for`): a condition on something real (a process, a socket, an
HTTP server) checked until it holds, one of the children it depends on exits, or a deadline
passes; and the waits built on it that launchers share (`wait_port`, `wait_http`,
`wait_segments`). A child that can say when it is ready says so on a pipe instead
(kvpool.launch.ready); these are for what cannot (etcd, nginx, a vLLM server, the proxy, whose
readiness is its workers')."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx

from kvpool.launch.children import check_alive, said

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], timeout_s: float = 10.0,
             what: str | Callable[[], object] = "", step_s: float = 0.02,
             procs: Sequence[subprocess.Popen[Any]] = ()) -> T:
    """Call `check` every `step_s` until it returns something true, and return that.
    KvpoolError as soon as one of `procs` has exited (what is waited for depends on them);
    after `timeout_s` TimeoutError naming `what` (a string, or a callable for a description
    of the state at that moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check_alive(procs, what)
        if found := check():
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {said(what) or 'the condition'}")
        time.sleep(step_s)


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on host:port now."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def wait_port(port: int, host: str = "127.0.0.1", timeout_s: float = 20.0,
              procs: Sequence[subprocess.Popen[Any]] = ()) -> None:
    """Until something accepts connections on host:port; TimeoutError after `timeout_s`."""
    wait_for(lambda: accepts(port, host), timeout_s, f"something accepting on {host}:{port}",
             0.05, procs)


def answers(url: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
    """`url`'s reply when it is a 200, else None (no answer, or another status)."""
    try:
        reply = httpx.get(url, headers=headers, timeout=2.0)
    except httpx.HTTPError:
        return None
    return reply if reply.status_code == 200 else None


def wait_http(url: str, procs: Sequence[subprocess.Popen[Any]], what: str,
              timeout_s: float = 60.0) -> None:
    """Until `url` answers 200; KvpoolError if one of `procs` exits first, TimeoutError."""
    wait_for(lambda: answers(url) is not None, timeout_s, f"{what}: {url} to answer", 0.1,
             procs)


def wait_segments(admin_url: str, count: int, procs: Sequence[subprocess.Popen[Any]],
                  timeout_s: float = 120.0, token: str | None = None) -> None:
    """Until the master has `count` mounted segments (a large store node takes seconds to map
    its memory; a put before that finds no space). `token`: the master's (default
    $KVPOOL_TOKEN)."""
    from kvpool.metadata.http_serving import bearer_header
    from kvpool.token import env_token

    headers = bearer_header(env_token() if token is None else token)

    def mounted() -> bool:
        reply = answers(f"{admin_url}/segments", headers)
        return reply is not None and len(reply.json()) >= count

    wait_for(mounted, timeout_s, f"the store: {count} segments mounted", 0.1, procs)
