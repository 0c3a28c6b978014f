"""Workers as real processes (a master, a store node, two prefill workers and a `both` worker
that serves decode legs and colocated requests): every path gives the same greedy tokens as
plain forward passes, and the KV in the pool is the KV a plain forward computes, bit for bit."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from kvpool.engine.blocks import block_key, prefix_block_hashes, request_key
from kvpool.engine.checkpoint import load_model
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.identity import identity_for_dir
from kvpool.engine.llm_engine import LLMEngine
from kvpool.engine.tiny import TinySpec, make_tiny
from kvpool.engine.worker.client import generate, prefill, stream
from kvpool.engine.worker.messages import (
    FinishLine,
    GenerateRequest,
    KVMode,
    KVSourceName,
    KVTransfer,
    PrefillReply,
    PrefillRequest,
    TokenLine,
)
from kvpool.errors import WorkerCallError
from tests.engine.helpers import full_logits
from tests.support.net import free_port, wait_port
from tests.support.procs import running, spawn_kvpool
from tests.support.wait import wait_for

BS = 8
SAMPLING = SamplingParams(max_tokens=10, ignore_eos=True)
ONE = SamplingParams(max_tokens=1)


def pre(url: str, rid: str, p: list[int], sampling: SamplingParams = SAMPLING,
        mode: KVMode = "pool", decode_url: str | None = None) -> PrefillReply:
    return prefill(url, PrefillRequest(request_id=rid, prompt_token_ids=p, sampling=sampling,
                                       kv_transfer=KVTransfer(mode=mode, decode_url=decode_url)))


def lines(url: str, rid: str, p: list[int], first: int | None,
          source: KVSourceName) -> list[TokenLine | FinishLine]:
    return list(stream(url, GenerateRequest(request_id=rid, prompt_token_ids=p, sampling=SAMPLING,
                                            first_token_id=first, kv_source=source)))


@dataclass
class Workers:
    master: str
    model_dir: Path
    p1: str
    p2: str
    d: str
    """role both: the decode worker of every P->D test, and the colocated baseline"""
    node: subprocess.Popen[bytes]


def spawn_worker(stack: ExitStack, model_dir: Path, role: str, *extra: str) -> tuple[str, int]:
    port = free_port()
    stack.enter_context(running(spawn_kvpool(
        "worker", "--role", role, "--model", str(model_dir), "--port", str(port),
        "--block-size", str(BS), "--num-blocks", "128", "--max-model-len", "512",
        "--remote-timeout", "3", *extra)))
    return f"http://127.0.0.1:{port}", port


@pytest.fixture(scope="module")
def workers(tiny_llama: Path) -> Iterator[Workers]:
    rpc, admin = free_port(), free_port()
    with ExitStack() as stack:
        stack.enter_context(running(spawn_kvpool(
            "master", "--rpc_port", str(rpc), "--metrics_port", str(admin), "--no-http-metadata")))
        wait_port(rpc)
        master = f"127.0.0.1:{rpc}"
        node = stack.enter_context(running(spawn_kvpool(
            "store-node", "--dram", "64MiB", "--master", master, "--heartbeat-interval", "0.2")))
        urls = [spawn_worker(stack, tiny_llama, role, "--master", master)
                for role in ("prefill", "prefill", "both")]
        for _, port in urls:
            wait_port(port, timeout_s=60)
        httpx.get(f"{urls[0][0]}/health", timeout=10).raise_for_status()
        yield Workers(master, tiny_llama, *(u for u, _ in urls), node=node)


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens from plain forward passes over the whole sequence, no engine."""
    model = load_model(model_dir)
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(10):
            ids.append(int(full_logits(model, ids)[-1].argmax()))
        out.append(ids[len(p):])
    return out


def root_of(model_dir: Path) -> int:
    """The chain root of the module's workers (float32, block size BS)."""
    return identity_for_dir(model_dir, EngineConfig(block_size=BS)).root


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_every_path_gives_the_same_tokens(workers: Workers) -> None:
    prompts = [prompt(5, 1), prompt(19, 2), prompt(24, 3)]
    want = reference(workers.model_dir, prompts)
    for p, expected in zip(prompts, want, strict=True):
        both = generate(p, SAMPLING, decode_url=workers.d)  # colocated: computes the prompt
        pool = generate(p, SAMPLING, prefill_url=workers.p1, decode_url=workers.d, mode="pool")
        push = generate(p, SAMPLING, prefill_url=workers.p2, decode_url=workers.d, mode="push")
        assert both.token_ids == pool.token_ids == push.token_ids == expected
        assert pool.finish_reason == push.finish_reason == "length"


def test_seeded_sampling_is_the_same_split_or_colocated(workers: Workers) -> None:
    p = prompt(11, 4)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.95,
                              seed=77)
    both = generate(p, sampling, decode_url=workers.d)
    split = generate(p, sampling, prefill_url=workers.p1, decode_url=workers.d, mode="pool")
    assert both.token_ids == split.token_ids and len(both.token_ids) == 10


def test_a_client_that_goes_away_aborts_its_request(workers: Workers) -> None:
    body = {"request_id": "gone", "prompt_token_ids": prompt(9, 5), "kv_source": "none",
            "sampling": {"max_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", f"{workers.d}/generate", json=body, timeout=10) as reply:
        assert "token_id" in next(reply.iter_lines())
    wait_for(lambda: not httpx.get(f"{workers.d}/load", timeout=10).json()["num_running"],
             10.0, "the request to stop running", 0.05)


def test_prefix_from_the_pool_written_by_another_prefill_worker(workers: Workers) -> None:
    shared = prompt(32, 10)
    first, second = shared + prompt(5, 11), shared + prompt(7, 12)
    want = reference(workers.model_dir, [first, second])
    a = generate(first, SAMPLING, prefill_url=workers.p1, decode_url=workers.d, mode="pool")
    assert a.prefill is not None and a.prefill.num_pool_tokens == 0 and a.prefill.num_computed_tokens == len(first)
    b = generate(second, SAMPLING, prefill_url=workers.p2, decode_url=workers.d, mode="push")
    assert b.prefill is not None and b.prefill.num_pool_tokens == 32 and b.prefill.num_cached_tokens == 0
    assert b.prefill.num_computed_tokens == len(second) - 32
    assert [a.token_ids, b.token_ids] == want
    c = generate(second, SAMPLING, prefill_url=workers.p2, decode_url=workers.d, mode="pool",
                 request_id="third")
    assert c.prefill is not None and c.prefill.num_cached_tokens == 32 and c.token_ids == want[1]
    from kvpool.store import ClientConfig, StoreClient
    with StoreClient(ClientConfig(master=workers.master)) as store:
        assert not store.exists(request_key("third")).ok  # the decode worker took it


def test_a_worker_of_other_weights_gets_no_pool_hits(workers: Workers, tmp_path: Path) -> None:
    """A checkpoint of the same shape (config.json and file sizes alike) and other weights
    shares the pool with the module's workers but none of its keys."""
    other = make_tiny(tmp_path / "seed7", TinySpec(arch="llama", seed=7))
    shared = prompt(32, 13)
    first, second = shared + prompt(5, 14), shared + prompt(6, 15)
    pre(workers.p1, "seed1-writes", first, ONE)
    assert pre(workers.p2, "seed1-reads", second, ONE).num_pool_tokens == 32
    with ExitStack() as stack:
        url, port = spawn_worker(stack, other, "prefill", "--master", workers.master)
        wait_port(port, timeout_s=60)
        info = httpx.get(f"{url}/info", timeout=10).json()
        b = pre(url, "seed7-reads", second, ONE)
    assert info["model_hash"] == root_of(other) != root_of(workers.model_dir)
    assert b.num_pool_tokens == 0 and b.num_cached_tokens == 0
    assert b.num_computed_tokens == len(second)
    assert b.first_token_id == reference(other, [second])[0][0]


def test_pool_kv_equals_recomputed_bit_for_bit(workers: Workers) -> None:
    from kvpool.store import ClientConfig, StoreClient
    p = prompt(27, 20)
    pre(workers.p1, "kv-check", p, ONE)
    engine = LLMEngine.from_dir(workers.model_dir, EngineConfig(block_size=BS, num_blocks=16))
    seq = engine.add_request("local", p, SamplingParams(max_tokens=2))
    engine.step()  # the whole prompt in one pass, as the worker did
    hashes = prefix_block_hashes(p, BS, root_of(workers.model_dir))
    assert len(hashes) == 3
    with StoreClient(ClientConfig(master=workers.master)) as store:
        assert store.exists(request_key("kv-check")).ok  # the partial block, for a decode leg
        for i, h in enumerate(hashes):
            for layer in range(engine.cache.num_layers):
                got = store.get(block_key(h, layer))
                assert got.ok, (i, layer, got.code)
                want = engine.cache.kv[layer, seq.block_table[i]].contiguous()
                stored = torch.frombuffer(bytearray(got.data), dtype=torch.float32).view(want.shape)
                assert torch.equal(stored, want), (i, layer)


def test_load_reports_held_blocks(workers: Workers) -> None:
    p = prompt(17, 30)
    pre(workers.p1, "load-check", p, ONE)
    load = httpx.get(f"{workers.p1}/load", timeout=10).json()
    hashes = prefix_block_hashes(p, BS, root_of(workers.model_dir))
    assert set(hashes) <= set(load["block_hashes"])
    assert load["kv_capacity_tokens"] == 128 * BS and load["num_running"] == 0
    info = httpx.get(f"{workers.d}/info", timeout=10).json()
    assert info["role"] == "both" and info["block_size"] == BS
    assert info["model_hash"] == root_of(workers.model_dir) and ":" in info["segment"]


def test_errors_are_lines_not_hangs(workers: Workers) -> None:
    p = prompt(12, 40)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WorkerCallError, match="unreachable"):
        pre(workers.p1, "to-dead", p, mode="push", decode_url=dead)
    with pytest.raises(WorkerCallError, match="could not be read from the pool .OBJECT_NOT_FOUND"):
        lines(workers.d, "never-prefilled", prompt(30, 41), 7, "pool")
    with pytest.raises(WorkerCallError, match="no reservation"):
        lines(workers.d, "never-pushed", p, 7, "push")
    with pytest.raises(WorkerCallError, match="400.*prefill worker"):
        lines(workers.p1, "wrong-role", p, None, "none")


def test_a_dead_decode_worker_fails_the_push(workers: Workers, tiny_llama: Path) -> None:
    port = free_port()
    proc = spawn_kvpool("worker", "--role", "decode", "--model", str(tiny_llama), "--port",
                        str(port), "--block-size", str(BS), "--num-blocks", "16")
    with running(proc):
        wait_port(port, timeout_s=60)
        url = f"http://127.0.0.1:{port}"
        reserve = httpx.post(f"{url}/kv/reserve", json={"request_id": "r", "num_tokens": 20},
                             timeout=10).json()
        assert reserve["ok"] and len(reserve["regions"]) == 3 * 2 * 2  # blocks x layers x K,V
        assert httpx.post(f"{url}/abort", json={"request_id": "r"}, timeout=10).json()["ok"]
    with pytest.raises(WorkerCallError, match="unreachable"):
        pre(workers.p2, "dead-decode", prompt(20, 50), mode="push", decode_url=url)


def test_generate_command(workers: Workers, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.cli.main import main
    args = ["generate", "hello world the cache", "--max-tokens", "6"]
    assert main([*args, "--prefill", workers.p1, "--decode", workers.d, "--kv-transfer", "push"]) == 0
    split = capsys.readouterr()
    assert main([*args, "--both", workers.d]) == 0
    both = capsys.readouterr()
    assert split.out == both.out and "6 tokens" in both.err
    assert main([*args, "--both", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "error" in capsys.readouterr().err


def test_a_dead_store_node_ends_requests_with_errors(workers: Workers) -> None:
    """Runs last: it kills the module's store node."""
    p = prompt(20, 60)
    info = pre(workers.p1, "before-death", p)
    workers.node.send_signal(signal.SIGKILL)
    workers.node.wait()
    t0 = time.monotonic()
    with pytest.raises(WorkerCallError, match="could not be read from the pool"):
        lines(workers.d, "before-death", p, info.first_token_id, "pool")
    with pytest.raises(WorkerCallError, match="502.*pool failed"):
        pre(workers.p2, "after-death", prompt(20, 61))
    assert time.monotonic() - t0 < 30
