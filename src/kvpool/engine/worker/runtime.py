"""A worker without its HTTP skin: the engine on its thread, the pool client, the transfer
engine, push reservations, and the async calls the HTTP handlers make."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpool.engine.blocks import request_key
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.core import EngineCore, StepOutput
from kvpool.engine.sequence import KVSource, SeqStatus
from kvpool.engine.worker.loop import EngineLoop, ShuttingDown
from kvpool.engine.worker.pool import PoolConnector, PoolPlan, PushPlan, push_parts
from kvpool.errors import ConfigError, InvalidArgument, KvpoolError
from kvpool.log import get_logger
from kvpool.metadata.http_serving import CLIENT_KEEPALIVE_S, bearer_header

log = get_logger("engine.worker")
ROLES = ("prefill", "decode", "both")
ENGINES = ("torch", "emulated")


@dataclass(frozen=True)
class WorkerConfig:
    model_dir: str
    role: str = "both"
    master: str | None = None
    """Store master HOST:PORT; None runs without the pool (push or local only)."""
    host: str = "127.0.0.1"
    port: int = 0
    kv_transfer: str = "pool"
    """Default for /prefill bodies that name no `kv_transfer`."""
    token: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    dram_bytes: int = 0
    """DRAM this worker contributes to the pool (0: a pure client)."""
    remote_timeout_s: float = 10.0
    """Bound on every call to another worker, and on each pool/transfer operation."""
    request_timeout_s: float = 300.0
    """A request that produces nothing for this long ends with an error."""
    reserve_ttl_s: float = 60.0
    """Reserved blocks no /generate claimed within this long are given back."""
    engine_kind: str = "torch"
    """torch: the reference model computes; emulated: a profile's step times (docs/serve.md)."""
    profile: str = "llama70b-8xa800"
    """emulated: a profile file or the name of a shipped one."""
    kv_scale: float = 1 / 1024
    """emulated: the share of the profile's KV bytes per token actually written and moved."""
    speed_up: float = 1.0
    """emulated: every step time is divided by this."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.engine_kind not in ENGINES:
            raise ConfigError(f"engine must be one of {ENGINES}, got {self.engine_kind!r}")
        if self.engine.device != "cpu":
            raise ConfigError(f"workers keep their KV in CPU memory registered with the transfer "
                              f"engine; device {self.engine.device!r} is for the engine alone")
        if self.kv_transfer not in ("pool", "push"):
            raise ConfigError(f"kv_transfer must be pool or push, got {self.kv_transfer!r}")


def make_engine(config: WorkerConfig) -> EngineCore:
    """The torch engine over the checkpoint, or the emulated one over its profile (the model
    folder then only gives the vocabulary and identity; the proxy serves its tokenizer)."""
    if config.engine_kind == "emulated":
        from kvpool.engine.emulated.engine import EmulatedEngine
        from kvpool.engine.emulated.profile import load_profile

        return EmulatedEngine.from_dir(config.model_dir, load_profile(config.profile),
                                       config.engine, config.kv_scale, config.speed_up)
    from kvpool.engine.llm_engine import LLMEngine

    return LLMEngine.from_dir(config.model_dir, config.engine)


class RequestFailed(Exception):
    """A request ended with an error (the message says why)."""


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.store, self.transfer = self._connect()
        self.engine = make_engine(config)
        self.transfer.register(self.engine.cache.kv)
        self.connector = PoolConnector(self.engine.cache, self.store, self.transfer,
                                       save_blocks=config.role == "prefill")
        self.engine.connector = self.connector
        self._reserved: dict[str, tuple[list[int], float]] = {}
        self.epoch = uuid.uuid4().hex
        """Names this process's block-event numbering (a restarted worker starts anew)."""
        self.loop = EngineLoop(self.engine, on_idle=self._expire).start()
        self.http = httpx.AsyncClient(timeout=config.remote_timeout_s, headers=self._auth(),
                                      limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S))

    def _connect(self) -> tuple[Any, Any]:
        from kvpool.store.client.config import ClientConfig
        from kvpool.store.client.store_client import StoreClient
        from kvpool.transfer import TransferConfig, TransferEngine
        c = self.config
        if c.master is None:
            engine = TransferEngine(TransferConfig(host=c.host, token=c.token,
                                                   timeout_s=c.remote_timeout_s)).start()
            return None, engine
        store = StoreClient(ClientConfig(master=c.master, local_hostname=c.host, token=c.token,
                                         global_segment_size=c.dram_bytes, local_buffer_size=0,
                                         rpc_timeout_s=c.remote_timeout_s,
                                         transfer_timeout_s=c.remote_timeout_s))
        return store, store.engine

    def _auth(self) -> dict[str, str]:
        return bearer_header(self.config.token)

    async def close(self) -> None:
        await self.http.aclose()
        self.loop.stop()
        self.connector.close()
        if self.store is not None:
            self.store.close()
        else:
            self.transfer.close()

    # -- facts -------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {"role": self.config.role, "model": str(Path(self.config.model_dir)),
                "model_hash": e.root_hash, "block_size": e.config.block_size,
                "max_model_len": e.config.max_model_len,
                "kv_capacity_tokens": e.config.kv_capacity_tokens,
                "segment": self.transfer.segment_name, "engine": self._engine_facts()}

    def _engine_facts(self) -> dict[str, Any]:
        from kvpool.engine.emulated.engine import EmulatedEngine

        e = self.engine
        if not isinstance(e, EmulatedEngine):
            return {"kind": "torch"}
        return {"kind": "emulated", "profile": e.profile.name, "kv_scale": e.kv_scale,
                "speed_up": e.speed_up, "kv_layers": e.cache.num_layers,
                "row_bytes": e.cache.row_bytes, "prefill_mode": e.config.prefill_mode,
                "enable_prefix_caching": e.config.enable_prefix_caching}

    async def load(self, epoch: str = "", since: int | None = None) -> dict[str, Any]:
        """The load report; with this worker's `epoch` and an event number `since`, the cached
        block hashes come as the events after it (`block_events`), else whole. Not queued
        behind the engine's commands: a step that waits without computing (the emulated
        engine) answers polls while it waits."""
        if self.loop.stopped:
            raise ShuttingDown("the worker is shutting down")

        def report() -> dict[str, Any]:
            with self.engine.state_lock:
                out = _load_report(self.engine)
                blocks = self.engine.blocks
                events = blocks.events_since(since) if epoch == self.epoch and since is not None \
                    else None
                if events is None:
                    out["block_hashes"] = blocks.cached_hashes()
                else:
                    out["block_events"] = [[h, int(stored)] for h, stored in events]
                out["epoch"], out["events_to"] = self.epoch, blocks.num_events
            return out
        return await asyncio.to_thread(report)

    # -- prefill leg -------------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                      kv_transfer: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        self.engine.new_sequence(request_id, prompt, sampling)  # validate before reserving
        mode = kv_transfer.get("mode", self.config.kv_transfer)
        plan: PoolPlan | PushPlan = PoolPlan()
        decode_url = kv_transfer.get("decode_url")
        if mode == "push":
            if not decode_url:
                raise InvalidArgument("kv_transfer push needs a decode_url")
            plan = await self._reserve(decode_url, request_id, len(prompt))
        elif mode != "pool":
            raise InvalidArgument(f"kv_transfer mode must be pool or push, got {mode!r}")
        try:
            first, stats, first_t = await self._run_prefill(request_id, prompt, sampling, plan)
        except (RequestFailed, KvpoolError):
            if decode_url:
                await self._quietly_abort(decode_url, request_id)
            raise
        num_pool, num_cached = int(stats["num_pool_tokens"]), int(stats["num_cached_tokens"])
        num_computed = len(prompt) - num_cached - num_pool
        moved = num_pool * self._token_bytes  # read from the pool
        if isinstance(plan, PushPlan):
            moved += sum(n for _, n in plan.regions)
        else:
            moved += num_computed * self._token_bytes  # written to the pool
        return {"request_id": request_id, "first_token_id": first, "first_token_t": first_t,
                "num_prompt_tokens": len(prompt), "num_cached_tokens": num_cached,
                "num_pool_tokens": num_pool,
                "num_computed_tokens": num_computed,
                "prefill_s": round(time.monotonic() - t0, 6),
                "pool_load_s": round(stats["pool_load_s"], 6), "kv_bytes_moved": moved}

    @property
    def _token_bytes(self) -> int:
        return self.engine.cache.token_bytes

    async def _run_prefill(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                           plan: PoolPlan | PushPlan) -> tuple[int, dict[str, float], float]:
        """The first token, the finish stats, and the engine's stamp of the first token."""
        def add(engine: EngineCore) -> None:
            engine.add_request(request_id, prompt, sampling, prefill_only=True)
            self.connector.plans[request_id] = plan  # read when the request finishes
        first: int | None = None
        first_t = 0.0
        async for out in self._follow(request_id, add):
            if out.token_id is not None:
                first, first_t = out.token_id, out.time_s
            if out.finish_reason is not None:
                assert first is not None
                return first, out.stats, first_t
        raise RequestFailed(f"request {request_id} ended without a token")

    async def _reserve(self, decode_url: str, request_id: str, num_tokens: int) -> PushPlan:
        try:
            reply = await self.http.post(f"{decode_url.rstrip('/')}/kv/reserve",
                                         json={"request_id": request_id, "num_tokens": num_tokens})
        except httpx.HTTPError as exc:
            raise RequestFailed(f"decode worker {decode_url} unreachable: {type(exc).__name__}: {exc}") from exc
        body = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        if reply.status_code != 200 or not body.get("ok"):
            raise RequestFailed(f"decode worker {decode_url} refused to reserve KV for "
                                f"{num_tokens} tokens: {reply.status_code} {body or reply.text}")
        return PushPlan(body["segment"], [(int(a), int(n)) for a, n in body["regions"]])

    async def _quietly_abort(self, url: str, request_id: str) -> None:
        try:
            await self.http.post(f"{url.rstrip('/')}/abort", json={"request_id": request_id})
        except httpx.HTTPError:
            pass

    # -- decode leg --------------------------------------------------------------------------

    async def reserve(self, request_id: str, num_tokens: int) -> dict[str, Any] | None:
        def reserve(engine: EngineCore) -> dict[str, Any] | None:
            if request_id in self._reserved:
                raise InvalidArgument(f"request {request_id} already holds a reservation")
            blocks = engine.reserve_blocks(num_tokens)
            if blocks is None:
                return None
            self._reserved[request_id] = (blocks, time.monotonic() + self.config.reserve_ttl_s)
            return {"ok": True, "segment": self.transfer.segment_name,
                    "block_bytes": engine.cache.block_bytes,
                    "regions": [list(p) for p in push_parts(engine.cache, blocks)]}
        return await self._on_engine(reserve)

    def generate(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                 first_token: int | None, kv_source: str) -> AsyncIterator[StepOutput]:
        source = KVSource(kv_source)
        if source is not KVSource.COMPUTE and first_token is None:
            raise InvalidArgument(f"kv_source {kv_source} needs the first_token_id")
        self.engine.new_sequence(request_id, prompt, sampling)  # validate before streaming

        def add(engine: EngineCore) -> None:
            if source is KVSource.PUSH:
                reserved = self._reserved.pop(request_id, None)
                if reserved is None:
                    raise RequestFailed(f"no KV was pushed for request {request_id} (no reservation)")
                if len(reserved[0]) * engine.config.block_size < len(prompt):
                    engine.blocks.release(reserved[0])
                    raise RequestFailed(f"request {request_id} reserved {len(reserved[0])} blocks, "
                                        f"too few for {len(prompt)} prompt tokens")
                engine.start_pushed(request_id, prompt, first_token or 0, sampling, reserved[0])
                return
            seq = engine.add_request(request_id, prompt, sampling, kv_source=source)
            if first_token is not None:
                engine.continue_with(seq, first_token)
            if seq.status is SeqStatus.FINISHED and source is KVSource.POOL:
                self._drop_partial(request_id)  # done with the prefill's token: nobody reads it
        return self._follow(request_id, add)

    async def abort(self, request_id: str) -> bool:
        """Stop the request here; a prefill worker also drops the last block it left in the
        pool for a decode leg that will not read it now."""
        def abort(engine: EngineCore) -> bool:
            reserved = self._reserved.pop(request_id, None)
            if reserved is not None:
                engine.blocks.release(reserved[0])
            return engine.abort(request_id) or reserved is not None
        found = bool(await self._on_engine(abort))
        if self.config.role == "prefill":
            await asyncio.to_thread(self._drop_partial, request_id)
        return found

    def _drop_partial(self, request_id: str) -> None:
        """Remove the request's last, partial block from the pool (written by a prefill leg
        for its decode leg), if there is a pool and it is there."""
        if self.store is not None:
            self.store.remove(request_key(request_id), True)

    def _expire(self) -> None:
        now = time.monotonic()
        for request_id, (blocks, deadline) in list(self._reserved.items()):
            if deadline < now:
                log.warning("reservation of %s expired unused", request_id)
                del self._reserved[request_id]
                self.engine.blocks.release(blocks)

    # -- plumbing ----------------------------------------------------------------------------

    async def _on_engine(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.loop.call(fn))

    async def _follow(self, request_id: str, add: Any) -> AsyncIterator[StepOutput]:
        """Add a request on the engine thread and yield its outputs; raise RequestFailed on an
        error or silence; abort it if the caller stops listening."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()

        def listen(out: StepOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        def start(engine: EngineCore) -> None:
            self.loop.subscribe(request_id, listen)
            try:
                add(engine)
            except BaseException:
                self.loop.unsubscribe(request_id)
                raise
        await self._on_engine(start)
        finished = False
        try:
            while not finished:
                try:
                    out = await asyncio.wait_for(outputs.get(), self.config.request_timeout_s)
                except TimeoutError:
                    raise RequestFailed(f"request {request_id} produced nothing for "
                                        f"{self.config.request_timeout_s}s") from None
                if out.error is not None:
                    raise RequestFailed(out.error)
                finished = out.finish_reason is not None
                yield out
        finally:
            if not finished:
                self.loop.call(lambda e: self._drop(e, request_id))

    def _drop(self, engine: EngineCore, request_id: str) -> None:
        self.loop.unsubscribe(request_id)
        engine.abort(request_id, "client went away")


def _load_report(engine: EngineCore) -> dict[str, Any]:
    s, bs = engine.scheduler, engine.config.block_size
    return {"num_waiting": len(s.waiting), "num_running": len(s.running),
            "queued_prefill_tokens": sum(q.num_uncomputed for q in (*s.waiting, *s.running)
                                         if q.num_uncomputed > 1),
            "running_tokens": sum(len(q) for q in s.running),
            "free_kv_tokens": engine.blocks.num_free_blocks * bs,
            "kv_capacity_tokens": engine.config.kv_capacity_tokens,
            "engine_lost_s": round(engine.lost_s, 6)}
