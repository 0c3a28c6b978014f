"""The worker's KV connector in one process, over an in-memory stand-in for the store and the
transfer engine: layer-wise puts, prefill -> decode through the pool and by push, and failures."""

from __future__ import annotations

import ctypes
import inspect
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvpool.engine.blocks import block_key, prefix_block_hashes, request_key
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.connector import KVFailure
from kvpool.engine.llm_engine import LLMEngine, StepOutput
from kvpool.engine.sequence import KVSource
from kvpool.engine.sequence import Sequence as KVSequence
from kvpool.engine.tiny import TinySpec, make_tiny
from kvpool.engine.worker.kv_store import KVStore, KVTransport, Part
from kvpool.engine.worker.pool import PoolConnector, PoolPlan, PushPlan, push_parts
from kvpool.errors import TransferError
from kvpool.store import ErrorCode, PutResult, ReadResult

BS = 8
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


class MemoryStore:
    """The `KVStore` protocol over a dict: put/get by (addr, size) parts."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.put_log: list[str] = []

    def batch_put_from_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[PutResult]:
        for key, ps in zip(keys, parts, strict=True):
            self.put_log.append(key)
            self.objects.setdefault(key, b"".join(ctypes.string_at(a, n) for a, n in ps))
        return [PutResult(ErrorCode.OK)] * len(keys)

    def batch_get_into_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[ReadResult]:
        out: list[ReadResult] = []
        for key, ps in zip(keys, parts, strict=True):
            data = self.objects.get(key)
            if data is None:
                out.append(ReadResult(ErrorCode.OBJECT_NOT_FOUND))
                continue
            offset = 0
            for addr, n in ps:
                ctypes.memmove(addr, data[offset:offset + n], n)
                offset += n
            out.append(ReadResult(ErrorCode.OK, len(data)))
        return out

    def remove(self, key: str, force: bool = False) -> ErrorCode:
        return ErrorCode.OK if self.objects.pop(key, None) is not None else ErrorCode.OBJECT_NOT_FOUND


class FullStore(MemoryStore):
    def batch_put_from_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[PutResult]:
        return [PutResult(ErrorCode.NO_AVAILABLE_HANDLE)] * len(keys)


class Memcpy:
    """A transfer engine whose every segment is this process."""

    segment_name = "local"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def batch_write(self, target: str, items: list[tuple[int, int, int]]) -> None:
        if self.fail:
            raise TransferError(f"peer {target} closed the connection")
        for local, remote, n in items:
            ctypes.memmove(remote, local, n)


def _protocol_methods(protocol: type) -> dict[str, list[str]]:
    return {name: list(inspect.signature(fn).parameters)
            for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


@pytest.mark.parametrize(("protocol", "impls"), [
    (KVStore, ["kvpool.store.client.store_client.StoreClient", MemoryStore]),
    (KVTransport, ["kvpool.transfer.engine.TransferEngine", Memcpy]),
])
def test_the_store_and_transport_satisfy_the_connector_protocols(
        protocol: type, impls: list[type | str]) -> None:
    """Each method of the protocol exists with the protocol's parameters first, in order, and
    any further parameter has a default (so the connector's calls bind the same way)."""
    import importlib
    wanted = _protocol_methods(protocol)
    assert sorted(wanted) == (["batch_get_into_parts", "batch_put_from_parts", "remove"]
                              if protocol is KVStore else ["batch_write"])
    for impl in impls:
        if isinstance(impl, str):
            module, _, name = impl.rpartition(".")
            impl = getattr(importlib.import_module(module), name)
        assert isinstance(impl, type) and issubclass(impl, protocol)
        for name, params in wanted.items():
            have = inspect.signature(getattr(impl, name)).parameters
            assert list(have)[:len(params)] == params, (impl, name)
            extra = list(have.values())[len(params):]
            assert all(p.default is not inspect.Parameter.empty for p in extra), (impl, name)


def make(model_dir: Path, store: MemoryStore | None, save: bool,
         transfer: Memcpy | None = None, dtype: str = "float32") -> tuple[LLMEngine, PoolConnector]:
    engine = LLMEngine.from_dir(model_dir, EngineConfig(block_size=BS, num_blocks=32,
                                                        max_prefill_chunk=12, dtype=dtype))
    conn = PoolConnector(engine.cache, store, transfer or Memcpy(), save_blocks=save)
    engine.connector = conn
    return engine, conn


def drain(engine: LLMEngine) -> list[StepOutput]:
    outs: list[StepOutput] = []
    while engine.has_work:
        outs += engine.step()
    return outs


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_blocks_are_put_layer_by_layer_while_computing(tiny_llama: Path) -> None:
    store = MemoryStore()
    engine, conn = make(tiny_llama, store, save=True)
    assert conn.saver is not None
    submitted: list[int] = []
    real_submit = conn.saver.submit
    conn.saver.submit = lambda layer, blocks: (submitted.append(layer), real_submit(layer, blocks))  # type: ignore[method-assign]
    p = prompt(20, 1)  # 12 + 8 tokens in two chunks: blocks 0 and 1 are full
    conn.plans["r"] = PoolPlan()
    seq = engine.add_request("r", p, GREEDY, prefill_only=True)
    engine.step()
    assert submitted == [0, 1]  # block 0 became full in the first chunk, at each layer
    drain(engine)
    assert submitted == [0, 1, 0, 1]
    keys = [block_key(h, layer) for h in seq.block_hashes for layer in (0, 1)]
    assert store.put_log[:4] == keys
    assert set(store.objects) == {*keys, request_key("r")}


def test_prefill_to_decode_through_the_pool(tiny_llama: Path) -> None:
    store = MemoryStore()
    p = prompt(21, 2)
    want = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=BS)).generate([p], GREEDY)[0]
    prefill, conn = make(tiny_llama, store, save=True)
    conn.plans["r"] = PoolPlan()
    prefill.add_request("r", p, GREEDY, prefill_only=True)
    first = [o.token_id for o in drain(prefill) if o.token_id is not None]
    decode, _ = make(tiny_llama, store, save=False)
    seq = decode.add_request("r", p, GREEDY, kv_source=KVSource.POOL)
    decode.continue_with(seq, first[0])
    drain(decode)
    assert seq.num_pool_tokens == 16 and seq.output_ids == want
    assert request_key("r") not in store.objects  # the decode worker took the partial block
    # KV moved through the pool is the prefill's KV, bit for bit
    for i, block_id in enumerate(seq.block_table[:3]):
        assert torch.equal(decode.cache.kv[:, block_id], prefill.cache.kv[:, i])


class DamagedStore(MemoryStore):
    """Reads of `damaged` keys fail their checksum (the real client has them dropped)."""

    def __init__(self, damaged: set[str]) -> None:
        super().__init__()
        self.damaged = damaged

    def batch_get_into_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[Part]]) -> list[ReadResult]:
        out = super().batch_get_into_parts(keys, parts)
        return [ReadResult(ErrorCode.CHECKSUM_MISMATCH) if k in self.damaged else r
                for k, r in zip(keys, out, strict=True)]


@pytest.mark.parametrize("where", ["block", "partial"])
def test_damaged_pool_kv_is_recomputed_by_the_decode_leg(tiny_llama: Path, where: str) -> None:
    """A decode leg whose prompt KV comes back damaged computes it instead: the same output
    as an undisturbed run, and the prefill's partial block is not left behind."""
    store = DamagedStore(set())
    p = prompt(21, 2)
    want = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=BS)).generate([p], GREEDY)[0]
    prefill, conn = make(tiny_llama, store, save=True)
    conn.plans["r"] = PoolPlan()
    prefill.add_request("r", p, GREEDY, prefill_only=True)
    first = [o.token_id for o in drain(prefill) if o.token_id is not None]
    bad = block_key(prefix_block_hashes(p, BS, prefill.root_hash)[1], 1) if where == "block" \
        else request_key("r")
    store.damaged.add(bad)
    decode, dconn = make(tiny_llama, store, save=False)
    seq = decode.add_request("r", p, GREEDY, kv_source=KVSource.POOL)
    decode.continue_with(seq, first[0])
    outs = drain(decode)
    assert [o.error for o in outs if o.error] == []
    assert seq.output_ids == want and dconn.num_recomputed == 1
    assert seq.num_pool_tokens == (BS if where == "block" else 2 * BS)
    assert request_key("r") not in store.objects


def test_prefill_to_decode_by_push(tiny_llama: Path) -> None:
    p = prompt(13, 3)
    want = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=BS)).generate([p], GREEDY)[0]
    decode, _ = make(tiny_llama, None, save=False)
    reserved = decode.reserve_blocks(len(p))
    assert reserved is not None and len(reserved) == 2
    prefill, conn = make(tiny_llama, None, save=False)
    conn.plans["r"] = PushPlan("local", push_parts(decode.cache, reserved))
    prefill.add_request("r", p, GREEDY, prefill_only=True)
    first = [o.token_id for o in drain(prefill) if o.token_id is not None]
    seq = decode.start_pushed("r", p, first[0], GREEDY, reserved)
    drain(decode)
    assert seq.output_ids == want


def test_failed_push_fails_the_request(tiny_llama: Path) -> None:
    prefill, conn = make(tiny_llama, None, save=False, transfer=Memcpy(fail=True))
    conn.plans["r"] = PushPlan("gone", push_parts(prefill.cache, [5, 6]))
    prefill.add_request("r", prompt(13, 4), GREEDY, prefill_only=True)
    outs = drain(prefill)
    assert outs[-1].error is not None and "closed the connection" in outs[-1].error
    assert prefill.blocks.num_free_blocks == 32


def test_no_push_starts_once_the_reservation_may_be_gone(tiny_llama: Path) -> None:
    """A prefill that ends after its reservation's time (it queued long): the push is not
    started (the decode worker may have given the blocks to another request, whose cached KV
    it would overwrite); the request fails instead, and the decode worker's memory is as it
    was."""
    decode, _ = make(tiny_llama, None, save=False)
    reserved = decode.reserve_blocks(13)
    assert reserved is not None
    before = decode.cache.kv.clone()
    prefill, conn = make(tiny_llama, None, save=False)
    conn.plans["r"] = PushPlan("local", push_parts(decode.cache, reserved),
                               push_by=time.monotonic() - 0.001)
    prefill.add_request("r", prompt(13, 3), GREEDY, prefill_only=True)
    outs = drain(prefill)
    assert outs[-1].error is not None and "reservation ran out" in outs[-1].error
    assert torch.equal(decode.cache.kv, before)


def test_kv_missing_from_the_pool_is_an_error(tiny_llama: Path) -> None:
    decode, _ = make(tiny_llama, MemoryStore(), save=False)
    seq = decode.add_request("r", prompt(20, 5), GREEDY, kv_source=KVSource.POOL)
    decode.continue_with(seq, 7)
    outs = drain(decode)
    assert outs[-1].error == ("KV of block 0 of request r could not be read from the pool "
                              "(OBJECT_NOT_FOUND)")


def test_a_failed_load_names_the_blocks_left_without_kv(tiny_llama: Path) -> None:
    """Block 1 of a 20-token prompt (2 full blocks and a partial one) is missing: the load
    fails with the cache blocks it did not fill, block 1's and the partial one's."""
    store = MemoryStore()
    p = prompt(20, 2)
    prefill, conn = make(tiny_llama, store, save=True)
    conn.plans["r"] = PoolPlan()
    prefill.add_request("r", p, GREEDY, prefill_only=True)
    first = [o.token_id for o in drain(prefill) if o.token_id is not None]
    del store.objects[block_key(prefix_block_hashes(p, BS, prefill.root_hash)[1], 0)]
    decode, dconn = make(tiny_llama, store, save=False)
    seen: list[tuple[KVFailure | None, list[int]]] = []
    real_load = dconn.load

    def load(seq: KVSequence) -> KVFailure | None:
        failure = real_load(seq)
        seen.append((failure, list(seq.block_table)))
        return failure
    dconn.load = load  # type: ignore[method-assign]
    seq = decode.add_request("r", p, GREEDY, kv_source=KVSource.POOL)
    decode.continue_with(seq, first[0])
    outs = drain(decode)
    (failure, table), = seen
    assert failure == KVFailure("KV of block 1 of request r could not be read from the pool "
                                "(OBJECT_NOT_FOUND)", frozenset(table[1:3]))
    assert len(table) == 3 and outs[-1].error == failure.reason


def prefilled(engine: LLMEngine, conn: PoolConnector, request_id: str,
              prompt_ids: list[int]) -> None:
    """`prompt_ids` prefilled on `engine`, its full blocks in the pool once this returns."""
    engine.add_request(request_id, prompt_ids, GREEDY, prefill_only=True)
    drain(engine)
    conn.saver.wait()  # type: ignore[union-attr]


def test_prefill_reuses_pool_blocks(tiny_llama: Path) -> None:
    store = MemoryStore()
    shared = prompt(24, 6)
    prefilled(*make(tiny_llama, store, save=True), "a", shared + [1, 2])
    b, _ = make(tiny_llama, store, save=True)
    seq = b.add_request("b", shared + [3, 4, 5], GREEDY)
    drain(b)
    assert seq.num_pool_tokens == 24
    plain = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=BS))
    assert seq.output_ids == plain.generate([shared + [3, 4, 5]], GREEDY)[0]


def test_as_nixl_only_a_decode_leg_loads_its_prompt_from_the_pool(tiny_llama: Path) -> None:
    """The vLLM face's --kv-connector nixl: a request computed here loads no prefix the pool
    holds (the instance's own cache is its reuse); a P/D decode leg loads its prompt's blocks
    (standing in for the pull from its prefill instance), and its output is the same."""
    store = MemoryStore()
    shared = prompt(24, 6)
    a, conn_a = make(tiny_llama, store, save=True)
    prefilled(a, conn_a, "a", shared + [1, 2])
    b, conn_b = make(tiny_llama, store, save=True)
    conn_b.reads_prefixes = False
    plain_seq = b.add_request("b", shared + [3, 4, 5], GREEDY)
    drain(b)
    joined = b.add_request("c", prompt(16, 8) + [1, 2], GREEDY, joins_prefilled=True)
    prefilled(a, conn_a, "a2", joined.token_ids[:joined.num_prompt_tokens])  # before b steps
    drain(b)
    assert (plain_seq.num_pool_tokens, joined.num_pool_tokens) == (0, 16)
    plain = LLMEngine.from_dir(tiny_llama, EngineConfig(block_size=BS))
    assert [plain_seq.output_ids, joined.output_ids] == plain.generate(
        [shared + [3, 4, 5], joined.token_ids[:joined.num_prompt_tokens]], GREEDY)


def test_a_full_pool_fails_a_pool_prefill(tiny_llama: Path) -> None:
    prefill, conn = make(tiny_llama, FullStore(), save=True)
    conn.plans["r"] = PoolPlan()
    prefill.add_request("r", prompt(20, 7), GREEDY, prefill_only=True)
    outs = drain(prefill)
    assert outs[-1].error is not None
    assert outs[-1].error.startswith("storing KV in the pool failed: put kv/")
    assert "NO_AVAILABLE_HANDLE" in outs[-1].error and not conn.plans


@pytest.fixture(scope="module")
def seed0_and_seed7(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one shape (config.json and file sizes alike), other weights."""
    base = tmp_path_factory.mktemp("seeds")
    return make_tiny(base / "s0", TinySpec(seed=0)), make_tiny(base / "s7", TinySpec(seed=7))


def test_other_weights_never_read_each_others_blocks(seed0_and_seed7: tuple[Path, Path]) -> None:
    s0, s7 = seed0_and_seed7
    store = MemoryStore()
    shared = prompt(24, 8)
    a, conn_a = make(s0, store, save=True)
    a.add_request("a", shared + [1, 2], GREEDY, prefill_only=True)
    drain(a)
    conn_a.saver.wait()  # type: ignore[union-attr]
    assert len(store.objects) == 3 * 2  # 3 full blocks x 2 layers
    b, _ = make(s7, store, save=True)
    seq = b.add_request("b", shared + [3, 4, 5], GREEDY)
    drain(b)
    assert seq.num_pool_tokens == 0 and seq.num_cached_tokens == 0
    solo = LLMEngine.from_dir(s7, EngineConfig(block_size=BS))
    assert seq.output_ids == solo.generate([shared + [3, 4, 5]], GREEDY)[0]
    again, _ = make(s0, store, save=False)  # the same checkpoint still finds them
    hit = again.add_request("c", shared + [3, 4, 5], GREEDY)
    drain(again)
    assert hit.num_pool_tokens == 24


def test_another_dtype_never_reads_the_blocks(seed0_and_seed7: tuple[Path, Path]) -> None:
    s0, _ = seed0_and_seed7
    store = MemoryStore()
    shared = prompt(16, 9)
    a, conn_a = make(s0, store, save=True)
    a.add_request("a", shared + [1], GREEDY, prefill_only=True)
    drain(a)
    conn_a.saver.wait()  # type: ignore[union-attr]
    b, _ = make(s0, store, save=False, dtype="bfloat16")
    seq = b.add_request("b", shared + [2, 3], GREEDY)
    drain(b)
    assert seq.num_pool_tokens == 0 and len(seq.output_ids) == GREEDY.max_tokens
