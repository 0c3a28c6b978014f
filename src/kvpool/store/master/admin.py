"""The master's admin HTTP app: health, Prometheus metrics and read-only inspection.

/health and /metrics are open (monitoring must work without secrets; they carry counts and
sizes, no keys, but /metrics labels used bytes by segment id, which names the endpoint and
base address). Everything that lists keys, segments or addresses, and
/integrity, needs the master's token when it has one.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.metadata.http_serving import bearer_matches
from kvpool.store.master.core import MasterCore
from kvpool.store.master.metrics import MasterMetrics
from kvpool.store.master.views import MasterSnapshot, list_keys, object_info, snapshot
from kvpool.store.wire.codes import ObjectInfo

LOCK_WAIT_S = 1.0
"""How long /health waits for the master lock before it reports the master stuck."""
INTEGRITY_MAX_SHARE = 0.1
"""/integrity walks every object under the master lock: it may hold it at most this share of
the time (one run at a time; after a run of d seconds the next waits 9 d)."""


def _token_check(token: str | None) -> Callable[[Request], None]:
    """A dependency that lets a request through only with `Authorization: Bearer <token>`
    (every request when there is no token)."""

    def check(request: Request) -> None:
        if token is not None and not bearer_matches(request.headers.get("authorization"),
                                                     token):
            raise HTTPException(401, "this admin endpoint needs the shared token: send "
                                "'Authorization: Bearer <token>' (KVPOOL_TOKEN)",
                                headers={"www-authenticate": "Bearer"})

    return check


BUSY_RETRY_S = 1.0
"""Wait suggested to a caller that finds another one's run in progress."""


class _DutyCycle:
    """Lets one caller at a time through, and after a run of d seconds the next one only
    d * (1 / max_share - 1) seconds later, so the gated work takes at most `max_share` of the
    time. `claim()` is 0 for the caller let through (who must then `release(d)`), else how
    many seconds to wait."""

    def __init__(self, max_share: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        """Times the runs and the rests (the real clock: the share is of real time)."""
        self._rest_per_s = 1 / max_share - 1
        self._next_s = 0.0
        self._lock = threading.Lock()

    def claim(self) -> float:
        with self._lock:
            now = self.clock.now()
            if self._next_s == math.inf:
                return BUSY_RETRY_S
            if now < self._next_s:
                return self._next_s - now
            self._next_s = math.inf   # until release(): one caller at a time
            return 0.0

    def release(self, duration_s: float) -> None:
        with self._lock:
            self._next_s = self.clock.now() + duration_s * self._rest_per_s


def _check(core: MasterCore) -> dict[str, Any]:
    try:
        core.check_integrity()
    except AssertionError as exc:
        raise HTTPException(500, f"integrity check failed: {exc}") from None
    return {"status": "ok", "keys": len(core.objects), "pending": len(core.pending)}


def _segment_json(snap: MasterSnapshot) -> list[dict[str, Any]]:
    return [{"segment_id": s.segment_id, "client_id": s.client_id, "endpoint": s.endpoint,
             "base_addr": s.base_addr, "capacity_bytes": s.capacity_bytes,
             "used_bytes": s.used_bytes, "tier": s.tier.name, "draining": s.draining}
            for s in snap.segments]


def mooncake_segment_names(core: MasterCore) -> list[str]:
    """Names of the mounted segments as Mooncake lists them: the owner's endpoint
    ("host:port", what its `get_hostname()` returns), once each, in mount order."""
    return list(dict.fromkeys(s.endpoint for s in core.segment_infos()))


def create_admin_app(core: MasterCore, lock: threading.Lock, metrics: MasterMetrics,
                     rpc_problem: Callable[[], str | None] | None = None,
                     token: str | None = None) -> FastAPI:
    """`rpc_problem()` says why the RPC server is not serving (None while it is). With
    `token`, everything but /health and /metrics needs `Authorization: Bearer <token>`."""
    app = FastAPI(title="kvpool master admin", openapi_url=None, docs_url=None,
                  redoc_url=None)
    guarded = [Depends(_token_check(token))]

    @app.get("/health")
    def health() -> Response:
        """200 with the pool's size while the RPC loop turns and the master lock is free
        within a second; 503 with the reason otherwise."""
        return _health(core, lock, rpc_problem() if rpc_problem is not None else None)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _add_listings(app, core, lock, guarded)
    _add_integrity(app, core, lock, guarded)
    return app


def _health(core: MasterCore, lock: threading.Lock, problem: str | None) -> Response:
    """/health's answer, given the RPC server's `problem` (None while it serves)."""
    if problem is None and not lock.acquire(timeout=LOCK_WAIT_S):
        problem = f"the master lock has been held for over {LOCK_WAIT_S}s"
    elif problem is None:
        try:
            snap = snapshot(core)
        finally:
            lock.release()
        return JSONResponse({"status": "ok", "keys": snap.keys,
                             "segments": len(snap.segments), "clients": snap.clients,
                             "capacity_bytes": snap.capacity_bytes,
                             "used_bytes": snap.used_bytes})
    return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)


def _add_listings(app: FastAPI, core: MasterCore, lock: threading.Lock,
                  guarded: list[Any]) -> None:
    """The guarded reads of the master's tables: segments, one object, keys, the journal."""

    @app.get("/segments", dependencies=guarded)
    def segments() -> list[dict[str, Any]]:
        with lock:
            snap = snapshot(core)
        return _segment_json(snap)

    @app.get("/get_all_segments", dependencies=guarded)
    def mooncake_segments() -> Response:
        """Mooncake's format: each mounted segment's name followed by a newline, an empty
        body when none is mounted (SGLang's `check_server` waits for a non-empty one)."""
        with lock:
            names = mooncake_segment_names(core)
        return PlainTextResponse("".join(f"{name}\n" for name in names))

    @app.get("/query_key", dependencies=guarded)
    def query_key(key: str = Query(..., min_length=1, max_length=4096)) -> dict[str, Any]:
        with lock:
            info = object_info(core, key)
        if info is None:
            raise HTTPException(404, f"no object with key {key!r}")
        return _object_json(info)

    @app.get("/journal", dependencies=guarded)
    def journal() -> dict[str, Any]:
        """What the replay at start skipped and how journal writes fare (404 without
        persistence)."""
        with lock:
            stats = core.journal.stats() if core.journal is not None else None
        if stats is None:
            raise HTTPException(404, "this master keeps no journal")
        return stats.as_dict()

    @app.get("/keys", dependencies=guarded)
    def keys(prefix: str = "", limit: int = Query(1000, ge=1, le=100000)) -> dict[str, Any]:
        with lock:
            found = list_keys(core, prefix, limit)
        return {"prefix": prefix, "count": len(found), "keys": found}


def _object_json(info: ObjectInfo) -> dict[str, Any]:
    return {"key": info.key, "size": info.size, "leased": info.leased,
            "hard_pinned": info.hard_pinned, "soft_pinned": info.soft_pinned,
            "replicas": [{"segment_id": r.segment_id, "endpoint": r.endpoint,
                          "addr": r.addr, "size": r.size, "tier": r.tier.name,
                          "state": r.state.name} for r in info.replicas]}


def _add_integrity(app: FastAPI, core: MasterCore, lock: threading.Lock,
                   guarded: list[Any]) -> None:
    integrity_gate = _DutyCycle(INTEGRITY_MAX_SHARE)

    @app.get("/integrity", dependencies=guarded)
    def integrity() -> dict[str, Any]:
        """Run the master's integrity check (500 with the broken invariant if it fails); 429
        while an earlier run's share of the master's time (INTEGRITY_MAX_SHARE) is used up."""
        wait_s = integrity_gate.claim()
        if wait_s > 0:
            raise HTTPException(429, f"/integrity may hold the master lock at most "
                                f"{INTEGRITY_MAX_SHARE:.0%} of the time; retry in "
                                f"{wait_s:.3f}s", headers={"retry-after": str(math.ceil(wait_s))})
        with lock:
            start = integrity_gate.clock.now()
            try:
                return _check(core)
            finally:
                integrity_gate.release(integrity_gate.clock.now() - start)
