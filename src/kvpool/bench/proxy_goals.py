"""The speed goals of `kvpool bench proxy`, judged on one run's rows: kvpool's proxy (one
process) against nginx relaying the same worker's stream in the same rounds, against the
client asking the worker straight, and against a scheduling load (docs/perf.md, "The proxy's
relay"):

    256-token streams, c=32    proxy CPU per output token <= 2x nginx's; per request <= 1.5 ms
    16-token streams, c=32     requests/s >= 0.8x nginx's
    16-token streams, >= 16    >= 500 requests per second of proxy CPU (its decisions among
      emulated workers         the workers and the relay of their answers)
    c=1                        added latency p50 over the direct way <= 1 ms
    c=32                       the emulated worker's CPU per output token <= 3x nginx's

They are set at the default speed-up (1000: engine steps cost almost nothing, so the front
door is what is measured) and a frame per token (--stream-interval 1); a run at other
settings gets no goal lines. The rows sum every round of a relay, so a goal is judged on a
run's totals, not on one round.
"""

from __future__ import annotations

from typing import Any

from kvpool.bench.common import goal_line

SPEED_UP = 1000.0
TOKEN_X_NGINX = 2.0
REQUEST_MS = 1.5
REQ_PER_S_X_NGINX = 0.8
SCHEDULED_PER_CPU_S = 500
SCHEDULED_ENGINES = 16
ADDED_P50_MS = 1.0
WORKER_X_NGINX = 3.0
PROXY = "kvpool"
"""The row the goals judge (one proxy process; not the comparisons beside it)."""


def goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A line per goal the run measured, in the order of the rows."""
    nginx = {(r["load"], r["concurrency"]): r for r in rows if r["relay"] == "nginx"}
    lines: list[str] = []
    for r in rows:
        if r["relay"] != PROXY or r.get("speed_up") != SPEED_UP or \
                r.get("stream_interval", 1) != 1:
            continue
        lines += _row_goals(r, nginx.get((r["load"], r["concurrency"])))
    return lines


def _row_goals(r: dict[str, Any], n: dict[str, Any] | None) -> list[str]:
    where = f"{r['load']} c={r['concurrency']}"
    out = []
    if r["load"] == "stream256" and r["concurrency"] == 32:
        if n is not None and n["relay_us_per_token"] > 0:
            x = r["relay_us_per_token"] / n["relay_us_per_token"]
            out.append(goal_line(x <= TOKEN_X_NGINX, f"{where}: proxy CPU per token {x:.2f} "
                                 f"x nginx <= {TOKEN_X_NGINX}"))
        ms = r["relay_ms_per_request"]
        out.append(goal_line(ms <= REQUEST_MS, f"{where}: proxy CPU per request {ms:.3f} ms "
                             f"<= {REQUEST_MS}"))
    if r["load"] == "req16" and r["concurrency"] == 32 and n is not None and n["req_per_s"] > 0:
        x = r["req_per_s"] / n["req_per_s"]
        out.append(goal_line(x >= REQ_PER_S_X_NGINX, f"{where}: requests/s {x:.2f} x nginx "
                             f">= {REQ_PER_S_X_NGINX}"))
    if r["load"] == "req16" and r.get("engines", 1) >= SCHEDULED_ENGINES and \
            r.get("req_per_relay_cpu_s"):
        per = r["req_per_relay_cpu_s"]
        out.append(goal_line(per >= SCHEDULED_PER_CPU_S, f"{where}, {r['engines']} workers: "
                             f"{per} requests per proxy CPU-second >= {SCHEDULED_PER_CPU_S}"))
    if r["concurrency"] == 1 and "added_p50_ms" in r:
        added = r["added_p50_ms"]
        out.append(goal_line(added <= ADDED_P50_MS, f"{where}: added latency p50 "
                             f"{added:+.2f} ms <= {ADDED_P50_MS}"))
    if r["concurrency"] == 32 and n is not None and n["relay_us_per_token"] > 0:
        x = r["worker_us_per_token"] / n["relay_us_per_token"]
        out.append(goal_line(x <= WORKER_X_NGINX, f"{where}: the emulated worker's CPU per "
                             f"token {x:.1f} x nginx's <= {WORKER_X_NGINX}"))
    return out
