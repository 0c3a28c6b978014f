"""`kvpool bench faults`: what the pool loses under real faults, in one run.

Real processes on loopback and a real etcd (`/usr/bin/etcd`):

- HA failover: two masters on etcd, two store nodes, a client with an `etcd://` address;
  the leader is SIGKILLed after 100 acknowledged puts. Figures: seconds from the kill to the
  first acknowledged put on the new leader (median of `--trials`), acknowledged objects lost,
  wrong bytes served (every read is compared with what was written), client errors seen in
  the window by kind.
- Single master with `--state-dir` SIGKILLed and restarted: seconds until it listens, until
  every acknowledged object reads back, objects lost.
- A store node SIGKILLed under replica_num=2: objects lost, at once and after the master
  declared the node dead.
- etcd SIGKILLed under a put load and started again: client errors, recovery, terms.
- SSD tier (when `kvpool store-node` offers `--ssd`), and the conversation trace's prefix hit
  rate through a real pool whose DRAM holds 10% of its distinct blocks.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from kvpool.launch.etcd import EtcdProcess

Report = dict[str, Any]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("faults", help="failover, restart and kill figures with real "
                              "processes and etcd: time to serve again, objects lost")
    p.add_argument("--trials", type=int, default=3, help="HA failover trials (median)")
    p.add_argument("--etcd-down", type=float, default=1.0,
                   help="seconds etcd stays down in the restart figure")
    p.add_argument("--trace-limit", type=int, default=None,
                   help="replay only the first N trace requests in the hit-rate figure")
    p.add_argument("--skip", default="",
                   help="comma-separated sections to skip: ha,etcd,restart,node,ssd,hitrate")
    p.add_argument("--json", action="store_true", help="one JSON object with every figure")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("kvpool").setLevel(logging.ERROR)  # errors are counted, not logged
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report = collect(args.trials, args.etcd_down, args.trace_limit, skip)
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        for line in format_table(report):
            print(line, flush=True)
    return 0 if healthy(report) else 1


def collect(trials: int, etcd_down_s: float, trace_limit: int | None,
            skip: set[str]) -> Report:
    from kvpool.bench import faults_ha, faults_single, faults_ssd

    report: Report = {}
    with ExitStack() as stack:
        etcd = EtcdProcess(stack).start() if not {"ha", "etcd"} <= skip else None
        steps: list[tuple[str, Callable[[], Report]]] = [
            ("ha", lambda: faults_ha.bench_failover(etcd, trials)),  # type: ignore[arg-type]
            ("etcd", lambda: faults_ha.bench_etcd_restart(etcd, etcd_down_s)),  # type: ignore[arg-type]
            ("restart", faults_single.bench_master_restart),
            ("node", faults_single.bench_node_kill),
        ]
        for name, step in steps:
            if name not in skip:
                report[name] = _timed(step)
    with_ssd = faults_ssd.ssd_tier_available()
    if "ssd" not in skip:
        report["ssd"] = _timed(lambda: faults_ssd.ssd_read_rows(with_ssd))
    if "hitrate" not in skip:
        report["hitrate"] = _timed(lambda: faults_ssd.hit_rate_rows(trace_limit, with_ssd))
    return report


def _timed(step: Callable[[], Report]) -> Report:
    t0 = time.monotonic()
    out = step()
    out["bench_s"] = round(time.monotonic() - t0, 1)
    return out


def healthy(report: Report) -> bool:
    """No wrong byte anywhere, and nothing lost where a copy survived."""
    wrong = sum(int(section.get("wrong", 0)) for section in report.values())
    hit = report.get("hitrate", {})
    wrong += int(hit.get("dram", {}).get("wrong", 0)) if hit else 0
    lost = sum(int(report.get(k, {}).get("lost", 0)) for k in ("ha", "etcd", "restart"))
    lost += int(report.get("node", {}).get("lost_at_once", 0))
    lost += int(report.get("node", {}).get("lost_after_ttl", 0))
    return wrong == 0 and lost == 0


def _kinds(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())) or "none"


def format_table(report: Report) -> list[str]:
    rows = [*_ha_rows(report), *_restart_rows(report), *_etcd_rows(report),
            *_ssd_rows(report)]
    width = max((len(k) for k, _ in rows), default=10)
    return [f"{'figure':<{width}}  value", "-" * (width + 40),
            *(f"{k:<{width}}  {v}" for k, v in rows)]


def _ha_rows(report: Report) -> list[tuple[str, str]]:
    if "ha" not in report:
        return []
    ha = report["ha"]
    return [("HA leader SIGKILL -> first put on new leader (median)",
             f"{ha['failover_median_s']:.2f} s  (trials {ha['failover_s']}, lease ttl "
             f"{ha['lease_ttl_s']} s)"),
            ("HA: acknowledged objects lost / wrong bytes served",
             f"{ha['lost']} of {ha['acked']} / {ha['wrong']}"),
            ("HA: client errors in the failover window", _kinds(ha["window_errors"]))]


def _restart_rows(report: Report) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if "restart" in report:
        r = report["restart"]
        rows += [("single master --state-dir SIGKILL+restart: listening / all readable",
                  f"{r['listening_s']:.2f} s / {r['all_readable_s']:.2f} s "
                  f"(first put {r['first_put_s']:.2f} s)"),
                 ("single master restart: objects lost / wrong bytes",
                  f"{r['lost']} of {r['objects']} / {r['wrong']}")]
    if "node" in report:
        n = report["node"]
        rows += [("store node SIGKILL, replica_num=2: lost at once / after ttl",
                  f"{n['lost_at_once']} / {n['lost_after_ttl']} of {n['objects']} "
                  f"(wrong {n['wrong']}, puts resume: {n['puts_resume']})")]
    return rows


def _etcd_rows(report: Report) -> list[tuple[str, str]]:
    if "etcd" not in report:
        return []
    e = report["etcd"]
    return [(f"etcd SIGKILL under load, down {e['down_s']} s: client errors",
             f"{e['errors']} ({_kinds(e['error_kinds'])})"),
            ("etcd restart: recovery after etcd is back / terms",
             f"{e['recovery_s']:.2f} s / term {e['term_before']} -> {e['term_end']}, "
             f"master exit codes {e['master_exit_codes']} "
             f"(lost {e['lost']} of {e['acked']}, wrong {e['wrong']})")]


def _ssd_rows(report: Report) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    if "ssd" in report:
        s = report["ssd"]
        loaded = (f" ({s['ssd']['loaded_share']:.0%} of reads loaded from disk, "
                  f"wrong {s['ssd']['wrong']})" if "ssd" in s else "")
        rows += [("read GB/s: DRAM / DRAM+SSD (working set 4x DRAM)",
                  f"{s['dram_read_gb_s']} / {s['ssd_read_gb_s']}{loaded}"),
                 ("SSD -> DRAM promotions per second", f"{s['promotions_per_s']}")]
    if "hitrate" in report:
        h = report["hitrate"]
        dram, ssd = h["dram"], h["dram_ssd"]
        ssd_text = ssd if isinstance(ssd, str) else (
            f"{ssd['hit_rate']:.4f} ({ssd['seconds']} s, wrong {ssd['wrong']}, "
            f"failed puts {ssd['failed_puts']})")
        rows += [(f"trace hit rate, DRAM = 10% of {h['distinct_blocks']} blocks "
                  f"({h['requests']} requests)",
                  f"pool {dram['hit_rate']:.4f} (sim LRU {h['sim_lru_hit_rate']:.4f}, "
                  f"unbounded {h['sim_unbounded_hit_rate']:.4f}; {dram['seconds']} s, "
                  f"wrong {dram['wrong']}, failed puts {dram['failed_puts']})"),
                 ("trace hit rate, DRAM 10% + SSD", ssd_text)]
    return rows
