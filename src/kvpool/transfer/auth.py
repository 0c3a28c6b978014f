"""Mutual authentication of a transfer connection by HMAC challenge-response, sans-I/O.

The shared token never crosses the wire; each side proves it knows it:

    initiator                                   target (listens at NAME = "host:port")
      HELLO      {peer, nonce: Ni}        ->
                                          <-    CHALLENGE {nonce: Nt, proof: P_t}
      check P_t == HMAC(token, "target"    | Ni | Nt | NAME)   (NAME: the address it dialed)
      AUTH       {proof: P_i}             ->
                                                check P_i == HMAC(token, "initiator" | Ni | Nt | NAME)
                                          <-    HELLO_OK  {segment descriptor}

Without a token on the target it answers HELLO with HELLO_OK at once, and an initiator that
has a token refuses that (a peer that cannot prove it knows the token gets nothing). The
initiator sends no frame and no data until the target's proof checked out; the target serves
nothing until the initiator's did. Fresh nonces on both sides stop replays, the role in each
proof stops reflecting one side's proof back to it, and NAME binds the target's proof to the
address the initiator dialed: a listener at another address (a poisoned directory entry) that
relays the handshake to the real target gets a proof for the wrong name.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from kvpool.errors import AuthError, RemoteProtocolError

NONCE_BYTES = 32
_CONTEXT = b"kvpool-transfer-auth/1\0"
TARGET, INITIATOR = b"target", b"initiator"


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def proof(token: str, role: bytes, initiator_nonce: str, target_nonce: str, name: str) -> str:
    """HMAC-SHA256 of both nonces, the prover's role and the target's name, keyed by the token."""
    message = b"\0".join([_CONTEXT, role, initiator_nonce.encode(), target_nonce.encode(), name.encode()])
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def check_proof(token: str, role: bytes, initiator_nonce: str, target_nonce: str, name: str,
                presented: Any) -> bool:
    expected = proof(token, role, initiator_nonce, target_nonce, name)
    return isinstance(presented, str) and hmac.compare_digest(presented.encode(), expected.encode())


def nonce_of(body: dict[str, Any] | str) -> str:
    """The peer's nonce from a HELLO or CHALLENGE body; RemoteProtocolError if malformed."""
    nonce = body.get("nonce") if isinstance(body, dict) else None
    if not isinstance(nonce, str) or len(nonce) != 2 * NONCE_BYTES:
        raise RemoteProtocolError("handshake nonce missing or malformed")
    try:
        bytes.fromhex(nonce)
    except ValueError:
        raise RemoteProtocolError("handshake nonce is not hex") from None
    return nonce


def require_token(token: str | None, name: str) -> str:
    if token is None:
        raise AuthError(f"{name} requires a shared token (set TransferConfig.token or $KVPOOL_TOKEN)")
    return token
