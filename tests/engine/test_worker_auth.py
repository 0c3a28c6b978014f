"""The worker's challenge-response (engine/worker/auth.py): only a worker that holds the token
proves it, only for a name it listens on, and a proof never verifies for another challenge."""

from __future__ import annotations

import pytest

from kvpool.engine.worker import auth
from kvpool.errors import AuthError


def test_a_token_holder_proves_it_and_nobody_else_does() -> None:
    sent = auth.challenge("http://127.0.0.1:8123")
    assert sent["name"] == "127.0.0.1:8123"
    reply = auth.answer("s3cret", "127.0.0.1", 8123, sent, incarnation="0a1b")
    assert auth.verify("s3cret", sent, reply) == "0a1b"
    with pytest.raises(AuthError, match="proof is wrong"):
        auth.verify("another", sent, reply)
    with pytest.raises(AuthError, match="proof is wrong"):  # not replayable: a fresh nonce
        auth.verify("s3cret", auth.challenge("http://127.0.0.1:8123"), reply)
    with pytest.raises(AuthError, match="holds no cluster token"):
        auth.verify("s3cret", sent, auth.answer(None, "127.0.0.1", 8123, sent, incarnation="1"))
    with pytest.raises(AuthError, match="proof is wrong"):  # the proof names its incarnation
        auth.verify("s3cret", sent, reply | {"incarnation": "0a1c"})
    with pytest.raises(AuthError, match="no incarnation"):
        auth.verify("s3cret", sent, reply | {"incarnation": "not hex"})
    for bad in ({}, {"proof": "x"}, {"nonce": "zz", "proof": "x"}, "text"):
        with pytest.raises(AuthError):
            auth.verify("s3cret", sent, bad)


def test_a_relayed_challenge_gets_no_proof_for_the_impostors_name() -> None:
    """An impostor at 127.0.0.1:9000 relays the proxy's challenge (naming 127.0.0.1:9000) to
    the real worker at 127.0.0.1:8123: the worker refuses a name that is not its own."""
    relayed = auth.challenge("http://127.0.0.1:9000")
    with pytest.raises(AuthError, match="not '127.0.0.1:9000'"):
        auth.answer("s3cret", "127.0.0.1", 8123, relayed, incarnation="1")
    other_host = auth.challenge("http://127.0.0.2:8123")  # loopback, but not its address
    with pytest.raises(AuthError):
        auth.answer("s3cret", "127.0.0.1", 8123, other_host, incarnation="1")
    assert auth.is_own_name("localhost:8123", "127.0.0.1", 8123)
    assert auth.is_own_name("127.0.0.2:8123", "0.0.0.0", 8123)  # every interface: any local
    assert not auth.is_own_name("192.0.2.1:8123", "0.0.0.0", 8123)  # TEST-NET: not this host
    assert not auth.is_own_name("nonsense", "127.0.0.1", 8123)


def test_a_signed_call_verifies_once_for_its_worker_body_and_time() -> None:
    url, body = "http://127.0.0.1:8123", b'{"request_id": "r"}'
    header = auth.sign("s3cret", "POST", url, "/prefill", body, now=1000.0, incarnation="be")
    assert "s3cret" not in header  # the token itself never travels
    seen = auth.SeenNonces()

    def check(h: str = header, token: str = "s3cret", target: str = "/prefill",
              data: bytes = body, port: int = 8123, now: float = 1010.0, inc: str = "be") -> None:
        auth.check_signed(token, h, "POST", target, data, "127.0.0.1", port, now, seen,
                          incarnation=inc)

    for wrong, match in ((dict(token="other"), "signature"), (dict(target="/generate"), "signature"),
                         (dict(data=b"{}"), "signature"), (dict(port=8124), "not this worker"),
                         (dict(now=1000.0 + 61), "time window"), (dict(h="KvpoolHMAC x"), "time"),
                         (dict(inc="bf"), "another start of this worker"),
                         (dict(h=header.replace("inc=be", "inc=bf")), "another start"),
                         (dict(h=header.replace("inc=be", "inc=bf"), inc="bf"), "signature")):
        with pytest.raises(AuthError, match=match):
            check(**wrong)  # type: ignore[arg-type]
    check()
    with pytest.raises(AuthError, match="replayed"):
        check()


def test_a_signed_head_is_refused_by_its_cheap_checks_before_its_name_is_resolved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller without the token names any host it likes: the time window, the nonce and
    the incarnation are checked before that name is looked up (a slow DNS answer would
    stall the worker's event loop), and a port of thousands of digits is no name."""
    looked_up: list[str] = []
    monkeypatch.setattr(auth, "_addresses", lambda host: looked_up.append(host) or set())
    auth.is_own_name.cache_clear()
    head = "KvpoolHMAC ts=1000.0,nonce=n,name=x1.attacker.example:8123,inc=zz,sig=s"
    for now, inc in ((1000.0, "be"), (float("nan"), "zz"), (5000.0, "zz")):
        with pytest.raises(AuthError):
            auth.check_signed_head(head.replace("ts=1000.0", f"ts={now}") if now != 1000.0
                                   else head, "127.0.0.1", 8123, 1000.0, incarnation=inc)
    assert looked_up == []
    huge = "KvpoolHMAC ts=1000.0,nonce=n,name=h:" + "9" * 5000 + ",inc=zz,sig=s"
    with pytest.raises(AuthError, match="not this worker"):
        auth.check_signed_head(huge, "127.0.0.1", 8123, 1000.0, incarnation="zz")
