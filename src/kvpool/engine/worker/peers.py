"""A worker's calls to another worker (push mode: /kv/reserve, /abort), authenticated as the
proxy's are (engine/worker/auth.py): the peer proves it holds the cluster token before it is
sent anything, and each call is signed for the incarnation that proved itself; the token never
goes on the wire. A peer that answers 401 (it restarted, or another listener took its port) is
challenged again once before the call is retried."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import httpx
from pydantic import BaseModel

from kvpool.engine.worker import auth
from kvpool.engine.worker.auth import CHALLENGE_PATH
from kvpool.engine.worker.messages import AbortRequest, ReserveReply, ReserveRequest, parse
from kvpool.engine.worker.pool import PushPlan
from kvpool.errors import AuthError, RequestFailed

JSON = {"Content-Type": "application/json"}


class PeerCalls:
    """The only writer of its table of proven peers (URL -> incarnation)."""

    def __init__(self, http: httpx.AsyncClient, token: str | None,
                 wall_clock: Callable[[], float]) -> None:
        self.http, self.token, self.wall_clock = http, token, wall_clock
        self._incarnations: dict[str, str] = {}

    async def post(self, base_url: str, path: str, msg: BaseModel) -> httpx.Response:
        """POST `msg` to the worker at `base_url`. Raises httpx.HTTPError (unreachable) or
        RequestFailed (it does not prove it holds the token)."""
        url, body = base_url.rstrip("/"), msg.model_dump_json().encode()
        if not self.token:
            return await self.http.post(url + path, content=body, headers=JSON)
        for retry in (False, True):
            incarnation = self._incarnations.get(url) or await self._prove(url)
            signed = auth.sign(self.token, "POST", url, path, body, self.wall_clock(),
                               incarnation=incarnation)
            reply = await self.http.post(url + path, content=body,
                                         headers=JSON | {"Authorization": signed})
            if reply.status_code != 401 or retry:
                return reply
            self._incarnations.pop(url, None)
        raise AssertionError("unreachable")

    async def _prove(self, url: str) -> str:
        assert self.token is not None
        sent = auth.challenge(url)
        reply = await self.http.post(url + CHALLENGE_PATH, json=sent)
        try:
            if reply.status_code != 200:
                raise AuthError(f"its challenge answered {reply.status_code}")
            incarnation = auth.verify(self.token, sent, reply.json())
        except (AuthError, ValueError) as exc:
            raise RequestFailed(f"worker {url} did not prove it holds the cluster token: "
                                f"{exc}") from None
        self._incarnations[url] = incarnation
        return incarnation

    async def reserve(self, decode_url: str, request_id: str, num_tokens: int) -> PushPlan:
        """Room for `request_id`'s prompt KV on the decode worker at `decode_url`: where to
        push it, and by when (the reservation's ttl, counted from before it was asked for,
        so before the decode worker's deadline). RequestFailed when there is none."""
        msg = ReserveRequest(request_id=request_id, num_tokens=num_tokens)
        asked = time.monotonic()
        try:
            reply = await self.post(decode_url, "/kv/reserve", msg)
        except httpx.HTTPError as exc:
            raise RequestFailed(f"decode worker {decode_url} unreachable: "
                                f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code != 200:
            raise RequestFailed(f"decode worker {decode_url} refused to reserve KV for "
                                f"{num_tokens} tokens: {reply.status_code} {reply.text[:300]}")
        try:
            got = parse(ReserveReply, reply.json(), "/kv/reserve reply")
        except ValueError as exc:  # InvalidArgument, or a body that is not JSON
            raise RequestFailed(f"decode worker {decode_url}: {exc}") from None
        if not got.ok:
            raise RequestFailed(f"decode worker {decode_url} refused to reserve KV for "
                                f"{num_tokens} tokens: {reply.text[:300]}")
        return PushPlan(got.segment, list(got.regions),
                        asked + got.ttl_s if got.ttl_s > 0 else math.inf)

    async def abort_quietly(self, url: str, request_id: str) -> None:
        """Ask the worker at `url` to drop `request_id`; best effort."""
        try:
            await self.post(url, "/abort", AbortRequest(request_id=request_id))
        except (httpx.HTTPError, RequestFailed):
            pass
