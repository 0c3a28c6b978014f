"""`kvpool sim run ...` (one configuration) and `kvpool sim experiment NAME` (a paper
experiment: table beside the paper's figures, a PNG plot, `--json` rows)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpool.cli.sim_calibrate import add_calibrate
from kvpool.errors import KvpoolError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sim", help="simulate a cluster replaying a request trace")
    sub = parser.add_subparsers(dest="sim_command", metavar="SIM_COMMAND")
    _add_run(sub)
    _add_experiment(sub)
    _add_fit(sub)
    add_calibrate(sub)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake-format JSONL (default: the conversation trace)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N requests")
    p.add_argument("--speed", type=float, default=None, help="replay speed-up factor (e.g. 2)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--profile", default=None,
                   help="accelerator profile, a shipped name or a file (default: "
                        "llama70b-8xa800-joint, fitted by `kvpool sim calibrate --joint`)")
    p.add_argument("--cost", type=Path, default=None,
                   help="cost model JSON (from `kvpool sim fit`) replacing the profile's")


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    from kvpool.sim.experiments import EXPERIMENTS

    p = sub.add_parser("experiment", help="reproduce one of the papers' experiments")
    p.add_argument("name", choices=[*sorted(EXPERIMENTS), "all"], metavar="NAME",
                   help=", ".join(sorted(EXPERIMENTS)) + "; all: every one, and a markdown "
                        "report beside the papers (OUT/report.md)")
    _common(p)
    p.add_argument("--out", type=Path, default=Path("out"), help="directory for the PNG plot")
    p.add_argument("--no-band", action="store_true",
                   help="run on the best fit only, not on every fit of the calibration's "
                        "neighbourhood")
    p.add_argument("--no-reach", action="store_true",
                   help="do not sweep the named assumption that would put a gain missing the "
                        "paper's at the paper's value")
    p.set_defaults(func=_experiment)


def _experiment(args: argparse.Namespace) -> int:
    from kvpool.sim.experiments import EXPERIMENTS, ExperimentOptions, default_profile
    from kvpool.sim.report import print_result

    try:
        name = "capacity" if args.name == "all" else args.name
        opts = ExperimentOptions(args.trace, args.limit, args.out, not args.no_progress,
                                 args.speed, _profile(args, default_profile(name)),
                                 band=not args.no_band, reach=not args.no_reach)
        if args.name == "all":
            return _all(args, opts)
        result = EXPERIMENTS[args.name](opts)
    except KvpoolError as exc:
        print(f"kvpool sim: {exc}", file=sys.stderr)
        return 2
    print_result(result, sys.stdout, args.json)
    if result.plot is not None:
        path = result.plot(args.out)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _all(args: argparse.Namespace, opts: object) -> int:
    from kvpool.engine.emulated.profile import load_profile
    from kvpool.sim.experiments import EXPERIMENTS, ExperimentOptions, default_profile
    from kvpool.sim.experiments.suite import run_all

    assert isinstance(opts, ExperimentOptions)
    named = args.profile is not None or args.cost is not None
    path = run_all(EXPERIMENTS, opts,
                   (lambda _: opts.profile) if named
                   else (lambda name: load_profile(default_profile(name))),
                   log=lambda line: print(line, file=sys.stderr))
    print(f"report: {path}")
    return 0


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="simulate one configuration")
    _common(p)
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    p.add_argument("--poisson-rate", type=float, default=None,
                   help="replace timestamps with Poisson arrivals at this rate (req/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len", type=int, default=None, help="force every output length")
    p.add_argument("--load-csv", type=Path, default=None,
                   help="write load over time (t_s,prefill_load,decode_load) to this file")
    g = p.add_argument_group("disaggregated (Mooncake)")
    g.add_argument("--prefill-policy", default="kvcache_centric")
    g.add_argument("--admission", default="early_rejection")
    g.add_argument("--num-prefill", type=int, default=8)
    g.add_argument("--num-decode", type=int, default=8)
    g.add_argument("--cache-blocks", type=int, default=5859,
                   help="DRAM cache per prefill instance in blocks (0 = unlimited)")
    g.add_argument("--pool-blocks", type=int, default=None,
                   help="total pool capacity in blocks, split evenly over prefill instances")
    g.add_argument("--eviction", default="lru", help="lru, lfu, length_aware")
    g.add_argument("--threshold", type=float, default=1.2, help="kvcache balancing threshold")
    g.add_argument("--decode-horizon", type=float, default=10.0, help="t_d in seconds")
    g.add_argument("--bandwidth-gbps", type=float, default=800.0)
    g.add_argument("--prefill-noise", type=float, default=0.0,
                   help="sigma of the lognormal error of real vs predicted prefill time")
    g.add_argument("--ttft-slo", type=float, default=30.0)
    g.add_argument("--tbt-slo", type=float, default=0.1)
    c = p.add_argument_group("colocated (vLLM-like)")
    c.add_argument("--instances", type=int, default=16)
    c.add_argument("--chunk-tokens", type=int, default=0, help="chunked prefill budget (0 = off)")
    c.add_argument("--prefix-cache-blocks", type=int, default=0, help="0 = prefix caching off")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        summary = _simulate(args)
    except KvpoolError as exc:
        print(f"kvpool sim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    return 0


def _profile(args: argparse.Namespace, default: str | None = None) -> Any:
    """The profile of `--profile` (else `default`, else the experiments' SIM_PROFILE), with
    `--cost` as its cost."""
    from dataclasses import replace

    from kvpool.conductor.cost import load_cost_model
    from kvpool.engine.emulated.profile import load_profile
    from kvpool.sim.experiments.common import SIM_PROFILE

    profile = load_profile(args.profile or default or SIM_PROFILE)
    return profile if args.cost is None else replace(profile, cost=load_cost_model(args.cost))


def _add_fit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="fit the prefill cost model to measured timings")
    p.add_argument("samples", type=Path,
                   help="CSV rows input_len,prefix_len,seconds (header optional)")
    p.add_argument("--out", type=Path, default=None, help="write the cost model JSON here")
    p.set_defaults(func=_fit)


def read_samples(path: Path) -> list[tuple[int, int, float]]:
    """(input_len, prefix_len, seconds) rows of a CSV file; a non-numeric first line is a
    header. Raises InvalidArgument naming the bad line."""
    from kvpool.errors import InvalidArgument

    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        parts = [x.strip() for x in line.split(",")]
        if not line.strip() or (lineno == 1 and not parts[0].lstrip("-").isdigit()):
            continue
        try:
            n, p, secs = int(parts[0]), int(parts[1]), float(parts[2])
        except (ValueError, IndexError):
            raise InvalidArgument(
                f"{path}:{lineno}: expected input_len,prefix_len,seconds") from None
        rows.append((n, p, secs))
    return rows


def _fit(args: argparse.Namespace) -> int:
    from kvpool.conductor.cost import fit_prefill

    try:
        samples = read_samples(args.samples)
        model = fit_prefill(samples)
    except (KvpoolError, OSError) as exc:
        print(f"kvpool sim fit: {exc}", file=sys.stderr)
        return 2
    worst = max(abs(model.prefill_s(n, p) - s) / max(s, 1e-9) for n, p, s in samples)
    text = json.dumps(model.to_dict(), indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)
    print(f"{len(samples)} samples, worst relative error {worst:.1%}", file=sys.stderr)
    return 0


def _requests(args: argparse.Namespace) -> list[Any]:
    from kvpool.sim.trace import force_output_len, load_trace, poisson_arrivals, speed_up

    reqs = load_trace(args.trace, args.limit)
    if args.poisson_rate is not None:
        reqs = poisson_arrivals(reqs, args.poisson_rate, args.seed)
    if args.speed is not None:
        reqs = speed_up(reqs, args.speed)
    if args.output_len is not None:
        reqs = force_output_len(reqs, args.output_len)
    return reqs


def _simulate(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.conductor import Conductor, ConductorConfig
    from kvpool.sim.colocated import ColocatedConfig, ColocatedSim
    from kvpool.sim.disagg import DisaggConfig, DisaggSim
    from kvpool.sim.engine import EngineConfig
    from kvpool.sim.vllm import VllmConfig

    reqs = _requests(args)
    profile = _profile(args)
    cost = profile.cost.with_bandwidth(args.bandwidth_gbps)
    progress = not args.no_progress
    if args.mode == "colocated":
        engine = EngineConfig(chunk_tokens=args.chunk_tokens,
                              prefix_cache_blocks=args.prefix_cache_blocks)
        vllm = VllmConfig(chunk_overhead_s=profile.chunk_overhead_s)
        sim = ColocatedSim(cost, ColocatedConfig(args.instances, engine, vllm=vllm),
                           args.ttft_slo, args.tbt_slo)
        return sim.run(reqs, progress).summary()
    config = ConductorConfig(args.prefill_policy, args.admission, args.ttft_slo, args.tbt_slo,
                             args.threshold, decode_horizon_s=args.decode_horizon,
                             seed=args.seed)
    per_instance = args.cache_blocks or None
    if args.pool_blocks is not None:
        per_instance = max(1, args.pool_blocks // args.num_prefill)
    disagg = DisaggConfig(args.num_prefill, args.num_decode, per_instance, args.eviction,
                          prefill_noise=args.prefill_noise, seed=args.seed)
    result = DisaggSim(Conductor(config, cost), disagg).run(reqs, progress)
    if args.load_csv is not None:
        _write_load(args.load_csv, result.load)
    summary = result.summary()
    if result.load:
        summary["peak_prefill_load"] = max(x.prefill_load for x in result.load)
        summary["peak_decode_load"] = max(x.decode_load for x in result.load)
    return summary


def _write_load(path: Path, samples: list[Any]) -> None:
    with path.open("w") as fh:
        fh.write("t_s,prefill_load,decode_load\n")
        for x in samples:
            fh.write(f"{x.t_s:.1f},{x.prefill_load:.4f},{x.decode_load:.4f}\n")
