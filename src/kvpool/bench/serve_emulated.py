"""`kvpool bench serve --engine emulated`: the conversation trace at full length, replayed live
through the real proxy, conductor, pool and KV bytes, on workers whose compute is emulated
from an accelerator profile, beside the simulator's prediction of the same run.

    trace window --> prompts (512 tokens per hash id, the trace's lengths and outputs)
                 --> one cluster per configuration: 8P8D with the pool (kvcache_centric,
                     load_balance, random; admission none / early / predicted) and 16
                     colocated baselines (vLLM's whole-prompt scheduler without prefix caching,
                     chunked prefill with prefix caching)
                 --> each request's worker-stamped tokens --> TTFT, TBT, SLO shares, mismatches
    the same window --> DisaggSim / ColocatedSim on the profile's cost model --> prediction

What is real: processes, HTTP, scheduling, the block managers, the pool and every KV byte
(at `--kv-scale` of the profile's size). What is emulated: the accelerator's step time.
Every duration is divided by `--speed-up` (workers, arrivals, SLOs, the proxy's cost model);
figures are printed in the profile's time (measured x speed-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.proc_cpu import cpu_s
from kvpool.bench.trace_prompts import TRACE_BLOCK_TOKENS, block_ids, pct
from kvpool.conductor.cost import CostModel
from kvpool.engine.emulated.kvbytes import expected_output, ordinary_vocab
from kvpool.engine.emulated.profile import EngineProfile, load_profile, scaled_cost
from kvpool.launch.wait import wait_for
from kvpool.serve.errors import REJECTED, refusal_reason
from kvpool.serve.launch import EMULATED_MAX_MODEL_LEN
from kvpool.sim.record import top_share_mean
from kvpool.sim.trace import TraceRequest, load_trace
from kvpool.sim.trace import speed_up as compress_arrivals
from kvpool.sim.window import describe as describe_window
from kvpool.sim.window import representative_window

TTFT_SLO_S = 30.0
TBT_SLOS_S = (0.1, 0.2, 0.3)


@dataclass(frozen=True)
class RunSpec:
    label: str
    num_prefill: int
    num_decode: int
    num_colocated: int
    policy: str
    admission: str
    baseline: str = ""
    """Colocated only: vllm (whole prompts, no prefix caching) or vllm_chunked_prefix."""
    load: float = 1.0
    """Arrival rate as a multiple of the trace's (the overload runs compress the arrivals)."""
    direct_below: int = 0
    """The proxy's --direct-below-tokens (conditional disaggregation; 0: off)."""


def default_runs(num_p: int, num_d: int, num_c: int, overload: float,
                 direct_below: int = 0) -> list[RunSpec]:
    """Placement at the trace's rate; admission at `overload` times it; the colocated
    baselines at the trace's rate; with `direct_below`, run 1 again with conditional
    disaggregation at that threshold (run 9)."""
    pd, x = f"{num_p}P{num_d}D", f"x{overload:g}"
    direct = ([RunSpec(f"{pd} kvcache_centric none direct<={direct_below}", num_p, num_d, 0,
                       "kvcache_centric", "none", direct_below=direct_below)]
              if direct_below > 0 else [])
    return [RunSpec(f"{pd} kvcache_centric none", num_p, num_d, 0, "kvcache_centric", "none"),
            RunSpec(f"{pd} load_balance none", num_p, num_d, 0, "load_balance", "none"),
            RunSpec(f"{pd} random none", num_p, num_d, 0, "random", "none"),
            RunSpec(f"{pd} kvcache_centric none {x}", num_p, num_d, 0, "kvcache_centric", "none",
                    load=overload),
            RunSpec(f"{pd} kvcache_centric early_rejection {x}", num_p, num_d, 0,
                    "kvcache_centric", "early_rejection", load=overload),
            RunSpec(f"{pd} kvcache_centric early_rejection_predicted {x}", num_p, num_d, 0,
                    "kvcache_centric", "early_rejection_predicted", load=overload),
            RunSpec(f"{num_c}M vllm", 0, 0, num_c, "round_robin", "none", "vllm"),
            RunSpec(f"{num_c}M vllm_chunked_prefix", 0, 0, num_c, "round_robin", "none",
                    "vllm_chunked_prefix"), *direct]


@dataclass
class Sent:
    """One request as replayed: its prompt, the answer's trace and the client's clock."""

    trace: TraceRequest
    prompt: list[int]
    arrival_t: float = 0.0
    status: int = 0
    reason: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    done_t: float = 0.0


def window(trace: list[TraceRequest], start_s: float, length_s: float | None) -> list[TraceRequest]:
    """Requests arriving in [start, start + length), their arrivals moved to start at 0."""
    end = float("inf") if length_s is None else start_s + length_s
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in trace
            if start_s <= r.arrival_s < end]


def prompt_of(r: TraceRequest, vocab: range) -> list[int]:
    """512 tokens per hash id (seeded by it), so prompts share tokens exactly where their hash
    ids do, cut or padded with tokens of this request alone to the trace's length."""
    ids: list[int] = []
    for h in r.block_hashes:
        if len(ids) >= r.input_len:
            break
        ids += block_ids(h, TRACE_BLOCK_TOKENS, vocab)
    tail = max(0, r.input_len - len(ids))
    return (ids + block_ids(-1 - r.request_id, tail, vocab))[:r.input_len]


async def _send(client: Any, url: str, model: str, s: Sent, start_t: float, speed_up: float) -> None:
    import httpx

    s.arrival_t = start_t + s.trace.arrival_s / speed_up
    await asyncio.sleep(max(0.0, s.arrival_t - time.monotonic()))
    body = {"model": model, "prompt": s.prompt, "max_tokens": s.trace.output_len,
            "temperature": 0, "ignore_eos": True, "kvpool_trace": True}
    try:
        resp = await client.post(url + "/v1/completions", json=body)
    except httpx.HTTPError as exc:
        s.status, s.reason = -1, type(exc).__name__
        return
    s.done_t = time.monotonic()
    s.status = resp.status_code
    s.body = resp.json()
    reason = refusal_reason(resp.status_code, s.body)
    if reason is not None:  # counted as rejected, as the simulator counts it
        s.status, s.reason = REJECTED, reason


async def replay(url: str, model: str, sent: list[Sent], speed_up: float) -> float:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        start_t = time.monotonic() + 0.5
        await asyncio.gather(*(_send(client, url, model, s, start_t, speed_up) for s in sent))
        return time.monotonic() - start_t


@dataclass(frozen=True)
class WorkerFacts:
    block_size: int
    model_hash: int
    kv_layers: int
    row_bytes: int
    vocab: range

    @property
    def token_bytes(self) -> int:
        return 2 * self.kv_layers * self.row_bytes

    def expected(self, prompt: list[int], n: int) -> list[int]:
        return expected_output(prompt, n, self.block_size, self.model_hash, self.kv_layers,
                               self.row_bytes, self.vocab)


def summarise(sent: list[Sent], facts: WorkerFacts, speed_up: float, disagg: bool,
              cost: CostModel) -> dict[str, Any]:
    """The measured row, in profile seconds. TBT of a request is the mean of its longest 10% of
    token gaps ([F] 5.1); shares count every request (rejected or failed ones miss)."""
    ok = [s for s in sent if s.status == 200]
    ttft, tbt, first_gap, lag, decision, mismatches, moved = [], [], [], [], [], 0, 0
    client_lag: list[float] = []
    wasted_s = 0.0
    for s in ok:
        tr = s.body["kvpool_trace"]
        stamps = tr["token_t"]
        ttft.append((stamps[0] - s.arrival_t) * speed_up)
        gaps = [(b - a) * speed_up for a, b in zip(stamps, stamps[1:], strict=False)]
        tbt.append(top_share_mean((g, 1) for g in gaps) if gaps else 0.0)
        first_gap += gaps[:1]
        if ttft[-1] > TTFT_SLO_S or tbt[-1] > TBT_SLOS_S[0]:  # served, and its prefill wasted
            reused = s.body["usage"]["prompt_tokens_details"]["cached_tokens"]
            wasted_s += cost.prefill_s(len(s.prompt), min(reused, len(s.prompt)))
        lag += [(r - t) * 1e3 for r, t in zip(tr["recv_t"], stamps, strict=True)]
        client_lag.append((s.done_t - tr["recv_t"][-1]) * 1e3)
        decision.append(tr["decision_s"] * 1e3)
        mismatches += tr["token_ids"] != facts.expected(s.prompt, s.trace.output_len)
        moved += int(tr["kv_bytes_moved"]) + (len(s.prompt) * facts.token_bytes if disagg else 0)
    prompt = sum(len(s.prompt) for s in ok)
    cached = sum(s.body["usage"]["prompt_tokens_details"]["cached_tokens"] for s in ok)
    row: dict[str, Any] = {
        "requests": len(sent), "ok": len(ok), "rejected": sum(s.status == 429 for s in sent),
        "failed": sum(s.status not in (200, 429) for s in sent),
        "output_mismatches": mismatches, "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "kv_bytes_moved": moved}
    for name, values in (("ttft", ttft), ("tbt", tbt), ("first_gap", first_gap)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = round(pct(values, q) * 1e3, 1)
    row["ttft_mean_ms"] = round(float(np.mean(ttft)) * 1e3, 1) if ttft else 0.0
    for slo in TBT_SLOS_S:
        met = sum(t <= TTFT_SLO_S and b <= slo for t, b in zip(ttft, tbt, strict=True))
        row[f"share_tbt_{int(slo * 1e3)}ms"] = round(met / len(sent), 4) if sent else 0.0
    row["wasted_prefill_requests"] = sum(
        t > TTFT_SLO_S or b > TBT_SLOS_S[0] for t, b in zip(ttft, tbt, strict=True))
    row["wasted_prefill_s"] = round(wasted_s, 1)
    row["decision_p50_ms"], row["decision_p99_ms"] = (round(pct(decision, q), 3) for q in (50, 99))
    row["lag_p50_ms"], row["lag_p99_ms"] = (round(pct(lag, q), 2) for q in (50, 99))
    row["client_lag_p50_ms"] = round(pct(client_lag, 50), 2)
    return row


def simulate(spec: RunSpec, reqs: list[TraceRequest], profile: EngineProfile,
             chunk_tokens: int) -> dict[str, Any]:
    """The simulator's row for the same window, on the profile's cost model ({} for a run
    with conditional disaggregation, which the simulator does not model)."""
    from kvpool.conductor import Conductor, ConductorConfig
    from kvpool.sim.colocated import ColocatedConfig, ColocatedSim, VllmConfig
    from kvpool.sim.disagg import DisaggConfig, DisaggSim
    from kvpool.sim.engine import EngineConfig

    if spec.direct_below:
        return {}
    eng = EngineConfig(kv_capacity_tokens=profile.kv_capacity_tokens)
    if spec.num_colocated:
        chunked = spec.baseline == "vllm_chunked_prefix"
        eng = replace(eng, chunk_tokens=chunk_tokens if chunked else 0,
                      prefix_cache_blocks=profile.kv_capacity_tokens // 512 if chunked else 0)
        vllm = VllmConfig(chunk_overhead_s=profile.chunk_overhead_s)
        result = ColocatedSim(profile.cost, ColocatedConfig(spec.num_colocated, eng,
                                                            "round_robin", vllm=vllm)).run(reqs)
    else:
        conductor = Conductor(ConductorConfig(prefill_policy=spec.policy,
                                              admission=spec.admission), profile.cost)
        result = DisaggSim(conductor, DisaggConfig(spec.num_prefill, spec.num_decode,
                                                   engine=eng)).run(reqs)
    ttft, tbt = result.ttfts(), result.tbts()
    row: dict[str, Any] = {"rejected": result.rejected(), "prefix_hit_rate": round(result.hit_rate(), 4)}
    missed = [r for r in result.records if r.completed and not r.meets(TTFT_SLO_S, TBT_SLOS_S[0])]
    row["wasted_prefill_requests"] = len(missed)
    row["wasted_prefill_s"] = round(sum(r.prefill_gpu_s for r in missed), 1)
    for name, values in (("ttft", ttft), ("tbt", tbt)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = round(float(np.percentile(values, q)) * 1e3, 1) if values.size else 0.0
    row["ttft_mean_ms"] = round(float(np.mean(ttft)) * 1e3, 1) if ttft.size else 0.0
    for slo in TBT_SLOS_S:
        row[f"share_tbt_{int(slo * 1e3)}ms"] = round(result.attainment(TTFT_SLO_S, slo), 4)
    return row


# -- the live runs ---------------------------------------------------------------------------------

def scaled_cost_file(profile: EngineProfile, speed_up: float, folder: Path) -> Path:
    """The profile's cost model with every duration divided by `speed_up`, for the proxy."""
    path = folder / "cost.json"
    path.write_text(json.dumps(scaled_cost(profile.cost, speed_up).to_dict()))
    return path


def worker_args(spec: RunSpec, args: argparse.Namespace) -> tuple[str, ...]:
    common: tuple[str, ...] = (
        "--engine", "emulated", "--profile", args.profile, "--speed-up", str(args.speed_up),
        "--kv-scale", str(args.kv_scale), "--block-size", str(TRACE_BLOCK_TOKENS),
        "--max-model-len", str(EMULATED_MAX_MODEL_LEN), "--max-num-seqs", "256")
    if spec.baseline:  # priced as the simulator's colocated vLLM v0.5.1
        common = (*common, "--step-rules", "vllm")
    if args.backend == "vllm":
        common = (*common, "--kv-connector", args.kv_connector)
    if spec.baseline == "vllm":
        return (*common, "--prefill-mode", "whole", "--max-prefill-chunk", str(EMULATED_MAX_MODEL_LEN),
                "--no-prefix-caching")
    if spec.baseline == "vllm_chunked_prefix":
        return (*common, "--max-prefill-chunk", str(args.chunk_tokens))
    return (*common, "--max-prefill-chunk", str(EMULATED_MAX_MODEL_LEN), "--max-prefill-seqs", "1")


NIXL_PROXY_ARGS = ("--pool-topic", "", "--pd-pool-wait-s", "0")
"""A fleet on vLLM's NIXL connector: no pool its instances load prefixes from (the conductor
prices none) and no wait for one at the handoff (the decode instance pulls the blocks)."""


def proxy_args(spec: RunSpec, args: argparse.Namespace, cost: Path) -> tuple[str, ...]:
    s = args.speed_up
    return ("--prefill-policy", spec.policy, "--admission", spec.admission,
            "--poll-interval", str(args.poll_interval),
            "--ttft-slo", str(TTFT_SLO_S / s), "--tbt-slo", str(TBT_SLOS_S[0] / s),
            "--decode-horizon", str(10.0 / s), "--cost", str(cost),
            *(("--direct-below-tokens", str(spec.direct_below)) if spec.direct_below else ()),
            *(NIXL_PROXY_ARGS if args.backend == "vllm" and args.kv_connector == "nixl" else ()))


def _facts(url: str) -> WorkerFacts:
    import httpx

    info = httpx.get(url + "/info", timeout=10).json()
    vocab = int(json.loads((Path(info["model"]) / "config.json").read_text())["vocab_size"])
    e = info["engine"]
    return WorkerFacts(int(info["block_size"]), int(info["model_hash"]), int(e["kv_layers"]),
                       int(e["row_bytes"]), ordinary_vocab(vocab))


def _load(url: str, backend: str) -> dict[str, Any]:
    """A worker's /load, or (vLLM's API) what its /metrics say of the same."""
    import httpx

    if backend != "vllm":
        return dict(httpx.get(url + "/load", timeout=10).json())
    from kvpool.serve.vllm.metrics_text import parse_metrics

    m = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    assert m is not None and m.kv_capacity_tokens is not None, url
    return {"free_kv_tokens": round(m.kv_capacity_tokens * (1 - m.kv_usage)),
            "kv_capacity_tokens": m.kv_capacity_tokens, "num_running": m.num_running}


def leftovers(cluster: Any, backend: str = "kvpool") -> tuple[list[str], float]:
    """What a finished run left behind: workers whose KV blocks are not all free again, and
    pool objects of requests (`kvreq/`) nobody collected; and the seconds the workers' steps
    started late (`engine_lost_s`, summed; not known through vLLM's API)."""
    import httpx

    found, lost_s = [], 0.0
    for urls in cluster.worker_urls.values():
        for url in urls:
            load = _load(url, backend)
            lost_s += float(load.get("engine_lost_s", 0.0))
            if load["free_kv_tokens"] != load["kv_capacity_tokens"] or load["num_running"]:
                found.append(f"{url}: {load['free_kv_tokens']} of {load['kv_capacity_tokens']} "
                             f"KV tokens free, {load['num_running']} running")
    keys = httpx.get(f"{cluster.admin_url}/keys", params={"prefix": "kvreq/"}, timeout=10).json()
    if keys["count"]:
        found.append(f"{keys['count']} request KV objects left in the pool "
                     f"({', '.join(keys['keys'][:3])})")
    return found, lost_s


def proxy_counter(url: str, name: str) -> float:
    """A counter of the proxy's /metrics (its samples summed over labels; 0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from kvpool.metadata.http_serving import bearer_header
    from kvpool.token import env_token

    text = httpx.get(url + "/metrics", timeout=30, headers=bearer_header(env_token())).text
    return sum(s.value for family in text_string_to_metric_families(text)
               if family.name == name for s in family.samples if s.name == name + "_total")


def wait_rotation(url: str, num_workers: int, timeout_s: float = 120.0) -> None:
    """Until the proxy has every worker in rotation."""
    from kvpool.bench.serve_sim import fetch_stats

    def in_rotation() -> bool:
        s = fetch_stats(url)
        return sum(s[f"num_{r}_workers"] for r in ("prefill", "decode", "colocated")) >= num_workers

    wait_for(in_rotation, timeout_s, f"the proxy to take all {num_workers} workers", 0.2)


def live_run(spec: RunSpec, args: argparse.Namespace, reqs: list[TraceRequest],
             model: Path, cost: Path, profile: EngineProfile) -> dict[str, Any]:
    from kvpool.launch.ports import free_port
    from kvpool.serve.launch import ServingSpec, serving_cluster

    serving = ServingSpec(model, port=free_port(), num_prefill=spec.num_prefill,
                          num_decode=spec.num_decode, num_colocated=spec.num_colocated,
                          dram=args.pool_dram, worker_args=worker_args(spec, args),
                          proxy_args=proxy_args(spec, args, cost), backend=args.backend)
    with serving_cluster(serving) as cluster:
        any_worker = next(iter(cluster.worker_urls.values()))[0]
        facts = _facts(any_worker)
        wait_rotation(cluster.proxy_url, spec.num_prefill + spec.num_decode + spec.num_colocated)
        sent = [Sent(r, prompt_of(r, facts.vocab)) for r in reqs]
        proxy_cpu = cpu_s(cluster.procs["proxy"].pid)
        wall = asyncio.run(replay(cluster.proxy_url, cluster.model_name, sent,
                                  args.speed_up * spec.load))
        proxy_cpu = cpu_s(cluster.procs["proxy"].pid) - proxy_cpu
        direct = proxy_counter(cluster.proxy_url, "kvpool_proxy_direct_requests")
        time.sleep(0.5)
        left, lost_s = leftovers(cluster, args.backend)
    row = summarise(sent, facts, args.speed_up, not spec.num_colocated, profile.cost)
    row["engine_lost_s"] = round(lost_s * args.speed_up, 2)
    row["proxy_cpu_ms_per_request"] = round(proxy_cpu * 1e3 / max(1, len(sent)), 1)
    row["direct_requests"] = int(direct)
    row["failed_by"] = sorted({f"{s.status} {str(s.body.get('error', s.reason))[:120]}"
                               for s in sent if s.status not in (200, 429)})[:3]
    row["wall_s"] = round(wall, 1)
    row["leftovers"] = left
    row["valid"] = row["lag_p50_ms"] * args.speed_up <= 0.1 * TBT_SLOS_S[0] * 1e3
    return row


# -- the command -------------------------------------------------------------------------------------

COMPARED = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "tbt_p50_ms", "tbt_p90_ms",
            "share_tbt_100ms", "share_tbt_200ms", "share_tbt_300ms", "rejected",
            "wasted_prefill_s", "prefix_hit_rate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--engine emulated")
    g.add_argument("--profile", default="llama70b-8xa800-joint",
                   help="accelerator profile (default: the simulator's, fitted on Mooncake's "
                        "curves by `kvpool sim calibrate --joint`)")
    g.add_argument("--kv-scale", type=float, default=1 / 1024,
                   help="share of the profile's KV bytes written and moved (default 1/1024)")
    g.add_argument("--window-start", type=float, default=None,
                   help="trace seconds skipped (default: the start of the window whose load is "
                        "most like the whole trace's, kvpool.sim.window)")
    g.add_argument("--window", type=float, default=50.0,
                   help="trace seconds replayed (default 50; --full: the whole hour)")
    g.add_argument("--full", action="store_true", help="replay the whole trace")
    g.add_argument("--prefill", type=int, default=8)
    g.add_argument("--decode", type=int, default=8)
    g.add_argument("--colocated", type=int, default=16)
    g.add_argument("--chunk-tokens", type=int, default=512,
                   help="chunked-prefill budget of the vllm_chunked_prefix baseline")
    g.add_argument("--pool-dram", default="3GiB", help="the store node's DRAM")
    g.add_argument("--overload", type=float, default=4.0,
                   help="arrival rate of the admission runs, x the trace's (default 4)")
    g.add_argument("--poll-interval", type=float, default=0.5,
                   help="seconds between the proxy's /load polls of each worker (default 0.5)")
    g.add_argument("--backend", choices=("kvpool", "vllm"), default="kvpool",
                   help="vllm: the workers serve vLLM's API (kvpool worker --api vllm) and the "
                        "proxy drives them through its vllm backend")
    g.add_argument("--kv-connector", choices=("store", "nixl"), default="store",
                   help="--backend vllm: the vLLM KV connector the instances act as: store "
                        "(MooncakeStoreConnector: every instance loads the prefixes the pool "
                        "holds, whatever the policy) or nixl (P/D moves a request's blocks from "
                        "its prefill instance, and reuse is each instance's own cache)")
    g.add_argument("--direct-below-tokens", type=int, default=0,
                   help="also run kvcache_centric with the proxy's conditional disaggregation at "
                        "this threshold (run 9; the simulator column shows n/a)")
    g.add_argument("--runs", default="",
                   help="comma-separated run numbers (1-based) of the default list")


def header(args: argparse.Namespace, profile: EngineProfile, reqs: list[TraceRequest]) -> str:
    return (f"kvpool bench serve --engine emulated: {len(reqs)} requests of the conversation "
            f"trace (t = {args.window_start:.0f} s + {'all' if args.full else f'{args.window:.0f} s'}),"
            f" full-length prompts, profile {profile.name}, speed-up {args.speed_up:g}, "
            f"KV bytes at scale {args.kv_scale:.6g}\n"
            "Real: processes, HTTP, the proxy's conductor, block managers, the pool and every KV "
            "byte. Emulated: the accelerator's step time (profile). Figures in profile time; "
            "'sim' = the simulator on the same window and profile.")


def _format(label: str, live: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    head = (f"{label}: ok {live['ok']}/{live['requests']} rejected {live['rejected']} failed "
            f"{live['failed']} mismatches {live['output_mismatches']} KV moved "
            f"{live['kv_bytes_moved'] / 2**20:.1f} MiB  decision p50/p99 "
            f"{live['decision_p50_ms']}/{live['decision_p99_ms']} ms  lag p50/p99 "
            f"{live['lag_p50_ms']}/{live['lag_p99_ms']} ms  first gap p50/p90 "
            f"{live['first_gap_p50_ms']}/{live['first_gap_p90_ms']} ms  steps late "
            f"{live['engine_lost_s']} s  proxy CPU {live['proxy_cpu_ms_per_request']} ms/request"
            f"{'  direct ' + str(live['direct_requests']) if live['direct_requests'] else ''}"
            f"{'' if live['valid'] else '  INVALID: lag over 10% of the TBT SLO'}"
            f"{'  LEFTOVERS: ' + '; '.join(live['leftovers']) if live['leftovers'] else ''}"
            f"{'  FAILURES: ' + ' | '.join(live['failed_by']) if live['failed_by'] else ''}")
    lines = [head, "    " + "".join(f"{k:>17}" for k in ("", *COMPARED))]
    for name, row in (("live", live), ("sim", sim)):
        lines.append("    " + f"{name:>17}" + "".join(f"{row.get(k, 'n/a')!s:>17}"
                                                      for k in COMPARED))
    return lines


def run_emulated(args: argparse.Namespace) -> int:
    from kvpool.serve.launch import default_model_dir, ensure_emulated_model, ensure_tiny_model

    profile = load_profile(args.profile)
    trace = load_trace(args.trace)
    if args.window_start is None:
        picked = representative_window(trace, args.window)
        args.window_start = 0.0 if args.full else picked.start_s
        if not args.json and not args.full:
            print(f"representative {describe_window(picked)}", flush=True)
    reqs = window(trace, args.window_start, None if args.full else args.window)
    specs = default_runs(args.prefill, args.decode, args.colocated, args.overload,
                         args.direct_below_tokens)
    if args.runs:
        specs = [specs[int(i) - 1] for i in args.runs.split(",")]
    tiny = Path(args.model) if args.model else ensure_tiny_model(default_model_dir())
    if not args.json:
        print(header(args, profile, reqs), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_emulated_model(tiny, Path(tmp) / "emulated", EMULATED_MAX_MODEL_LEN)
        cost = scaled_cost_file(profile, args.speed_up, Path(tmp))
        for spec in specs:
            sim = simulate(spec, compress_arrivals(reqs, spec.load), profile,
                           args.chunk_tokens)
            live = live_run(spec, args, reqs, model, cost, profile)
            if args.json:
                print(json.dumps({"config": spec.label, "speed_up": args.speed_up,
                                  "kv_scale": args.kv_scale, "profile": profile.name,
                                  **live, "sim": sim}), flush=True)
            else:
                print("\n".join(_format(spec.label, live, sim)), flush=True)
    return 0
