"""The `kvpool` engine backend (serve/backend.py): HTTP calls from the proxy to one of kvpool's
workers (docs/worker-api.md), over one shared `httpx.AsyncClient`, in the worker API's typed
messages (engine.worker.messages). Every failure is raised as `WorkerCallError` naming the
worker and the call (a reply that does not parse included); an abort is best-effort and never
raises."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeVar

import httpx

from kvpool.engine.blocks import prefix_block_hashes, salted_root
from kvpool.engine.config import SamplingParams
from kvpool.engine.worker import auth
from kvpool.engine.worker.auth import CHALLENGE_PATH
from kvpool.engine.worker.messages import (
    AbortRequest,
    FinishLine,
    Frame,
    GenerateRequest,
    InfoReply,
    LoadReply,
    PlainFrame,
    PrefillReply,
    PrefillRequest,
    plain_prefix,
    read_frames,
    reply_from,
)
from kvpool.errors import AuthError, WorkerCallError
from kvpool.log import get_logger
from kvpool.metadata.http_serving import CLIENT_KEEPALIVE_S
from kvpool.serve.backend import BackendFeatures, EnginePrefixes, FrameRelay, read_relay
from kvpool.serve.ndjson_reply import ReplyError
from kvpool.serve.worker_stream import StreamPool, call_whole

log = get_logger("serve.worker_client")
M = TypeVar("M", InfoReply, LoadReply, PrefillReply)
CONNECT_S = 5.0
"""Connecting to a worker (its calls' own time is the client's timeout)."""


def _error_text(status: int, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return f"HTTP {status}: {body[:200]!r}"


class WorkerClient:
    """With a token, every call but the challenge goes only to workers that proved they hold
    it (`prove`; engine/worker/auth.py): an impostor's URL gets neither token nor prompt."""

    name = "kvpool"
    features = BackendFeatures(migration=True, push=True, logprobs=True, prompt_logprobs=True,
                               first_token_from_prefill=True)

    def __init__(self, timeout_s: float, token: str | None = None,
                 now: Callable[[], float] = time.time, merge_frames: bool = True) -> None:
        self.token, self.now, self.timeout_s = token, now, timeout_s
        self.merge_frames = merge_frames
        """The plain frames one read of a stream brings are one frame (`read_frames`)."""
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=CLIENT_KEEPALIVE_S))
        self.streams = StreamPool(CLIENT_KEEPALIVE_S)
        """Kept-alive connections for /generate (serve/worker_stream.py)."""
        self._proven: dict[str, str] = {}
        """url -> the incarnation that proved itself there (every call is signed for it)."""

    async def aclose(self) -> None:
        self.streams.close()
        await self.http.aclose()

    async def prove(self, url: str, timeout_s: float) -> None:
        """Challenge the worker at `url` (no-op without a token); WorkerCallError (status
        403) if it cannot prove it holds the token. Until it has, nothing else is sent."""
        self._proven.pop(url, None)
        if self.token is None:
            return
        sent = auth.challenge(url)
        try:
            resp = await self.http.post(url + CHALLENGE_PATH, json=sent, timeout=timeout_s)
            if resp.status_code != 200:
                raise WorkerCallError(url, CHALLENGE_PATH, _error_text(resp.status_code,
                                                                       resp.content),
                                      resp.status_code)
            incarnation = auth.verify(self.token, sent, resp.json())
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, CHALLENGE_PATH, repr(exc)) from None
        except (AuthError, ValueError) as exc:
            raise WorkerCallError(url, CHALLENGE_PATH, f"not admitted: {exc}", 403) from None
        self._proven[url] = incarnation

    def proven(self, url: str) -> bool:
        return self.token is None or url in self._proven

    def _headers(self, url: str, path: str, body: bytes = b"",
                 method: str = "POST") -> dict[str, str]:
        """The call's headers: JSON, and (with a token) the call signed with it, for a worker
        that proved it holds it (the token itself never goes out; engine/worker/auth.py)."""
        if not self.proven(url):
            raise WorkerCallError(url, path, "the worker has not (or not since its last "
                                  "connection failure) proven it holds the cluster token")
        headers = dict(JSON)
        if self.token is not None:
            headers["Authorization"] = auth.sign(self.token, method, url, path, body,
                                                 self.now(), incarnation=self._proven[url])
        return headers

    def _failed(self, url: str, path: str, exc: Exception) -> WorkerCallError:
        """A transport failure: whatever answers at `url` next must prove itself again (a
        listener that took over a dead worker's port would otherwise get the token). Not a
        timeout: no new listener answered, and a slow worker stays in rotation (a proof
        withdrawn there would fail its requests as "not proven"; serve/poller.py)."""
        if not isinstance(exc, httpx.TimeoutException | TimeoutError):
            self._proven.pop(url, None)
        return WorkerCallError(url, path, repr(exc))

    def _refused(self, url: str, path: str, status: int, content: bytes) -> WorkerCallError:
        """A worker's error reply. A 401 means it no longer takes our signature (another
        start of it, or another listener, answers there): it must prove itself again before
        anything else is sent."""
        if status == 401:
            self._proven.pop(url, None)
        return WorkerCallError(url, path, _error_text(status, content), status)

    def block_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None,
                     reference: InfoReply) -> list[int]:
        """kvpool's chain (engine/blocks.py), rooted in the workers' model identity."""
        root = salted_root(reference.model_hash, cache_salt)
        return prefix_block_hashes(prompt_ids, reference.block_size, root)

    def unsupported(self, sampling: SamplingParams) -> str | None:
        return None

    def refused_instance(self, url: str) -> str | None:
        return "a kvpool worker's URL has no fragment" if "#" in url else None

    def engine_gauges(self) -> dict[str, dict[str, float]]:
        return {}

    def prefixes(self, prefill_urls: Sequence[str]) -> EnginePrefixes | None:
        """None: the workers' cached blocks come with their /load (the view's index)."""
        return None

    async def info(self, url: str, timeout_s: float) -> InfoReply:
        return await self._get(url, "/info", InfoReply, timeout_s)

    async def load(self, url: str, path: str, timeout_s: float) -> LoadReply:
        """`path`: /load with its query (the event numbering to continue from)."""
        return await self._get(url, path, LoadReply, timeout_s)

    async def _get(self, url: str, path: str, model: type[M], timeout_s: float) -> M:
        return reply_from(url, path, model, await self._call(url, path, b"", "GET", timeout_s))

    async def _call(self, url: str, path: str, body: bytes, method: str,
                    timeout_s: float) -> bytes:
        """The body of a 200 reply to one call (`body` POSTed, or a GET), on the lean client's
        kept-alive connections (https:// workers through httpx). WorkerCallError when the
        call fails or is refused."""
        headers = self._headers(url, path, body, method=method)
        try:
            status, content = await call_whole(self.streams, self.http, url, path, headers,
                                               body, CONNECT_S, timeout_s, method)
        except (OSError, ValueError, httpx.HTTPError) as exc:  # ValueError: ReplyError, a URL
            raise self._failed(url, path, exc) from None
        if status != 200:
            raise self._refused(url, path, status, content)
        return content

    async def handoff(self, url: str, request_id: str,
                      block_hashes: Sequence[int]) -> float | None:
        """Nothing to wait for: a worker's prefill reply promises its KV is in place."""
        return None

    async def prefill(self, url: str, req: PrefillRequest) -> PrefillReply:
        body = req.model_dump_json().encode()
        return reply_from(url, "/prefill", PrefillReply,
                          await self._call(url, "/prefill", body, "POST", self.timeout_s))

    async def generate(self, url: str, req: GenerateRequest,
                       relay: FrameRelay | None = None) -> AsyncGenerator[Frame | FinishLine]:
        """The frames of /generate (those of one read merged, `merge_frames`); an error line,
        a malformed line or a broken stream raises. The finish line comes once the stream has been read to its end: its connection
        then goes back to the pool for the next call (a stream left unread is a connection
        closed, and a new one, TIME-WAIT included, for every request). http:// workers are
        read by the lean client (serve/worker_stream.py), others through httpx; with `relay`,
        the lean client hands it the plain frames that come while this generator waits, in
        the connection's read callback (`backend.read_relay`)."""
        body = req.model_dump_json().encode()
        gate = None if relay is None else _UntilFinish(relay)
        lines: AsyncGenerator[list[bytes]] | AsyncGenerator[list[str]] = \
            self._lean_lines(url, body, gate) if url.startswith("http://") \
            else self._httpx_lines(url, body)
        finish: FinishLine | None = None
        extra: bytes | str | None = None
        async with contextlib.aclosing(lines) as batches:
            try:
                async for batch in batches:
                    if finish is not None:
                        extra = batch[0]
                        break
                    frames, used, error = read_frames(url, batch, self.merge_frames)
                    for msg in frames:
                        if isinstance(msg, FinishLine):
                            finish = msg  # yielded once the stream has ended
                            if gate is not None:  # a line after it is for this loop to refuse
                                gate.finished = True
                        else:
                            yield msg
                    if error is not None:
                        raise error
                    if used < len(batch):
                        extra = batch[used]
                        break
            except WorkerCallError as exc:
                if finish is None:
                    raise
                log.debug("/generate on %s broke after its finish line: %s", url, exc)
        if extra is not None:
            raise WorkerCallError(url, "/generate", f"a line after the finish line: "
                                  f"{extra[:200]!r}")
        if finish is not None:
            yield finish

    async def _lean_lines(self, url: str, body: bytes,
                          relay: FrameRelay | None = None) -> AsyncGenerator[list[bytes]]:
        """The non-empty lines of /generate, read by the lean client: those of each read at
        once (less those `relay` took)."""
        path = "/generate"
        try:
            call = await self.streams.open(url, path, self._headers(url, path, body), body,
                                           CONNECT_S, self.timeout_s)
        except (OSError, ValueError) as exc:  # ReplyError, a URL it cannot use
            raise self._failed(url, path, exc) from None
        try:
            if call.status != 200:
                raise self._refused(url, path, call.status, await call.read_all())
            if relay is not None:
                call.relay_with(read_relay(relay, plain_prefix, self.streams.on_lines))
            while batch := await call.next_lines():
                yield batch
        except (OSError, ReplyError) as exc:
            raise self._failed(url, path, exc) from None
        finally:
            call.close()

    async def _httpx_lines(self, url: str, body: bytes) -> AsyncGenerator[list[str]]:
        """The non-empty lines of /generate, read through httpx (a list of one each)."""
        try:
            async with self.http.stream("POST", url + "/generate", content=body,
                                        headers=self._headers(url, "/generate", body)) as resp:
                if resp.status_code != 200:
                    raise self._refused(url, "/generate", resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    if line.strip():
                        yield [line]
        except httpx.HTTPError as exc:
            raise self._failed(url, "/generate", exc) from None

    async def abort(self, url: str, request_id: str) -> None:
        try:
            body = AbortRequest(request_id=request_id).model_dump_json().encode()
            await self.http.post(url + "/abort", content=body,
                                 headers=self._headers(url, "/abort", body), timeout=2.0)
        except (httpx.HTTPError, WorkerCallError) as exc:
            log.debug("abort of %s on %s failed: %r", request_id, url, exc)


class _UntilFinish:
    """A stream's FrameRelay until the reader has read the finish line itself (the relay was
    not ready for it: a slow client): what comes after the finish is the reader's to refuse, as
    it is without a relay, not a frame to relay."""

    __slots__ = ("_relay", "finished")

    def __init__(self, relay: FrameRelay) -> None:
        self._relay = relay
        self.finished = False

    def ready(self) -> bool:
        return not self.finished and self._relay.ready()

    def take(self, frame: PlainFrame) -> bool:
        return self._relay.take(frame)


JSON = {"Content-Type": "application/json"}
