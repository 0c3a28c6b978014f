"""The processes `kvpool bench proxy` relays through: emulated colocated workers (no pool,
no master: the proxy's cost is measured, not the cluster's) and kvpool's proxy in front of it,
with the profile's cost model on the sped-up clock as `kvpool up --engine emulated` sets it,
and no admission control (the closed loop keeps `--concurrency` requests running; none may be
refused for the objectives).

The children run without a cluster token (on loopback, as `kvpool up` allows): nginx relays
the client's `/generate` to the worker unsigned.
"""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import ExitStack
from pathlib import Path

from kvpool.engine.emulated.profile import DEFAULT_PROFILE, load_profile, scaled_cost
from kvpool.engine.gguf_checkpoint import served_name
from kvpool.launch.children import die_with_parent, kvpool_argv, stop
from kvpool.launch.ports import free_port
from kvpool.launch.store import start_all_ready
from kvpool.launch.wait import wait_http
from kvpool.serve.launch import (
    EMULATED_MAX_MODEL_LEN,
    default_model_dir,
    ensure_emulated_model,
    ensure_tiny_model,
)
from kvpool.token import TOKEN_ENV

HOST = "127.0.0.1"


def _child(stack: ExitStack, *args: str, src: Path | None = None) -> subprocess.Popen[bytes]:
    """`kvpool ARGS` without the cluster token (from the sources in `src`, if given), stopped
    when `stack` closes."""
    env = _untokened()
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    proc = subprocess.Popen(kvpool_argv(*args), stdout=subprocess.DEVNULL, env=env,
                            preexec_fn=die_with_parent(os.getpid()), start_new_session=True)
    stack.callback(stop, proc)
    return proc


def _untokened() -> dict[str, str]:
    """This process's environment without the cluster token."""
    return {k: v for k, v in os.environ.items() if k != TOKEN_ENV}


def start_worker(stack: ExitStack, tmp: Path, speed_up: float,
                 *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    """The emulated colocated worker (`extra`: more `kvpool worker` flags), ready; (process,
    port)."""
    return start_workers(stack, tmp, speed_up, 1, *extra)[0]


def start_workers(stack: ExitStack, tmp: Path, speed_up: float, count: int,
                  *extra: str) -> list[tuple[subprocess.Popen[bytes], int]]:
    """`count` emulated colocated workers, started together, each waited for by its
    announcement; (process, port)."""
    model = _model(tmp)
    ports = [free_port(HOST) for _ in range(count)]
    procs = start_all_ready(
        stack, [("worker", "--role", "both", "--engine", "emulated", "--profile",
                 DEFAULT_PROFILE, "--speed-up", str(speed_up), "--model", str(model),
                 "--host", HOST, "--port", str(port),
                 "--max-model-len", str(EMULATED_MAX_MODEL_LEN),
                 "--max-prefill-chunk", str(EMULATED_MAX_MODEL_LEN), *extra) for port in ports],
        "an emulated worker", 120 + 10 * count, log_level="WARNING", show_errors=True,
        environ=_untokened())
    return list(zip(procs, ports, strict=True))


def start_proxy(stack: ExitStack, tmp: Path, worker: subprocess.Popen[bytes], worker_port: int,
                speed_up: float, src: Path | None = None, flags: tuple[str, ...] = (),
                named: bool = True) -> tuple[subprocess.Popen[bytes], int, str]:
    """kvpool's proxy in front of the worker (from the sources in `src`: another version of
    kvpool to compare with; `flags`: more `kvpool proxy` flags; `named` False: the flags name
    the worker), once it has the worker in rotation; (process, port, served model name)."""
    model = _model(tmp)
    cost = tmp / "cost.json"
    cost.write_text(json.dumps(scaled_cost(load_profile(DEFAULT_PROFILE).cost,
                                           speed_up).to_dict()))
    port = free_port(HOST)
    proc = _child(stack, "proxy", "--model", str(model), "--host", HOST, "--port", str(port),
                  *(("--prefill", f"http://{HOST}:{worker_port}") if named else ()),
                  "--no-access-log",
                  "--cost", str(cost), "--admission", "none",
                  "--decode-horizon", str(10.0 / speed_up), *flags, src=src)
    wait_http(f"http://{HOST}:{port}/health", [proc, worker], "the proxy", 120)
    return proc, port, served_name(model)


def _model(tmp: Path) -> Path:
    """The emulated model folder (the tiny model's tokenizer, a long context) in `tmp`."""
    folder = tmp / "emulated-model"
    if (folder / "config.json").is_file():
        return folder
    tiny = ensure_tiny_model(default_model_dir())
    return ensure_emulated_model(tiny, folder, EMULATED_MAX_MODEL_LEN)
