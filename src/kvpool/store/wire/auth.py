"""The handshake that opens an RPC connection to a master with a shared token (sans-I/O
state machines, plus the client's blocking driver).

The token itself never crosses the wire: the master sends a fresh random nonce and the client
answers with HMAC-SHA256(token, nonce || ROLE). Each message is one frame (framing.py) that
starts with AUTH_MAGIC, which no msgpack request starts with:

    client                                            master
      HELLO      MAGIC 01                       ->
                                                <-    CHALLENGE  MAGIC 02 nonce(32 B)
                                                      (a master without a token: OK)
      PROOF      MAGIC 03 hmac(32 B)            ->
                                                <-    OK         MAGIC 04
                                                      or an error reply [0, -600, "authentication
                                                      failed: ..."], then the master hangs up
      requests ...

The client sends no request before OK. A master with a token refuses any other first frame
(a plain request included) with that error reply; a master without one answers HELLO with OK,
so a client configured with a token can still talk to it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import socket
import time

from kvpool.errors import AuthError, RemoteProtocolError, RpcError, RpcTimeout
from kvpool.store.wire.framing import FrameDecoder, encode_frame
from kvpool.store.wire.protocol import decode_reply

AUTH_MAGIC = b"\x00KVPAUTH"
NONCE_BYTES = 32
ROLE = b"kvpool-master-rpc-client"
"""Bound into the proof, so a proof made for another kvpool handshake cannot be replayed here."""
MAX_HANDSHAKE_FRAME_BYTES = 4096
"""Largest frame a master reads from a connection that has not authenticated yet."""


class Kind(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    OK = 4


def encode_message(kind: Kind, body: bytes = b"") -> bytes:
    """The payload of a handshake frame."""
    return AUTH_MAGIC + bytes([kind]) + body


def decode_message(frame: bytes) -> tuple[Kind, bytes] | None:
    """(kind, body) of a handshake frame; None when `frame` is not one (e.g. a request)."""
    if len(frame) <= len(AUTH_MAGIC) or not frame.startswith(AUTH_MAGIC):
        return None
    try:
        return Kind(frame[len(AUTH_MAGIC)]), frame[len(AUTH_MAGIC) + 1:]
    except ValueError:
        return None


def proof(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce + ROLE, hashlib.sha256).digest()


class ServerHandshake:
    """The master's side for one connection to a master with `token`. `receive(frame)`
    returns the payload of the frame to send back; AuthError when the peer failed, after
    which the connection must be answered with the error and closed."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._nonce: bytes | None = None
        self.done = False

    def receive(self, frame: bytes) -> bytes:
        message = decode_message(frame)
        if message is None:
            raise AuthError("authentication failed: this master requires the shared token "
                            "(configure the client with --token or KVPOOL_TOKEN)")
        kind, body = message
        if kind is Kind.HELLO and self._nonce is None:
            self._nonce = secrets.token_bytes(NONCE_BYTES)
            return encode_message(Kind.CHALLENGE, self._nonce)
        if kind is Kind.PROOF and self._nonce is not None:
            if not hmac.compare_digest(body, proof(self._token, self._nonce)):
                raise AuthError("authentication failed: wrong shared token")
            self.done = True
            return encode_message(Kind.OK)
        raise AuthError(f"authentication failed: unexpected handshake message {kind.name}")


def answer_without_token(frame: bytes) -> bytes | None:
    """What needs no token: the payload answering a handshake frame on a connection that
    needs no (more) authentication, which is OK; None when `frame` is not a handshake frame."""
    return None if decode_message(frame) is None else encode_message(Kind.OK)


def client_handshake(sock: socket.socket, token: str, timeout_s: float, address: str) -> None:
    """Authenticate a fresh blocking connection. RpcError when the master refuses (the message
    says why), RpcTimeout when it does not answer within `timeout_s`. Leaves the socket's
    timeout as it found it."""
    previous = sock.gettimeout()
    deadline = time.monotonic() + timeout_s
    decoder = FrameDecoder(MAX_HANDSHAKE_FRAME_BYTES)
    try:
        sock.sendall(encode_frame(encode_message(Kind.HELLO)))
        first = _next_message(sock, decoder, deadline, address)
        if first[0] is Kind.CHALLENGE:
            sock.sendall(encode_frame(encode_message(Kind.PROOF, proof(token, first[1]))))
            first = _next_message(sock, decoder, deadline, address)
        if first[0] is not Kind.OK:
            raise RpcError(f"master {address} broke the handshake with {first[0].name}")
    except (TimeoutError, BlockingIOError):
        raise RpcTimeout(f"master {address} did not complete the handshake within "
                         f"{timeout_s}s") from None
    except OSError as exc:
        raise RpcError(f"connection to master {address} lost in the handshake: {exc}") from None
    finally:
        sock.settimeout(previous)


def _next_message(sock: socket.socket, decoder: FrameDecoder, deadline: float,
                  address: str) -> tuple[Kind, bytes]:
    while True:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data = sock.recv(MAX_HANDSHAKE_FRAME_BYTES)
        if not data:
            raise RpcError(f"master {address} closed the connection in the handshake")
        try:
            frames = decoder.feed(data)
        except RemoteProtocolError as exc:
            raise RpcError(f"malformed handshake from master {address}: {exc}") from None
        if frames:
            return _message_or_refusal(frames[0], address)


def _message_or_refusal(frame: bytes, address: str) -> tuple[Kind, bytes]:
    message = decode_message(frame)
    if message is not None:
        return message
    try:
        reply = decode_reply(frame)
    except RemoteProtocolError:
        raise RpcError(f"master {address} answered the handshake with a malformed frame") \
            from None
    raise RpcError(f"master {address} refused the connection: {reply.result}")
