"""A worker's calls to another worker (push mode: /kv/reserve, /abort), authenticated as the
proxy's are (engine/worker/auth.py): the peer proves it holds the cluster token before it is
sent anything, and each call is signed for the incarnation that proved itself; the token never
goes on the wire. A peer that answers 401 (it restarted, or another listener took its port) is
challenged again once before the call is retried."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from pydantic import BaseModel

from kvpool.engine.worker import auth
from kvpool.engine.worker.auth import CHALLENGE_PATH
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
