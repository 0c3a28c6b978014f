"""A worker without its HTTP skin: the engine on its thread, the pool client, the transfer
engine, push reservations, and the async calls the HTTP handlers make."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvpool.clock import SYSTEM_CLOCK, Clock
from kvpool.engine.blocks import request_key
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.core import EngineCore, StepOutput
from kvpool.engine.sequence import KVSource, SeqStatus
from kvpool.engine.worker.loop import EngineLoop
from kvpool.engine.worker.mailbox import StepMailbox, StepQueue
from kvpool.engine.worker.messages import (
    MAX_STREAM_INTERVAL,
    GenerateRequest,
    InfoReply,
    LoadReply,
    PrefillReply,
    PrefillRequest,
    ReserveReply,
    ReserveRequest,
)
from kvpool.engine.worker.peers import PeerCalls
from kvpool.engine.worker.pool import PoolConnector, PoolPlan, PushPlan, push_parts
from kvpool.engine.worker.reservations import Reservations
from kvpool.errors import ConfigError, InvalidArgument, KvpoolError, RequestFailed, ShuttingDown
from kvpool.idle_timeout import IdleTimeout
from kvpool.log import get_logger
from kvpool.metadata.http_serving import CLIENT_KEEPALIVE_S

if TYPE_CHECKING:  # both pull in the transfer engine: imported on use below
    from kvpool.engine.worker.sse_text import SseText
    from kvpool.serve.tokenizer import ModelTokenizer
    from kvpool.store.client.store_client import StoreClient
    from kvpool.transfer import TransferEngine

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
    stream_interval: int = 1
    """/generate: output tokens per frame after the first (GenerateRequest.stream_interval)."""
    engine_kind: str = "torch"
    """torch: the reference model computes; emulated: a profile's step times (docs/serve.md)."""
    profile: str = "llama70b-8xa800"
    """emulated: a profile file or the name of a shipped one."""
    kv_scale: float = 1 / 1024
    """emulated: the share of the profile's KV bytes per token actually written and moved."""
    speed_up: float = 1.0
    """emulated: every step time is divided by this."""
    step_rules: str = "kvpool"
    """emulated: how a step is charged, kvpool or vllm (`EngineProfile.step_rules`)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(f"stream_interval must be in 1..{MAX_STREAM_INTERVAL}, "
                              f"got {self.stream_interval}")
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
                                       config.engine, config.kv_scale, config.speed_up,
                                       config.step_rules)
    from kvpool.engine.llm_engine import LLMEngine

    return LLMEngine.from_dir(config.model_dir, config.engine)


class Worker:
    def __init__(self, config: WorkerConfig, wall_clock: Callable[[], float] = time.time,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.wall_clock = wall_clock
        """Unix seconds, for the time window of the calls it signs to other workers."""
        self.config = config
        self.store, self.transfer = self._connect()
        self.engine = make_engine(config)
        self.transfer.register(self.engine.cache.kv)
        self.connector = PoolConnector(self.engine.cache, self.store, self.transfer,
                                       save_blocks=config.role in ("prefill", "both"),
                                       save_planned_only=config.role == "both")
        self.engine.connector = self.connector
        self.reservations = Reservations(config.reserve_ttl_s, clock,
                                         grace_s=3 * config.remote_timeout_s + 1.0)
        """Blocks held for prompts a prefill worker pushes here (engine thread only)."""
        self.epoch = uuid.uuid4().hex
        """Names this process's block-event numbering (a restarted worker starts anew)."""
        self.mailbox = StepMailbox()
        """Step outputs to the event loop: one wake-up per engine step."""
        self.loop = EngineLoop(self.engine, on_idle=self._expire,
                               on_step=self.mailbox.flush).start()
        self.http = httpx.AsyncClient(timeout=config.remote_timeout_s,
                                      limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S))
        self.peers = PeerCalls(self.http, config.token, wall_clock)
        self._tokenizer: asyncio.Future[ModelTokenizer] | None = None
        """Loaded off the event loop, once, as a decoding worker starts (`ready_text`), for
        the SSE text of the requests that ask (GenerateRequest.sse)."""

    def _connect(self) -> tuple[StoreClient | None, TransferEngine]:
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

    async def close(self) -> None:
        await self.http.aclose()
        self.loop.stop()
        self.connector.close()
        if self.store is not None:
            self.store.close()
        else:
            self.transfer.close()

    # -- facts -------------------------------------------------------------------------------

    def info(self) -> InfoReply:
        e = self.engine
        return InfoReply(role=self.config.role,  # type: ignore[arg-type]  # checked in config
                         model=str(Path(self.config.model_dir)), model_hash=e.root_hash,
                         block_size=e.config.block_size, max_model_len=e.config.max_model_len,
                         kv_capacity_tokens=e.config.kv_capacity_tokens,
                         segment=self.transfer.segment_name, engine=self._engine_facts(),
                         sse_text=self._makes_text())

    def _engine_facts(self) -> dict[str, Any]:
        from kvpool.engine.emulated.engine import EmulatedEngine

        e = self.engine
        if not isinstance(e, EmulatedEngine):
            return {"kind": "torch", "dtype": e.config.dtype}
        return {"kind": "emulated", "profile": e.profile.name, "kv_scale": e.kv_scale,
                "speed_up": e.speed_up, "kv_layers": e.cache.num_layers,
                "row_bytes": e.cache.row_bytes, "prefill_mode": e.config.prefill_mode,
                "enable_prefix_caching": e.config.enable_prefix_caching}

    async def load(self, epoch: str = "", since: int | None = None) -> LoadReply:
        """The load report; with this worker's `epoch` and an event number `since`, the cached
        block hashes come as the events after it (`block_events`), else whole. Not queued
        behind the engine's commands: a step that waits without computing (the emulated
        engine) answers polls while it waits."""
        if self.loop.stopped:
            raise ShuttingDown("the worker is shutting down")

        def report() -> LoadReply:
            with self.engine.state_lock:
                blocks = self.engine.blocks
                events = blocks.events_since(since) if epoch == self.epoch and since is not None \
                    else None
                changes = {"block_hashes": blocks.cached_hashes()} if events is None else {
                    "block_events": [(h, bool(stored)) for h, stored in events]}
                return LoadReply(**_load_report(self.engine), **changes, epoch=self.epoch,
                                 events_to=blocks.num_events)
        return await asyncio.to_thread(report)

    # -- prefill leg -------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillReply:
        t0 = time.monotonic()
        rid, prompt, sampling = req.request_id, req.prompt_token_ids, req.sampling
        self.engine.new_sequence(rid, prompt, sampling)  # validate before reserving
        mode = req.kv_transfer.mode or self.config.kv_transfer
        plan: PoolPlan | PushPlan = PoolPlan()
        decode_url = req.kv_transfer.decode_url
        if mode == "push":
            if not decode_url:
                raise InvalidArgument("kv_transfer push needs a decode_url")
            plan = await self.peers.reserve(decode_url, rid, len(prompt))
        try:
            first, end = await self._run_prefill(rid, prompt, sampling, plan)
        except KvpoolError:  # RequestFailed included
            if decode_url:
                await self.peers.abort_quietly(decode_url, rid)
            raise
        stats = end.stats
        num_pool, num_cached = int(stats["num_pool_tokens"]), int(stats["num_cached_tokens"])
        num_computed = len(prompt) - num_cached - num_pool
        moved = num_pool * self._token_bytes  # read from the pool
        if isinstance(plan, PushPlan):
            moved += sum(n for _, n in plan.regions)
        else:
            moved += num_computed * self._token_bytes  # written to the pool
        assert first.token_id is not None
        return PrefillReply(
            request_id=rid, first_token_id=first.token_id, first_token_t=first.time_s,
            num_prompt_tokens=len(prompt), num_cached_tokens=num_cached,
            num_pool_tokens=num_pool, num_computed_tokens=num_computed,
            prefill_s=round(time.monotonic() - t0, 6),
            pool_load_s=round(stats["pool_load_s"], 6), kv_bytes_moved=moved,
            first_logprob=first.logprob,
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs))

    @property
    def _token_bytes(self) -> int:
        return self.engine.cache.token_bytes

    async def _run_prefill(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                           plan: PoolPlan | PushPlan) -> tuple[StepOutput, StepOutput]:
        """The first token's output and the finish output."""
        def add(engine: EngineCore) -> None:
            engine.add_request(request_id, prompt, sampling, prefill_only=True)
            self.connector.plans[request_id] = plan  # read when the request finishes
        first: StepOutput | None = None
        async for outs in self._follow(request_id, add):
            for out in outs:
                if out.token_id is not None:
                    first = out
                if out.finish_reason is not None:
                    assert first is not None
                    return first, out
        raise RequestFailed(f"request {request_id} ended without a token")

    # -- decode leg --------------------------------------------------------------------------

    async def reserve(self, req: ReserveRequest) -> ReserveReply | None:
        request_id, num_tokens = req.request_id, req.num_tokens

        def reserve(engine: EngineCore) -> ReserveReply | None:
            if request_id in self.reservations:
                raise InvalidArgument(f"request {request_id} already holds a reservation")
            blocks = engine.reserve_blocks(num_tokens)
            if blocks is None:
                return None
            self.reservations.add(request_id, blocks)
            return ReserveReply(ok=True, segment=self.transfer.segment_name,
                                block_bytes=engine.cache.block_bytes,
                                regions=push_parts(engine.cache, blocks),
                                ttl_s=self.reservations.ttl_s)
        reply: ReserveReply | None = await self._on_engine(reserve)
        return reply

    def generate(self, req: GenerateRequest) -> AsyncGenerator[list[StepOutput]]:
        """The request's outputs, one list per engine step (with `req.merge_steps`, the steps
        that ended while the event loop was busy elsewhere in one list)."""
        request_id, prompt, sampling = req.request_id, req.prompt_token_ids, req.sampling
        first_token, source = req.first_token_id, KVSource(req.kv_source)
        if source is not KVSource.COMPUTE and first_token is None:
            raise InvalidArgument(f"kv_source {req.kv_source} needs the first_token_id")
        resumed = req.resume_output_ids
        if resumed and (source is not KVSource.COMPUTE or first_token is not None):
            raise InvalidArgument("resume_output_ids needs kv_source none and no first_token_id")
        if first_token is not None:
            self.engine.check_tokens(request_id, [first_token])
        over = self.engine.finish_reason_of(sampling, resumed)
        if over is not None:  # the legs before this one produced the whole output
            return self._already_over(request_id, over)
        self.engine.new_sequence(request_id, prompt, sampling, outputs=resumed)  # validate

        def add(engine: EngineCore) -> None:
            if source is KVSource.PUSH:
                reserved = self.reservations.take(request_id)
                if reserved is None:
                    raise RequestFailed(f"no KV was pushed for request {request_id} (no reservation)")
                if len(reserved) * engine.config.block_size < len(prompt):
                    engine.blocks.release(reserved)
                    raise RequestFailed(f"request {request_id} reserved {len(reserved)} blocks, "
                                        f"too few for {len(prompt)} prompt tokens")
                try:
                    engine.start_pushed(request_id, prompt, first_token or 0, sampling, reserved)
                except KvpoolError:  # (an id already running here): the blocks are not its
                    engine.blocks.release(reserved)
                    raise
                return
            seq = engine.add_request(request_id, prompt, sampling, outputs=resumed,
                                     kv_source=source, joins_prefilled=req.joins_prefilled)
            if resumed:  # a leg before this one failed: whatever it did not read is unread
                self._drop_partial(request_id)
            if first_token is not None:
                engine.continue_with(seq, first_token)
            if seq.status is SeqStatus.FINISHED and source is KVSource.POOL:
                self._drop_partial(request_id)  # done with the prefill's token: nobody reads it
        return self._follow(request_id, add, req.merge_steps)

    def load_tokenizer(self) -> asyncio.Future[ModelTokenizer]:
        """The model's tokenizer, loaded in a thread once (`ready_text`, as it starts)."""
        if self._tokenizer is None:
            from kvpool.serve.tokenizer import ModelTokenizer

            self._tokenizer = asyncio.ensure_future(
                asyncio.to_thread(ModelTokenizer, self.config.model_dir))
            self._tokenizer.add_done_callback(_retrieved)
        return self._tokenizer

    async def ready_text(self) -> None:
        """A decoding worker with a tokenizer loads it (in a thread) before it serves, so
        that `/info` says whether it can make SSE text; a load that fails is logged, and the
        worker says it cannot."""
        if not self._has_tokenizer():
            return
        try:
            await asyncio.shield(self.load_tokenizer())
        except KvpoolError as exc:
            log.warning("no SSE text from this worker: its tokenizer did not load: %s", exc)

    def _makes_text(self) -> bool:
        """Whether it can make SSE text (InfoReply.sse_text): it decodes, its folder has a
        tokenizer, and its load has not failed."""
        load = self._tokenizer
        if not self._has_tokenizer():
            return False
        return load is None or not load.done() or load.cancelled() or load.exception() is None

    def _has_tokenizer(self) -> bool:
        """It decodes, and its model folder has a tokenizer to make SSE text with."""
        return self.config.role != "prefill" and \
            (Path(self.config.model_dir) / "tokenizer.json").is_file()

    async def sse_text(self, req: GenerateRequest) -> SseText | None:
        """The SSE text state of a request that asks its frames to carry the response's bytes
        (`req.sse`), after the output the client has; None otherwise."""
        if req.sse is None:
            return None
        from kvpool.engine.worker.sse_text import SseText

        tokenizer = await asyncio.shield(self.load_tokenizer())
        return SseText(req.sse, tokenizer.decode, req.resume_output_ids,
                       skip=int(req.first_token_id is not None), pieces=tokenizer.byte_pieces)

    async def _already_over(self, request_id: str,
                            reason: str) -> AsyncGenerator[list[StepOutput]]:
        """A resumed leg with nothing left to do: its finish, and no partial block left."""
        await asyncio.to_thread(self._drop_partial, request_id)
        yield [StepOutput(request_id, finish_reason=reason)]

    async def abort(self, request_id: str) -> bool:
        """Stop the request here; a prefill worker also drops the last block it left in the
        pool for a decode leg that will not read it now."""
        def abort(engine: EngineCore) -> bool:
            retired = self.reservations.retire(request_id)  # (a push may still land there)
            return engine.abort(request_id) or retired
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
        for request_id in self.reservations.retire_expired():
            log.warning("reservation of %s expired unused", request_id)
        for blocks in self.reservations.release_due():
            self.engine.blocks.release(blocks)

    # -- plumbing ----------------------------------------------------------------------------

    async def _on_engine(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.loop.call(fn))

    async def _follow(self, request_id: str, add: Any,
                      merge: bool = False) -> AsyncGenerator[list[StepOutput]]:
        """Add a request on the engine thread and yield its outputs, a list per engine step
        (`merge`: every step waiting when the loop gets to the request, in one list: a loop
        behind the engine writes one frame per request per wake-up, not one per step); raise
        RequestFailed on an error (after the outputs before it) or silence; abort it if the
        caller stops listening."""
        loop = asyncio.get_running_loop()
        outputs = StepQueue(loop)
        listen = self.mailbox.listener(loop, outputs)

        def start(engine: EngineCore) -> None:
            engine.check_new_id(request_id)  # before a refused one takes the listener
            self.loop.subscribe(request_id, listen)
            try:
                add(engine)
            except BaseException:
                self.loop.unsubscribe(request_id)
                raise
        await self._on_engine(start)
        finished = False
        silence = IdleTimeout()  # one timer for the whole stream, not one per step
        try:
            while not finished:
                try:
                    outs = await silence.wait(outputs.get(), self.config.request_timeout_s)
                except TimeoutError:
                    raise RequestFailed(f"request {request_id} produced nothing for "
                                        f"{self.config.request_timeout_s}s") from None
                if merge and not outputs.empty():
                    outs = list(outs)  # the mailbox's list stays as it was
                    while not outputs.empty():
                        outs += outputs.get_nowait()
                failed, finished = _scan(outs)
                if failed is not None:
                    if failed:
                        yield outs[:failed]
                    raise RequestFailed(str(outs[failed].error))
                yield outs
        finally:
            silence.close()
            if not finished:
                self.loop.call(lambda e: self._drop(e, request_id))

    def _drop(self, engine: EngineCore, request_id: str) -> None:
        self.loop.unsubscribe(request_id)
        engine.abort(request_id, "client went away")


def _scan(outs: list[StepOutput]) -> tuple[int | None, bool]:
    """(index of the first output with an error or None, whether one finishes the request):
    one pass, once per request per step."""
    finished = False
    for i, out in enumerate(outs):
        if out.error is not None:
            return i, finished
        finished = finished or out.finish_reason is not None
    return None, finished


def _load_report(engine: EngineCore) -> dict[str, Any]:
    """The queue and cache fields of `LoadReply`."""
    s, bs = engine.scheduler, engine.config.block_size
    return {"num_waiting": len(s.waiting), "num_running": len(s.running),
            "queued_prefill_tokens": sum(q.num_uncomputed for q in (*s.waiting, *s.running)
                                         if q.num_uncomputed > 1),
            "running_tokens": sum(len(q) for q in s.running),
            "free_kv_tokens": engine.blocks.num_free_blocks * bs,
            "kv_capacity_tokens": engine.config.kv_capacity_tokens,
            "engine_lost_s": round(engine.lost_s, 6)}


def _retrieved(done: asyncio.Future[Any]) -> None:
    """A load that failed raises for each request that awaits it, and is not logged as an
    exception nobody retrieved where none did."""
    if not done.cancelled():
        done.exception()
