"""The serving cluster `kvpool up` starts (`serving_cluster`: master, store nodes, workers or
vLLM servers, the proxy; all stopped on exit), and the model folders it serves
(`ensure_tiny_model`, `ensure_emulated_model`). The processes are kvpool.launch's: children
that die with this process, the master, store nodes and workers announcing on a pipe when they
are ready (the proxy, whose readiness is its workers', and vLLM servers are polled).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from kvpool.engine.gguf_checkpoint import kvpool_cache, served_name
from kvpool.errors import KvpoolError
from kvpool.launch.children import Command, run_to_end
from kvpool.launch.ports import check_ports, free_port
from kvpool.launch.ready import ReadyPipe
from kvpool.launch.table import ChildTable
from kvpool.launch.wait import wait_http

if TYPE_CHECKING:
    from kvpool.serve.vllm.launch import EventWiring, VllmEngines


def default_model_dir() -> Path:
    return kvpool_cache() / "models" / "tiny"


def ensure_tiny_model(folder: Path) -> Path:
    """The tiny random model at `folder`, made on first use (`kvpool model make-tiny`) into a
    temporary folder and renamed, so an interrupted run never leaves half a checkpoint."""
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    run_to_end([sys.executable, "-m", "kvpool", "model", "make-tiny", str(tmp)])
    try:
        tmp.rename(folder)
    except OSError:  # another `kvpool up` made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


EMULATED_MAX_MODEL_LEN = 131_072 + 4096
"""Context of emulated fleets: room for the conversation trace's longest prompts (126k tokens)
and their outputs."""


def ensure_emulated_model(tiny: Path, folder: Path, max_model_len: int) -> Path:
    """A model folder for emulated workers: the tiny model's tokenizer (the proxy serves it)
    and its config with `max_model_len` positions; no weights (an emulated engine computes
    nothing)."""
    import json
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny / name).is_file():
            shutil.copyfile(tiny / name, folder / name)
    config = json.loads((tiny / "config.json").read_text())
    config["max_position_embeddings"] = max_model_len
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


@dataclass
class ServingCluster(ChildTable):
    host: str
    proxy_url: str
    model_dir: Path
    model_name: str
    master_address: str = ""
    metadata_url: str = ""
    admin_url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker_urls: dict[str, list[str]] = field(default_factory=dict)
    commands: dict[str, Command] = field(default_factory=dict)
    ready: dict[str, ReadyPipe] = field(default_factory=dict)


@dataclass(frozen=True)
class ServingSpec:
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0
    dram: str = "256MiB"
    num_store_nodes: int = 1
    proxy_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    insecure: bool = False
    """Pass --insecure to every child (a non-loopback host without a token)."""
    backend: str = "kvpool"
    """vllm: the engines serve vLLM's API and the proxy drives them as vLLM servers
    (`--backend vllm`, colocated ones as --colocated), their KV events and the pool's wired to
    it: kvpool workers with vLLM's face (`--api vllm`), or real vLLM servers (`vllm`)."""
    vllm: VllmSpec | None = None
    """Real vLLM servers instead of kvpool workers (backend vllm)."""


@dataclass(frozen=True)
class VllmSpec:
    python: str | None = None
    """The Python that runs vLLM (None: found, see serve.vllm.launch.find_vllm)."""
    extra_args: tuple[str, ...] = ()
    """The user's own `vllm serve` arguments."""
    start_timeout_s: float = 900.0
    """How long a server may take to answer /health (CPU builds load and warm up slowly)."""
    start_attempts: int = 2
    """Starts of a server that exits before it answers /health (vLLM's engine core can fail
    to come up on a loaded machine), before `kvpool up` gives up."""


@contextmanager
def serving_cluster(spec: ServingSpec,
                    say: Callable[[str], None] | None = None) -> Iterator[ServingCluster]:
    """Master (+ metadata), one store node, the workers and the proxy; all stopped on exit.
    KvpoolError before any process starts when the proxy's port is taken (by another cluster,
    whose proxy would otherwise answer the readiness checks of this one)."""
    host = spec.host
    check_ports(host, {"--port": spec.port})
    stage = _Stages(say)
    rpc, admin, meta = free_port(host), free_port(host), free_port(host)
    cluster = ServingCluster(host, f"http://{host}:{spec.port}", spec.model_dir,
                             served_name(spec.model_dir))
    with ExitStack() as stack:
        stack.callback(cluster.stop_all, say)

        def start(name: str, *args: str, announce: bool = False) -> subprocess.Popen[bytes]:
            return cluster.start(name, *args, *(("--insecure",) if spec.insecure else ()),
                                 announce=announce)

        wiring, engines = _vllm_side(spec, stack, rpc, meta, stage)
        start("master", "master", "--host", host, "--rpc-port", str(rpc),
              "--admin-port", str(admin), "--metadata-port", str(meta),
              *(wiring.master_flags() if wiring is not None else ()), announce=True)
        cluster.wait_ready("master", "master", 60.0)
        stage.done(f"master ready at {host}:{rpc}")
        master_addr, metadata = f"{host}:{rpc}", f"http://{host}:{meta}/metadata"
        cluster.master_address, cluster.metadata_url = master_addr, metadata
        cluster.admin_url = f"http://{host}:{admin}"
        for i in range(spec.num_store_nodes):
            start(f"store-node-{i}", "store-node", "--dram", spec.dram, "--master", master_addr,
                  "--host", host, "--metadata", metadata, announce=True)
        for i in range(spec.num_store_nodes):  # a node announces once its memory is mounted
            cluster.wait_ready(f"store-node-{i}", "the store", 120.0)
        stage.done(f"{spec.num_store_nodes} store node(s) mounted ({spec.dram} each)")
        ports = _start_engines(cluster, spec, start, wiring, engines, stage)
        events = wiring.proxy_flags(ports) if wiring is not None else ()
        start("proxy", "proxy", "--model", str(spec.model_dir), "--host", host,
              "--port", str(spec.port), *_worker_flags(cluster, spec.backend), *events,
              *spec.proxy_args)
        wait_http(cluster.proxy_url + "/health", list(cluster.procs.values()),
                  "the serving cluster", timeout_s=120)
        stage.done(f"proxy ready at {cluster.proxy_url}")
        yield cluster


def _start_engines(cluster: ServingCluster, spec: ServingSpec,
                   start: Callable[..., subprocess.Popen[bytes]], wiring: EventWiring | None,
                   engines: VllmEngines | None, stage: _Stages) -> dict[str, int]:
    """Every engine of the spec, kvpool workers or vLLM servers, started and waited for;
    their URLs -> ports."""
    host, master_addr = spec.host, cluster.master_address
    roles = (["prefill"] * spec.num_prefill + ["decode"] * spec.num_decode
             + ["both"] * spec.num_colocated)
    ports: dict[str, int] = {}
    names: dict[str, str] = {}
    for i, role in enumerate(roles):
        port = free_port(host)
        url = f"http://{host}:{port}"
        names[url] = f"{role}-{i}"
        if engines is not None and wiring is not None:
            cluster.run(names[url], engines.command(url, port, spec.model_dir,
                                                    cluster.model_name, wiring))
        else:
            face = (("--api", "vllm", "--kv-events-config", wiring.engine_config(url, port))
                    if wiring is not None else ())
            start(names[url], "worker", "--role", role, "--model", str(spec.model_dir),
                  "--host", host, "--port", str(port), "--master", master_addr,
                  *spec.worker_args, *face, announce=True)
        cluster.worker_urls.setdefault(role, []).append(url)
        ports[url] = port
    what = f"vLLM {engines.version} servers" if engines is not None else "workers"
    stage.note(f"{len(roles)} {what} starting (each loads the model)")
    timeout_s = spec.vllm.start_timeout_s if spec.vllm is not None else 120.0
    for role, urls in cluster.worker_urls.items():
        for url in urls:
            if engines is None:  # a kvpool worker announces once it serves
                cluster.wait_ready(names[url], "a worker", timeout_s)
            else:
                _wait_engine(url, names[url], cluster, timeout_s, stage,
                             spec.vllm.start_attempts if spec.vllm is not None else 1)
            stage.done(f"{role} {'vLLM server' if engines else 'worker'} ready at {url}")
    return ports


def _vllm_side(spec: ServingSpec, stack: ExitStack, rpc: int, meta: int,
               stage: _Stages) -> tuple[EventWiring | None, VllmEngines | None]:
    """Backend vllm: the KV-event wiring, in a run folder removed at exit, and for real vLLM
    servers the Python that runs them (found before any process starts)."""
    if spec.backend != "vllm":
        return None, None
    from kvpool.serve.vllm.launch import EventWiring, prepare

    run_dir = Path(tempfile.mkdtemp(prefix="kvpool-up-"))
    stack.callback(shutil.rmtree, run_dir, True)
    wiring = EventWiring.pick(spec.host, run_dir)
    if spec.vllm is None:
        return wiring, None
    stage.note("looking for vLLM (importing it takes a while)")
    engines = prepare(run_dir, spec.vllm.python, f"{spec.host}:{rpc}",
                      f"http://{spec.host}:{meta}/metadata", spec.host, spec.vllm.extra_args)
    stage.done(f"vLLM {engines.version} found at {engines.python}")
    return wiring, engines


def _wait_engine(url: str, name: str, cluster: ServingCluster, timeout_s: float,
                 stage: _Stages, attempts: int) -> None:
    """Until the vLLM server at `url` answers /health. One that exits first is started again,
    up to `attempts` starts in all (its log keeps every start's output: the cause of the first
    failure stays readable); then it, or another child that exited, is reported with the end
    of its log."""
    for attempt in range(1, attempts + 1):
        try:
            wait_http(url + "/health", list(cluster.procs.values()), "a worker",
                      timeout_s=timeout_s)
            return
        except (KvpoolError, TimeoutError) as exc:
            exited = cluster.exited()
            if exited != [name] or attempt == attempts:
                _engine_failed(exc, cluster)
            stage.note(f"{name} exited while starting ({exc}); starting it again "
                       f"(attempt {attempt + 1} of {attempts}), its log: "
                       f"{cluster.commands[name].log}")
            cluster.restart(name)


def _engine_failed(exc: Exception, cluster: ServingCluster) -> NoReturn:
    """`exc`, with the end of the log of a child that exited (the cause, when it was one)."""
    logs = [c.log for name, c in cluster.commands.items()
            if c.log is not None and cluster.procs[name].poll() is not None]
    if not logs:
        raise exc
    from kvpool.serve.vllm.launch import log_tail

    raise KvpoolError(f"{exc}; the end of {logs[0]}:\n{log_tail(logs[0])}") from None


class _Stages:
    """One line per start-up stage as it ends, with the seconds since the start (`say`:
    where to; None: silent)."""

    def __init__(self, say: Callable[[str], None] | None) -> None:
        self.say, self.start_s = say, time.monotonic()

    def note(self, what: str) -> None:
        if self.say is not None:
            self.say(f"{what}...")

    def done(self, what: str) -> None:
        if self.say is not None:
            self.say(f"{what} ({time.monotonic() - self.start_s:.1f} s)")


def _worker_flags(cluster: ServingCluster, backend: str) -> list[str]:
    """The proxy's flags naming the workers: kvpool workers say their role themselves; vLLM
    instances are named by role (`both` ones as --colocated)."""
    if backend == "vllm":
        flag = {"prefill": "--prefill", "decode": "--decode", "both": "--colocated"}
        return ["--backend", "vllm", *(f for role, urls in cluster.worker_urls.items()
                                       for u in urls for f in (flag[role], u))]
    return [f for role, urls in cluster.worker_urls.items() for u in urls
            for f in ("--decode" if role == "decode" else "--prefill", u)]
