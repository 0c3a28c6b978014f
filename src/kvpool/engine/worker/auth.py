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

Each start of a worker is an incarnation of its own (a random id made at start, `INC`): the
proof covers it (`NAME#INC`), the proxy signs every later call for that incarnation, and the
worker refuses a call signed for another. So a port cannot inherit its former owner's standing:
a restarted worker, or any listener that takes over the port, is asked to prove itself again,
and a call captured before a restart cannot be replayed after it.
"""

from __future__ import annotations

import functools
import hmac
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
    if not port.isdigit() or len(port) > 5:
        raise AuthError(f"not a host:port name: {name[:80]!r}")
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


@functools.lru_cache(maxsize=1024)
def is_own_name(name: str, host: str, port: int) -> bool:
    """Whether a worker listening on host:port is reachable as `name` (remembered: every
    signed call asks)."""
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


def _bound(name: str, incarnation: str) -> str:
    """The name a proof covers: the worker's address and which start of it answers there."""
    return f"{name}#{incarnation}"


def answer(token: str | None, host: str, port: int, body: Any, *,
           incarnation: str) -> dict[str, Any]:
    """The worker's reply to a challenge body, for this start of it (`incarnation`);
    AuthError for a name that is not its own."""
    nonce = nonce_of(body)
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not is_own_name(name, host, port):
        raise AuthError(f"this worker listens on {host}:{port}, not {name!r}")
    if token is None:
        return {"nonce": None, "proof": None}
    mine = new_nonce()
    return {"nonce": mine, "incarnation": incarnation,
            "proof": proof(token, WORKER, nonce, mine, _bound(name, incarnation))}


def challenge(url: str) -> dict[str, str]:
    """The proxy's challenge body for the worker at `url`."""
    return {"nonce": new_nonce(), "name": name_of(url)}


def verify(token: str, sent: dict[str, str], reply: Any) -> str:
    """The incarnation of the worker that answered; AuthError unless `reply` proves it holds
    `token` for the challenge `sent`."""
    if not isinstance(reply, dict) or reply.get("proof") is None:
        raise AuthError("the worker holds no cluster token (it answered the challenge "
                        "without a proof)")
    try:
        theirs = nonce_of(reply)
    except RemoteProtocolError as exc:  # a malformed reply is a failed proof
        raise AuthError(f"malformed challenge reply: {exc}") from None
    incarnation = reply.get("incarnation")
    if not _is_incarnation(incarnation):
        raise AuthError("malformed challenge reply: no incarnation")
    assert isinstance(incarnation, str)
    if not check_proof(token, WORKER, sent["nonce"], theirs, _bound(sent["name"], incarnation),
                       reply.get("proof")):
        raise AuthError("the worker's proof is wrong: it does not hold the cluster token")
    return incarnation


def _is_incarnation(value: Any) -> bool:
    return (isinstance(value, str) and 0 < len(value) <= 64
            and all(c in "0123456789abcdef" for c in value))


# -- signed calls ------------------------------------------------------------------------------
#
# The proxy does not send the token itself to workers either: each call carries
#
#     Authorization: KvpoolHMAC ts=<unix s>,nonce=<hex>,name=<host:port>,inc=<id>,sig=<hex>
#     sig = HMAC(token, "call" | METHOD | PATH?QUERY | ts | nonce | NAME | INC | sha256(body))
#
# so a listener that takes over a worker's port between two polls learns no token, and cannot
# replay the call elsewhere (NAME), to a later start of the worker (INC), later (ts,
# SIGNATURE_WINDOW_S) or twice (the nonce).

SCHEME = "KvpoolHMAC"
SIGNATURE_WINDOW_S = 60.0
"""A signed call is accepted this long either side of its timestamp (clock skew)."""
_CALL = b"call"


def _call_mac(token: str, method: str, target: str, ts: str, nonce: str, name: str, inc: str,
              body: bytes) -> str:
    import hashlib

    digest = hashlib.sha256(body).hexdigest()
    return proof(token, _CALL, nonce, ts,
                 "\0".join([method.upper(), target, name, inc, digest]))


def sign(token: str, method: str, url: str, target: str, body: bytes, now: float, *,
         incarnation: str) -> str:
    """The Authorization value of one call to the worker at `url` (`target`: path?query),
    for the incarnation that proved itself there."""
    ts, nonce, name = f"{now:.3f}", new_nonce(), name_of(url)
    mac = _call_mac(token, method, target, ts, nonce, name, incarnation, body)
    return f"{SCHEME} ts={ts},nonce={nonce},name={name},inc={incarnation},sig={mac}"


class SeenNonces:
    """Nonces of accepted calls within the window: a replayed call is refused."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._until: dict[str, float] = {}
        self.limit = limit

    def add(self, nonce: str, now: float) -> bool:
        """False if `nonce` was seen (within the window)."""
        if len(self._until) >= self.limit:
            self._until = {n: t for n, t in self._until.items() if t > now}
        if self._until.get(nonce, 0.0) > now:
            return False
        self._until[nonce] = now + 2 * SIGNATURE_WINDOW_S
        return True


def check_signed_head(header: str, host: str, port: int, now: float, *,
                      incarnation: str) -> dict[str, str]:
    """The fields of a signed call's header (ts, nonce, name, inc, sig); AuthError unless it
    is in its time window and names this worker and this start of it. Needs no body:
    checked before one is read."""
    scheme, _, rest = header.partition(" ")
    parsed = dict(part.partition("=")[::2] for part in rest.split(","))
    fields = {k: parsed.get(k, "") for k in ("ts", "nonce", "name", "inc", "sig")}
    try:
        stamp = float(fields["ts"])
    except ValueError:
        raise AuthError("signed call without a timestamp") from None
    if scheme != SCHEME or not abs(now - stamp) <= SIGNATURE_WINDOW_S:  # (NaN too)
        raise AuthError("signed call outside its time window")
    if not fields["nonce"] or not fields["sig"]:
        raise AuthError("signed call without a nonce or signature")
    if not hmac.compare_digest(fields["inc"].encode(), incarnation.encode()):
        raise AuthError(STALE_INCARNATION)
    # last: it may resolve the name (remembered), which the cheap checks spare most callers
    if not is_own_name(fields["name"], host, port):
        raise AuthError(f"signed call for {fields['name'][:80]!r}, not this worker")
    return fields


STALE_INCARNATION = "signed for another start of this worker: prove it again"


def check_signed(token: str, header: str, method: str, target: str, body: bytes,
                 host: str, port: int, now: float, seen: SeenNonces, *,
                 incarnation: str) -> None:
    """AuthError unless `header` is a fresh, unreplayed signature of this call, made for
    this worker's name and incarnation with `token`."""
    fields = check_signed_head(header, host, port, now, incarnation=incarnation)
    ts, nonce, name, inc, sig = (fields[k] for k in ("ts", "nonce", "name", "inc", "sig"))
    expected = _call_mac(token, method, target, ts, nonce, name, inc, body)
    if not hmac.compare_digest(expected.encode(), sig.encode()):
        raise AuthError("wrong call signature")
    if not seen.add(nonce, now):
        raise AuthError("replayed call")
