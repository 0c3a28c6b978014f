"""The flags every serving command shares: `--token` and `--insecure`, and the rule that
without a token a command binds loopback only."""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
from pathlib import Path

from kvpool.token import TOKEN_ENV, env_token


def add_security_args(parser: argparse.ArgumentParser, protects: str) -> None:
    parser.add_argument(
        "--token", default=env_token(),
        help=f"shared secret that {protects} (default: ${TOKEN_ENV})")
    parser.add_argument(
        "--insecure", action="store_true",
        help="allow binding a non-loopback address without a token (anyone who can reach "
             "the port then controls it)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(command: str, host: str, token: str | None, insecure: bool) -> str | None:
    """Why `command` must not bind `host`, or None: without a token only loopback is safe."""
    if token or insecure or is_loopback(host):
        return None
    return (f"kvpool {command}: refusing to listen on {host} without a token: anyone who can "
            f"reach it could use it. Set --token (or ${TOKEN_ENV}) on every kvpool process, "
            f"or pass --insecure on a trusted network.")


def export_token(token: str | None) -> None:
    """Make `token` the default of every library in this process (and its children) that
    reads ${TOKEN_ENV}, e.g. the metadata client inside a transfer engine."""
    if token:
        os.environ[TOKEN_ENV] = token


def token_file(port: int, host: str = "127.0.0.1") -> Path:
    """Where `kvpool up` on `host`:`port` keeps the cluster token it made: the user's runtime
    directory (or cache), readable by the user alone; `up-PORT.token` on 127.0.0.1, else
    `up-HOST-PORT.token` (a cluster on another address and the same port has its own)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or os.environ.get("XDG_CACHE_HOME") \
        or str(Path.home() / ".cache")
    name = f"up-{port}" if host == "127.0.0.1" else f"up-{host.replace(':', '_')}-{port}"
    return Path(base) / "kvpool" / f"{name}.token"


def new_token_file(path: Path) -> str:
    """A fresh random token written to `path` with mode 0600 (created so from the start,
    never readable by others); the token."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a crashed run's (its port is free: checked before)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode() + b"\n")
    finally:
        os.close(fd)
    return token
