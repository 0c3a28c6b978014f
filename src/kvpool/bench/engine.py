"""`kvpool bench engine`: the reference engine beside Hugging Face transformers on the same
checkpoint in the same run, and a long prompt's time to first token on a prefill worker, cold
and with most of it in the pool (real master, store node and two prefill workers as processes).

Throughput: prefill and decode tokens/s at batch 1 (one prompt) and at larger batches with
mixed prompt and output lengths. Both engines get the same requests; transformers runs them as
one left-padded `generate` (every row to the longest output), kvpool as requests in its
continuous batch (a row leaves when its output is done). Only useful tokens count: prompt
tokens for prefill, generated tokens after the first for decode. The two engines alternate,
--repeats times (3), on fresh prompts each time; the rows give medians.

Disaggregation: a cold prompt's TTFT on a colocated worker beside a prefill worker that hands
its KV to the pool or pushes it to a decode worker (bench/engine_disagg.py).

Pool: the prefill worker's KV load (bytes of the prefix it read from the pool / the time of that
batch get) beside the raw store's `batch_get_into` of the same objects from this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.launch.engines import start_engines

if TYPE_CHECKING:
    from kvpool.engine.worker.messages import PrefillReply

STREAM_FACTOR = 3  # requests per running slot in the stream rows


@dataclass(frozen=True)
class Workload:
    batch: int
    prompts: list[list[int]]
    outputs: list[int]  # tokens each request generates (the first one comes from prefill)
    mixed: bool         # lengths drawn at random, not all equal

    @property
    def name(self) -> str:
        return f"batch {self.batch}" + (" mixed" if self.mixed else "")

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.outputs) - len(self.outputs)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("engine", help="engine tokens/s vs transformers; pool-prefix TTFT")
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint folder (default: a random Llama, 12 layers x 768 hidden)")
    p.add_argument("--quick", action="store_true",
                   help="a 4 x 256 random Llama and short prompts (smoke runs)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens (mean of the mixed lengths at batch > 1); default 128")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="generated tokens (mean of the mixed lengths at batch > 1); default 32")
    p.add_argument("--same-lengths", action="store_true", help="no mixed lengths at batch > 1")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--ttft-len", type=int, default=None, help="TTFT prompt (default 4096)")
    p.add_argument("--ttft-prefix", type=int, default=None,
                   help="its tokens another worker left in the pool (default 3/4 of it)")
    p.add_argument("--penalty-len", type=int, default=None,
                   help="the prefill-penalty rows' cold prompt (default half the TTFT prompt)")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternations of the two engines per throughput row (median)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-ttft", action="store_true", help="skip the worker processes")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both engines (1 is steadiest on a shared VM)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write-profile", type=Path, default=None, metavar="FILE",
                   help="measure this engine's step times and write them as an accelerator "
                        "profile (for --engine emulated and the simulator), then stop")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    prompt_len = args.prompt_len or (32 if args.quick else 128)
    steps = args.decode_steps or (8 if args.quick else 32)
    ttft_len = args.ttft_len or (512 if args.quick else 4096)
    with tempfile.TemporaryDirectory() as tmp:
        from kvpool.engine.checkpoint import read_model_config
        model_dir = args.model or _random_llama(Path(tmp) / "model", args.quick)
        if args.write_profile is not None:
            return _write_profile(model_dir, args)
        vocab = read_model_config(model_dir).vocab_size
        rows: list[dict[str, Any]] = []
        for batch in (int(b) for b in args.batches.split(",")):
            mixed = batch > 1 and not args.same_lengths
            rows += _throughput(model_dir, batch, prompt_len, steps, mixed, vocab, args.no_hf,
                                args.repeats)
            if mixed:
                rows += _stream(model_dir, batch, prompt_len // 2, steps, vocab, args.no_hf)
            _print(rows, args.json)
        if not args.no_ttft:
            _print(_ttft(model_dir, ttft_len, args.ttft_prefix or ttft_len * 3 // 4, vocab,
                         args.repeats), args.json)
            from kvpool.bench.engine_disagg import prefill_penalty
            _print(prefill_penalty(model_dir, args.penalty_len or ttft_len // 2, vocab,
                                   args.repeats), args.json)
    return 0


def _write_profile(model_dir: Path, args: argparse.Namespace) -> int:
    from kvpool.bench.engine_profile import measure_profile
    from kvpool.engine.emulated.profile import write_profile

    profile = measure_profile(model_dir, args.quick, args.repeats)
    write_profile(profile, args.write_profile)
    c = profile.cost
    print(f"wrote {args.write_profile}: prefill {c.prefill_base_s * 1e3:.2f} ms + "
          f"{c.prefill_linear_s * 1e6:.2f} us/token + {c.prefill_quadratic_s * 1e9:.3f} ns/pair; "
          f"decode {c.decode_base_s * 1e3:.2f} ms + {c.decode_per_seq_s * 1e6:.1f} us/seq + "
          f"{c.decode_per_token_s * 1e9:.2f} ns/context token; "
          f"{c.kv_bytes_per_token} KV bytes/token", flush=True)
    return 0


def _print(rows: list[dict[str, Any]], as_json: bool) -> None:
    for row in rows:
        print(json.dumps(row) if as_json else _fmt(row), flush=True)
    rows.clear()


def _fmt(row: dict[str, Any]) -> str:
    extra = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("impl", "phase", "value", "unit"))
    return f"{row['impl']:<13} {row['phase']:<26} {row['value']:>12,.1f} {row['unit']:<9} {extra}"


def _random_llama(folder: Path, quick: bool) -> Path:
    """The spec's shape: big enough that compute, not Python, dominates."""
    from kvpool.engine.tiny import TinySpec, make_tiny
    if quick:
        spec = TinySpec(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
                        vocab_size=1024, max_position_embeddings=8192)
    else:
        spec = TinySpec(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4,
                        intermediate_size=2048, vocab_size=32000, max_position_embeddings=8192)
    return make_tiny(folder, spec)


def _prompts(batch: int, length: int, vocab: int, shift: int = 0) -> list[list[int]]:
    """Random token ids in 2..vocab-1; `shift` makes a different set of the same shape."""
    import torch
    g = torch.Generator().manual_seed(batch * 7 + length + 1000 * shift)
    return torch.randint(2, vocab, (batch, length), generator=g).tolist()


def _lengths(batch: int, mean: int, mixed: bool, seed: int) -> list[int]:
    """`batch` lengths with mean about `mean`: all equal, or uniform in [mean/8, 2 mean - mean/8]."""
    import torch
    if not mixed:
        return [mean] * batch
    low = max(1, mean // 8)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, 2 * mean - low + 1, (batch,), generator=g).tolist()


def _workload(batch: int, prompt_len: int, steps: int, mixed: bool, vocab: int,
              rep: int) -> Workload:
    lens = _lengths(batch, prompt_len, mixed, seed=1)
    outs = [n + 1 for n in _lengths(batch, steps, mixed, seed=2)]
    rows = _prompts(batch, max(lens), vocab, shift=rep + 1)
    return Workload(batch, [row[:n] for row, n in zip(rows, lens, strict=True)], outs, mixed)


def _throughput(model_dir: Path, batch: int, prompt_len: int, steps: int, mixed: bool,
                vocab: int, no_hf: bool, repeats: int) -> list[dict[str, Any]]:
    """Alternate the two engines on the same workloads; medians of prefill and decode tok/s."""
    work = [_workload(batch, prompt_len, steps, mixed, vocab, rep) for rep in range(repeats)]
    runners: dict[str, _Ours | _HF] = {"kvpool": _Ours(model_dir, work[0])}
    if not no_hf:
        runners["transformers"] = _HF(model_dir)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for w in work:
        for name, runner in runners.items():
            times[name].append(runner.run(w))
    rows = []
    for name, ts in times.items():
        prefill = statistics.median(work[0].num_prompt_tokens / p for p, _ in ts)
        decode = statistics.median(work[0].num_decode_tokens / d for _, d in ts)
        rows += [_row(name, f"prefill {work[0].name}", prefill, work[0]),
                 _row(name, f"decode {work[0].name}", decode, work[0])]
    if not no_hf:
        for ours, theirs in zip(rows[:2], rows[2:], strict=True):
            ours["vs_transformers"] = round(ours["value"] / theirs["value"], 2)
    return rows


def _stream(model_dir: Path, batch: int, prompt_len: int, steps: int, vocab: int,
            no_hf: bool) -> list[dict[str, Any]]:
    """STREAM_FACTOR x batch requests of mixed lengths, `batch` at a time: kvpool admits the
    next request as soon as one finishes; transformers runs them in arrival order as static
    batches of `batch`, each to its longest output. Generated tokens per second of wall time
    (prefill included); 2 alternations, median."""
    work = [_workload(batch * STREAM_FACTOR, prompt_len, steps, True, vocab, rep)
            for rep in range(2)]
    runners: dict[str, _Ours | _HF] = {"kvpool": _Ours(model_dir, work[0], batch)}
    if not no_hf:
        runners["transformers"] = _HF(model_dir)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for w in work:
        for name, runner in runners.items():
            seconds[name].append(runner.run_stream(w, batch))
    phase = f"generate {len(work[0].prompts)} requests, {batch} at a time"
    rows = [_row(name, phase, sum(work[0].outputs) / statistics.median(ts), work[0])
            for name, ts in seconds.items()]
    if not no_hf:
        rows[0]["vs_transformers"] = round(rows[0]["value"] / rows[1]["value"], 2)
    return rows


class _Ours:
    def __init__(self, model_dir: Path, w: Workload, max_num_seqs: int | None = None) -> None:
        from kvpool.engine.config import EngineConfig, SamplingParams
        from kvpool.engine.llm_engine import LLMEngine
        longest = max(len(p) for p in w.prompts) + max(w.outputs) + 16
        running = max_num_seqs or w.batch
        config = EngineConfig(block_size=16, num_blocks=running * (-(-longest // 16)) + 8,
                              max_num_seqs=running, max_prefill_chunk=longest * running,
                              max_model_len=longest)
        self.engine = LLMEngine.from_dir(model_dir, config)
        self.engine.generate([[5] * 16], SamplingParams(max_tokens=2))  # warm up
        self.num_runs = 0

    def run(self, w: Workload) -> tuple[float, float]:
        """(seconds until every request has its first token, seconds from there to the end)."""
        from kvpool.engine.config import SamplingParams
        self.num_runs += 1
        for i, (prompt, n) in enumerate(zip(w.prompts, w.outputs, strict=True)):
            self.engine.add_request(f"{self.num_runs}-{i}", prompt,
                                    SamplingParams(max_tokens=n, ignore_eos=True))
        t0 = time.perf_counter()
        started: set[str] = set()
        while len(started) < w.batch:
            started |= {o.request_id for o in self.engine.step() if o.token_id is not None}
        t1 = time.perf_counter()
        while self.engine.has_work:
            self.engine.step()
        return t1 - t0, time.perf_counter() - t1

    def run_stream(self, w: Workload, batch: int) -> float:
        """Seconds to finish every request, at most `batch` running (the engine's limit)."""
        first, rest = self.run(w)
        return first + rest


class _HF:
    def __init__(self, model_dir: Path) -> None:
        import torch
        import transformers
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self._generate([[5] * 16], 2)  # warm up

    def run(self, w: Workload) -> tuple[float, float]:
        """One left-padded generate to the longest output; the first token marks prefill."""
        return self._generate(w.prompts, max(w.outputs))

    def run_stream(self, w: Workload, batch: int) -> float:
        """Static batches of `batch` requests in arrival order."""
        return sum(sum(self._generate(w.prompts[i:i + batch], max(w.outputs[i:i + batch])))
                   for i in range(0, len(w.prompts), batch))

    def _generate(self, prompts: list[list[int]], num_tokens: int) -> tuple[float, float]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stamps: list[float] = []

        class Clock:  # generate calls put() with the prompt, then once per new token
            def put(self, value: Any) -> None:
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=num_tokens,
                                min_new_tokens=num_tokens, do_sample=False, pad_token_id=0,
                                streamer=Clock())
        t2 = time.perf_counter()
        return stamps[1] - t0, t2 - stamps[1]


def _row(impl: str, phase: str, tok_s: float, w: Workload) -> dict[str, Any]:
    return {"impl": impl, "phase": phase, "value": round(tok_s, 1), "unit": "tok/s",
            "prompt_tokens": w.num_prompt_tokens, "output_tokens": sum(w.outputs)}


def _ttft(model_dir: Path, length: int, prefix_len: int, vocab: int,
          repeats: int) -> list[dict[str, Any]]:
    """Per repeat, a new prefix: cold prefill on P1 (its blocks go to the pool), then the same
    prefix plus a new tail on P2, which loads the prefix from the pool, then P2 again with
    another tail (local cache). Medians over the repeats."""
    from kvpool.engine.config import SamplingParams
    from kvpool.engine.worker.client import prefill
    from kvpool.engine.worker.messages import PrefillRequest

    def once(url: str, rid: str, prompt: list[int]) -> PrefillReply:
        return prefill(url, PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                           sampling=SamplingParams(max_tokens=1)))
    phases = (("cold", 0), ("prefix from pool", 1), ("prefix in local cache", 1))
    runs: list[list[tuple[float, PrefillReply]]] = [[], [], []]
    with _cluster(model_dir, length) as (master, p1, p2):
        urls = (p1, p2)
        for url in urls:  # first requests pay one-time costs (connections, allocator)
            once(url, f"warm-{url}", _prompts(1, 64, vocab, shift=9)[0])
        for rep in range(repeats):
            shared = _prompts(1, prefix_len, vocab, shift=20 + rep)[0]
            tails = _prompts(3, length - prefix_len, vocab, shift=40 + rep)
            for i, (_, worker) in enumerate(phases):
                t0 = time.perf_counter()
                info = once(urls[worker], f"ttft-{rep}-{i}", shared + tails[i])
                runs[i].append(((time.perf_counter() - t0) * 1e3, info))
        fresh_tail = _prompts(1, length - prefix_len, vocab, shift=11)[0]
        loads = _kv_load(model_dir, master, shared, fresh_tail, [info for _, info in runs[1]])
    rows: list[dict[str, Any]] = []
    for (name, _), timed in zip(phases, runs, strict=True):
        info = timed[-1][1]
        rows.append({"impl": "kvpool worker", "phase": f"TTFT {name}",
                     "value": statistics.median(ms for ms, _ in timed), "unit": "ms",
                     "prompt_len": length, "pool_tokens": info.num_pool_tokens,
                     "cached_tokens": info.num_cached_tokens,
                     "computed_tokens": info.num_computed_tokens,
                     "runs_ms": [round(ms) for ms, _ in timed]})
        if rows[0] is not rows[-1]:
            rows[-1]["vs_cold"] = round(rows[-1]["value"] / rows[0]["value"], 3)
    return rows + loads


def _kv_load(model_dir: Path, master: str, prefix: list[int], tail: list[int],
             infos: list[PrefillReply]) -> list[dict[str, Any]]:
    """GB/s of the KV load path: the worker's own loads above (median; each the first touch of
    those pool pages by that worker), then the same `PoolConnector.load` in this process into
    an engine-sized cache, alternating with one raw `batch_get_into` of the same objects into a
    plain buffer; medians."""
    import torch

    from kvpool.engine.blocks import block_key, prefix_block_hashes
    from kvpool.engine.checkpoint import read_model_config
    from kvpool.engine.config import EngineConfig, SamplingParams
    from kvpool.engine.identity import checkpoint_digest, torch_identity
    from kvpool.engine.kv_cache import KVCache
    from kvpool.engine.sequence import Sequence
    from kvpool.engine.worker.pool import PoolConnector
    from kvpool.store.client.config import ClientConfig
    from kvpool.store.client.store_client import StoreClient
    cfg = read_model_config(model_dir)
    root = torch_identity(checkpoint_digest(model_dir), cfg, EngineConfig()).root  # the workers'
    object_bytes = 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V of one block, float32
    keys = [block_key(h, layer) for h in prefix_block_hashes(prefix, 16, root)
            for layer in range(cfg.num_layers)]
    total = len(keys) * object_bytes
    load_s = statistics.median(info.pool_load_s for info in infos)
    worker = infos[-1].num_pool_tokens // 16 * cfg.num_layers * object_bytes / load_s
    prompt = prefix + tail
    cache = KVCache(cfg, EngineConfig(num_blocks=-(-len(prompt) // 16)), torch.float32, "cpu")
    buf = torch.zeros(total, dtype=torch.uint8)
    addrs = [buf.data_ptr() + i * object_bytes for i in range(len(keys))]
    path_s, raw_s = [], []
    with StoreClient(ClientConfig(master=master, local_buffer_size=0)) as client:
        client.register_buffer(buf)
        client.register_buffer(cache.kv)
        conn = PoolConnector(cache, client, client.engine, save_blocks=False)
        for _ in range(3):
            t0 = time.perf_counter()
            if not all(r.ok for r in client.batch_get_into(keys, addrs, [object_bytes] * len(keys))):
                raise RuntimeError("a raw get of the prefix failed")
            raw_s.append(time.perf_counter() - t0)
            seq = Sequence("load", prompt, len(prompt), SamplingParams(), 16, root)
            seq.block_table = list(range(seq.num_blocks_needed))
            conn.load(seq)
            if seq.num_pool_tokens != len(prefix):
                raise RuntimeError(f"loaded {seq.num_pool_tokens} of {len(prefix)} tokens")
            path_s.append(seq.pool_load_s)
    shape = {"bytes": total, "objects": len(keys), "object_bytes": object_bytes}
    return _kv_load_rows(shape, worker, load_s, path_s, raw_s)


def _kv_load_rows(shape: dict[str, int], worker: float, load_s: float, path_s: list[float],
                  raw_s: list[float]) -> list[dict[str, Any]]:
    """The rows of _kv_load: the worker's rate `worker` (bytes/s, over `load_s`), then the
    medians of the path's and the raw gets' times, all of `shape["bytes"]`."""
    total = shape["bytes"]
    raw = total / statistics.median(raw_s) / 1e9
    return [
        {"impl": "kvpool worker", "phase": "KV load, in the worker", "value": worker / 1e9,
         "unit": "GB/s", **shape, "load_ms": round(load_s * 1e3, 1),
         "vs_raw": round(worker / 1e9 / raw, 2)},
        {"impl": "kvpool", "phase": "KV load path, warm", "value": total / statistics.median(path_s) / 1e9,
         "unit": "GB/s", **shape, "load_ms": round(statistics.median(path_s) * 1e3, 1),
         "vs_raw": round(total / statistics.median(path_s) / 1e9 / raw, 2)},
        {"impl": "store", "phase": "raw batch_get_into", "value": raw, "unit": "GB/s", **shape,
         "load_ms": round(statistics.median(raw_s) * 1e3, 1)}]


@contextmanager
def _cluster(model_dir: Path, length: int) -> Iterator[tuple[str, str, str]]:
    """A store and two prefill workers alike (one chunk for the whole prompt)."""
    args = ("--role", "prefill", "--model", str(model_dir), "--max-prefill-chunk", str(length),
            "--max-model-len", str(length + 64), "--num-blocks", str(length // 16 * 3 + 64))
    with ExitStack() as stack:
        fleet = start_engines(stack, [args, args])
        yield fleet.master, fleet.urls[0], fleet.urls[1]
