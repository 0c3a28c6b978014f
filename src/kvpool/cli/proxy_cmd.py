"""`kvpool proxy`: the OpenAI-compatible front of a prefill/decode cluster (docs/serve.md)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import replace

from kvpool.cli.security import add_security_args, bind_refusal
from kvpool.conductor import ADMISSION_POLICIES, PREFILL_POLICIES
from kvpool.errors import ConfigError, KvpoolError
from kvpool.serve.config import BACKENDS, KV_TRANSFER_MODES, ProxyConfig
from kvpool.token import env_token

_D = ProxyConfig(model_dir="")
API_KEY_ENV = "KVPOOL_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("proxy", help="OpenAI-compatible proxy scheduling over workers")
    p.add_argument("--model", required=True,
                   help="model folder (tokenizer.json, config.json), GGUF file, smollm2 or tiny")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", default="",
                   help="name served in /v1/models (default: the model's own name)")
    p.add_argument("--host", default=_D.host)
    p.add_argument("--port", type=int, default=_D.port)
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill (or colocated 'both') worker; repeat for more")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode worker; repeat for more")
    add_backend_args(p)
    add_process_args(p)
    _add_scheduling_args(p)
    _add_leg_args(p)
    _add_front_args(p)
    p.set_defaults(func=run)


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """The conductor: its policies, objectives and cost model."""
    p.add_argument("--prefill-policy", default=_D.prefill_policy, choices=sorted(PREFILL_POLICIES))
    p.add_argument("--admission", default=_D.admission, choices=sorted(ADMISSION_POLICIES))
    add_slo_args(p, _D.ttft_slo_s, _D.tbt_slo_s)
    p.add_argument("--decode-horizon", type=float, default=_D.decode_horizon_s,
                   help="seconds a request is assumed to decode (predicted early rejection)")
    p.add_argument("--cost", default=None, metavar="JSON",
                   help="cost model for the conductor's predictions (kvpool sim fit --out)")
    p.add_argument("--fit-cost", action="store_true",
                   help="refit the prefill cost model from the prefill times workers report")
    p.add_argument("--direct-below-tokens", type=int, default=_D.direct_below_tokens,
                   metavar="N", help="conditional disaggregation: a request whose uncached "
                   "part is at most N tokens goes straight to its decode worker (0: never)")


def _add_leg_args(p: argparse.ArgumentParser) -> None:
    """How the legs are streamed and handed over, and how often workers are polled."""
    p.add_argument("--stream-interval", type=int, default=_D.stream_interval, metavar="N",
                   help="kvpool workers: after a stream's first frame, one frame (one SSE "
                   "chunk) every N output tokens (default: each worker's own)")
    p.add_argument("--whole-interval", type=int, default=_D.whole_interval, metavar="N",
                   help="kvpool workers: a response that is not streamed (and has no stop "
                   "strings) is relayed from frames of N output tokens: fewer reads, and at "
                   "most N tokens recomputed when its decode worker fails (0: as streams; "
                   f"default {_D.whole_interval})")
    p.add_argument("--no-merge-frames", dest="merge_frames", action="store_false",
                   help="kvpool workers: one SSE chunk per engine step, even when the worker "
                   "or the proxy fell behind (default: the steps missed go as one chunk); with "
                   "either backend, a stream's chunks are then written together per wake-up")
    p.add_argument("--prompt-cache-mib", type=float, default=_D.prompt_cache_mib,
                   metavar="MIB", help="memory for each of what the proxy remembers of "
                   "prompts: the token ids of their pieces between special tokens (a chat's "
                   "earlier turns, its system prompt), and with --backend vllm on vLLM's "
                   "sha256_cbor chain their blocks' digests; 0: off")
    p.add_argument("--no-read-relay", dest="read_relay", action="store_false",
                   help="every chunk of a stream through the proxy's generators (default: a "
                   "streamed choice of text alone is relayed in the "
                   "worker connection's read callback)")
    p.add_argument("--worker-sse", action="store_true",
                   help="kvpool workers: streamed choices without logprobs or echo get their "
                   "SSE text chunks from the decoding worker, relayed as they come (default: "
                   "the proxy detokenizes and makes them)")
    p.add_argument("--kv-transfer", default=_D.kv_transfer, choices=KV_TRANSFER_MODES,
                   help="prefill -> decode KV handoff: through the pool, or pushed (kvpool "
                        "workers); vllm: pool (a store connector, or NIXL's params relayed) "
                        "or mooncake (vLLM's MooncakeConnector, a shared transfer id)")
    p.add_argument("--poll-interval", type=float, default=_D.poll_interval_s,
                   help="seconds between /load polls of each worker")
    p.add_argument("--loop-poll-us", type=int, default=_D.loop_poll_us, metavar="US",
                   help="the event loop polls instead of sleeping until US microseconds after "
                   "the last request or worker bytes came: lower latency at low load, for "
                   f"CPU while it polls; 0 always sleeps (default {_D.loop_poll_us})")


def _add_front_args(p: argparse.ArgumentParser) -> None:
    """What the proxy's clients must send and may open."""
    add_security_args(p, "the workers and the proxy's own admin endpoints (/workers/register, "
                      "/stats/samples) require")
    p.add_argument("--max-body-bytes", type=int, default=_D.max_body_bytes,
                   help=f"largest request body (default {_D.max_body_bytes}; 413 beyond)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access-log line per request")
    add_api_key_args(p)
    p.add_argument("--restart-counts", default=None, metavar="JSON",
                   help="export the restart counts a supervisor keeps in this file "
                   "({process: restarts}; kvpool up passes it) as kvpool_up_restarts_total")
    p.add_argument("--max-connections", type=int, default=_D.http_limits.max_concurrency,
                   help="open connections and streams at once (the idlest is closed for a "
                        f"new one; 503 beyond; default {_D.http_limits.max_concurrency})")


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=_D.backend, choices=BACKENDS,
                   help="the engines behind the proxy: kvpool workers, or unmodified vLLM "
                        "OpenAI servers (docs/serve.md, kvpool in front of vLLM)")
    p.add_argument("--colocated", action="append", default=[], metavar="URL",
                   help="vllm: an instance that prefills and decodes; repeat for more "
                   "(URL#dpR: rank R of a server run with --data-parallel-size)")
    p.add_argument("--engine-model", default=_D.engine_model, metavar="NAME",
                   help="vllm: the model name the instances serve (default: the first "
                        "instance's; every other must serve it)")
    p.add_argument("--engine-block-size", type=int, default=_D.engine_block_size,
                   help="vllm: the instances' --block-size (default: from their /metrics)")
    p.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="vllm: bind this ZMQ endpoint for the instances' KV events (their "
                        "--kv-events-config endpoint; topic = the instance's URL)")
    p.add_argument("--kv-events-replay", action="append", default=[], metavar="URL=ENDPOINT",
                   help="vllm: an instance's replay endpoint (its --kv-events-config "
                        "replay_endpoint), read when it joins, restarts or skips events")
    p.add_argument("--pool-topic", default=_D.pool_topic, metavar="TOPIC",
                   help="vllm: the topic of the pool's KV events (the kvpool master's "
                        "--kv-events-topic, sent to --kv-events; '' = ignore the pool)")
    p.add_argument("--pd-pool-wait-s", type=float, default=_D.pd_pool_wait_s, metavar="S",
                   help="vllm, P/D through a store connector: the decode leg waits up to S s "
                        "after the prefill reply for the pool's events to show the prompt's "
                        "blocks (the connector writes them after replying); 0 = no wait")
    p.add_argument("--hash-algo", default=_D.hash_algo, choices=("", "sha256", "sha256_cbor"),
                   help="vllm: the instances' --prefix-caching-hash-algo (default: what their "
                        "/metrics report, else sha256)")
    p.add_argument("--mooncake-bootstrap", action="append", default=[], metavar="URL=BOOTSTRAP",
                   help="vllm, --kv-transfer mooncake: an instance's Mooncake bootstrap server "
                        "(default: its host, port 8998, vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT)")
    p.add_argument("--hash-seed", default=None, metavar="SEED",
                   help="vllm: the instances' PYTHONHASHSEED, if they set one")


def add_process_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N proxy processes accepting on one port, each seeing the others' "
                        "bookings (one core each; not with --kv-events)")
    for flag in ("--listen-fd", "--peer-index", "--num-peers"):  # set by --workers
        p.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer-dir", default="", help=argparse.SUPPRESS)


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="the OpenAI API needs `Authorization: Bearer KEY` (repeat for several "
                        f"keys; also ${API_KEY_ENV}, comma-separated)")
    p.add_argument("--salt-per-api-key", action="store_true",
                   help="each API key's requests reuse only each other's prefixes (and see "
                        "only their own cached_tokens)")


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key values, else those of $KVPOOL_API_KEY."""
    keys = args.api_key or [k for k in os.environ.get(API_KEY_ENV, "").split(",")]
    return tuple(k.strip() for k in keys if k.strip())


def add_slo_args(p: argparse.ArgumentParser, ttft_s: float, tbt_s: float) -> None:
    p.add_argument("--ttft-slo-s", "--ttft-slo", dest="ttft_slo", type=float, default=ttft_s,
                   help=f"TTFT objective, seconds (default {ttft_s:g})")
    p.add_argument("--tbt-slo-s", "--tbt-slo", dest="tbt_slo", type=float, default=tbt_s,
                   help=f"TBT objective, seconds (default {tbt_s:g})")
    p.add_argument("--ttft-slo-relative", type=float, default=None, metavar="K",
                   help="each request's TTFT limit is K x its own unloaded TTFT (instead of "
                        "--ttft-slo-s)")


def config_from_args(args: argparse.Namespace) -> ProxyConfig:

    from kvpool.serve.models import resolve_model

    return ProxyConfig(
        model_dir=str(resolve_model(args.model)), model_name=args.model_name, host=args.host, port=args.port,
        prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
        colocated_urls=tuple(args.colocated), backend=args.backend,
        direct_below_tokens=args.direct_below_tokens, stream_interval=args.stream_interval,
        whole_interval=args.whole_interval,
        worker_sse=args.worker_sse, merge_frames=args.merge_frames,
        read_relay=args.read_relay, prompt_cache_mib=args.prompt_cache_mib,
        engine_model=args.engine_model, engine_block_size=args.engine_block_size,
        kv_events=args.kv_events, pool_topic=args.pool_topic,
        pd_pool_wait_s=args.pd_pool_wait_s, hash_algo=args.hash_algo, hash_seed=args.hash_seed,
        kv_events_replay=tuple(_pair(v, "--kv-events-replay") for v in args.kv_events_replay),
        mooncake_bootstrap=tuple(_pair(v, "--mooncake-bootstrap")
                                 for v in args.mooncake_bootstrap),
        prefill_policy=args.prefill_policy, admission=args.admission,
        ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
        ttft_slo_relative=args.ttft_slo_relative,
        decode_horizon_s=args.decode_horizon, cost_path=args.cost, fit_cost=args.fit_cost,
        kv_transfer=args.kv_transfer, poll_interval_s=args.poll_interval,
        loop_poll_us=args.loop_poll_us,
        token=args.token or env_token(), access_log=args.access_log,
        max_body_bytes=args.max_body_bytes, api_keys=api_keys_from(args),
        salt_per_api_key=args.salt_per_api_key, restart_counts_path=args.restart_counts,
        peer_dir=args.peer_dir, peer_index=args.peer_index or 0,
        num_peers=args.num_peers or max(1, args.workers),
        http_limits=replace(_D.http_limits, max_concurrency=args.max_connections))


def _pair(value: str, flag: str) -> tuple[str, str]:
    """URL=ADDRESS (split at the first '='; a URL has none before its query)."""
    url, sep, address = value.partition("=")
    if not sep or not url or not address:
        raise ConfigError(f"{flag} takes URL=ADDRESS, got {value!r}")
    return url.rstrip("/"), address


def run(args: argparse.Namespace) -> int:
    from kvpool.metadata.http_serving import serve
    from kvpool.serve.app import create_app

    refusal = bind_refusal("proxy", args.host, args.token or env_token(), args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
        if args.workers > 1:
            from kvpool.launch.proxy_group import run_group

            return run_group(args.argv, config.host, config.port, args.workers,
                             config.http_limits.backlog)
        app = create_app(config)
    except (KvpoolError, OSError) as exc:
        print(f"kvpool proxy: {exc}", file=sys.stderr)
        return 2
    sockets = None if args.listen_fd is None else [socket.socket(fileno=args.listen_fd)]
    serve(app, config.host, config.port, config.http_limits, sockets=sockets,
          fast=True, hold_heads=True,  # a response's first bytes follow its head at once
          timeout_graceful_shutdown=5)
    return 0
