"""The `vllm` engine backend (serve/backend.py): the proxy drives unmodified vLLM OpenAI servers.

    join   GET /health (200), GET /v1/models (the served model, max_model_len),
           GET /metrics (vllm: samples; block size and KV blocks from cache_config_info)
    poll   GET /metrics -> LoadReply (running, waiting, free and total KV tokens); both
           scrapes ask for the five names read (metrics_text.METRICS_PATH)
    legs   POST /v1/completions with the prompt's token ids (serve/vllm/wire.py); P/D by
           kv_transfer_params, colocated as one streamed call: the prefill leg's reply's
           kv_transfer_params relayed to the decode leg (NIXL; a store connector needs none),
           or with --kv-transfer mooncake a transfer id given to both legs and the prefill
           instance's Mooncake engine id, read from its bootstrap server when it joins
           (serve/vllm/mooncake_p2p.py)

An instance's role is the flag it was named with (--prefill, --decode, --colocated); one added
later through /workers/register is colocated. A URL that answers but is not a vLLM (no vllm:
metrics), or serves another model than the cluster's, is not admitted (InvalidArgument, which
the poller logs with the reason and keeps trying). vLLM has no abort call: closing a leg's
connection aborts it there, so `abort` has nothing left to do.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any, Protocol

import httpx

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import (
    FinishLine,
    Frame,
    GenerateRequest,
    InfoReply,
    LoadReply,
    PrefillReply,
    PrefillRequest,
    Role,
)
from kvpool.errors import ConfigError, InvalidArgument, WorkerCallError
from kvpool.log import get_logger
from kvpool.metadata.http_serving import CLIENT_KEEPALIVE_S
from kvpool.serve.backend import BackendFeatures, EnginePrefixes, FrameRelay, read_relay
from kvpool.serve.config import ProxyConfig
from kvpool.serve.ndjson_reply import ReplyError as HttpReplyError
from kvpool.serve.vllm.metrics_text import METRICS_PATH, EngineMetrics, parse_metrics
from kvpool.serve.vllm.mooncake_p2p import MooncakeP2P, new_transfer_id
from kvpool.serve.vllm.prefixes import InstancePrefixes
from kvpool.serve.vllm.ranks import Ranks
from kvpool.serve.vllm.stream import Tally, call_lines, one_by_one, stream_frames
from kvpool.serve.vllm.wire import (
    COMPLETIONS,
    PREFILL_KV_PARAMS,
    ReplyError,
    completion_body,
    read_choice,
    token_chunks,
)
from kvpool.serve.worker_client import CONNECT_S
from kvpool.serve.worker_stream import StreamPool, call_whole

log = get_logger("serve.vllm")
DEFAULT_BLOCK_SIZE = 16
"""vLLM's default --block-size on GPUs, when neither the flag nor /metrics says."""
JSON_TYPE = {"Content-Type": "application/json"}
UNKNOWN_LEN = 1 << 30
"""max_model_len of an instance whose /v1/models does not say (the model's own limit holds)."""
UNKNOWN_CAPACITY_TOKENS = 1 << 20
HANDOFF_STEP_S = 0.005
"""How often a P/D handoff through the pool looks for the prompt's blocks in the pool."""
HANDOFF_STALL_S = 0.5
"""A handoff whose blocks stopped landing in the pool this long ago goes on without the rest."""
SILENT_POOL_WAITS = 3
"""Handoff waits that found nothing of a pool that never published, after which no more are
made until it publishes (a proxy with --kv-events but no master publishing to it)."""


class EventFeed(Protocol):
    """What the backend reads of its instances' KV events (serve/vllm/events.py)."""

    def hashes(self, prompt_ids: Sequence[int], block_size: int,
               reported_algo: str | None) -> list[int]: ...

    def prefixes(self, prefill_urls: Sequence[str]) -> InstancePrefixes: ...

    def pool_blocks(self, hashes: Sequence[int]) -> int: ...

    def pool_heard(self) -> bool: ...

    def check(self, url: str) -> bool: ...

    def rejoined(self, url: str) -> None: ...

    def gauges(self, urls: Sequence[str]) -> dict[str, dict[str, float]]: ...

    def close(self) -> None: ...


def model_hash(name: str) -> int:
    """The cluster identity of instances serving `name` (64 bits of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


class VllmBackend:
    name = "vllm"
    features = BackendFeatures(migration=True, push=False, logprobs=True,
                               prompt_logprobs=False, first_token_from_prefill=False,
                               reports_pool_tokens=False)

    def __init__(self, roles: dict[str, Role], timeout_s: float, api_key: str | None = None,
                 model: str = "", block_size: int = 0, events: EventFeed | None = None,
                 p2p: MooncakeP2P | None = None, handoff_wait_s: float = 0.0) -> None:
        self.roles = {url.rstrip("/"): role for url, role in roles.items()}
        self.ranks = Ranks(self.roles)
        """The data-parallel ranks named as instances (URL#dpN): calls pinned to their rank."""
        self.model = model
        """The served model name every instance must serve ("" until the first joins)."""
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_S), headers=self._auth,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=CLIENT_KEEPALIVE_S))
        """For https:// instances; http:// ones go through `streams`."""
        self.streams = StreamPool(CLIENT_KEEPALIVE_S)
        """Kept-alive connections of the proxy's own client (serve/worker_stream.py) for the
        polls of /metrics, the prefill legs and the decode streams."""
        self.capacity: dict[str, int] = {}
        """url -> KV tokens, as read at join."""
        self.events = events
        """The instances' KV events (--kv-events), or None: no cached prefix is known."""
        self.p2p = p2p
        """vLLM's MooncakeConnector protocol (--kv-transfer mooncake), or None: the prefill
        reply's kv_transfer_params are relayed."""
        self.handoff_wait_s = handoff_wait_s
        """P/D through a store connector: how long the decode leg waits, after the prefill
        reply, for the pool to hold the prompt's full blocks (0 = it does not wait)."""
        self._silent_waits = 0

    @classmethod
    def from_config(cls, config: ProxyConfig) -> VllmBackend:
        roles: dict[str, Role] = {}
        for urls, role in ((config.prefill_urls, "prefill"), (config.decode_urls, "decode"),
                           (config.colocated_urls, "both")):
            for url in urls:
                roles[url.rstrip("/")] = role  # type: ignore[assignment]  # as __init__ keys
        ranks = Ranks(roles)  # before the events' sockets are bound: ConfigError for names
        # it cannot take
        ranked = [url for url in roles if ranks.named(url)]
        if config.kv_transfer == "mooncake" and ranked:
            raise ConfigError("--kv-transfer mooncake does not take data-parallel ranks as "
                              "instances (URL#dpN): name each server once")
        events: EventFeed | None = None
        if config.kv_events:
            from kvpool.serve.vllm.events import KvEventsFeed

            replay = {url.rstrip("/"): ep for url, ep in config.kv_events_replay}
            events = KvEventsFeed(config.kv_events, config.hash_algo, config.hash_seed, replay,
                                  config.pool_topic, memo_bytes=config.prompt_cache_bytes,
                                  ranked=ranked)
            log.info("KV events: bound %s (topic = each instance's URL; the pool's: %r)",
                     events.endpoint, config.pool_topic)
        p2p = (MooncakeP2P(dict(config.mooncake_bootstrap))
               if config.kv_transfer == "mooncake" else None)
        return cls(roles, config.worker_timeout_s, config.token, config.engine_model,
                   config.engine_block_size, events, p2p, config.pd_pool_wait_s)

    async def aclose(self) -> None:
        self.streams.close()
        await self.http.aclose()
        if self.events is not None:
            self.events.close()

    async def prove(self, url: str, timeout_s: float) -> None:
        """Nothing to prove: vLLM checks the API key it is sent (--api-key)."""

    def proven(self, url: str) -> bool:
        return True

    def unsupported(self, sampling: SamplingParams) -> str | None:
        return "prompt_logprobs" if sampling.prompt_logprobs is not None else None

    def refused_instance(self, url: str) -> str | None:
        return self.ranks.refused(url)

    def block_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None,
                     reference: InfoReply) -> list[int]:
        """vLLM's own chain, with KV events; [] without them, and for a salted request (its
        salt enters the engine's first block hash)."""
        if self.events is None or cache_salt is not None:
            return []
        return self.events.hashes(prompt_ids, reference.block_size,
                                  reference.engine.get("hash_algo"))

    def prefixes(self, prefill_urls: Sequence[str]) -> EnginePrefixes | None:
        return None if self.events is None else self.events.prefixes(prefill_urls)

    def engine_gauges(self) -> dict[str, dict[str, float]]:
        return {} if self.events is None else self.events.gauges(sorted(self.roles))

    # -- joining and polling -----------------------------------------------------------------

    async def _call(self, url: str, path: str, timeout_s: float, body: bytes = b"",
                    method: str = "GET",
                    headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """(status, body) of one call, read whole; WorkerCallError when it fails."""
        base, pin = self.ranks.target(url)
        sent = {**self._auth, **JSON_TYPE, **(headers or {}), **pin}
        try:
            return await call_whole(self.streams, self.http, base, path, sent, body, CONNECT_S,
                                    timeout_s, method)
        except (OSError, ValueError, httpx.HTTPError) as exc:  # ValueError: HttpReplyError
            raise WorkerCallError(url, path, repr(exc)) from None

    async def _get(self, url: str, path: str, timeout_s: float) -> bytes:
        status, content = await self._call(url, path, timeout_s)
        if status != 200:
            raise WorkerCallError(url, path, f"HTTP {status}: {content[:200]!r}", status)
        return content

    async def _metrics(self, url: str, timeout_s: float) -> EngineMetrics:
        text = (await self._get(url, METRICS_PATH, timeout_s)).decode("utf-8", "replace")
        engine = self.ranks.engine(url)
        found = parse_metrics(text, engine)
        if found is None and engine is not None and parse_metrics(text) is not None:
            raise InvalidArgument(f"{url}: its server's /metrics has no engine {engine}: "
                                  "not a data-parallel rank of that server")
        if found is None:
            raise InvalidArgument(f"{url}/metrics has no vllm: samples: not a vLLM server")
        return found

    async def _served(self, url: str, timeout_s: float) -> tuple[str, int]:
        raw = await self._get(url, "/v1/models", timeout_s)
        try:
            cards = [c for c in json.loads(raw)["data"] if isinstance(c, dict)]
        except (ValueError, KeyError, TypeError):
            raise InvalidArgument(f"{url}/v1/models is not an OpenAI model list: "
                                  f"{raw[:200]!r}") from None
        names = [str(c.get("id")) for c in cards]
        want = self.model or (names[0] if names else "")
        if want not in names:
            raise InvalidArgument(f"{url} serves {names or 'no model'}, the cluster "
                                  f"{want!r} (--engine-model, or the first instance to join)")
        card = cards[names.index(want)]
        return want, int(card.get("max_model_len") or UNKNOWN_LEN)

    async def info(self, url: str, timeout_s: float) -> InfoReply:
        await self._get(url, "/health", timeout_s)
        served, max_len = await self._served(url, timeout_s)
        metrics = await self._metrics(url, timeout_s)
        block_size = self.block_size or metrics.block_size or DEFAULT_BLOCK_SIZE
        capacity = metrics.kv_capacity_tokens or UNKNOWN_CAPACITY_TOKENS
        role = self.roles.get(url, "both")
        if self.p2p is not None and role != "decode":
            await self._learn_engine_id(url, timeout_s)
        self.model = self.model or served
        self.capacity[url] = capacity
        if self.events is not None:  # (re)joining: its cache may be another process's now
            self.events.rejoined(url)
        return InfoReply(role=role, model=served,
                         model_hash=model_hash(served), block_size=block_size,
                         max_model_len=max_len, kv_capacity_tokens=capacity,
                         engine={"kind": "vllm", "hash_algo": metrics.hash_algo,
                                 "reported_block_size": metrics.block_size})

    async def _learn_engine_id(self, url: str, timeout_s: float) -> None:
        """A prefill-capable instance's Mooncake engine id, from its bootstrap server."""
        assert self.p2p is not None
        bootstrap = self.p2p.bootstrap(url)
        try:
            query = json.loads(await self._get(bootstrap, "/query", timeout_s))
        except WorkerCallError as exc:
            raise InvalidArgument(f"{url}: its Mooncake bootstrap server {bootstrap} does not "
                                  f"answer ({exc}); --kv-transfer mooncake needs vLLM's "
                                  "MooncakeConnector there (--mooncake-bootstrap URL=BOOTSTRAP "
                                  "names another address)") from None
        except ValueError:
            raise InvalidArgument(f"{url}: {bootstrap}/query is not JSON") from None
        try:
            self.p2p.learn(url, query)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{url}: {exc}") from None

    async def load(self, url: str, path: str, timeout_s: float) -> LoadReply:
        m = await self._metrics(url, timeout_s)
        if self.events is not None:
            self.events.check(url)
        capacity = m.kv_capacity_tokens or self.capacity.get(url, UNKNOWN_CAPACITY_TOKENS)
        return LoadReply(num_waiting=m.num_waiting, num_running=m.num_running,
                         free_kv_tokens=int(capacity * max(0.0, 1.0 - m.kv_usage)),
                         kv_capacity_tokens=capacity)

    # -- legs --------------------------------------------------------------------------------

    def _headers(self, request_id: str) -> dict[str, str]:
        return {"X-Request-Id": request_id}

    async def prefill(self, url: str, req: PrefillRequest) -> PrefillReply:
        t0 = time.monotonic()
        transfer_id = "" if self.p2p is None else new_transfer_id()  # MooncakeConnector only
        params = (dict(PREFILL_KV_PARAMS) if self.p2p is None
                  else self.p2p.prefill_params(transfer_id))
        body = completion_body(self.model, req.prompt_token_ids, req.sampling, max_tokens=1,
                               stream=False, kv_transfer_params=params)
        body.pop("logprobs", None)
        status, content = await self._call(url, COMPLETIONS, self.timeout_s,
                                           json.dumps(body).encode(), "POST",
                                           self._headers(req.request_id))
        got = self._reply(url, status, content)
        if not got.token_ids:
            raise WorkerCallError(url, COMPLETIONS, "the prefill leg made no token")
        return PrefillReply(request_id=req.request_id, first_token_id=got.token_ids[0],
                            num_prompt_tokens=len(req.prompt_token_ids),
                            num_cached_tokens=got.num_cached_tokens or 0,
                            prefill_s=round(time.monotonic() - t0, 6),
                            kv_transfer_params=got.kv_transfer_params if self.p2p is None
                            else self.p2p.decode_params(url, transfer_id))

    async def handoff(self, url: str, request_id: str,
                      block_hashes: Sequence[int]) -> float | None:
        """Through a store connector (not --kv-transfer mooncake), wait until the pool's
        events show every block of `block_hashes` (the request's chain, as scheduled): the
        connector writes the prefill's blocks to the pool after its reply has gone out, and a
        decode leg that looked them up before they landed would compute the whole prompt
        again. It goes on anyway after handoff_wait_s, or HANDOFF_STALL_S after the last block
        that landed (the pool refused the rest: it is full). Nothing to wait for without the
        pool's events or a chain (a salted prompt has none here), or once a pool that never
        published has been waited for in vain SILENT_POOL_WAITS times. The seconds waited,
        or None where there was nothing to wait for."""
        events = self.events
        if events is None or self.p2p is not None or self.handoff_wait_s <= 0 or \
                not block_hashes:
            return None
        heard = events.pool_heard()
        if not heard and self._silent_waits >= SILENT_POOL_WAITS:
            return None
        start = last_t = time.monotonic()
        last = 0
        while (held := events.pool_blocks(block_hashes)) < len(block_hashes):
            now = time.monotonic()
            last, last_t = (held, now) if held > last else (last, last_t)
            if now - start >= self.handoff_wait_s or (held and now - last_t >= HANDOFF_STALL_S):
                log.info("request %s: the pool holds %d of its prompt's %d blocks %.2f s after "
                         "its prefill on %s; the decode leg goes on (it computes the rest)",
                         request_id, held, len(block_hashes), now - start, url)
                self._silent_waits = 0 if heard or held else self._silent_waits + 1
                return now - start
            await asyncio.sleep(HANDOFF_STEP_S)
        return time.monotonic() - start

    def _reply(self, url: str, status: int, raw: bytes) -> Any:
        try:
            obj = _json(raw)
            if status != 200:
                err = obj.get("error", obj) if isinstance(obj, dict) else obj
                message = err.get("message") if isinstance(err, dict) else err
                raise WorkerCallError(url, COMPLETIONS, f"HTTP {status}: {message}",
                                      status)
            return read_choice(obj, None)
        except ReplyError as exc:
            raise WorkerCallError(url, COMPLETIONS, str(exc),
                                  None if status == 200 else status) from None

    async def generate(self, url: str, req: GenerateRequest,
                       relay: FrameRelay | None = None) -> AsyncGenerator[Frame | FinishLine]:
        if req.first_token_id is not None:
            raise WorkerCallError(url, COMPLETIONS, "a vLLM decode leg makes every output "
                                  "token itself: no first_token_id", 400)
        body = json.dumps(self._generate_body(url, req)).encode()
        base, pin = self.ranks.target(url)
        headers = {**self._auth, **JSON_TYPE, **self._headers(req.request_id), **pin}
        if not base.startswith("http://"):
            async for line in self._httpx_generate(url, base, body, headers,
                                                   req.sampling.logprobs):
                yield line
            return
        try:
            call = await self.streams.open(base, COMPLETIONS, headers, body, CONNECT_S,
                                           self.timeout_s)
        except (OSError, ValueError) as exc:  # HttpReplyError, a URL it cannot use
            raise WorkerCallError(url, COMPLETIONS, repr(exc)) from None
        tally = Tally()
        try:
            if call.status != 200:
                self._reply(url, call.status, await call.read_all())
            if relay is not None and req.sampling.logprobs is None:
                call.relay_with(read_relay(relay, token_chunks, self.streams.on_lines,
                                           tally.add))
            async for line in stream_frames(url, call_lines(call), req.sampling.logprobs, tally):
                yield line
        except (OSError, HttpReplyError) as exc:
            raise WorkerCallError(url, COMPLETIONS, repr(exc)) from None
        finally:
            call.close()  # one not read to its end is closed: vLLM aborts the request

    async def _httpx_generate(self, url: str, base: str, body: bytes, headers: dict[str, str],
                              logprobs_k: int | None) -> AsyncGenerator[Frame | FinishLine]:
        try:
            async with self.http.stream("POST", base + COMPLETIONS, content=body,
                                        headers=headers) as resp:
                if resp.status_code != 200:
                    self._reply(url, resp.status_code, await resp.aread())
                async for line in stream_frames(url, one_by_one(resp.aiter_lines()), logprobs_k):
                    yield line
        except httpx.HTTPError as exc:
            raise WorkerCallError(url, COMPLETIONS, repr(exc)) from None

    def _generate_body(self, url: str, req: GenerateRequest) -> dict[str, Any]:
        """The decode leg's body; a resumed one (migration) sends the output the client has as
        part of the prompt, with that much less to make. vLLM counts presence and frequency
        penalties, min_tokens and a seed's positions from its own output: a resumed request
        that uses them would not go on as it started, so it is refused (400) instead."""
        s, done = req.sampling, len(req.resume_output_ids)
        if done and (s.presence_penalty or s.frequency_penalty or s.min_tokens > done
                     or (s.temperature > 0 and s.seed is not None)):
            raise WorkerCallError(url, COMPLETIONS, "this request cannot go on exactly on "
                                  "another vLLM instance (output penalties, min_tokens or a "
                                  "seed)", 400)
        if done:
            s = replace(s, min_tokens=0)
        return completion_body(self.model, [*req.prompt_token_ids, *req.resume_output_ids], s,
                               max_tokens=max(1, s.max_tokens - done), stream=True,
                               kv_transfer_params=req.kv_transfer_params)

    async def abort(self, url: str, request_id: str) -> None:
        """Nothing to send: vLLM aborts a request when its connection closes, which the
        dispatcher's leg did already."""


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise ReplyError(f"not JSON: {raw[:200]!r}") from None
