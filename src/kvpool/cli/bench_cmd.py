"""`kvpool bench ...`: benchmarks that print kvpool's figures beside their anchors."""

from __future__ import annotations

import argparse
import importlib

_BENCH_MODULES = (
    "kvpool.bench.transfer",
    "kvpool.bench.store",
    "kvpool.bench.conductor",
    "kvpool.bench.serve",
    "kvpool.bench.mooncake_api",
    "kvpool.bench.mooncake_cpu",
    "kvpool.bench.engine",
    "kvpool.bench.faults",
    "kvpool.bench.attacks",
    "kvpool.bench.migration",
    "kvpool.bench.proxy",
    "kvpool.bench.proxy_vllm",
    "kvpool.bench.prompts",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (transfer, store, conductor, mooncake-api)")
    bench_sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for name in _BENCH_MODULES:
        importlib.import_module(name).register(bench_sub)
