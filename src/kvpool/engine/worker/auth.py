"""A worker proves it holds the cluster token before anyone sends it the token or a prompt.

The proxy registers workers by URL, and a URL can name an impostor; a bearer token sent to it
would be stolen, and the prompts with it. So before its first token-bearing call to a worker
(and again whenever the worker rejoins), the proxy challenges it, sending nothing secret:

    proxy                                              worker (listens at NAME = host:port)
      POST /auth/challenge {nonce: Np, name: NAME}  ->
                                                    <-  {nonce: Nw, proof: P}
      P == HMAC(token, "worker" | Np | Nw | NAME) ?     (kvpool.transfer.auth.proof)

The worker proves only for a NAME that is its own (its port, and its host or, when it listens
on every interface, an address of this machine): an impostor that relays the challenge to a
real worker gets a proof for the real worker's name, not for the one the proxy dialed. The
proxy's nonce makes each proof fresh. A worker without a token answers `proof: null`, which a
proxy with a token refuses.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

from kvpool.errors import AuthError, RemoteProtocolError
from kvpool.transfer.auth import check_proof, new_nonce, nonce_of, proof

CHALLENGE_PATH = "/auth/challenge"
WORKER = b"worker"
WILDCARDS = ("", "0.0.0.0", "::")


def name_of(url: str) -> str:
    """host:port of a worker URL, as the challenge names it."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname or ''}:{port}"


def _split(name: str) -> tuple[str, int]:
    host, _, port = name.rpartition(":")
    if not port.isdigit():
        raise AuthError(f"not a host:port name: {name!r}")
    return host.strip("[]"), int(port)


def _addresses(host: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def _is_local(address: str) -> bool:
    """Whether `address` belongs to this machine (a socket can bind it; nothing is sent)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((address, 0))
        return True
    except (OSError, ValueError):
        return False


def is_own_name(name: str, host: str, port: int) -> bool:
    """Whether a worker listening on host:port is reachable as `name`."""
    try:
        asked_host, asked_port = _split(name)
    except AuthError:
        return False
    if asked_port != port:
        return False
    asked = _addresses(asked_host)
    if host in WILDCARDS:
        return any(_is_local(a) for a in asked)
    return bool(asked & _addresses(host))


def answer(token: str | None, host: str, port: int, body: Any) -> dict[str, Any]:
    """The worker's reply to a challenge body; AuthError for a name that is not its own."""
    nonce = nonce_of(body)
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not is_own_name(name, host, port):
        raise AuthError(f"this worker listens on {host}:{port}, not {name!r}")
    if token is None:
        return {"nonce": None, "proof": None}
    mine = new_nonce()
    return {"nonce": mine, "proof": proof(token, WORKER, nonce, mine, name)}


def challenge(url: str) -> dict[str, str]:
    """The proxy's challenge body for the worker at `url`."""
    return {"nonce": new_nonce(), "name": name_of(url)}


def verify(token: str, sent: dict[str, str], reply: Any) -> None:
    """AuthError unless `reply` proves the worker holds `token` for the challenge `sent`."""
    if not isinstance(reply, dict) or reply.get("proof") is None:
        raise AuthError("the worker holds no cluster token (it answered the challenge "
                        "without a proof)")
    try:
        theirs = nonce_of(reply)
    except RemoteProtocolError as exc:  # a malformed reply is a failed proof
        raise AuthError(f"malformed challenge reply: {exc}") from None
    if not check_proof(token, WORKER, sent["nonce"], theirs, sent["name"], reply.get("proof")):
        raise AuthError("the worker's proof is wrong: it does not hold the cluster token")
