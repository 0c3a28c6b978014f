"""The simulator beside the live system: `kvpool bench serve` replays a slice through a real
cluster, then simulates the same slice on a cluster of the same shape with the cost model
refitted from what that run measured, and reports how far the two are apart.

    live run --> GET /stats/samples --> prefill samples --fit_prefill--+
                 (shape, settings)      decode gaps ----fit_decode-----+--> CostModel
                                                                        |
    the same BenchRequests (arrivals, lengths, block hashes) ----------+--> DisaggSim or
                                                                            ColocatedSim
    measured row, simulated row, relative error per figure (sim - live) / live

Fitted: the three prefill terms (`fit_prefill`, as `kvpool sim fit`) and the three decode-step
terms (`fit_decode`, here). Kept at the papers' 70B values: KV bytes per token, bandwidth, link
efficiency, transfer latency and the prefix load rate (they move tiny amounts of KV on
loopback here and no sample isolates them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvpool.bench.trace_prompts import BenchRequest, pct
from kvpool.conductor.cost import CostModel, fit_prefill
from kvpool.engine.blocks import prefix_block_hashes
from kvpool.errors import InvalidArgument
from kvpool.sim.metrics import SimResult
from kvpool.sim.trace import TraceRequest

KEPT_TERMS = ("kv_bytes_per_token", "bandwidth_gbps", "link_efficiency", "transfer_latency_s",
              "load_s_per_token")
"""CostModel fields that keep the papers' 70B values in the simulated cluster."""

COMPARED = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_req_p50_ms", "tbt_req_p90_ms",
            "tbt_req_p99_ms", "output_tok_per_s", "prefix_hit_rate", "rejected")
"""Figures of the measured and simulated rows set side by side (TBT per request, the mean of
its longest 10% of gaps, as the simulator defines it)."""


@dataclass(frozen=True)
class LiveStats:
    """A proxy's `GET /stats/samples` reply, cut to the samples of one replay."""

    num_prefill: int
    num_decode: int
    num_colocated: int
    block_size: int
    model_hash: int
    kv_capacity_tokens: int
    prefill_policy: str
    admission: str
    ttft_slo_s: float
    tbt_slo_s: float
    decode_horizon_s: float
    prefill: list[tuple[int, int, float, bool]] = field(default_factory=list)
    decode: list[tuple[int, int, float]] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: dict[str, Any], since: dict[str, Any] | None = None) -> LiveStats:
        """`since`: an earlier reply of the same proxy; only the samples taken after it."""
        new_p = obj["num_prefill_samples"] - (since["num_prefill_samples"] if since else 0)
        new_d = obj["num_decode_samples"] - (since["num_decode_samples"] if since else 0)
        prefill = [(int(n), int(p), float(s), bool(a)) for n, p, s, a in obj["prefill"]]
        decode = [(int(b), int(t), float(g)) for b, t, g in obj["decode"]]
        return cls(obj["num_prefill_workers"], obj["num_decode_workers"],
                   obj["num_colocated_workers"], int(obj["block_size"]), int(obj["model_hash"]),
                   int(obj["kv_capacity_tokens"]), obj["prefill_policy"], obj["admission"],
                   float(obj["ttft_slo_s"]), float(obj["tbt_slo_s"]),
                   float(obj["decode_horizon_s"]),
                   prefill[len(prefill) - min(new_p, len(prefill)):],
                   decode[len(decode) - min(new_d, len(decode)):])


@dataclass(frozen=True)
class FittedCost:
    cost: CostModel
    prefill_from: str
    """Where the prefill terms come from: this run's workers, its calibration TTFTs, another
    run's samples, or the papers' defaults (see `fit_cost`)."""
    decode_from: str
    prefill_worst_error: float | None
    """Worst relative error of the fitted prefill model on the samples it was fitted to."""
    prefill_samples: list[tuple[int, int, float]] = field(default_factory=list)
    """The samples the prefill terms were fitted to (outliers left out)."""


def fit_decode(samples: Iterable[tuple[int, int, float]],
               base: CostModel | None = None) -> CostModel:
    """Least squares of `decode_step_s = base + per_seq*batch + per_token*context` on measured
    (batch, context_tokens, seconds) gaps, every coefficient >= 0 (a term whose unconstrained
    fit goes negative is dropped and the rest refitted). Raises InvalidArgument for fewer than
    3 samples."""
    arr = np.array([(b, t, s) for b, t, s in samples], dtype=np.float64)
    if len(arr) < 3:
        raise InvalidArgument(f"fit_decode needs at least 3 samples, got {len(arr)}")
    design = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=1)
    active = [0, 1, 2]
    coef = np.zeros(3)
    while active:
        sol, *_ = np.linalg.lstsq(design[:, active], arr[:, 2], rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return replace(base or CostModel(), decode_base_s=float(coef[0]),
                   decode_per_seq_s=float(coef[1]), decode_per_token_s=float(coef[2]))


def prefill_samples(stats: LiveStats) -> list[tuple[int, int, float]]:
    """The clean samples (the worker had nothing else queued) when there are 3 or more, else
    all of them (their times then include waits inside the worker)."""
    alone = [(n, p, s) for n, p, s, a in stats.prefill if a]
    return alone if len(alone) >= 3 else [(n, p, s) for n, p, s, _ in stats.prefill]


def worst_error(cost: CostModel, samples: Sequence[tuple[int, int, float]]) -> float:
    return max(abs(cost.prefill_s(n, p) - s) / max(s, 1e-9) for n, p, s in samples)


def trimmed_fit(samples: Sequence[tuple[int, int, float]],
                base: CostModel) -> tuple[CostModel, list[tuple[int, int, float]]]:
    """`fit_prefill`, then again without the samples whose residual is over 3x the median
    residual (a worker's first prefill, which warms torch up, can take seconds and would
    otherwise set the base cost), at most a quarter of them. Returns the model and the samples
    it was fitted to."""
    cost = fit_prefill(samples, base)
    resid = [abs(cost.prefill_s(n, p) - s) for n, p, s in samples]
    limit = 3 * float(np.median(resid))
    order = sorted(range(len(samples)), key=lambda i: -resid[i])
    drop = {i for i in order[:len(samples) // 4] if resid[i] > limit}
    kept = [x for i, x in enumerate(samples) if i not in drop]
    if not drop or len(kept) < 3:
        return cost, list(samples)
    return fit_prefill(kept, base), kept


def fit_cost(stats: LiveStats, client: Sequence[tuple[int, int, float]] = (),
             borrowed: Sequence[tuple[int, int, float]] = (),
             borrowed_from: str = "") -> FittedCost:
    """The cost model of the simulated cluster. Prefill terms from the first source with 3 or
    more samples: the prefill times the workers reported in this run; the TTFTs of this run's
    calibration requests as the client saw them (colocated workers report no prefill time);
    `borrowed` samples of another run of the same model; else the papers'. Decode terms from
    this run's gaps, else the papers'."""
    clean = sum(a for *_, a in stats.prefill) >= 3
    sources = ((prefill_samples(stats),
                f"this run's workers ({{}} {'alone' if clean else 'queued'} prefills)"),
               (list(client), "this run's calibration TTFTs ({} requests sent alone)"),
               (list(borrowed), f"{borrowed_from} ({{}} prefills)"))
    cost, worst = CostModel(), None
    kept: list[tuple[int, int, float]] = []
    prefill_from = "papers' 70B (no prefill measured)"
    for samples, name in sources:
        if len(samples) >= 3:
            cost, kept = trimmed_fit(samples, cost)
            worst = worst_error(cost, kept)
            prefill_from = name.format(len(samples))
            if len(kept) < len(samples):
                prefill_from += f", {len(samples) - len(kept)} outliers left out"
            break
    decode_from = "papers' 70B (fewer than 3 gaps)"
    if len(stats.decode) >= 3:
        cost = fit_decode(stats.decode, cost)
        decode_from = f"this run ({len(stats.decode)} gaps)"
    return FittedCost(cost, prefill_from, decode_from, worst, kept)


def sim_requests(reqs: Sequence[BenchRequest], block_size: int,
                 model_hash: int) -> list[TraceRequest]:
    """The replayed requests as the simulator takes them, hashed exactly as the proxy hashes."""
    return [TraceRequest(i, r.arrival_s, len(r.prompt_ids), r.max_tokens,
                         tuple(prefix_block_hashes(r.prompt_ids, block_size, model_hash)))
            for i, r in enumerate(reqs)]


def simulate(stats: LiveStats, cost: CostModel, reqs: Sequence[TraceRequest]) -> SimResult:
    """The same slice on a simulated cluster of the live one's shape and settings."""
    from kvpool.conductor import Conductor, ConductorConfig
    from kvpool.sim.colocated import ColocatedConfig, ColocatedSim
    from kvpool.sim.disagg import DisaggConfig, DisaggSim
    from kvpool.sim.engine import EngineConfig

    if stats.num_colocated:
        engine = EngineConfig(kv_capacity_tokens=stats.kv_capacity_tokens,
                              prefix_cache_blocks=stats.kv_capacity_tokens // stats.block_size)
        config = ColocatedConfig(stats.num_colocated, engine, "least_loaded", stats.block_size)
        return ColocatedSim(cost, config, stats.ttft_slo_s, stats.tbt_slo_s).run(reqs)
    conductor = Conductor(ConductorConfig(
        stats.prefill_policy, stats.admission, stats.ttft_slo_s, stats.tbt_slo_s,
        block_size=stats.block_size, decode_horizon_s=stats.decode_horizon_s), cost)
    disagg = DisaggConfig(stats.num_prefill, stats.num_decode, None,
                          engine=EngineConfig(kv_capacity_tokens=stats.kv_capacity_tokens))
    return DisaggSim(conductor, disagg).run(reqs)


def sim_row(result: SimResult) -> dict[str, Any]:
    """The simulated run in the measured row's terms."""
    done = [r for r in result.records if r.completed]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tbt = [r.tbt_s for r in done if r.req.output_len > 1]
    end = max((r.finish_s for r in done if r.finish_s is not None), default=0.0)
    rejected = [r for r in result.records if r.rejected_stage is not None]
    row: dict[str, Any] = {"requests": len(result.records), "ok": len(done),
                           "rejected": len(rejected),
                           "rejected_by": {k: sum(r.rejected_reason == k for r in rejected)
                                           for k in sorted({str(r.rejected_reason)
                                                            for r in rejected})}}
    for name, values in (("ttft", ttft), ("tbt_req", tbt)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = round(pct(values, q) * 1e3, 1)
    tokens = sum(r.req.output_len for r in done)
    row["output_tok_per_s"] = round(tokens / end, 1) if end > 0 else 0.0
    row["req_per_s"] = round(len(done) / end, 2) if end > 0 else 0.0
    row["prefix_hit_rate"] = round(result.hit_rate(), 3)
    return row


def relative_errors(measured: dict[str, Any], simulated: dict[str, Any]) -> dict[str, float | None]:
    """(simulated - measured) / measured per compared figure; None where measured is 0."""
    out: dict[str, float | None] = {}
    for key in COMPARED:
        m, s = float(measured[key]), float(simulated[key])
        out[key] = round((s - m) / m, 3) if m else None
    return out


@dataclass(frozen=True)
class Comparison:
    stats: LiveStats
    fitted: FittedCost
    simulated: dict[str, Any]
    errors: dict[str, float | None]

    def to_json(self) -> dict[str, Any]:
        fit = self.fitted
        return {"simulated": self.simulated, "error": self.errors,
                "cost": fit.cost.to_dict(), "prefill_fit_from": fit.prefill_from,
                "decode_fit_from": fit.decode_from,
                "prefill_fit_worst_error": fit.prefill_worst_error,
                "kept_papers_terms": list(KEPT_TERMS),
                "simulator": "ColocatedSim" if self.stats.num_colocated else "DisaggSim"}


def fetch_stats(url: str) -> dict[str, Any]:
    """The proxy's `GET /stats/samples` (raises httpx.HTTPError), with the cluster's token."""
    import httpx

    from kvpool.metadata.http_serving import bearer_header
    from kvpool.token import env_token

    resp = httpx.get(url + "/stats/samples", timeout=30, headers=bearer_header(env_token()))
    resp.raise_for_status()
    return dict(resp.json())


def compare(measured: dict[str, Any], reqs: Sequence[BenchRequest], stats: LiveStats,
            client: Sequence[tuple[int, int, float]] = (),
            borrowed: Sequence[tuple[int, int, float]] = (),
            borrowed_from: str = "") -> Comparison:
    """Fit (see `fit_cost`), simulate the replayed requests, and set the result beside the
    measured row."""
    fitted = fit_cost(stats, client, borrowed, borrowed_from)
    result = simulate(stats, fitted.cost, sim_requests(reqs, stats.block_size, stats.model_hash))
    row = sim_row(result)
    return Comparison(stats, fitted, row, relative_errors(measured, row))


def _triple(row: dict[str, Any], name: str) -> str:
    return "/".join(f"{row[f'{name}_p{q}_ms']:>7}" for q in (50, 90, 99))


def _err(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:+6.0%}"


def format_comparison(measured: dict[str, Any], c: Comparison) -> list[str]:
    """Lines printed under a measured row: live and simulated in the same terms, the errors,
    and where the cost model's terms come from."""
    lines = []
    for who, row in (("live", measured), ("sim", c.simulated)):
        lines.append(f"    {who:<5} ok {row['ok']:>3}/{row['requests']:<3} rej {row['rejected']:>3}"
                     f"  TTFT p50/p90/p99 {_triple(row, 'ttft')} ms  TBT/req p50/p90/p99 "
                     f"{_triple(row, 'tbt_req')} ms  {row['output_tok_per_s']:>6} tok/s  "
                     f"hit {row['prefix_hit_rate']:.2f}")
    e = c.errors
    lines.append("    error (sim-live)/live  TTFT " + "/".join(
        _err(e[f"ttft_p{q}_ms"]) for q in (50, 90, 99)) + "  TBT/req " + "/".join(
        _err(e[f"tbt_req_p{q}_ms"]) for q in (50, 90, 99)) +
        f"  tok/s {_err(e['output_tok_per_s'])}  hit {_err(e['prefix_hit_rate'])}"
        f"  rej {_err(e['rejected'])}")
    cost, fit = c.fitted.cost, c.fitted
    worst = ("" if fit.prefill_worst_error is None
             else f", worst fit error {fit.prefill_worst_error:.0%}")
    lines.append(f"    cost  prefill from {fit.prefill_from}{worst}: {cost.prefill_base_s:.3g} s "
                 f"+ {cost.prefill_linear_s:.3g} s/tok + {cost.prefill_quadratic_s:.3g} s/tok^2; "
                 f"decode from {fit.decode_from}: {cost.decode_base_s:.3g} s "
                 f"+ {cost.decode_per_seq_s:.3g} s/seq + {cost.decode_per_token_s:.3g} s/tok")
    lines.append("    kept at the papers' 70B values: " + ", ".join(KEPT_TERMS))
    return lines
