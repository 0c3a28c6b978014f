"""A worker's edges: a first token outside the vocabulary is refused (not a step failing every
request), a request whose whole sequence cannot fit in the KV cache is refused (not a queue
stalled behind it), a `both` worker's prefill leg leaves its blocks in the pool, a failed put
fails its own request, and a refused duplicate id leaves the running request its stream."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpool.engine.blocks import block_key, prefix_block_hashes
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.sequence import KVSource
from kvpool.engine.worker.kv_store import Part
from kvpool.engine.worker.messages import GenerateRequest, PrefillRequest
from kvpool.engine.worker.pool import PoolPlan
from kvpool.engine.worker.runtime import Worker, WorkerConfig
from kvpool.errors import InvalidArgument
from kvpool.store import ErrorCode, PutResult
from kvpool.transfer import TransferConfig, TransferEngine
from tests.engine.test_pool_connector import MemoryStore, drain, make, prompt


def test_bad_first_token_does_not_kill_other_requests(tiny_llama: Path) -> None:
    async def go() -> tuple[list[int], str | None]:
        w = Worker(WorkerConfig(str(tiny_llama), role="both",
                                engine=EngineConfig(block_size=8, num_blocks=32, max_model_len=64)))
        try:
            good = GenerateRequest(request_id="good", prompt_token_ids=[5, 6, 7],
                                   sampling=SamplingParams(max_tokens=30, ignore_eos=True))
            bad_err: str | None = None
            got: list[int] = []
            it = w.generate(good)
            async for outs in it:
                got += [o.token_id for o in outs if o.token_id is not None]
                if len(got) == 2:
                    bad = GenerateRequest(request_id="bad", prompt_token_ids=[5, 6, 7],
                                          first_token_id=w.engine.vocab_size + 5,
                                          sampling=SamplingParams(max_tokens=4))
                    try:
                        async for _ in w.generate(bad):
                            pass
                    except Exception as exc:  # the bad request may fail: that is fine
                        bad_err = repr(exc)
            return got, bad_err
        finally:
            await w.close()

    got, bad_err = asyncio.run(go())
    assert bad_err is not None and "vocabulary" in bad_err
    assert len(got) == 30  # now: RequestFailed('engine step failed') after 2 tokens


S20 = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("resumed", [0, 12])
def test_a_sequence_larger_than_the_cache_is_refused(tiny_llama: Path, resumed: int) -> None:
    """Its prompt fits, its prompt and max_tokens do not: refused up front (accepted, it would
    preempt itself when it needs one more block and wait at the head of the queue for good,
    with every request behind it)."""
    e = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=4, num_blocks=4, max_model_len=64))
    with pytest.raises(InvalidArgument, match="do not fit"):
        e.add_request("big", list(range(5, 13)), S20, outputs=list(range(30, 30 + resumed)))
    e.add_request("small", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(300):
        e.step()
        if not e.has_work:
            break
    assert not e.has_work


S6 = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("role", ["prefill", "both"])
def test_prefill_on_a_both_worker_leaves_the_prompt_in_the_pool(
        tiny_llama: Path, role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    te = TransferEngine(TransferConfig(host="127.0.0.1")).start()
    store.close = te.close  # type: ignore[attr-defined]  # Worker.close closes the store
    monkeypatch.setattr(Worker, "_connect", lambda self: (store, te))
    p = prompt(21, 2)

    async def go() -> int:
        w = Worker(WorkerConfig(str(tiny_llama), role=role, engine=EngineConfig(block_size=8)))
        try:
            reply = await w.prefill(PrefillRequest(request_id="r", prompt_token_ids=p, sampling=S6))
            return reply.first_token_id
        finally:
            await w.close()

    first = asyncio.run(go())
    decode, _ = make(tiny_llama, store, save=False)
    seq = decode.add_request("r", p, S6, kv_source=KVSource.POOL)
    decode.continue_with(seq, first)
    errors = [o.error for o in drain(decode) if o.error]
    assert errors == []   # both: "KV of block 0 of request r could not be read from the pool"


class FailFor(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.bad: set[str] = set()

    def batch_put_from_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[PutResult]:
        ok = super().batch_put_from_parts(keys, parts)
        return [PutResult(ErrorCode.NO_AVAILABLE_HANDLE) if k in self.bad else r
                for k, r in zip(keys, ok, strict=True)]


def test_a_failed_put_fails_its_own_request(tiny_llama: Path) -> None:
    store = FailFor()
    engine, conn = make(tiny_llama, store, save=True)   # block 8, chunk 12
    pa, pb = prompt(4, 1), prompt(8, 2)          # one 12-token step: A partial only, B one block
    store.bad = {block_key(h, layer) for h in prefix_block_hashes(pb, 8, engine.root_hash)
                 for layer in (0, 1)}
    one = SamplingParams(max_tokens=1)
    for rid, p in (("A", pa), ("B", pb)):
        conn.plans[rid] = PoolPlan()
        engine.add_request(rid, p, one, prefill_only=True)
    ends = {o.request_id: o for o in drain(engine) if o.finish_reason or o.error}
    assert ends["B"].error is not None, "B's blocks were not stored, yet B is reported done"
    assert ends["A"].error is None, f"A failed for B's put: {ends['A'].error}"


CFG = EngineConfig(block_size=8, num_blocks=16, max_model_len=64)


def test_refused_duplicate_does_not_silence_the_running_request(tiny_llama: Path) -> None:
    async def go() -> tuple[int, str, str]:
        w = Worker(WorkerConfig(str(tiny_llama), role="both", engine=CFG, request_timeout_s=3))
        dup_err, run_err, n = "", "", 0
        try:
            req = GenerateRequest(request_id="X", prompt_token_ids=[5, 6, 7],
                                  sampling=SamplingParams(max_tokens=40, ignore_eos=True))
            try:
                async for outs in w.generate(req):
                    n += sum(o.token_id is not None for o in outs)
                    if n == 1:
                        try:
                            async for _ in w.generate(req):
                                pass
                        except Exception as exc:
                            dup_err = repr(exc)
            except Exception as exc:
                run_err = repr(exc)
            return n, dup_err, run_err
        finally:
            await w.close()

    n, dup_err, run_err = asyncio.run(go())
    assert "already running" in dup_err
    assert run_err == "" and n == 40  # now: RequestFailed('... produced nothing for 3s'), n == 1
