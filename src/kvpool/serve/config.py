"""Settings of the proxy: one frozen dataclass, bounds checked once. The CLI's defaults are
these defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.busypoll import check_window_us
from kvpool.engine.worker.messages import MAX_STREAM_INTERVAL
from kvpool.errors import ConfigError
from kvpool.metadata.http_serving import HttpLimits

KV_TRANSFER_MODES = ("pool", "push", "mooncake")
BACKENDS = ("kvpool", "vllm")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    model_dir: str
    """Folder with the model's tokenizer.json, tokenizer_config.json and config.json."""
    model_name: str = ""
    """Name served in /v1/models and required in requests; "" = the folder's name."""
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_urls: tuple[str, ...] = ()
    """Workers given on the command line (role from their /info: prefill or both)."""
    decode_urls: tuple[str, ...] = ()
    colocated_urls: tuple[str, ...] = ()
    """Instances that prefill and decode (vllm backend; kvpool workers say their role)."""
    backend: str = "kvpool"
    """The engines behind the proxy (serve/backend.py): kvpool workers or vLLM servers."""
    engine_model: str = ""
    """vllm: the model name the instances serve (their /v1/models); "" = whatever the first
    one to join serves (every other must serve the same)."""
    engine_block_size: int = 0
    """vllm: the instances' KV block size; 0 = read from their /metrics (cache_config_info),
    else 16."""
    direct_below_tokens: int = 0
    """Conditional disaggregation: a request whose uncached part (its prompt minus the prefix
    the conductor found held) is at most this many tokens skips the prefill instance, and its
    decode instance computes it; 0 = every request is disaggregated."""
    stream_interval: int | None = None
    """kvpool workers: output tokens per frame of a decode leg after the first (fewer frames to
    relay, fewer chunks to the client); None = each worker's own --stream-interval."""
    whole_interval: int = 64
    """kvpool workers: output tokens per frame of a decode leg whose response is one JSON body
    (not streamed, no stop strings, no trace): nobody sees its tokens before the end, so the
    proxy reads a few frames instead of one per step. A frame is also what a leg resumed
    elsewhere starts from: a decode worker that fails costs its replacement at most this many
    tokens recomputed. 0 = as `stream_interval`."""
    merge_frames: bool = True
    """kvpool workers: the steps a decode worker's event loop fell behind go as one frame
    (GenerateRequest.merge_steps), and the frames one read brings as one chunk, as vLLM
    merges its outputs when its API server is behind; False: a chunk per engine step (per
    stream interval), boundaries that do not depend on timing."""
    read_relay: bool = True
    """A streamed choice whose chunks are text alone (no logprobs, echo or trace; one choice)
    takes its decode leg's frames in the worker connection's read callback and writes their
    chunks there, up to a frame in which a stop string may end (serve/responses.py
    `ChoiceRelay`): the same bytes, without a task switch and the generators between the two
    streams per chunk. False: every chunk goes through them."""
    worker_sse: bool = False
    """kvpool workers: a streamed choice without logprobs, echo or trace gets its text chunks
    from its decoding worker (detokenized, stop strings applied there), relayed as they come
    (GenerateRequest.sse); the proxy makes only the first chunk and the usage chunk. Off by
    default: the worker makes text per engine step where the proxy makes it per read, and it
    cost the emulated worker more than it saved the proxy (docs/serve.md)."""
    prompt_cache_mib: float = 64.0
    """What each of the proxy's memories of the prompts it has seen may take: the tokenizer's
    pieces (serve/token_cache.py: the pieces between special tokens, a chat's earlier turns and
    system prompt, are looked up instead of encoded again), and with the vllm backend on
    vLLM's sha256_cbor chain, the blocks' digests (kvevents/hashing.py `BlockHasher`); 0 =
    every prompt encoded and hashed whole."""
    peer_dir: str = ""
    """`kvpool proxy --workers N`: the folder of the processes' booking sockets ("" = one
    process); `peer_index` is this process's, `num_peers` N."""
    peer_index: int = 0
    num_peers: int = 1
    kv_events: str | None = None
    """vllm: the ZMQ endpoint the proxy binds for the instances' KV events (tcp://HOST:PORT);
    None = no events (the conductor sees no instance's cached prefix)."""
    kv_events_replay: tuple[tuple[str, str], ...] = ()
    """vllm with kv_events: (instance URL, its replay endpoint) pairs (its --kv-events-config
    replay_endpoint), read on a join, a restart or a gap; an instance without one relearns."""
    pool_topic: str = "kvpool-pool"
    """vllm with kv_events: the topic of the pool's events (the kvpool master's
    --kv-events-topic, publishing to the same endpoint); "" = ignore the pool."""
    pd_pool_wait_s: float = 5.0
    """vllm with kv_events, P/D through a store connector: after the prefill reply, the decode
    leg waits up to this long for the pool's events to show the prompt's full blocks (the
    connector writes them after the reply); 0 = no wait."""
    hash_algo: str = ""
    """vllm with kv_events: the instances' --prefix-caching-hash-algo (sha256, sha256_cbor);
    "" = what their /metrics report (cache_config_info), else sha256."""
    hash_seed: str | None = None
    """vllm with kv_events: the instances' PYTHONHASHSEED; None = unset there (vLLM's fixed
    default seed)."""
    prefill_policy: str = "kvcache_centric"
    """A name in kvpool.conductor.PREFILL_POLICIES."""
    admission: str = "early_rejection_predicted"
    """A name in kvpool.conductor.ADMISSION_POLICIES."""
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    decode_horizon_s: float = 10.0
    """t_d of predicted early rejection: how long a request is assumed to decode. The
    conductor's default fits the papers' 70B model; a tiny CPU model finishes far sooner."""
    cost_path: str | None = None
    """A CostModel JSON (`kvpool sim fit --out`); None = the default coefficients."""
    fit_cost: bool = False
    """Refit the cost model's prefill coefficients from the prefill times workers report
    (requests that had their prefill worker to themselves), starting from `cost_path`'s."""
    kv_transfer: str = "pool"
    """How the prefill leg hands the KV to the decode leg: through the pool, or pushed
    (kvpool workers); vllm: "pool" relays the prefill reply's kv_transfer_params (a store
    connector, NIXL), "mooncake" drives vLLM's MooncakeConnector (a shared transfer id)."""
    mooncake_bootstrap: tuple[tuple[str, str], ...] = ()
    """kv_transfer mooncake: (instance URL, its Mooncake bootstrap URL) pairs; an instance
    not named has it on its own host at vLLM's default port 8998."""
    poll_interval_s: float = 0.15
    """How often each worker's /load is read."""
    loop_poll_us: int = 1000
    """The event loop polls its sockets instead of sleeping until this long after the last
    request or worker bytes came (kvpool.loop_poll: a sleeping loop pays for a wake-up per
    event, most of what the proxy adds to a request at low load); 0 = it always sleeps."""
    dead_after_failures: int = 2
    """Refused polls in a row after which a worker leaves the rotation."""
    silent_dead_s: float = 10.0
    """A worker that answers no poll for this long leaves the rotation too (hung, stopped)."""
    worker_timeout_s: float = 600.0
    """Backstop on one worker call; a dead worker is detected by polling long before."""
    token: str | None = None
    """Bearer token sent to workers (their --token / KVPOOL_TOKEN)."""
    max_body_bytes: int = 4 << 20
    """A request body over this is a 413, refused before it is read whole."""
    access_log: bool = True
    """One line per request on the `kvpool.serve.access` logger (serve/access.py)."""
    ttft_slo_relative: float | None = None
    """k: each request's TTFT limit is k x its own unloaded TTFT instead of ttft_slo_s."""
    http_limits: HttpLimits = field(default_factory=lambda: HttpLimits(
        max_concurrency=1024, idle_timeout_s=15.0))
    """Connections (streams included) and the deadlines of a connection's request head."""
    api_keys: tuple[str, ...] = ()
    """Bearer keys the OpenAI API requires (any one of them); none = an open API."""
    salt_per_api_key: bool = False
    """Salt every request's cache with its API key: prefixes are reused (and cached_tokens
    reported) only among requests made with the same key (docs/serve.md, cache isolation)."""
    restart_counts_path: str | None = None
    """A JSON file {process: restarts} kept by the cluster's supervisor (`kvpool up`),
    exported on /metrics as kvpool_up_restarts_total."""

    @property
    def prompt_cache_bytes(self) -> int:
        return int(self.prompt_cache_mib * (1 << 20))

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend != "vllm" and self.kv_transfer == "mooncake":
            raise ConfigError("kv_transfer mooncake drives vLLM's MooncakeConnector: it needs "
                              "the vllm backend")
        if self.backend != "kvpool" and self.kv_transfer == "push":
            raise ConfigError(f"kv_transfer push needs kvpool workers; the {self.backend} "
                              f"backend hands the KV over with its own connector")
        if self.num_peers < 1 or not 0 <= self.peer_index < self.num_peers:
            raise ConfigError(f"peer_index must be in 0..num_peers-1, got {self.peer_index} "
                              f"of {self.num_peers}")
        if self.num_peers > 1 and self.kv_events:
            raise ConfigError("--workers N with --kv-events: the events' endpoint is bound by "
                              "one process; run one proxy process to consume KV events")
        if self.pd_pool_wait_s < 0:
            raise ConfigError(f"pd_pool_wait_s must be >= 0, got {self.pd_pool_wait_s}")
        if self.prompt_cache_mib < 0:
            raise ConfigError(f"prompt_cache_mib must be >= 0, got {self.prompt_cache_mib}")
        if self.direct_below_tokens < 0:
            raise ConfigError(f"direct_below_tokens must be >= 0, got {self.direct_below_tokens}")
        if self.stream_interval is not None and not \
                1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(f"stream_interval must be in 1..{MAX_STREAM_INTERVAL}, "
                              f"got {self.stream_interval}")
        if not 0 <= self.whole_interval <= MAX_STREAM_INTERVAL:
            raise ConfigError(f"whole_interval must be in 0..{MAX_STREAM_INTERVAL}, "
                              f"got {self.whole_interval}")
        if self.engine_block_size < 0:
            raise ConfigError(f"engine_block_size must be >= 0, got {self.engine_block_size}")
        if self.kv_transfer not in KV_TRANSFER_MODES:
            raise ConfigError(f"kv_transfer must be one of {KV_TRANSFER_MODES}, "
                              f"got {self.kv_transfer!r}")
        if min(self.poll_interval_s, self.worker_timeout_s, self.silent_dead_s) <= 0:
            raise ConfigError("poll_interval_s, silent_dead_s and worker_timeout_s must be > 0")
        check_window_us("loop_poll_us", self.loop_poll_us)
        if self.dead_after_failures < 1:
            raise ConfigError(f"dead_after_failures must be >= 1, got {self.dead_after_failures}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        _check_fragments(self)


def _check_fragments(config: ProxyConfig) -> None:
    """A worker URL's #dpN names a vLLM server's data-parallel rank (serve/vllm/ranks.py):
    only the vllm backend reads it."""
    urls = (*config.prefill_urls, *config.decode_urls, *config.colocated_urls)
    named = [url for url in urls if "#" in url]
    if named and config.backend != "vllm":
        raise ConfigError(f"{named[0]!r}: #dpN (a data-parallel rank) names a vLLM server's "
                          "rank; a kvpool worker's URL has no fragment")
