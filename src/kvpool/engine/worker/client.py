"""A small synchronous client of the worker API: drive one request through a prefill and a
decode worker (or one colocated worker). Used by `kvpool generate`, the tests and the bench."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.errors import KvpoolError
from kvpool.metadata.http_serving import bearer_header


class WorkerCallFailed(KvpoolError):
    """A worker answered an error (status or error line)."""


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefill: dict[str, Any] = field(default_factory=dict)


def prefill(url: str, request_id: str, prompt: list[int], sampling: dict[str, Any],
            kv_transfer: dict[str, Any], token: str | None = None,
            timeout_s: float = 120.0) -> dict[str, Any]:
    reply = httpx.post(f"{url}/prefill", headers=bearer_header(token), timeout=timeout_s, json={
        "request_id": request_id, "prompt_token_ids": prompt, "sampling": sampling,
        "kv_transfer": kv_transfer})
    if reply.status_code != 200:
        raise WorkerCallFailed(f"prefill on {url}: {reply.status_code} {reply.text}")
    return dict(reply.json())


def stream(url: str, request_id: str, prompt: list[int], sampling: dict[str, Any],
           first_token_id: int | None, kv_source: str, token: str | None = None,
           timeout_s: float = 120.0) -> Iterator[dict[str, Any]]:
    """The decode leg's NDJSON lines, parsed; raises WorkerCallFailed on an error line."""
    body = {"request_id": request_id, "prompt_token_ids": prompt, "sampling": sampling,
            "first_token_id": first_token_id, "kv_source": kv_source}
    with httpx.stream("POST", f"{url}/generate", json=body, headers=bearer_header(token),
                      timeout=timeout_s) as reply:
        if reply.status_code != 200:
            raise WorkerCallFailed(f"generate on {url}: {reply.status_code} {reply.read().decode()}")
        for line in reply.iter_lines():
            if not line:
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise WorkerCallFailed(f"generate on {url}: {msg['error']}")
            yield msg


def generate(prompt: list[int], sampling: dict[str, Any], *, decode_url: str,
             prefill_url: str | None = None, mode: str = "pool", token: str | None = None,
             request_id: str | None = None) -> Generation:
    """prefill_url None: the decode worker computes the prompt (a colocated `both` worker)."""
    rid = request_id or uuid.uuid4().hex
    out = Generation()
    first, source = None, "none"
    if prefill_url is not None:
        transfer = {"mode": mode, "decode_url": decode_url} if mode == "push" else {"mode": mode}
        out.prefill = prefill(prefill_url, rid, prompt, sampling, transfer, token)
        first, source = out.prefill["first_token_id"], mode
    for msg in stream(decode_url, rid, prompt, sampling, first, source, token):
        if "token_id" in msg:
            out.token_ids.append(int(msg["token_id"]))
        else:
            out.finish_reason = msg.get("finish_reason")
    return out
