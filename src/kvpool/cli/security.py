"""The flags every serving command shares: `--token` and `--insecure`, and the rule that
without a token a command binds loopback only."""

from __future__ import annotations

import argparse
import ipaddress
import os

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
