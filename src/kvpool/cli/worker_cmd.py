"""`kvpool worker --role prefill|decode|both --model DIR [--master H:P]`: serve the reference
engine over HTTP (docs/worker-api.md), with KV through the pool or pushed to decode workers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvpool.cli.security import add_security_args, bind_refusal
from kvpool.engine.config import PREFILL_MODES
from kvpool.engine.emulated.profile import DEFAULT_PROFILE, STEP_RULES
from kvpool.engine.model_flags import DEFAULT_MAX_MODEL_LEN, DTYPE_CHOICES, ModelFlags
from kvpool.engine.worker.runtime import ENGINES
from kvpool.errors import KvpoolError
from kvpool.launch.ports import free_port
from kvpool.launch.ready import announce_ready
from kvpool.log import get_logger
from kvpool.token import env_token
from kvpool.units import parse_size

log = get_logger("cli.worker")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="run a prefill, decode or colocated engine worker")
    p.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    p.add_argument("--model", required=True,
                   help="Hugging Face checkpoint folder, GGUF file, smollm2 or tiny")
    p.add_argument("--master", default=None, help="store master HOST:PORT (no pool if absent)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0 = a free one, printed)")
    p.add_argument("--kv-transfer", choices=("pool", "push"), default="pool",
                   help="how a prefill worker hands KV over when the request does not say")
    add_security_args(p, "every call to the worker (and its transfer engine) must carry")
    _add_scheduler_args(p)
    _add_emulated_args(p)
    _add_runtime_args(p)
    _add_vllm_face_args(p)
    p.set_defaults(func=run)


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The KV cache's size and the scheduler's limits."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default 1024; emulated: the profile's KV capacity)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-prefill-chunk", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit, tokens (default: the model's, at most "
                        f"{DEFAULT_MAX_MODEL_LEN}; more than the model's is refused)")
    p.add_argument("--prefill-mode", choices=PREFILL_MODES, default="chunked",
                   help="chunked: decodes ride with prompt chunks; whole: vLLM's old default, "
                        "a step of whole prompts pauses every decode")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="ignore the local cache's prefix hits")
    p.add_argument("--max-prefill-seqs", type=int, default=0,
                   help="prompts computed per step at most (0 = no limit)")


def _add_emulated_args(p: argparse.ArgumentParser) -> None:
    """--engine and what --engine emulated runs."""
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="torch: the reference model; emulated: an accelerator profile's step "
                        "times, real KV bytes (docs/serve.md)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="--engine emulated: a profile JSON or a shipped profile's name")
    p.add_argument("--kv-scale", type=float, default=1 / 1024,
                   help="--engine emulated: share of the profile's KV bytes actually moved")
    p.add_argument("--speed-up", type=float, default=1.0,
                   help="--engine emulated: divide every step time by this")
    p.add_argument("--step-rules", choices=STEP_RULES, default="kvpool",
                   help="--engine emulated: how a step is charged, as the simulator charges "
                        "a kvpool instance or its colocated vLLM v0.5.1 baseline (docs/sim.md)")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Where the model runs, what the worker gives the pool, and how it streams."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights and KV; auto: the checkpoint's torch_dtype (a float16 one "
                        "runs in float32 on the CPU)")
    p.add_argument("--device", default="cpu", help="torch device (cpu; cuda where torch has it)")
    p.add_argument("--dram", default="0", help="DRAM to contribute to the pool, e.g. 1GiB")
    p.add_argument("--remote-timeout", type=float, default=10.0, help="seconds")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="/generate: after the first frame, one frame every N output tokens "
                        "(fewer lines to relay; a request's own stream_interval wins)")


def _add_vllm_face_args(p: argparse.ArgumentParser) -> None:
    """--api vllm and what vLLM's face serves."""
    p.add_argument("--api", choices=("kvpool", "vllm"), default="kvpool",
                   help="the HTTP API served: kvpool's worker API, or vLLM's OpenAI server "
                        "endpoints over the same engine (for `kvpool proxy --backend vllm`)")
    p.add_argument("--served-model-name", default="",
                   help="--api vllm: the model name in /v1/models (default: the folder's)")
    p.add_argument("--kv-events-config", default="", metavar="JSON",
                   help="--api vllm: publish KV events as vLLM does with this config "
                        '(\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://H:P", "topic": "URL"}\'; hashes seeded by '
                        "$PYTHONHASHSEED)")
    p.add_argument("--kv-connector", choices=("store", "nixl"), default="store",
                   help="--api vllm: which vLLM KV connector the face acts as: store (vLLM's "
                        "MooncakeStoreConnector: every request loads the prefix the pool holds) "
                        "or nixl (only a P/D decode leg loads, its prompt's blocks, standing in "
                        "for NIXL's pull from the prefill instance; reuse is the instance's own "
                        "cache alone)")
    p.add_argument("--prefix-caching-hash-algo", default="sha256",
                   choices=("sha256", "sha256_cbor"),
                   help="--api vllm: the block hashes its KV events carry")


def _num_blocks(args: argparse.Namespace) -> int:
    if args.num_blocks is not None:
        return int(args.num_blocks)
    if args.engine == "emulated":
        from kvpool.engine.emulated.profile import load_profile

        return max(2, load_profile(args.profile).kv_capacity_tokens // args.block_size)
    return 1024


def _model_flags(args: argparse.Namespace, model_dir: Path) -> ModelFlags:
    """--dtype, --max-model-len and --device over the model (kvpool.engine.model_flags)."""
    from kvpool.engine.model_flags import checked_flags

    flags = checked_flags(model_dir, args.dtype, args.max_model_len, args.device, args.engine)
    if flags.note:
        log.warning("--dtype auto: %s", flags.note)
    return flags


def run(args: argparse.Namespace) -> int:
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.worker.runtime import Worker, WorkerConfig
    from kvpool.metadata.http_serving import HttpLimits, serve
    from kvpool.serve.models import resolve_model
    refusal = bind_refusal("worker", args.host, args.token or env_token(), args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model)
        flags = _model_flags(args, model_dir)
        config = WorkerConfig(
            model_dir=str(model_dir), role=args.role, master=args.master, host=args.host,
            port=args.port or free_port(args.host), kv_transfer=args.kv_transfer,
            token=args.token or env_token(),
            engine=EngineConfig(block_size=args.block_size, num_blocks=_num_blocks(args),
                                max_num_seqs=args.max_num_seqs,
                                max_prefill_chunk=args.max_prefill_chunk,
                                max_model_len=flags.max_model_len, dtype=flags.dtype,
                                device=args.device, prefill_mode=args.prefill_mode,
                                enable_prefix_caching=not args.no_prefix_caching,
                                max_prefill_seqs=args.max_prefill_seqs),
            dram_bytes=parse_size(args.dram), remote_timeout_s=args.remote_timeout,
            engine_kind=args.engine, profile=args.profile, kv_scale=args.kv_scale,
            speed_up=args.speed_up, step_rules=args.step_rules,
            stream_interval=args.stream_interval)
        worker = Worker(config)
    except KvpoolError as exc:
        log.error("%s", exc)
        return 2
    print(f"kvpool worker ({config.role}) on http://{config.host}:{config.port} "
          f"segment {worker.transfer.segment_name} ({flags.dtype}, max-model-len "
          f"{flags.max_model_len})", flush=True)
    # Keep idle connections longer than clients do (CLIENT_KEEPALIVE_S), so a client never
    # reuses one the worker is closing; a proxy holds one connection per stream.
    limits = HttpLimits(max_concurrency=1024, idle_timeout_s=30.0)
    try:
        app = _app(args, worker)
    except KvpoolError as exc:
        log.error("%s", exc)
        return 2
    serve(app, config.host, config.port, limits, fast=True, on_ready=lambda: announce_ready(
        f"kvpool worker ({config.role}) serving on http://{config.host}:{config.port}",
        echo=False))
    return 0


def _app(args: argparse.Namespace, worker: Any) -> Any:
    """The worker API, or the vLLM face over the same worker."""
    from kvpool.engine.worker.app import create_app

    if args.api != "vllm":
        return create_app(worker)
    from kvpool.engine.gguf_checkpoint import served_name
    from kvpool.engine.worker.vllm_face import block_names, create_vllm_app

    name = args.served_model_name or served_name(Path(worker.config.model_dir))
    worker.connector.reads_prefixes = args.kv_connector == "store"
    algo = args.prefix_caching_hash_algo
    names = block_names(worker, name, algo)
    if not args.kv_events_config:
        return create_vllm_app(worker, name, hash_algo=algo, names=names)
    from kvpool.engine.worker.vllm_face_events import FaceEvents, KvEventsConfig

    config = KvEventsConfig.parse(args.kv_events_config)
    events = FaceEvents(worker, config, names) if config is not None else None
    return create_vllm_app(worker, name, events, algo, names)
