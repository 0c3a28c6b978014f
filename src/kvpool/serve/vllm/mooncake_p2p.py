"""vLLM's MooncakeConnector P/D protocol as the proxy drives it (`--kv-transfer mooncake`):
the decode instance pulls the KV straight from the prefill instance's memory, named by a
transfer id the proxy makes and gives to both legs. Sans-I/O: the backend does the HTTP.

    join      GET {bootstrap}/query on each prefill-capable instance: its Mooncake bootstrap
              server (vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT, 8998 by default, on the instance's
              host) answers {dp_rank: {"engine_id": E, "worker_addr": {tp: {pp: addr}}}};
              the instance's engine id is E (one data-parallel rank: several are refused)
    prefill   kv_transfer_params {"do_remote_decode": true, "do_remote_prefill": false,
                                  "transfer_id": T}, max_tokens 1; vLLM keeps the blocks for T
              and returns no kv_transfer_params
    decode    kv_transfer_params {"do_remote_prefill": true, "do_remote_decode": false,
                                  "remote_engine_id": E, "remote_bootstrap_addr": bootstrap,
                                  "transfer_id": T}; the decode instance asks the bootstrap
              server for E's workers and pulls T's blocks from them

    MooncakeP2P.bootstrap(url)        the instance's bootstrap URL (named, else host:8998)
    MooncakeP2P.learn(url, query)     its engine id from the /query reply (InvalidArgument
                                      says why a reply is unusable)
    MooncakeP2P.prefill_params(T)     the prefill leg's kv_transfer_params
    MooncakeP2P.decode_params(url, T) the decode leg's, for a prefill on `url`
    new_transfer_id()                 a fresh T (128 random bits, hex)
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvpool.errors import InvalidArgument

DEFAULT_BOOTSTRAP_PORT = 8998
"""vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default."""


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def engine_id_of(query: Any) -> str:
    """The engine id in a bootstrap server's /query reply."""
    if not isinstance(query, dict) or not query:
        raise InvalidArgument(f"its Mooncake bootstrap /query names no engine: {query!r:.200}")
    if len(query) > 1:
        raise InvalidArgument(f"its Mooncake bootstrap serves {len(query)} data-parallel ranks; "
                              "--kv-transfer mooncake drives one engine per instance URL")
    entry = next(iter(query.values()))
    engine_id = entry.get("engine_id") if isinstance(entry, dict) else None
    if not isinstance(engine_id, str) or not engine_id:
        raise InvalidArgument(f"its Mooncake bootstrap /query entry has no engine_id: "
                              f"{entry!r:.200}")
    return engine_id


@dataclass
class MooncakeP2P:
    named: Mapping[str, str] = field(default_factory=dict)
    """Instance URL -> its bootstrap URL, as configured (--mooncake-bootstrap)."""
    engine_ids: dict[str, str] = field(default_factory=dict)
    """Instance URL -> engine id, learned when it joins."""

    def bootstrap(self, url: str) -> str:
        if url in self.named:
            return self.named[url].rstrip("/")
        parts = urlsplit(url)
        return f"http://{parts.hostname}:{DEFAULT_BOOTSTRAP_PORT}"

    def learn(self, url: str, query: Any) -> str:
        self.engine_ids[url] = engine_id = engine_id_of(query)
        return engine_id

    @staticmethod
    def prefill_params(transfer_id: str) -> dict[str, Any]:
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}

    def decode_params(self, url: str, transfer_id: str) -> dict[str, Any]:
        engine_id = self.engine_ids.get(url)
        if engine_id is None:  # it joined before the engine id was learned: cannot happen
            raise InvalidArgument(f"{url}: no Mooncake engine id learned at its join")
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": engine_id, "remote_bootstrap_addr": self.bootstrap(url),
                "transfer_id": transfer_id}
