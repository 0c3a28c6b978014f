"""KV through the pool and by push: the worker's KVConnector.

Pool layout (docs/engine.md):

    block_key(h, layer)   one object per full block per layer: K bytes then V bytes
                          (2 * block_bytes), h = the block's chained prefix hash (the vLLM
                          face keys it as vLLM's store connector would: `name_blocks`)
    request_key(rid)      a request's last, partial block, all layers: K0 V0 K1 V1 ...
                          (2 * num_layers * block_bytes); read once by the decode worker

A prefill worker stores each new full block layer by layer while it computes: after layer i
of a forward has written its KV, a background thread puts layer i's objects while layer i+1
computes. When the request finishes it waits for those puts (the reply promises the KV is in
place), then, by plan, puts the full blocks that came from its local cache and the partial
block (`PoolPlan`), or writes every block straight into the decode worker's reserved memory
(`PushPlan`).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpool.engine.blocks import block_key, request_key
from kvpool.engine.connector import KVConnector, KVFailure
from kvpool.engine.kv_layout import KVLayout
from kvpool.engine.scheduler import ScheduledBatch
from kvpool.engine.sequence import KVSource, Sequence
from kvpool.engine.worker.kv_store import KVStore, KVTransport, Part
from kvpool.errors import KvpoolError
from kvpool.log import get_logger

log = get_logger("engine.pool")
BlockKeyFn = Callable[[int, int], str]
"""A full block's pool key by its hash and layer (`block_key`, or an engine face's own)."""
DAMAGED = "CHECKSUM_MISMATCH"
"""The read code of pool bytes that fail their checksum: the store client has the replica
dropped, and a decode leg computes the KV instead of failing."""


@dataclass(frozen=True)
class PoolPlan:
    """Leave the whole prompt's KV in the pool for the decode worker."""


@dataclass(frozen=True)
class PushPlan:
    """Write the prompt's KV into the decode worker's reserved regions."""

    segment: str
    regions: list[Part]  # (addr, bytes), in `push_parts` order
    push_by: float = math.inf
    """time.monotonic() after which the reservation may be gone: no push starts then."""


def push_parts(cache: KVLayout, block_ids: list[int]) -> list[Part]:
    """Every block's K and V for every layer: block-major, then layer, then K, V."""
    return [part for b in block_ids for part in cache.block_parts(b)]


class LayerSaver:
    """A thread that puts (layer, blocks) objects in the pool as the forward hands them over."""

    def __init__(self, store: KVStore, cache: KVLayout) -> None:
        self.store, self.cache = store, cache
        self.key_of: BlockKeyFn = block_key
        self._queue: queue.Queue[tuple[int, list[tuple[int, int]]] | None] = queue.Queue()
        self._failures: dict[int, str] = {}
        """Block hash -> why its put failed, until the request holding it asks (`flush`)."""
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvpool-kv-saver")
        self._thread.start()

    def submit(self, layer: int, blocks: list[tuple[int, int]]) -> None:
        """blocks: (hash, block_id) whose layer-`layer` KV is complete."""
        self._queue.put((layer, blocks))

    def wait(self) -> None:
        """Wait until every submitted put has read its blocks."""
        self._queue.join()

    def flush(self, hashes: Iterable[int]) -> list[str]:
        """Wait as `wait`; returns (and forgets) the failures of the blocks of `hashes` (one
        request's: another's failures are its own)."""
        self._queue.join()
        return [f for h in hashes if (f := self._failures.pop(h, None)) is not None]

    def forget(self, hashes: Iterable[int]) -> None:
        """Drop the failures of the blocks of `hashes` (a request that ended otherwise)."""
        for h in hashes:
            self._failures.pop(h, None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._put(*item)
            except Exception as exc:  # a failed put must not kill the thread
                for h, _ in item[1]:
                    self._failures[h] = f"{type(exc).__name__}: {exc}"
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _put(self, layer: int, blocks: list[tuple[int, int]]) -> None:
        keys = [self.key_of(h, layer) for h, _ in blocks]
        parts = [[self.cache.layer_part(b, layer)] for _, b in blocks]
        results = self.store.batch_put_from_parts(keys, parts)
        for (h, _), key, result in zip(blocks, keys, results, strict=True):
            if not result.ok:
                self._failures[h] = f"put {key}: {result.code.name}"


class PoolConnector(KVConnector):
    """`store` is the pool (a StoreClient in a worker; None: no pool); `transfer` the engine
    pushes use (the worker's TransferEngine)."""

    def __init__(self, cache: KVLayout, store: KVStore | None, transfer: KVTransport,
                 save_blocks: bool, save_planned_only: bool = False) -> None:
        self.cache, self.transfer = cache, transfer
        self.store = store
        self.bs = cache.block_size
        self.plans: dict[str, PoolPlan | PushPlan] = {}
        self.saver = LayerSaver(store, cache) if store is not None and save_blocks else None
        self.save_planned_only = save_planned_only
        """Only the blocks of requests with a hand-over plan (a `both` worker's prefill legs,
        not what it serves whole) go to the pool as they are computed."""
        self._pending: list[tuple[int, int]] = []
        self.num_recomputed = 0
        """Requests whose KV the pool held damaged, computed here instead (`_recompute`)."""
        self.key_of: BlockKeyFn = block_key
        self.reads_prefixes = True
        """Whether a request computed here loads the prefix blocks the pool holds (a store
        connector's lookup). False: only a P/D decode leg's prompt blocks are loaded
        (`Sequence.joins_prefilled`), as vLLM's NIXL connector pulls the prefill instance's
        blocks and nothing else (the vLLM face's --kv-connector nixl)."""

    def name_blocks(self, key_of: BlockKeyFn) -> None:
        """Key full blocks in the pool by `key_of` from now on (the vLLM face names them as
        vLLM's store connector does, engine/worker/vllm_names.py)."""
        self.key_of = key_of
        if self.saver is not None:
            self.saver.key_of = key_of

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()

    # -- loading at admission ----------------------------------------------------------------

    def load(self, seq: Sequence) -> KVFailure | None:
        if seq.kv_source is KVSource.COMPUTE and \
                (not seq.reuses_kv or not (self.reads_prefixes or seq.joins_prefilled)):
            return None
        limit = (len(seq) - 1) // self.bs  # full blocks that may be loaded
        first = seq.num_computed_tokens // self.bs
        store = self.store
        t0 = time.perf_counter()
        loaded, why = self._load_blocks(store, seq, first, limit) if store is not None else (0, "")
        seq.pool_load_s = time.perf_counter() - t0
        seq.num_pool_tokens = loaded * self.bs
        seq.num_computed_tokens += seq.num_pool_tokens
        if seq.kv_source is not KVSource.POOL:
            return None
        if store is None:
            return KVFailure("this worker has no pool (--master) to load KV from",
                             self._unloaded(seq, first + loaded, limit))
        if first + loaded < limit:
            if why == DAMAGED:
                self._recompute(store, seq, f"block {first + loaded}")
                return None
            return KVFailure(f"KV of block {first + loaded} of request {seq.request_id} could "
                             f"not be read from the pool ({why})",
                             self._unloaded(seq, first + loaded, limit))
        return self._load_partial(store, seq, limit)

    def _unloaded(self, seq: Sequence, start: int, limit: int) -> frozenset[int]:
        """The cache blocks of a pool load that stopped at full block `start`: the full
        blocks start..limit-1, and the partial last block of the prompt if it has one."""
        end = limit + 1 if seq.num_prompt_tokens % self.bs else limit
        return frozenset(seq.block_table[start:end])

    def _recompute(self, store: KVStore, seq: Sequence, what: str) -> None:
        """The pool held damaged bytes for `seq` (the store client had the replica dropped):
        compute what was not loaded here instead, as after a preemption (the tokens it
        already has, the prefill's first included, are recomputed, not sampled again), and
        drop the partial block the prefill left, which nobody reads now."""
        log.warning("request %s: KV of %s in the pool is damaged; computing it here",
                    seq.request_id, what)
        self.num_recomputed += 1
        seq.kv_source = KVSource.COMPUTE
        if seq.num_prompt_tokens % self.bs:
            store.remove(request_key(seq.request_id), force=True)

    def _load_blocks(self, store: KVStore, seq: Sequence, first: int,
                     limit: int) -> tuple[int, str]:
        """Load blocks first..limit-1 (all layers); how many leading ones arrived whole, and
        why the next one did not."""
        layers = range(self.cache.num_layers)
        keys = [self.key_of(seq.block_hashes[i], layer) for i in range(first, limit)
                for layer in layers]
        if not keys:
            return 0, ""
        parts = [[self.cache.layer_part(seq.block_table[i], layer)]
                 for i in range(first, limit) for layer in layers]
        results = store.batch_get_into_parts(keys, parts)
        for j in range(0, len(results), len(layers)):
            bad = [r for r in results[j:j + len(layers)] if not r.ok]
            if bad:
                return j // len(layers), bad[0].code.name
        return limit - first, ""

    def _load_partial(self, store: KVStore, seq: Sequence, limit: int) -> KVFailure | None:
        if seq.num_prompt_tokens % self.bs:
            key = request_key(seq.request_id)
            result = store.batch_get_into_parts(
                [key], [self._partial_parts(seq.block_table[limit])])[0]
            if result.code.name == DAMAGED:
                self._recompute(store, seq, "the last block")
                return None
            if not result.ok:
                return KVFailure(f"last block of request {seq.request_id} could not be read "
                                 f"from the pool ({result.code.name})",
                                 self._unloaded(seq, limit, limit))
            store.remove(key, force=True)  # our own read lease would refuse a plain remove
        seq.num_computed_tokens = seq.num_prompt_tokens
        return None

    def _partial_parts(self, block_id: int) -> list[Part]:
        """The `request_key` object: K0 V0 K1 V1 ..., one range per layer."""
        return [self.cache.layer_part(block_id, layer) for layer in range(self.cache.num_layers)]

    # -- saving while computing ----------------------------------------------------------------

    def before_step(self) -> None:
        # The puts of the last forward's last layers may still be reading blocks that this
        # step's scheduling could free (preemption, abort) and hand to another sequence.
        if self.saver is not None:
            self.saver.wait()

    def on_abort(self, seq: Sequence) -> None:
        self.plans.pop(seq.request_id, None)
        if self.saver is not None:
            self.saver.forget(seq.block_hashes)

    def before_forward(self, batch: ScheduledBatch) -> None:
        self._pending = []
        if self.saver is None:
            return
        for seq, n in batch:
            if self.save_planned_only and seq.request_id not in self.plans:
                continue
            done = min((seq.num_computed_tokens + n) // self.bs, len(seq.block_hashes))
            for i in range(seq.num_computed_tokens // self.bs, done):
                self._pending.append((seq.block_hashes[i], seq.block_table[i]))

    def on_layer(self, layer: int) -> None:
        if self._pending and self.saver is not None:
            self.saver.submit(layer, self._pending)

    # -- handing the KV over -----------------------------------------------------------------

    def on_finish(self, seq: Sequence) -> KVFailure | None:
        plan = self.plans.pop(seq.request_id, None)
        failures = self.saver.flush(seq.block_hashes) if self.saver is not None else []
        if plan is None:
            return None
        try:
            if isinstance(plan, PushPlan):
                return self._push(seq, plan)
            if failures:
                return KVFailure(f"storing KV in the pool failed: {failures[0]} "
                                 f"({len(failures)} in all)")
            return self._put_rest(seq)
        except KvpoolError as exc:
            return KVFailure(f"{type(exc).__name__}: {exc}")

    def _push(self, seq: Sequence, plan: PushPlan) -> KVFailure | None:
        if time.monotonic() >= plan.push_by:  # its blocks may be another request's by now
            return KVFailure("the decode worker's reservation ran out before the prompt's "
                             "KV could be pushed")
        num_blocks = -(-seq.num_prompt_tokens // self.bs)
        local = push_parts(self.cache, seq.block_table[:num_blocks])
        if len(local) != len(plan.regions) or any(a[1] != b[1] for a, b in zip(local, plan.regions, strict=True)):
            return KVFailure(f"decode worker reserved {len(plan.regions)} regions, the prompt "
                             f"needs {len(local)} of {self.cache.block_bytes} bytes")
        items = [(addr, remote, n) for (addr, n), (remote, _) in zip(local, plan.regions, strict=True)]
        self.transfer.batch_write(plan.segment, items)
        return None

    def _put_rest(self, seq: Sequence) -> KVFailure | None:
        """The full blocks that came from the local cache (the pool may have dropped them since
        they were computed; a put of a key still there writes nothing), and the partial one.
        Blocks computed now were put by the saver; blocks loaded from the pool are there."""
        if self.store is None:
            return KVFailure("this worker has no pool (--master) to leave the KV in")
        full = seq.num_prompt_tokens // self.bs
        hits = min(seq.num_cached_tokens // self.bs, full)
        layers = range(self.cache.num_layers)
        keys = [self.key_of(seq.block_hashes[i], layer) for i in range(hits) for layer in layers]
        parts = [[self.cache.layer_part(seq.block_table[i], layer)]
                 for i in range(hits) for layer in layers]
        if seq.num_prompt_tokens % self.bs:
            keys.append(request_key(seq.request_id))
            parts.append(self._partial_parts(seq.block_table[full]))
        results = self.store.batch_put_from_parts(keys, parts) if keys else []
        bad = [(k, r.code.name) for k, r in zip(keys, results, strict=True) if not r.ok]
        return KVFailure(f"storing KV in the pool failed: put {bad[0][0]}: {bad[0][1]}") \
            if bad else None
