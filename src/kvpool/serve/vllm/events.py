"""The vLLM instances' KV events, for the conductor (kvpool.kvevents): the proxy binds the one
endpoint every instance publishes to (its `--kv-events-config` endpoint; topic = the
instance's URL as the proxy names it), a `CacheIndex` holds each instance's cached blocks, and
a `BlockHasher` computes a request's chain as the instances do (their hash algorithm, seed and
block size). The kvpool master's pool events (`kvpool master --kv-events-endpoint`, the same
endpoint) arrive under their own topic (`pool_topic`, the master's `--kv-events-topic`): the
blocks the pool holds, which every instance loads through its store connector.

An instance whose events never match a single computed hash (another algorithm, seed or block
size than configured here: routing on its events would be blind) is said loudly: one error
line, and the gauge `kvpool_proxy_engine_kv_events_unmatched` at 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpool.kvevents.hashing import BlockHasher
from kvpool.kvevents.index import CacheIndex
from kvpool.kvevents.subscriber import KvEventSubscriber, offset_port
from kvpool.log import get_logger
from kvpool.serve.vllm.prefixes import POOL_MEDIA, InstancePrefixes
from kvpool.serve.vllm.ranks import Ranks, split_rank

log = get_logger("serve.vllm.events")
DEFAULT_ALGO = "sha256"


class KvEventsFeed:
    """`algo` "" = what each instance's /metrics reports (else sha256); `hash_seed` None =
    vLLM's default (PYTHONHASHSEED unset on the instances)."""

    def __init__(self, endpoint: str, algo: str = "", hash_seed: str | None = None,
                 replay: Mapping[str, str] | None = None, pool_topic: str = "",
                 memo_bytes: int = 0, ranked: Sequence[str] = ()) -> None:
        """`replay`: instance URL (or the pool's topic) -> the replay endpoint it binds;
        `pool_topic`: the pool's events' topic ("" = none expected); `memo_bytes`: what
        each hasher may keep of the blocks it hashed (`BlockHasher`); `ranked`: the
        instances that are data-parallel ranks (serve/vllm/ranks.py), whose events come at
        the endpoint's port plus their rank."""
        self.memo_bytes = memo_bytes
        self.index = CacheIndex()
        self.pool_topic = pool_topic
        ranks = Ranks(ranked)
        self._rank0_named = {url.removesuffix("#dp0").encode() for url in ranked
                             if url.endswith("#dp0")}
        """Servers whose rank 0 is named `URL#dp0` (else by the bare URL)."""
        self.subscriber = KvEventSubscriber(endpoint, self.index,
                                            replay_endpoints=_rank_replays(replay or {}, ranked),
                                            ranks=ranks.max_rank,
                                            rank_topic=self._rank_topic).start()
        self.endpoint = self.subscriber.endpoint
        self.algo, self.hash_seed = algo, hash_seed
        self._hashers: dict[tuple[str, int], BlockHasher] = {}
        self._alarmed: set[str] = set()

    def close(self) -> None:
        self.subscriber.close()

    def _rank_topic(self, rank: int, topic: bytes) -> bytes:
        """The instance a rank's message is for: `URL#dpR` where that rank is named (rank
        0 may be named by its bare URL), else the topic (the bare URL, the pool)."""
        if rank or topic in self._rank0_named:
            return b"%s#dp%d" % (topic, rank)
        return topic

    def rejoined(self, url: str) -> None:
        """`url` joined the rotation (again): it may be a new process with an empty cache."""
        self.subscriber.forget(url)

    def hashes(self, prompt_ids: Sequence[int], block_size: int,
               reported_algo: str | None) -> list[int]:
        algo = self.algo or reported_algo or DEFAULT_ALGO
        hasher = self._hashers.get((algo, block_size))
        if hasher is None:
            hasher = BlockHasher(algo, block_size, self.hash_seed,  # type: ignore[arg-type]
                                 memo_bytes=self.memo_bytes)
            self._hashers[(algo, block_size)] = hasher
        return [int(h) for h in hasher.block_hashes(prompt_ids)]

    def pool_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` the pool holds (0 without a pool topic)."""
        if not self.pool_topic:
            return 0
        return self.index.matched_on_any(self.pool_topic, hashes, POOL_MEDIA)  # type: ignore[arg-type]

    def pool_heard(self) -> bool:
        """Whether the pool has published any event since this proxy started."""
        return bool(self.pool_topic) and self.pool_topic in self.index.instances()

    def prefixes(self, prefill_urls: Sequence[str]) -> InstancePrefixes:
        return InstancePrefixes(self.index, prefill_urls, self.pool_topic)  # type: ignore[arg-type]

    def check(self, url: str) -> bool:
        """Whether `url`'s events never matched a computed hash (logged once, loudly)."""
        unmatched = self.index.never_matched(url)
        if unmatched and url not in self._alarmed:
            self._alarmed.add(url)
            stats = self.index.stats(url)
            log.error("KV events of %s never match a computed block hash (%d lookups met its "
                      "%d cached blocks, 0 matches): its --prefix-caching-hash-algo, "
                      "PYTHONHASHSEED or --block-size differ from this proxy's (--hash-algo "
                      "%s, --hash-seed %s); its cached prefixes are invisible to the conductor",
                      url, stats.num_lookups_with_blocks, self.index.num_blocks(url),
                      self.algo or "from /metrics", self.hash_seed)
        return unmatched

    def gauges(self, urls: Sequence[str]) -> dict[str, dict[str, float]]:
        gauges = {"kv_events_blocks": {u: float(self.index.num_blocks(u)) for u in urls},
                  "kv_events_matches": {u: float(self.index.stats(u).num_matches) for u in urls},
                  "kv_events_unmatched": {u: float(self.check(u)) for u in urls}}
        if self.pool_topic:
            gauges["kv_events_pool_blocks"] = {
                f"{self.pool_topic}/{m}": float(self.index.num_blocks(self.pool_topic, m))
                for m in POOL_MEDIA}
        return gauges


def _rank_replays(replay: Mapping[str, str], ranked: Sequence[str]) -> dict[str, str]:
    """`replay`, and for each rank without an endpoint of its own its server's offset by the
    rank (vLLM binds rank r's replay socket there)."""
    out = dict(replay)
    for url in ranked:
        base, rank = split_rank(url)
        if url not in out and base in replay and rank is not None:
            out[url] = offset_port(replay[base], rank)
    return out
