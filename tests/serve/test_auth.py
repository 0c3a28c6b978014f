"""The API-key gate (serve/auth.py) in-process, on a virtual clock: wrong keys are limited per
client address, a right key is never limited unless its address is, and the table stays bounded."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool.serve.auth import ApiKeyGate, FailedKeyLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def ok_app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})


def call(gate: ApiKeyGate, key: str, client: str = "10.0.0.1") -> tuple[int, dict[str, str]]:
    """One request to /v1/models through `gate`: the status and headers it answers."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/models", "client": (client, 5555),
             "headers": [(b"authorization", f"Bearer {key}".encode())]}
    asyncio.run(gate(scope, None, send))
    return sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]}


def test_wrong_keys_are_limited_per_address_and_refill() -> None:
    clock = Clock()
    gate = ApiKeyGate(ok_app, ("right",), salt_per_api_key=False, now=clock)
    statuses = [call(gate, f"guess{i}")[0] for i in range(200)]
    assert statuses == [401] * 64 + [429] * 136  # burst 64, then nothing while the clock stands
    status, headers = call(gate, "right")
    assert status == 429 and headers["retry-after"] == "1"  # blocked before the key is compared
    assert call(gate, "right", client="10.0.0.2")[0] == 200  # other addresses are not
    clock.t += 1.0  # 5 failures a second refill
    assert [call(gate, "guess")[0] for _ in range(6)] == [401] * 5 + [429]
    clock.t += 64 / 5
    assert call(gate, "right")[0] == 200


def test_the_limiter_table_is_bounded() -> None:
    limiter = FailedKeyLimiter(per_s=1.0, burst=2.0, max_clients=100)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}", now=float(i))
    assert len(limiter._spent) <= 100
    assert limiter.retry_after_s("10.0.3.231", now=999.0) == 0.0  # one failure of two
    limiter.failed("10.0.3.231", now=999.0)
    assert limiter.retry_after_s("10.0.3.231", now=999.0) == 1.0
