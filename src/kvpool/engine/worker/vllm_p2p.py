"""The vLLM face's side of vLLM's MooncakeConnector P/D protocol (serve/vllm/mooncake_p2p.py
is the proxy's): what a prefill instance keeps for a transfer id and what a decode instance
checks before it computes, so that the proxy's `--kv-transfer mooncake` runs against real
processes that refuse every deviation from the protocol.

    GET  /query                    the bootstrap server's reply, as vLLM's: {"0": {"engine_id":
                                   E, "worker_addr": {"0": {"0": "HOST:PORT"}}}} (a real vLLM
                                   serves it on its own port, VLLM_MOONCAKE_BOOTSTRAP_PORT;
                                   the face on its API port)
    POST /kvpool/mooncake/pull     {"transfer_id": T, "engine_id": E}: stands in for the pull
                                   a real decode worker makes over ZMQ and RDMA/TCP from the
                                   address /query gave; 200 once per held T, 404 otherwise

What is emulated: the bytes. The face's KV moves through the pool (its prefill leg stores the
prompt's full blocks there, as with the store connector); the pull only proves that the decode
leg was sent the transfer id, engine id and bootstrap address the prefill leg was. Stricter than
vLLM: a decode request with do_remote_prefill but a missing field is refused (400) where vLLM
logs a warning and recomputes, and a failed pull fails the request (500).

    HeldTransfers(clock, ttl_s)    transfer id -> prompt tokens, held by the prefill leg until
                                   pulled or ttl_s old (vLLM's VLLM_MOONCAKE_ABORT_REQUEST_
                                   TIMEOUT, 480 s); sans-I/O
    decode_fields(kv)              (engine id, bootstrap URL, transfer id) of a decode
                                   request's kv_transfer_params; ValueError names a missing one
    pull(http, kv)                 the decode leg's query and pull (RequestFailed says which
                                   step failed)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.clock import Clock, MonotonicClock
from kvpool.errors import RequestFailed

PULL_PATH = "/kvpool/mooncake/pull"
DEFAULT_TTL_S = 480.0
DECODE_FIELDS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")


def bootstrap_query(engine_id: str, addr: str) -> dict[str, Any]:
    return {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": addr}}}}


@dataclass
class HeldTransfers:
    """One writer: the face's request handlers, through hold and take."""

    clock: Clock = field(default_factory=MonotonicClock)
    ttl_s: float = DEFAULT_TTL_S
    _held: dict[str, tuple[int, float]] = field(default_factory=dict)

    def hold(self, transfer_id: str, num_tokens: int) -> None:
        self._expire()
        if transfer_id in self._held:
            raise ValueError(f"transfer_id {transfer_id!r} is already held here")
        self._held[transfer_id] = (num_tokens, self.clock.now() + self.ttl_s)

    def take(self, transfer_id: str) -> int | None:
        """The held prompt's token count, once; None for an unknown or expired id."""
        self._expire()
        held = self._held.pop(transfer_id, None)
        return None if held is None else held[0]

    def __len__(self) -> int:
        return len(self._held)

    def _expire(self) -> None:
        now = self.clock.now()
        for tid in [t for t, (_, until) in self._held.items() if until <= now]:
            del self._held[tid]


def decode_fields(kv: dict[str, Any]) -> tuple[str, str, str]:
    absent = [f for f in DECODE_FIELDS if not isinstance(kv.get(f), str) or not kv[f]]
    if absent:
        raise ValueError(f"kv_transfer_params with do_remote_prefill and a transfer_id lack "
                         f"{', '.join(absent)}")
    return kv["remote_engine_id"], kv["remote_bootstrap_addr"].rstrip("/"), kv["transfer_id"]


async def pull(http: httpx.AsyncClient, kv: dict[str, Any]) -> int:
    """The prompt tokens the prefill instance held for the transfer (see module doc)."""
    engine_id, bootstrap, transfer_id = decode_fields(kv)
    try:
        query = (await http.get(bootstrap + "/query")).json()
        entry = next((e for e in query.values() if e.get("engine_id") == engine_id), None)
        if entry is None:
            raise RequestFailed(f"KV transfer {transfer_id}: {bootstrap} knows no engine "
                                f"{engine_id!r}")
        addr = entry["worker_addr"]["0"]["0"]
        resp = await http.post(f"http://{addr}{PULL_PATH}",
                               json={"transfer_id": transfer_id, "engine_id": engine_id})
    except (httpx.HTTPError, ValueError, KeyError, AttributeError) as exc:
        raise RequestFailed(f"KV transfer {transfer_id}: the query or pull at {bootstrap} "
                            f"failed: {exc!r}") from None
    if resp.status_code != 200:
        raise RequestFailed(f"KV transfer {transfer_id}: engine {engine_id} holds no such "
                            f"transfer ({resp.status_code})")
    return int(resp.json()["num_tokens"])
