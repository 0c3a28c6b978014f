"""The worker's HTTP API (docs/worker-api.md) over a `Worker`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.loop import ShuttingDown
from kvpool.engine.worker.runtime import RequestFailed, Worker
from kvpool.errors import KvpoolError
from kvpool.log import get_logger
from kvpool.metadata.http_serving import bearer_matches

log = get_logger("engine.worker.http")


class Sampling(BaseModel):
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None


class PrefillBody(BaseModel):
    request_id: str = Field(min_length=1, max_length=512)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: Sampling = Sampling()
    kv_transfer: dict[str, Any] = Field(default_factory=dict)


class GenerateBody(BaseModel):
    request_id: str = Field(min_length=1, max_length=512)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: Sampling = Sampling()
    first_token_id: int | None = None
    kv_source: Literal["pool", "push", "none"] = "none"


class ReserveBody(BaseModel):
    request_id: str = Field(min_length=1, max_length=512)
    num_tokens: int = Field(ge=1)


class AbortBody(BaseModel):
    request_id: str


def error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def create_app(worker: Worker) -> FastAPI:
    role = worker.config.role

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await worker.close()

    async def authorized(request: Request) -> None:
        token = worker.config.token
        if token and not bearer_matches(request.headers.get("authorization"), token):
            raise _Unauthorized()

    app = FastAPI(title=f"kvpool worker ({role})", lifespan=lifespan,
                  dependencies=[Depends(authorized)])

    @app.exception_handler(_Unauthorized)
    async def unauthorized(_: Request, __: Exception) -> JSONResponse:
        return error(401, "missing or wrong bearer token", "authentication_error")

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error(400, str(exc.errors()[:3]), "invalid_request_error")

    @app.exception_handler(KvpoolError)
    async def bad_request(_: Request, exc: KvpoolError) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error")

    @app.exception_handler(ShuttingDown)
    async def shutting_down(_: Request, exc: Exception) -> JSONResponse:
        return error(503, str(exc), "unavailable")

    @app.exception_handler(RequestFailed)
    async def failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return error(502, str(exc), "request_failed")

    def needs(*roles: str) -> None:
        if role not in roles:
            raise _WrongRole(f"this is a {role} worker; the call needs {' or '.join(roles)}")

    @app.exception_handler(_WrongRole)
    async def wrong_role(_: Request, exc: Exception) -> JSONResponse:
        return error(400, str(exc), "invalid_request_error")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "role": role}

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return worker.info()

    @app.get("/load")
    async def load(epoch: str = "", since: int | None = None) -> dict[str, Any]:
        return await worker.load(epoch, since)

    @app.post("/prefill")
    async def prefill(body: PrefillBody) -> dict[str, Any]:
        needs("prefill", "both")
        return await worker.prefill(body.request_id, body.prompt_token_ids,
                                    sampling_params(body.sampling), body.kv_transfer)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> StreamingResponse:
        needs("decode", "both")
        outputs = worker.generate(body.request_id, body.prompt_token_ids,
                                  sampling_params(body.sampling), body.first_token_id,
                                  body.kv_source)
        return StreamingResponse(ndjson(outputs), media_type="application/x-ndjson")

    @app.post("/kv/reserve", response_model=None)
    async def reserve(body: ReserveBody) -> dict[str, Any] | JSONResponse:
        needs("decode", "both")
        reply = await worker.reserve(body.request_id, body.num_tokens)
        if reply is None:
            return error(503, f"no room for {body.num_tokens} tokens of KV", "out_of_kv_space")
        return reply

    @app.post("/abort")
    async def abort(body: AbortBody) -> dict[str, bool]:
        return {"ok": await worker.abort(body.request_id)}

    return app


class _Unauthorized(Exception):
    pass


class _WrongRole(Exception):
    pass


def sampling_params(s: Sampling) -> SamplingParams:
    return SamplingParams.from_json(s.model_dump())


def _reuse(stats: dict[str, float]) -> dict[str, int]:
    """Prompt tokens this worker did not compute (its cache, the pool), for the proxy's metrics."""
    return {k: int(stats[k]) for k in ("num_cached_tokens", "num_pool_tokens") if k in stats}


async def ndjson(outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    """One JSON line per token, then the finish line; an error ends the stream with its line."""
    num_tokens = 0
    try:
        async for out in outputs:
            if out.token_id is not None:
                num_tokens += 1
                yield _line({"token_id": out.token_id, "t": out.time_s})
            if out.finish_reason is not None:
                yield _line({"finish_reason": out.finish_reason, "num_output_tokens": num_tokens,
                             **_reuse(out.stats)})
    except (RequestFailed, KvpoolError, ShuttingDown) as exc:
        yield _line({"error": str(exc)})
    except Exception as exc:
        log.exception("generate failed")
        yield _line({"error": f"{type(exc).__name__}: {exc}"})


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"
