"""`kvpool bench engine --write-profile FILE`: the real engine on this machine described as an
accelerator profile, so the emulated engine and the simulator can run on it.

Measured with the torch engine itself (no processes, no pool), each figure the median of
`repeats` runs on fresh tokens:
- prefill: one prompt of n tokens, of which p are a prefix still in the local cache (p = 0,
  n/2), over several n; fitted with `fit_prefill` (base + linear + quadratic);
- decode: steps of a batch of b sequences of context c, over several (b, c); fitted with
  `fit_decode` (base + per sequence + per context token);
- the KV bytes per token and the capacity from the engine's own cache.
Transfer terms keep the shipped profile's values (nothing here isolates them).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.emulated.profile import EngineProfile, load_profile


def _fresh(n: int, vocab: int, salt: int) -> list[int]:
    return [16 + (salt * 1_000_003 + i * 7919) % (vocab - 16) for i in range(n)]


def _timed_step(engine: object) -> float:
    t0 = time.perf_counter()
    engine.step()  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def prefill_samples(engine: object, lengths: list[int], vocab: int,
                    repeats: int) -> list[tuple[int, int, float]]:
    out = []
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    salt = 0
    for n in lengths:
        for share in (0.0, 0.5):
            times = []
            for _ in range(repeats):
                salt += 1
                prompt = _fresh(n, vocab, salt)
                p = int(n * share) // 16 * 16
                if p:
                    engine.generate([prompt[:p] + [17]], one)  # type: ignore[attr-defined]
                engine.add_request(f"p{salt}", prompt, one)  # type: ignore[attr-defined]
                times.append(_timed_step(engine))
                while engine.has_work:  # type: ignore[attr-defined]
                    engine.step()  # type: ignore[attr-defined]
            out.append((n, p, statistics.median(times)))
    return out


def decode_samples(engine: object, shapes: list[tuple[int, int]], vocab: int,
                   steps: int = 6) -> list[tuple[int, int, float]]:
    out = []
    for batch, context in shapes:
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"d{batch}-{context}-{i}", _fresh(context, vocab, 10_000 + i), params)  # type: ignore[attr-defined]
        while any(s.num_uncomputed > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
        times = [_timed_step(engine) for _ in range(steps)]
        out.append((batch, batch * (context + 1), statistics.median(times)))
        while engine.has_work:  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
    return out


def measure_profile(model_dir: Path, quick: bool = False, repeats: int = 3) -> EngineProfile:
    from kvpool.bench.serve_sim import fit_decode
    from kvpool.conductor.cost import fit_prefill
    from kvpool.engine.checkpoint import read_model_config
    from kvpool.engine.llm_engine import LLMEngine

    vocab = read_model_config(model_dir).vocab_size
    config = EngineConfig(num_blocks=1024, max_prefill_chunk=8192, max_model_len=8192,
                          max_num_seqs=64)
    engine = LLMEngine.from_dir(model_dir, config)
    lengths = [64, 256, 512] if quick else [128, 512, 1024, 2048]
    shapes = [(1, 64), (4, 64), (4, 512)] if quick else [(1, 128), (8, 128), (8, 1024), (16, 512)]
    prefill = prefill_samples(engine, lengths, vocab, repeats)
    decode = decode_samples(engine, shapes, vocab)
    shipped = load_profile("llama70b-8xa800")
    cost = fit_decode(decode, fit_prefill(prefill, shipped.cost))
    cost = replace(cost, kv_bytes_per_token=engine.cache.token_bytes)
    return EngineProfile(f"kvpool-torch-{Path(model_dir).name}", cost,
                         description=f"kvpool's torch engine on {model_dir}, measured here: "
                                     f"prefill {prefill}, decode {decode}",
                         chunk_overhead_s=0.0, kv_capacity_tokens=config.kv_capacity_tokens,
                         kv_layers=shipped.kv_layers)
