"""The master's admin HTTP app: health, Prometheus metrics and read-only inspection."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool.store.master_core import MasterCore
from kvpool.store.master_inspect import list_keys, object_info
from kvpool.store.metrics import MasterMetrics

LOCK_WAIT_S = 1.0
"""How long /health waits for the master lock before it reports the master stuck."""


def _segment_json(core: MasterCore) -> list[dict[str, Any]]:
    return [{"segment_id": s.segment_id, "client_id": s.client_id, "endpoint": s.endpoint,
             "base_addr": s.base_addr, "capacity_bytes": s.capacity_bytes,
             "used_bytes": s.used_bytes, "tier": s.tier.name} for s in core.segment_infos()]


def create_admin_app(core: MasterCore, lock: threading.Lock, metrics: MasterMetrics,
                     rpc_problem: Callable[[], str | None] | None = None) -> FastAPI:
    """`rpc_problem()` says why the RPC server is not serving (None while it is)."""
    app = FastAPI(title="kvpool master admin")

    @app.get("/health")
    def health() -> Response:
        """200 with the pool's size while the RPC loop turns and the master lock is free
        within a second; 503 with the reason otherwise."""
        problem = rpc_problem() if rpc_problem is not None else None
        if problem is None and not lock.acquire(timeout=LOCK_WAIT_S):
            problem = f"the master lock has been held for over {LOCK_WAIT_S}s"
        elif problem is None:
            try:
                body = {"status": "ok", "keys": len(core.objects),
                        "segments": len(core.segments), "clients": len(core.clients),
                        "capacity_bytes": core.capacity_bytes, "used_bytes": core.used_bytes}
            finally:
                lock.release()
            return JSONResponse(body)
        return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/segments")
    @app.get("/get_all_segments")
    def segments() -> list[dict[str, Any]]:
        with lock:
            return _segment_json(core)

    @app.get("/query_key")
    def query_key(key: str = Query(..., min_length=1, max_length=4096)) -> dict[str, Any]:
        with lock:
            info = object_info(core, key)
        if info is None:
            raise HTTPException(404, f"no object with key {key!r}")
        return {"key": info.key, "size": info.size, "leased": info.leased,
                "hard_pinned": info.hard_pinned, "soft_pinned": info.soft_pinned,
                "replicas": [{"segment_id": r.segment_id, "endpoint": r.endpoint,
                              "addr": r.addr, "size": r.size, "tier": r.tier.name,
                              "state": r.state.name} for r in info.replicas]}

    @app.get("/integrity")
    def integrity() -> dict[str, Any]:
        """Run the master's integrity check (500 with the broken invariant if it fails)."""
        with lock:
            try:
                core.check_integrity()
            except AssertionError as exc:
                raise HTTPException(500, f"integrity check failed: {exc}") from None
            return {"status": "ok", "keys": len(core.objects), "pending": len(core.pending)}

    @app.get("/keys")
    def keys(prefix: str = "", limit: int = Query(1000, ge=1, le=100000)) -> dict[str, Any]:
        with lock:
            found = list_keys(core, prefix, limit)
        return {"prefix": prefix, "count": len(found), "keys": found}

    return app
