"""A kvpool worker behind vLLM's OpenAI server endpoints (`kvpool worker --api vllm`): the same
engine (torch or emulated), scheduler, pool connector and outputs, spoken to as a vLLM, so the
proxy's vllm backend runs against real processes, and at scale without GPUs.

    GET  /health            200 once the engine is up
    GET  /v1/models         the served name and max_model_len
    GET  /metrics           vllm:num_requests_running, vllm:num_requests_waiting,
                            vllm:kv_cache_usage_perc, vllm:cache_config_info (block_size,
                            num_gpu_blocks, prefix_caching_hash_algo)
    POST /v1/completions    prompt as token ids; stream or not; token_ids and usage (with
                            prompt_tokens_details.cached_tokens) in the reply, logprobs keyed
                            token_id:N; kv_transfer_params in and out
    GET  /info              not vLLM's: the kvpool worker's facts (engine identity), for tests
                            and benches that compute the expected outputs
    GET  /query, POST /kvpool/mooncake/pull
                            vLLM's MooncakeConnector protocol (a shared transfer_id), as
                            engine/worker/vllm_p2p.py emulates it

P/D as vLLM does it over a KV store connector (MooncakeStoreConnector): a request with
`kv_transfer_params.do_remote_decode` is a prefill leg (its full blocks go to the pool, one
token comes back, with kv_transfer_params naming the request for the decode instance); a
request with `do_remote_prefill` loads the prompt's blocks from the pool, computes the rest and
makes every output token, the first included (on the emulated engine, the rest of its prompt
is priced as a decode joining the batch, `Sequence.joins_prefilled`: vLLM's connector loads the
blocks beside the engine's steps, and the rest is a short chunk in a running batch, not a new
prefill with its fixed cost). What a real vLLM does differently: its NIXL
connector pulls the blocks from the prefill instance's GPU instead of the pool; the fields
relayed are the same. A prefill leg whose kv_transfer_params carry a `transfer_id` is one of
vLLM's MooncakeConnector instead: it returns no kv_transfer_params and holds the transfer for
the decode leg that names it (engine/worker/vllm_p2p.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from kvpool.engine.config import SamplingParams
from kvpool.engine.core import StepOutput
from kvpool.engine.sequence import TokenLogprob
from kvpool.engine.worker.messages import (
    GenerateRequest,
    InfoReply,
    KVTransfer,
    PrefillRequest,
)
from kvpool.engine.worker.runtime import Worker
from kvpool.engine.worker.vllm_names import VllmBlockNames
from kvpool.engine.worker.vllm_p2p import PULL_PATH, HeldTransfers, bootstrap_query, pull
from kvpool.errors import KvpoolError, RequestFailed
from kvpool.metadata.http_serving import bearer_matches

NAMES_HELD = 65536
"""The fewest block names the face keeps (engine/worker/vllm_names.py)."""


class CompletionBody(BaseModel):
    """The /v1/completions fields this face serves (others are ignored, as vLLM warns)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: list[int]
    max_tokens: int = 16
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = {}
    logprobs: int | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(0, self.top_k), seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()},
            logprobs=self.logprobs, cache_salt=self.cache_salt)


def vllm_error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None,
                         "code": status}, status_code=status)


def metrics_text(worker: Worker, model: str, running: int, waiting: int, free: int,
                 hash_algo: str) -> str:
    c = worker.engine.config
    usage = 1.0 - free / c.kv_capacity_tokens if c.kv_capacity_tokens else 0.0
    labels = f'engine="0",model_name="{model}"'
    info = (f'block_size="{c.block_size}",engine="0",num_gpu_blocks="{c.num_blocks}",'
            f'enable_prefix_caching="{c.enable_prefix_caching}",'
            f'prefix_caching_hash_algo="{hash_algo}"')
    return "".join((
        "# TYPE vllm:num_requests_running gauge\n",
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n",
        "# TYPE vllm:num_requests_waiting gauge\n",
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n",
        "# TYPE vllm:kv_cache_usage_perc gauge\n",
        f"vllm:kv_cache_usage_perc{{{labels}}} {usage}\n",
        "# TYPE vllm:cache_config_info gauge\n",
        f"vllm:cache_config_info{{{info}}} 1.0\n"))


def _logprobs(lps: list[TokenLogprob | None]) -> dict[str, Any] | None:
    if not lps or any(lp is None for lp in lps):
        return None
    return {"tokens": [f"token_id:{lp.token_id}" for lp in lps if lp],
            "token_logprobs": [lp.logprob for lp in lps if lp],
            "top_logprobs": [{f"token_id:{t}": v for t, v in lp.top} for lp in lps if lp],
            "text_offset": [0] * len(lps)}


def _choice(tokens: list[int], lps: list[TokenLogprob | None],
            finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": "", "token_ids": tokens, "logprobs": _logprobs(lps),
            "finish_reason": finish, "stop_reason": None}


def _usage(num_prompt: int, num_out: int, num_cached: int) -> dict[str, Any]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out,
            "total_tokens": num_prompt + num_out,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


class _Completion:
    """One /v1/completions request on the worker, as vLLM would answer it."""

    def __init__(self, worker: Worker, body: CompletionBody, request_id: str) -> None:
        self.worker, self.body, self.request_id = worker, body, request_id
        self.head = {"id": f"cmpl-{request_id}", "object": "text_completion",
                     "created": int(time.time()), "model": body.model}
        kv = body.kv_transfer_params or {}
        self.mode: Literal["prefill", "generate"] = \
            "prefill" if kv.get("do_remote_decode") else "generate"

    async def prefill(self) -> dict[str, Any]:
        """The prefill leg: blocks to the pool, one token, the handoff for the decode."""
        w, b = self.worker, self.body
        reply = await w.prefill(PrefillRequest(
            request_id=self.request_id, prompt_token_ids=b.prompt, sampling=b.sampling(),
            kv_transfer=KVTransfer(mode="pool")))
        await w.abort(self.request_id)  # the decode leg computes its last block itself
        handoff = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_engine_id": w.epoch, "remote_request_id": self.request_id,
                   "remote_block_ids": [], "remote_host": w.config.host,
                   "remote_port": w.config.port, "tp_size": 1}
        cached = reply.num_cached_tokens + reply.num_pool_tokens
        return {**self.head, "choices": [_choice([reply.first_token_id],
                                                 [reply.first_logprob], "length")],
                "usage": _usage(len(b.prompt), 1, cached), "kv_transfer_params": handoff}

    def outputs(self) -> AsyncIterator[StepOutput]:
        b = self.body
        joins = bool((b.kv_transfer_params or {}).get("do_remote_prefill"))
        return _each(self.worker.generate(GenerateRequest(
            request_id=self.request_id, prompt_token_ids=b.prompt, sampling=b.sampling(),
            kv_source="none", joins_prefilled=joins)))

    async def whole(self) -> dict[str, Any]:
        tokens: list[int] = []
        lps: list[TokenLogprob | None] = []
        async for out in self.outputs():
            if out.token_id is not None:
                tokens.append(out.token_id)
                lps.append(out.logprob)
            if out.finish_reason is not None:
                cached = _cached(out)
                return {**self.head, "choices": [_choice(tokens, lps, out.finish_reason)],
                        "usage": _usage(len(self.body.prompt), len(tokens), cached),
                        "kv_transfer_params": None}
        raise KvpoolError(f"request {self.request_id} ended without finishing")

    async def stream(self, outputs: AsyncIterator[StepOutput]) -> AsyncIterator[bytes]:
        """`outputs` (made before the reply starts, so that a bad request is a 400) as SSE."""
        num_out = 0
        try:
            async for out in outputs:
                if out.token_id is not None:
                    num_out += 1
                    yield _sse({**self.head, "choices": [
                        _choice([out.token_id], [out.logprob], None)]})
                if out.finish_reason is not None:
                    yield _sse({**self.head, "choices": [_choice([], [], out.finish_reason)]})
                    yield _sse({**self.head, "choices": [],
                                "usage": _usage(len(self.body.prompt), num_out, _cached(out))})
        except KvpoolError as exc:
            yield _sse({"object": "error", "message": str(exc), "type": "InternalServerError",
                        "code": 500})
        yield b"data: [DONE]\n\n"


async def _each(steps: AsyncGenerator[list[StepOutput]]) -> AsyncIterator[StepOutput]:
    """The outputs of each step, one by one (closing `steps` however it ends: that aborts
    the request if it did not finish)."""
    async with contextlib.aclosing(steps):
        async for outs in steps:
            for out in outs:
                yield out


def _cached(out: StepOutput) -> int:
    return int(out.stats.get("num_cached_tokens", 0) + out.stats.get("num_pool_tokens", 0))


def block_names(worker: Worker, served_name: str, hash_algo: str) -> VllmBlockNames:
    """vLLM's names of the worker's blocks (its hash algorithm, PYTHONHASHSEED, block size);
    enough of them held for every request the engine can have queued."""
    cfg = worker.engine.config
    return VllmBlockNames(cfg.block_size, worker.engine.root_hash, hash_algo,  # type: ignore[arg-type]
                          os.environ.get("PYTHONHASHSEED"), served_name,
                          max(4 * cfg.num_blocks, NAMES_HELD))


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class EventSource(Protocol):
    """The face's KV-event publisher (vllm_face_events.FaceEvents)."""

    async def run(self) -> None: ...


def create_vllm_app(worker: Worker, served_name: str, events: EventSource | None = None,
                    hash_algo: str = "sha256", names: VllmBlockNames | None = None) -> FastAPI:
    """The face over `worker`, serving the model as `served_name`; with `events`, publishing
    its KV events (as --kv-events-config makes vLLM do); its blocks named as vLLM names them,
    in its events and its pool keys, by `names` (default: from `hash_algo` and PYTHONHASHSEED)."""
    names = names or block_names(worker, served_name, hash_algo)
    worker.connector.name_blocks(names.pool_key)

    held = HeldTransfers()
    peers = httpx.AsyncClient(timeout=30.0)
    app = FastAPI(title="kvpool worker (vLLM API)",
                  lifespan=_lifespan(worker, events, peers))
    _add_api_key(app, worker.config.token)
    _add_state_routes(app, worker, served_name, hash_algo)
    _add_mooncake_routes(app, worker, held)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        try:
            body = CompletionBody.model_validate(json.loads(await request.body()))
            if body.model != served_name:
                return vllm_error(404, f"The model `{body.model}` does not exist.")
            run = _Completion(worker, body, request.headers.get("x-request-id")
                              or uuid.uuid4().hex)
            names.learn(body.prompt, body.cache_salt)
            return await _answer(run, held, peers)
        except (ValueError, ValidationError) as exc:
            return vllm_error(400, str(exc)[:500])
        except RequestFailed as exc:
            return vllm_error(500, str(exc))
        except KvpoolError as exc:
            return vllm_error(400, str(exc))

    return app


def _lifespan(worker: Worker, events: EventSource | None,
              peers: httpx.AsyncClient) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Runs `events` while the app serves; then closes `peers` and the worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(events.run()) if events else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await peers.aclose()
            await worker.close()

    return lifespan


def _add_api_key(app: FastAPI, token: str | None) -> None:
    @app.middleware("http")
    async def api_key(request: Request, call_next: Any) -> Response:
        """As vLLM's --api-key: the /v1 routes need the bearer (here the worker's token)."""
        if token and request.url.path.startswith("/v1") and \
                not bearer_matches(request.headers.get("authorization"), token):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)  # type: ignore[no-any-return]


def _add_state_routes(app: FastAPI, worker: Worker, served_name: str, hash_algo: str) -> None:
    """/health, /v1/models, /info and /metrics."""
    max_len = worker.engine.config.max_model_len

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served_name, "object": "model", "created": 0, "owned_by": "vllm",
            "root": worker.config.model_dir, "parent": None, "max_model_len": max_len}]}

    @app.get("/info")
    async def info() -> InfoReply:
        return worker.info()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        # from the current event number on: no list of every cached block per scrape
        load = await worker.load(worker.epoch, worker.engine.blocks.num_events)
        return PlainTextResponse(metrics_text(worker, served_name, load.num_running,
                                              load.num_waiting, load.free_kv_tokens, hash_algo))


def _add_mooncake_routes(app: FastAPI, worker: Worker, held: HeldTransfers) -> None:
    """The prefill side of vLLM's MooncakeConnector (engine/worker/vllm_p2p.py)."""

    @app.get("/query")
    async def query() -> dict[str, Any]:
        return bootstrap_query(worker.epoch, f"{worker.config.host}:{worker.config.port}")

    @app.post(PULL_PATH, response_model=None)
    async def mooncake_pull(request: Request) -> Response:
        body = json.loads(await request.body())
        num = held.take(str(body.get("transfer_id"))) if body.get("engine_id") == worker.epoch \
            else None
        if num is None:
            return JSONResponse({"error": "no such transfer"}, status_code=404)
        return JSONResponse({"num_tokens": num})


async def _answer(run: _Completion, held: HeldTransfers, peers: httpx.AsyncClient) -> Response:
    """`run`'s reply: a prefill leg (held for the decode leg that pulls it, when it names a
    transfer), or the outputs, streamed or whole (after pulling a named transfer)."""
    body = run.body
    kv = body.kv_transfer_params or {}
    if run.mode == "prefill":
        reply = await run.prefill()
        if kv.get("transfer_id"):  # vLLM's MooncakeConnector: the decode leg pulls
            held.hold(str(kv["transfer_id"]), len(body.prompt))
            reply["kv_transfer_params"] = None
        return JSONResponse(reply)
    if kv.get("do_remote_prefill") and "transfer_id" in kv:
        await pull(peers, kv)
    if body.stream:
        return StreamingResponse(run.stream(run.outputs()), media_type="text/event-stream")
    return JSONResponse(await run.whole())
