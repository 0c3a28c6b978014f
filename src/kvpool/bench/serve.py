"""`kvpool bench serve`: replay a scaled-down slice of a Mooncake trace through the proxy.

Prompts are synthesised from the trace: every hash id becomes a fixed run of `--block-tokens`
token ids (seeded by the id), so requests share prompt prefixes exactly where their hash ids
repeat, and lengths keep the trace's proportions (512 trace tokens -> one block). Output
lengths are scaled the same way and capped; EOS is ignored so every request runs its length.

With `--url` it measures one running proxy. With `--matrix` it starts a local cluster per
configuration (colocated vs disaggregated, kvcache_centric vs load_balance, early rejection
on vs off) and replays the same slice through each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.bench.trace_prompts import TRACE_BLOCK_TOKENS, BenchRequest, block_ids, pct
from kvpool.serve.errors import REJECTED, refusal_reason

__all__ = ["TRACE_BLOCK_TOKENS", "BenchRequest", "BenchResult", "block_ids", "pct"]


@dataclass
class BenchResult:
    status: int
    reason: str = ""
    """For a 429: the admission's reason (ttft, tbt, kv_capacity)."""
    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="replay a trace slice through the proxy (TTFT, TBT)")
    p.add_argument("--url", default=None, help="a running proxy (default: --matrix)")
    p.add_argument("--matrix", action="store_true",
                   help="start clusters and compare layouts, prefill policies and admission")
    p.add_argument("--model", default=None, help="--matrix: model folder (default: tiny)")
    p.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL (default: packaged)")
    p.add_argument("--limit", type=int, default=40, help="requests replayed (default 40)")
    p.add_argument("--engine", choices=("torch", "emulated"), default="torch",
                   help="emulated: the full-length trace on emulated-accelerator workers "
                        "(kvpool.bench.serve_emulated)")
    p.add_argument("--speed-up", type=float, default=None,
                   help="replay this many times faster (default 4; emulated: 1)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block")
    p.add_argument("--max-output", type=int, default=16, help="cap on output tokens")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="--matrix: proxies' TTFT SLO, s")
    p.add_argument("--tbt-slo", type=float, default=0.2, help="--matrix: proxies' TBT SLO, s")
    p.add_argument("--decode-horizon", type=float, default=1.0,
                   help="--matrix: proxies' assumed decode time t_d, s")
    p.add_argument("--calibrate", type=int, default=8,
                   help="requests sent one at a time before the replay, so the simulator's "
                        "cost model is fitted to clean prefill times (default 8; 0 = none)")
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    from kvpool.bench.serve_emulated import add_arguments

    add_arguments(p)
    p.set_defaults(func=_main)


def synthesise(trace: list[Any], block_tokens: int, vocab: range, max_model_len: int,
               max_output: int) -> list[BenchRequest]:
    """Trace records -> prompts that share prefixes exactly where hash ids repeat."""
    scale = block_tokens / TRACE_BLOCK_TOKENS
    out = []
    for r in trace:
        output = max(1, min(max_output, round(r.output_len * scale)))
        want = max(1, min(round(r.input_len * scale), max_model_len - output - 1))
        ids: list[int] = []
        for h in r.block_hashes:
            if len(ids) >= want:
                break
            ids += block_ids(h, block_tokens, vocab)
        ids = (ids + block_ids(-1 - r.request_id, want, vocab))[:want]
        out.append(BenchRequest(r.arrival_s, ids, output))
    return out


async def _one(client: Any, url: str, model: str, req: BenchRequest) -> BenchResult:
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = BenchResult(0)
    last = 0.0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            reason = refusal_reason(resp.status_code, json.loads(raw))
            if reason is not None:  # counted as rejected, as the simulator counts it
                res.status, res.reason = REJECTED, reason
            return res
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter() - start
            if event.get("choices") and event["choices"][0].get("text"):
                if not res.ttft_s:
                    res.ttft_s = now
                else:
                    res.gaps_s.append(now - last)
                last = now
            use = event.get("usage")
            if use:
                res.prompt_tokens = use["prompt_tokens"]
                res.output_tokens = use["completion_tokens"]
                res.cached_tokens = (use.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0)
    return res


async def replay(url: str, model: str, reqs: list[BenchRequest]) -> tuple[list[BenchResult], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()

        async def at(req: BenchRequest) -> BenchResult:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - start)))
            try:
                return await _one(client, url, model, req)
            except httpx.HTTPError:
                return BenchResult(-1)

        results = await asyncio.gather(*(at(r) for r in reqs))
        return list(results), time.perf_counter() - start


def calibration_requests(reqs: list[BenchRequest], num: int,
                         vocab: range) -> list[BenchRequest]:
    """`num` prompts spread evenly over the slice's prompt lengths, of tokens no trace prompt
    shares (so they leave nothing the replay could reuse), 2 output tokens each."""
    lens = sorted(len(r.prompt_ids) for r in reqs)
    if num <= 0 or not lens:
        return []
    step = (lens[-1] - lens[0]) / max(1, num - 1)
    return [BenchRequest(0.0, block_ids(-(10**9) - i, round(lens[0] + i * step), vocab), 2)
            for i in range(num)]


async def calibrate(url: str, model: str,
                    reqs: list[BenchRequest]) -> list[tuple[int, int, float]]:
    """Send `reqs` one at a time, so each prefill has its worker to itself (a clean sample at
    the proxy). Returns (prompt tokens, cached tokens, TTFT) of the answered ones: the prefill
    time as the client sees it, proxy and HTTP included."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for req in reqs:
            res = await _one(client, url, model, req)
            if res.status == 200 and res.ttft_s > 0:
                out.append((res.prompt_tokens, res.cached_tokens, res.ttft_s))
    return out


def summarise(results: list[BenchResult], wall_s: float) -> dict[str, Any]:
    """The measured row. `tbt_*` are over every gap; `tbt_req_*` over requests, each the mean
    of its longest 10% of gaps (the simulator's TBT, [F] 5.1)."""
    from kvpool.sim.record import top_share_mean

    ok = [r for r in results if r.status == 200]
    ttft = [r.ttft_s for r in ok if r.ttft_s]
    tbt = [g for r in ok for g in r.gaps_s]
    prompt = sum(r.prompt_tokens for r in ok)
    row: dict[str, Any] = {"requests": len(results), "ok": len(ok),
                           "rejected": sum(r.status == 429 for r in results),
                           "rejected_by": {reason: sum(r.reason == reason for r in results)
                                           for reason in sorted({r.reason for r in results
                                                                 if r.status == 429})},
                           "failed": sum(r.status not in (200, 429) for r in results)}
    tbt_req = [top_share_mean((g, 1) for g in r.gaps_s) for r in ok if r.gaps_s]
    for name, values in (("ttft", ttft), ("tbt", tbt), ("tbt_req", tbt_req)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = round(pct(values, q) * 1e3, 1)
    row["output_tok_per_s"] = round(sum(r.output_tokens for r in ok) / wall_s, 1)
    row["req_per_s"] = round(len(ok) / wall_s, 2)
    row["prefix_hit_rate"] = round(sum(r.cached_tokens for r in ok) / prompt, 3) if prompt else 0.0
    return row


def _requests(args: argparse.Namespace, vocab: range, max_model_len: int) -> list[BenchRequest]:
    from kvpool.sim.trace import load_trace, speed_up

    trace = speed_up(load_trace(args.trace, args.limit), args.speed_up)
    return synthesise(trace, args.block_tokens, vocab, max_model_len, args.max_output)


def _model_facts(url: str) -> tuple[str, int]:
    import httpx

    card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    return str(card["id"]), int(card["max_model_len"])


def _vocab(model_dir: Path | None) -> range:
    """Ordinary tokens of the model (specials sit at the start of the tiny model's vocabulary)."""
    size = 512
    if model_dir is not None and (model_dir / "config.json").is_file():
        size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    return range(min(16, size // 2), size)


def _print(label: str, row: dict[str, Any], as_json: bool, sim: Any = None) -> None:
    """One measured row; with `sim` (a serve_sim.Comparison) the simulated row under it."""
    if as_json:
        print(json.dumps({"config": label, **row, **(sim.to_json() if sim else {})}), flush=True)
        return
    why = ",".join(f"{k}:{v}" for k, v in row["rejected_by"].items()) or "-"
    print(f"{label:<44} ok {row['ok']:>3}/{row['requests']:<3} rej {row['rejected']:>3} "
          f"({why}) "
          f"fail {row['failed']:>2}  TTFT p50/p90/p99 {row['ttft_p50_ms']:>7}/"
          f"{row['ttft_p90_ms']:>7}/{row['ttft_p99_ms']:>7} ms  TBT p50/p90/p99 "
          f"{row['tbt_p50_ms']:>5}/{row['tbt_p90_ms']:>5}/{row['tbt_p99_ms']:>6} ms  "
          f"{row['output_tok_per_s']:>6} tok/s  hit {row['prefix_hit_rate']:.2f}", flush=True)
    if sim is not None:
        from kvpool.bench.serve_sim import format_comparison

        print("\n".join(format_comparison(row, sim)), flush=True)


MATRIX = (  # (label, prefill workers, decode workers, colocated workers, policy, admission)
    ("2P1D kvcache_centric early_rej_pred", 2, 1, 0, "kvcache_centric",
     "early_rejection_predicted"),
    ("2P1D kvcache_centric no_rejection", 2, 1, 0, "kvcache_centric", "none"),
    ("2P1D load_balance early_rej_pred", 2, 1, 0, "load_balance", "early_rejection_predicted"),
    ("3 colocated kvcache_centric early_rej_pred", 0, 0, 3, "kvcache_centric",
     "early_rejection_predicted"),
    ("3 colocated load_balance early_rej_pred", 0, 0, 3, "load_balance",
     "early_rejection_predicted"),
)


def _run_matrix(args: argparse.Namespace) -> int:
    from kvpool.bench.serve_sim import prefill_samples
    from kvpool.launch.ports import free_port
    from kvpool.serve.launch import (
        ServingSpec,
        default_model_dir,
        ensure_tiny_model,
        serving_cluster,
    )

    model = Path(args.model) if args.model else ensure_tiny_model(default_model_dir())
    reqs: list[BenchRequest] | None = None
    borrowed: list[tuple[int, int, float]] = []
    for label, num_p, num_d, num_c, policy, admission in MATRIX:
        spec = ServingSpec(model, port=free_port(), num_prefill=num_p, num_decode=num_d,
                           num_colocated=num_c, proxy_args=(
                               "--prefill-policy", policy, "--admission", admission,
                               "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo),
                               "--decode-horizon", str(args.decode_horizon), "--fit-cost"))
        with serving_cluster(spec) as cluster:
            name, max_len = _model_facts(cluster.proxy_url)
            reqs = reqs or _requests(args, _vocab(model), max_len)
            row, sim = _measure(args, cluster.proxy_url, name, reqs, _vocab(model), borrowed)
        if len(prefill_samples(sim.stats)) >= 3:
            borrowed += prefill_samples(sim.stats)
        _print(label, row, args.json, sim)
    return 0


def _measure(args: argparse.Namespace, url: str, name: str, reqs: list[BenchRequest],
             vocab: range, borrowed: list[tuple[int, int, float]]) -> tuple[dict[str, Any], Any]:
    """Calibrate, replay, and simulate the replay: the measured row and the comparison."""
    from kvpool.bench.serve_sim import LiveStats, compare, fetch_stats

    before = fetch_stats(url)
    cal = asyncio.run(calibrate(url, name, calibration_requests(reqs, args.calibrate, vocab)))
    results, wall = asyncio.run(replay(url, name, reqs))
    stats = LiveStats.from_json(fetch_stats(url), before)
    row = summarise(results, wall)
    return row, compare(row, reqs, stats, cal, borrowed, "the runs above")


def _run_url(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    name, max_len = _model_facts(url)
    vocab = _vocab(Path(args.model) if args.model else None)
    reqs = _requests(args, vocab, max_len)
    row, sim = _measure(args, url, name, reqs, vocab, [])
    _print(url, row, args.json, sim)
    return 0


def _main(args: argparse.Namespace) -> int:
    import httpx

    from kvpool.errors import KvpoolError

    try:
        if args.engine == "emulated":
            from kvpool.bench.serve_emulated import run_emulated

            args.speed_up = args.speed_up or 1.0
            return run_emulated(args)
        args.speed_up = args.speed_up or 4.0
        if args.url is None or args.matrix:
            return _run_matrix(args)
        return _run_url(args)
    except (KvpoolError, OSError, TimeoutError, httpx.HTTPError) as exc:
        print(f"kvpool bench serve: {exc}", file=sys.stderr)
        return 2
