"""The proxy's FastAPI app: OpenAI-compatible endpoints over the dispatcher.

    POST /v1/completions, /v1/chat/completions   (stream or not)
    GET  /v1/models, /health, /metrics
    GET  /stats/samples   measured prefill and decode times, the cluster's shape and settings
    POST /workers/register {"url": "http://H:P"}

A request is parsed and checked (4xx), scheduled (429/503), then run; a failure before the
first token is a 502 JSON error, after it an SSE error event followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool import __version__
from kvpool.clock import Clock, MonotonicClock
from kvpool.conductor import load_cost_model
from kvpool.conductor.cost import CostModel
from kvpool.engine.gguf_checkpoint import served_name
from kvpool.engine.worker.messages import SseSpec
from kvpool.errors import WorkerCallError
from kvpool.log import get_logger
from kvpool.loop_poll import LoopPoller
from kvpool.metadata.http_front import EventStream
from kvpool.metadata.http_serving import bearer_matches
from kvpool.serve import access
from kvpool.serve.access import Access
from kvpool.serve.auth import TENANT_KEY, ApiKeyGate
from kvpool.serve.backends import create_backend
from kvpool.serve.cancel import cancel_and_wait, close_all
from kvpool.serve.cluster import DECODE_ROLES, PREFILL_ROLES, LiveCluster, WorkerState
from kvpool.serve.config import ProxyConfig
from kvpool.serve.dispatch import Dispatcher
from kvpool.serve.errors import (
    ApiError,
    bad_request,
    model_not_found,
    not_found,
    unauthorized,
    worker_failed,
)
from kvpool.serve.front import front_door
from kvpool.serve.metrics import ProxyMetrics
from kvpool.serve.peer_link import PeerLink
from kvpool.serve.poller import Poller
from kvpool.serve.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvpool.serve.requests import PreparedRequest, parse_body, prepare
from kvpool.serve.responses import (
    Choice,
    ChoiceRelay,
    full_body,
    relayable,
    sse_stream,
    usage_of,
)
from kvpool.serve.route import route_headers, route_note
from kvpool.serve.run import Run
from kvpool.serve.scoring import scored_body, scored_events
from kvpool.serve.text import TextStream
from kvpool.serve.tokenize import detokenize, tokenize
from kvpool.serve.tokenizer import ModelTokenizer

log = get_logger("serve.app")
LOOP_POLL_MAX_IN_FLIGHT = 4
"""The loop polls (config.loop_poll_us) only while at most this many requests are in flight:
with more, their events keep it awake, and polling through the short gaps between them cost
CPU per relayed token (docs/serve.md, "Polling the loop")."""
M = TypeVar("M", bound=BaseModel)


class Proxy:
    """Everything one proxy process holds; built before the event loop, started in lifespan."""

    def __init__(self, config: ProxyConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        access.enable(config.access_log)
        self.model_name = config.model_name or served_name(Path(config.model_dir))
        self.tokenizer = ModelTokenizer(config.model_dir, config.prompt_cache_bytes)
        self.context_len = _config_context_len(Path(config.model_dir))
        cost = load_cost_model(config.cost_path) if config.cost_path else CostModel()
        self.cluster = LiveCluster(cost, self.clock, config.dead_after_failures,
                                   config.silent_dead_s)
        self.client = create_backend(config)
        self.metrics = ProxyMetrics()
        self.metrics.watch(self.cluster, config.restart_counts_path, self.client)
        self.dispatcher = Dispatcher(config, self.cluster, self.client, cost, self.clock,
                                     self.metrics)
        self.metrics.watch_cost(self.dispatcher.cost_in_use)
        self.poller = Poller(self.cluster, self.client, config.poll_interval_s)
        self.loop_poll = LoopPoller(config.loop_poll_us, self.cluster, LOOP_POLL_MAX_IN_FLIGHT)
        self.metrics.watch_loop_poll(self.loop_poll)
        if self.tokenizer.cache is not None:
            self.metrics.watch_tokenizer(self.tokenizer.cache)
        self.client.streams.on_lines = self.loop_poll.kick
        self.peers = (PeerLink.attach(self.cluster, Path(config.peer_dir), config.peer_index,
                                      config.num_peers, self.clock)
                      if config.peer_dir else None)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        c = self.config
        for url in (*c.prefill_urls, *c.decode_urls, *c.colocated_urls):
            self.poller.watch(url)
        self.loop_poll.start()
        if self.peers is not None:
            self.peers.start()
        try:
            yield
        finally:
            if self.peers is not None:
                await self.peers.stop()
            await self.loop_poll.stop()
            await self.poller.stop()
            await self.client.aclose()

    @property
    def max_model_len(self) -> int:
        """The smaller of the model's positions (config.json) and the workers' limit."""
        return min(self.cluster.max_model_len or self.context_len, self.context_len)

    async def serve(self, request: Request, kind: str) -> Response:
        self.loop_poll.kick()
        arrival_s, received_t = time.perf_counter(), time.monotonic()
        endpoint = "completions" if kind == "completion" else "chat"
        acc = Access("POST", request.scope["path"], arrival_s)  # request.url: a URL object, 6 us
        try:
            parsed = await parse_body(request, CompletionRequest if kind == "completion" else ChatRequest,
                                  self.config.max_body_bytes)
            tenant = request.scope.get("state", {}).get(TENANT_KEY)  # request.state: raises
            prep = await _prepared(request, parsed, kind, self, tenant)
            acc.prompt_tokens = sum(len(p) for p in prep.prompts)  # a refusal's line too
            choices = await self._start(prep, received_t)
            acc.ttft_s = time.perf_counter() - arrival_s
            self.metrics.ttft.observe(acc.ttft_s)
        except WorkerCallError as exc:
            return self._error(endpoint, worker_failed(str(exc), exc.status), acc)
        except StopAsyncIteration:
            return self._error(endpoint, worker_failed("the worker produced no token"), acc)
        except ApiError as exc:
            return self._error(endpoint, exc, acc)
        self.metrics.requests.labels(endpoint, "200").inc()
        if prep.score_only:
            return await self._scored(prep, choices, acc)
        if prep.stream:
            relay = choices[0].run.relay_chunk
            return EventStream(sse_stream(self, prep, choices, acc),
                               self._on_close(acc, prep, choices),
                               coalesce=self._coalesce(choices),
                               on_writer=relay.attach if isinstance(relay, ChoiceRelay) else None,
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"}
                               | route_headers(choices[0].run))
        return await self._collect(endpoint, prep, choices, acc, request)

    async def _scored(self, prep: PreparedRequest, choices: list[Choice],
                      acc: Access) -> Response:
        """echo with max_tokens 0: the prompt scored, no completion (kvpool.serve.scoring)."""
        headers = route_headers(choices[0].run)
        if prep.stream:
            return EventStream(scored_events(self, prep, choices),
                               self._on_close(acc, prep, choices), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"} | headers)
        body = await scored_body(self, prep, choices)
        self._account(acc, prep, choices)
        return JSONResponse(body, headers=headers)

    def _on_close(self, acc: Access, prep: PreparedRequest,
                  choices: list[Choice]) -> Callable[[bool], None]:
        """The access line of a stream, however it ends (a client that goes away is one line
        too, not a traceback)."""
        def close(client_gone: bool) -> None:
            if client_gone:
                acc.note = acc.note or "client gone"
            self._account(acc, prep, choices)
        return close

    def _account(self, acc: Access, prep: PreparedRequest, choices: list[Choice]) -> None:
        use = usage_of(prep, choices)
        acc.prompt_tokens, acc.output_tokens = use["prompt_tokens"], use["completion_tokens"]
        acc.cached_tokens = use["prompt_tokens_details"]["cached_tokens"]
        acc.route = route_note(choices[0].run) if choices else ""
        acc.done(time.perf_counter())

    def _worker_sse(self, prep: PreparedRequest, index: int,
                    decode: WorkerState) -> SseSpec | None:
        """--worker-sse: the decoding worker makes the text chunks of a streamed choice
        without logprobs, echo or trace, where it says it can (kvpool workers, InfoReply
        .sse_text); None: the proxy makes them."""
        if not (self.config.worker_sse and self.client.name == "kvpool" and prep.stream) or \
                prep.logprobs is not None or prep.echo or prep.trace or prep.score_only or \
                not decode.makes_text:
            return None
        return SseSpec(kind=prep.kind, id=prep.request_id, model=self.model_name, index=index,
                       stop=prep.stop)

    def _whole(self, prep: PreparedRequest) -> bool:
        """Whether a request's decode legs go in frames of `whole_interval` tokens: its
        response is one body (nobody reads its tokens before the end), no stop string ends it
        early (the worker would go on to the frame's end), no trace stamps its tokens."""
        return (self.config.whole_interval > 0 and not prep.stream and not prep.stop
                and not prep.trace)

    def _coalesce(self, choices: list[Choice]) -> bool:
        """Whether a stream's chunks go through an outbox, written together: not for one
        choice whose frames are merged upstream (a chunk per read already; the outbox's task
        switch would be all it adds)."""
        return len(choices) > 1 or not self.config.merge_frames

    async def _start(self, prep: PreparedRequest, received_t: float) -> list[Choice]:
        """Schedule every choice, then wait for each one's first token (a failure of any ends
        them all and is raised)."""
        runs: list[Run] = []
        try:
            for job in prep.jobs:
                refused = self.client.unsupported(job.sampling)
                if refused is not None:
                    raise bad_request(f"'{refused}' is not served by the {self.client.name} "
                                      f"engines behind this proxy", param=refused)
                decide_t = time.perf_counter()
                booking = self.dispatcher.schedule(job.prompt_ids, job.sampling.max_tokens,
                                                   job.sampling.cache_salt)
                rid = prep.request_id if len(prep.jobs) == 1 else f"{prep.request_id}-{job.index}"
                run = Run(self.dispatcher, booking, rid, job.prompt_ids, job.sampling)
                run.received_t, run.decision_s = received_t, time.perf_counter() - decide_t
                run.sse = self._worker_sse(prep, job.index, booking.decode)
                if self._whole(prep):
                    run.stream_interval = self.config.whole_interval
                self.metrics.decision.observe(run.decision_s)
                runs.append(run)
        except BaseException:
            for r in runs:
                r.discard()
            raise
        relay = self._relay(prep, runs)
        streams = [r.chunks() for r in runs]
        firsts = await _firsts(streams)
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            await close_all(*streams)
            raise failure
        choices = [Choice(job, run, first, s,  # type: ignore[arg-type]  # no failure here
                          TextStream(self.tokenizer.decode, prep.stop, self.tokenizer.byte_pieces))
                   for job, run, first, s in zip(prep.jobs, runs, firsts, streams, strict=True)]
        if relay is not None:
            relay.choice = choices[0]
        return choices

    def _relay(self, prep: PreparedRequest, runs: list[Run]) -> ChoiceRelay | None:
        """The one streamed choice's relay in the read callback (config.read_relay), set on
        its run before its legs start; None where its chunks all go through the generators."""
        if not (self.config.read_relay and self.config.merge_frames
                and relayable(prep, len(runs))):
            return None
        relay = runs[0].relay_chunk = ChoiceRelay(self.metrics)
        return relay

    async def _collect(self, endpoint: str, prep: PreparedRequest, choices: list[Choice],
                       acc: Access, request: Request) -> Response:
        """The whole body; a client that goes away meanwhile ends the choices (and their
        work on the workers) at once instead of after the last token."""
        body = asyncio.ensure_future(full_body(self, prep, choices))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not body.done():
                acc.note = "client gone"
                await cancel_and_wait(body)
            await cancel_and_wait(gone)
        if body.cancelled():
            self._account(acc, prep, choices)
            return Response(status_code=499)  # nobody reads it
        failure = body.exception()
        if isinstance(failure, WorkerCallError):
            return self._error(endpoint, worker_failed(str(failure)), acc)
        if failure is not None:
            raise failure
        self._account(acc, prep, choices)
        return JSONResponse(body.result(), headers=route_headers(choices[0].run))

    def _error(self, endpoint: str, exc: ApiError, acc: Access | None = None) -> JSONResponse:
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        if acc is not None:
            acc.status = exc.status
            acc.note = " ".join(filter(None, (exc.code or exc.type, exc.log_note)))
            acc.done(time.perf_counter())
        return _json_error(exc)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "kvpool",
            "max_model_len": self.max_model_len}]}

    def authorized(self, request: Request) -> bool:
        """Whether `request` may use the admin endpoints: it carries the cluster's bearer
        token, when there is one."""
        token = self.config.token
        return not token or bearer_matches(request.headers.get("authorization"), token)

    def health(self, detailed: bool) -> JSONResponse:
        """Healthy or not; the counts and worker URLs only for a caller with the cluster
        token (the probe is open, the cluster's layout is not)."""
        num_p = len(self.cluster.alive(PREFILL_ROLES))
        num_d = len(self.cluster.alive(DECODE_ROLES))
        ok = num_p > 0 and num_d > 0
        body: dict[str, Any] = {"ok": ok}
        if detailed:
            body |= {"prefill": num_p, "decode": num_d,
                     "workers": {w.url: {"role": w.role, "alive": w.alive}
                                 for w in self.cluster.workers.values()}}
        return JSONResponse(body, status_code=200 if ok else 503)

    def samples(self) -> dict[str, Any]:
        """What `kvpool bench serve` needs to simulate this proxy's cluster: the measured
        samples, the workers in rotation by role, the conductor's settings and cost model."""
        cfg, ref = self.config, self.cluster.reference
        roles = [w.role for w in self.cluster.workers.values() if w.alive]
        caps = [d.kv_capacity_tokens for d in self.cluster.view.decode]
        return {**self.dispatcher.measured.to_json(),
                "num_prefill_workers": roles.count("prefill"),
                "num_decode_workers": roles.count("decode"),
                "num_colocated_workers": roles.count("both"),
                "block_size": ref.block_size if ref else None,
                "model_hash": ref.model_hash if ref else None,
                "kv_capacity_tokens": min(caps) if caps else None,
                "prefill_policy": cfg.prefill_policy, "admission": cfg.admission,
                "ttft_slo_s": cfg.ttft_slo_s, "tbt_slo_s": cfg.tbt_slo_s,
                "decode_horizon_s": cfg.decode_horizon_s,
                "cost": self.dispatcher.cost.to_dict()}


async def _firsts(streams: list[AsyncGenerator[list[int]]]) -> list[Any]:
    """Each stream's first chunk, or what it raised; one stream awaited in place (most
    requests: no task for it)."""
    if len(streams) == 1:
        try:
            return [await anext(streams[0])]
        except Exception as exc:  # noqa: BLE001 - returned, as gather's return_exceptions does
            return [exc]
    return await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)


INLINE_PREPARE_BYTES = 8192
"""A request body up to this size is tokenized on the event loop: the hop to a thread cost
more than tokenizing its prompt (docs/serve.md, "The proxy's own cost")."""


async def _prepared(request: Request, parsed: BaseModel, kind: str, proxy: Proxy,
                    tenant: str | None) -> PreparedRequest:
    """`prepare`, off the event loop for a big request (tokenizing it, rendering its chat
    template, would stall the other streams), inline for a small one."""
    if _small(request):
        return prepare(parsed, kind, proxy, tenant)  # type: ignore[arg-type]
    return await asyncio.to_thread(prepare, parsed, kind, proxy,  # type: ignore[arg-type]
                                   tenant)


def _small(request: Request) -> bool:
    """Whether the request's body is small enough to work on inline (INLINE_PREPARE_BYTES)."""
    size = request.headers.get("content-length", "")
    return size.isdigit() and int(size) <= INLINE_PREPARE_BYTES


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the body was read already, so the
    next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _config_context_len(folder: Path) -> int:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 2048
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


def _vllm_routes(app: FastAPI, proxy: Proxy) -> None:
    """Where vLLM's server answers and tools look: one model, the version, the tokenizer;
    every unknown route is an OpenAI-shaped error."""
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != proxy.model_name:
            return _json_error(model_not_found(model_id, proxy.model_name))
        return JSONResponse(proxy.models()["data"][0])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    async def answer(request: Request, model: type[M],
                     fn: Callable[[Proxy, M], dict[str, Any]]) -> JSONResponse:
        """`fn` on the parsed body: inline for a small one, in a thread for a big one (as
        a completion is prepared, `_prepared`: tokenizing megabytes stalls every stream)."""
        try:
            parsed = await parse_body(request, model, proxy.config.max_body_bytes)
            return JSONResponse(fn(proxy, parsed) if _small(request)
                                else await asyncio.to_thread(fn, proxy, parsed))
        except ApiError as exc:
            return _json_error(exc)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return await answer(request, TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return await answer(request, DetokenizeRequest, detokenize)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):
            return _json_error(not_found(request.method, request.url.path, exc.status_code))
        return _json_error(ApiError(exc.status_code, str(exc.detail)))


def _json_error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(config: ProxyConfig, clock: Clock | None = None) -> ApiKeyGate:
    """The proxy's ASGI app: the API-key gate, then the completion endpoints
    (`front.front_door`), then FastAPI's routes for the rest (and the lifespan)."""
    proxy = Proxy(config, clock)
    app = FastAPI(title="kvpool proxy", lifespan=proxy.lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")  # front_door answers these; here for 405s (GET) and the docs
    async def completions(request: Request) -> Response:
        return await proxy.serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.serve(request, "chat")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return proxy.models()

    _vllm_routes(app, proxy)

    _admin_routes(app, proxy)

    return ApiKeyGate(front_door(app, proxy.serve), keys=config.api_keys,
                      salt_per_api_key=config.salt_per_api_key)


def _admin_routes(app: FastAPI, proxy: Proxy) -> None:
    """/health, /metrics, /stats/samples and /workers/register."""

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        return proxy.health(proxy.authorized(request))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not proxy.authorized(request):
            return _json_error(unauthorized())
        return Response(proxy.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/stats/samples")
    async def samples(request: Request) -> JSONResponse:
        if not proxy.authorized(request):
            return _json_error(unauthorized())
        return JSONResponse(proxy.samples())

    @app.post("/workers/register")
    async def register_worker(request: Request) -> JSONResponse:
        if not proxy.authorized(request):  # an impostor would get the token and the prompts
            return _json_error(unauthorized())
        try:
            obj = json.loads(await request.body())
            url = str(obj["url"])
        except (ValueError, KeyError, TypeError):
            return _json_error(bad_request('body must be {"url": "http://host:port"}'))
        if not url.startswith(("http://", "https://")):
            return _json_error(bad_request(f"not an http URL: {url!r}"))
        if (why := proxy.client.refused_instance(url)) is not None:
            return _json_error(bad_request(f"{url!r} not registered: {why}"))
        proxy.poller.watch(url)
        return JSONResponse({"ok": True, "url": url.rstrip("/")})
