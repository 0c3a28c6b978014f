"""Errors the proxy answers with, in OpenAI's shape: `{"error": {message, type, param, code}}`.

Who is at fault decides the status: the client (400/404), the cluster's load (429, with
`Retry-After`), a worker (502) or the absence of workers (503)."""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, log_note: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.log_note = log_note
        """Words for the access log's line beside the code (which cost model refused what)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def sse(self) -> bytes:
        """The error as one SSE event (sent when a stream has already begun)."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def model_not_found(asked: str, served: str) -> ApiError:
    return ApiError(404, f"model {asked!r} does not exist; this proxy serves {served!r}",
                    code="model_not_found", param="model")


def not_found(method: str, path: str, status: int = 404) -> ApiError:
    """An unknown route (or a known one with another method: 405), in OpenAI's shape."""
    what = "no such route" if status == 404 else "method not allowed"
    return ApiError(status, f"{what}: {method} {path}", type="invalid_request_error",
                    code="not_found" if status == 404 else "method_not_allowed")


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size} bytes, over this server's limit of {limit} "
                    "(kvpool proxy --max-body-bytes)", code="request_too_large")


def unauthorized() -> ApiError:
    return ApiError(401, "missing or wrong bearer token", type="authentication_error",
                    code="invalid_token")


def worker_failed(message: str, worker_status: int | None = None) -> ApiError:
    """A leg that failed: a 502, unless the worker refused the request itself as invalid (its
    400: what its engine cannot do, e.g. logprobs on the emulated engine), which is the
    client's 400."""
    if worker_status == 400:
        return ApiError(400, message, code="unsupported_by_engine")
    return ApiError(502, message, type="worker_error", code="worker_failed")


def no_workers(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="no_workers")


def rejected(reason: str, predicted_ttft_s: float, predicted_tbt_s: float,
             retry_after_s: int, cost_note: str = "") -> ApiError:
    """A 429; `cost_note` (measured.cost_note: which cost model predicted what) goes into the
    message and the access log."""
    what = {"ttft": "the prefill pool cannot meet the TTFT objective",
            "tbt": "the decode pool cannot meet the TBT objective",
            "kv_capacity": "the decode pool has no room for this request's KV cache"}
    return ApiError(
        429, f"request rejected by admission control: {what.get(reason, reason)} "
        f"(predicted TTFT {predicted_ttft_s:.3f} s, TBT {predicted_tbt_s * 1e3:.1f} ms"
        f"{'; ' + cost_note if cost_note else ''}); retry after {retry_after_s} s",
        type="rate_limit_exceeded", code=f"rejected_{reason}",
        headers={"Retry-After": str(retry_after_s)}, log_note=cost_note)


def slo_unreachable(unloaded_ttft_s: float, limit_s: float, cost_note: str = "") -> ApiError:
    """The request alone, on an idle prefill worker, would miss the TTFT objective: waiting
    cannot help, so no Retry-After (a 400, not a 429). `cost_note` as for `rejected`."""
    return ApiError(
        400, f"this request cannot meet the TTFT objective on this cluster: its prefill alone "
        f"is predicted to take {unloaded_ttft_s:.3f} s, over the {limit_s:.3f} s limit"
        f"{' (' + cost_note + ')' if cost_note else ''}; send a "
        "shorter prompt, or run the proxy with a larger --ttft-slo-s or a relative "
        "--ttft-slo-relative", code="slo_unreachable", param="messages", log_note=cost_note)


REJECTED = 429
"""How the benchmarks file an admission refusal, whichever status it came with."""


def refusal_reason(status: int, body: object) -> str | None:
    """The admission's reason (ttft, tbt, kv_capacity) if a reply is an admission refusal: a
    429 `rejected_<reason>`, or the 400 `slo_unreachable` (a TTFT refusal no wait helps)."""
    err = body.get("error") if isinstance(body, dict) else None
    code = str(err.get("code") or "") if isinstance(err, dict) else ""
    if status == 429 and code.startswith("rejected_"):
        return code.removeprefix("rejected_")
    if status == 400 and code == "slo_unreachable":
        return "ttft"
    return None
