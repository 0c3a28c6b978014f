"""`kvpool bench conductor`: the whole trace through the simulator under kvcache_centric with
early rejection (target <= 20 s), and one scheduling decision over 16 prefill instances
(target <= 100 us median)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TRACE_TARGET_S = 20.0
DECISION_TARGET_US = 100.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("conductor", help="conductor decision time and trace replay time")
    p.add_argument("--trace", type=Path, default=None,
                   help="Mooncake JSONL (default: conversation)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--decisions", type=int, default=2000, help="decisions to time")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement")
    p.set_defaults(func=_main)


def measure_replay(trace: Path | None, limit: int | None) -> dict[str, Any]:
    from kvpool.conductor import Conductor, ConductorConfig
    from kvpool.sim.disagg import DisaggSim
    from kvpool.sim.trace import load_trace

    reqs = load_trace(trace, limit)
    start = time.perf_counter()
    res = DisaggSim(Conductor(ConductorConfig("kvcache_centric", "early_rejection"))).run(reqs)
    wall = time.perf_counter() - start
    return {"name": "trace_replay", "value": round(wall, 3), "unit": "s",
            "target": TRACE_TARGET_S, "ok": wall <= TRACE_TARGET_S, "requests": len(reqs),
            "events": res.num_events, "policy": "kvcache_centric+early_rejection"}


def measure_decision(trace: Path | None, num_decisions: int) -> dict[str, Any]:
    """Warm a 16P8D cluster with the first part of the trace, then time `schedule` alone."""
    from kvpool.conductor import Conductor, ConductorConfig
    from kvpool.sim.disagg import DisaggConfig, DisaggSim
    from kvpool.sim.trace import load_trace

    reqs = load_trace(trace, 3000 + num_decisions)
    warm, probe = reqs[:3000], reqs[3000:]
    conductor = Conductor(ConductorConfig("kvcache_centric", "early_rejection_predicted"))
    sim = DisaggSim(conductor, DisaggConfig(num_prefill=16, num_decode=8))
    sim.run(warm)
    now = sim.loop.now
    samples = []
    for r in probe:
        info = r.info()
        t0 = time.perf_counter_ns()
        conductor.schedule(info, sim.view, now)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    median = statistics.median(samples) if samples else 0.0
    return {"name": "decision", "value": round(median, 2), "unit": "us",
            "target": DECISION_TARGET_US, "ok": median <= DECISION_TARGET_US,
            "p90_us": round(statistics.quantiles(samples, n=10)[-1], 2) if len(samples) > 1
            else median, "decisions": len(samples), "prefill_instances": 16,
            "indexed_blocks": len(sim.view.index)}


def _main(args: argparse.Namespace) -> int:
    from kvpool.errors import KvpoolError

    try:
        rows = [measure_replay(args.trace, args.limit),
                measure_decision(args.trace, args.decisions)]
    except KvpoolError as exc:
        print(f"kvpool bench conductor: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            verdict = "ok" if row["ok"] else "SLOWER THAN TARGET"
            print(f"{row['name']:14s} {row['value']:>10} {row['unit']:3s} "
                  f"(target <= {row['target']} {row['unit']}) {verdict}")
    return 0
