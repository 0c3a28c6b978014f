"""`kvpool bench engine`: the reference engine beside Hugging Face transformers on the same
checkpoint in the same run (prefill and decode tokens/s at batch 1 and 16), and a long prompt's
time to first token on a prefill worker, cold and with its prefix in the pool (real master,
store node and two prefill workers as processes)."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REPEATS = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("engine", help="engine tokens/s vs transformers; pool-prefix TTFT")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint folder (default: a random Llama of --layers/--hidden)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (throughput)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--ttft-len", type=int, default=2048, help="long prompt for the TTFT rows")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-ttft", action="store_true", help="skip the worker processes")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both engines (1 is steadiest on a shared VM)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    with tempfile.TemporaryDirectory() as tmp:
        from kvpool.engine.checkpoint import read_model_config
        model_dir = args.model or _tiny(Path(tmp) / "model", args.layers, args.hidden)
        vocab = read_model_config(model_dir).vocab_size
        rows: list[dict[str, Any]] = []
        for batch in (int(b) for b in args.batches.split(",")):
            rows += _ours(model_dir, batch, args.prompt_len, args.decode_steps, vocab)
            if not args.no_hf:
                rows += _hf(model_dir, batch, args.prompt_len, args.decode_steps, vocab)
        if not args.no_ttft:
            rows += _ttft(model_dir, args.ttft_len, vocab)
    for row in rows:
        print(json.dumps(row) if args.json else _fmt(row), flush=True)
    return 0


def _fmt(row: dict[str, Any]) -> str:
    extra = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("impl", "phase", "value", "unit"))
    return f"{row['impl']:<13} {row['phase']:<22} {row['value']:>12,.1f} {row['unit']:<9} {extra}"


def _tiny(folder: Path, layers: int, hidden: int) -> Path:
    from kvpool.engine.tiny import TinySpec, make_tiny
    return make_tiny(folder, TinySpec(num_layers=layers, hidden_size=hidden, num_heads=8,
                                      num_kv_heads=4, vocab_size=1024,
                                      max_position_embeddings=8192))


def _prompts(batch: int, length: int, vocab: int, shift: int = 0) -> list[list[int]]:
    """Random token ids in 2..vocab-1; `shift` makes a different set of the same shape."""
    import torch
    g = torch.Generator().manual_seed(batch * 7 + length + 1000 * shift)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def _ours(model_dir: Path, batch: int, length: int, steps: int, vocab: int) -> list[dict[str, Any]]:
    """Best of REPEATS prefills (fresh prompts each time), median decode step."""
    from kvpool.engine.config import EngineConfig, SamplingParams
    from kvpool.engine.llm_engine import LLMEngine
    blocks_per_seq = -(-(length + steps + 1) // 16)
    config = EngineConfig(block_size=16, num_blocks=batch * blocks_per_seq + 8,
                          max_num_seqs=batch, max_prefill_chunk=batch * length,
                          max_model_len=length + steps + 16)
    engine = LLMEngine.from_dir(model_dir, config)
    engine.generate(_prompts(1, 16, vocab), SamplingParams(max_tokens=2))  # warm up
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prefill_s, step_s = [], []
    for rep in range(REPEATS):
        for i, p in enumerate(_prompts(batch, length, vocab, shift=rep + 1)):
            engine.add_request(f"{rep}-{i}", p, params)
        prefill_s.append(_timed(engine.step))  # every prompt in one pass, and first tokens
        step_s += [_timed(engine.step) for _ in range(steps)]
    return [_row("kvpool", f"prefill batch {batch}", batch * length / min(prefill_s), length),
            _row("kvpool", f"decode batch {batch}", batch / statistics.median(step_s), length)]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _hf(model_dir: Path, batch: int, length: int, steps: int, vocab: int) -> list[dict[str, Any]]:
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefill_s, step_s = [], []
    with torch.inference_mode():
        model(torch.tensor(_prompts(1, 16, vocab)))  # warm up
        for rep in range(REPEATS):
            ids = torch.tensor(_prompts(batch, length, vocab, shift=rep + 1))
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            prefill_s.append(time.perf_counter() - t0)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                step_s.append(time.perf_counter() - t0)
    return [_row("transformers", f"prefill batch {batch}", batch * length / min(prefill_s), length),
            _row("transformers", f"decode batch {batch}", batch / statistics.median(step_s), length)]


def _row(impl: str, phase: str, tok_s: float, length: int) -> dict[str, Any]:
    return {"impl": impl, "phase": phase, "value": round(tok_s, 1), "unit": "tok/s",
            "prompt_len": length}


def _ttft(model_dir: Path, length: int, vocab: int) -> list[dict[str, Any]]:
    """Cold prefill on P1 (its blocks go to the pool), then the same prefix plus a new tail on
    P2, which loads the prefix from the pool; then P2 again (local cache)."""
    from kvpool.engine.worker.client import prefill
    shared = _prompts(1, length, vocab)[0]
    with _cluster(model_dir, length) as (p1, p2):
        for url in (p1, p2):  # first requests pay one-time costs (connections, allocator)
            prefill(url, f"warm-{url}", _prompts(1, 64, vocab, shift=9)[0], {"max_tokens": 1},
                    {"mode": "pool"})
        rows = []
        for name, url, tail in (("cold", p1, [5, 6, 7]), ("prefix from pool", p2, [8, 9, 10]),
                                ("prefix in local cache", p2, [11, 12, 13])):
            t0 = time.perf_counter()
            info = prefill(url, f"ttft-{tail[0]}", shared + tail, {"max_tokens": 1}, {"mode": "pool"})
            wall = time.perf_counter() - t0
            rows.append({"impl": "kvpool worker", "phase": f"TTFT {name}", "value": wall * 1e3,
                         "unit": "ms", "prompt_len": len(shared) + 3,
                         "pool_tokens": info["num_pool_tokens"],
                         "cached_tokens": info["num_cached_tokens"],
                         "computed_tokens": info["num_computed_tokens"]})
    return rows


@contextmanager
def _cluster(model_dir: Path, length: int) -> Iterator[tuple[str, str]]:
    rpc, admin = _free_port(), _free_port()
    with ExitStack() as stack:
        stack.enter_context(_proc("master", "--rpc_port", str(rpc), "--metrics_port", str(admin),
                                  "--no-http-metadata"))
        _wait(rpc)
        master = f"127.0.0.1:{rpc}"
        stack.enter_context(_proc("store-node", "--dram", "1GiB", "--master", master))
        urls = []
        for _ in range(2):
            port = _free_port()
            stack.enter_context(_proc("worker", "--role", "prefill", "--model", str(model_dir),
                                      "--master", master, "--port", str(port),
                                      "--max-prefill-chunk", "4096",
                                      "--max-model-len", str(length + 64),
                                      "--num-blocks", str(length // 16 * 3 + 64)))
            urls.append((f"http://127.0.0.1:{port}", port))
        for _, port in urls:
            _wait(port, 120)
        yield urls[0][0], urls[1][0]


@contextmanager
def _proc(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "--log-level", "WARNING", *args],
                            stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")
