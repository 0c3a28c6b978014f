"""`kvpool bench mooncake-api`: ratios, and a tiny kvpool-only run end to end."""

from __future__ import annotations

import argparse

import pytest

from kvpool.bench.common import Measurement
from kvpool.compat import bench


def m(impl: str, op: str, gbps: float, reqs: float) -> Measurement:
    return Measurement("mooncake-api-store", impl, "tcp", op, "batched", 4096, gbps, reqs)


def test_ratios_are_kvpool_over_mooncake() -> None:
    rows = [m("kvpool", "put", 2.0, 10), m("mooncake", "put", 1.0, 5),
            m("kvpool", "exist", 0.0, 300), m("mooncake", "exist", 0.0, 100),
            m("kvpool", "get", 1.0, 1)]
    bench.add_ratios(rows)
    assert [(r.ratio, r.anchor) for r in rows] == [(2.0, "mooncake"), (None, None),
                                                   (3.0, "mooncake"), (None, None),
                                                   (None, None)]


def test_kvpool_only_run(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    args = parser.parse_args(["mooncake-api", "--impl", "kvpool", "--sizes", "4KiB",
                              "--batch", "4", "--phase-bytes", "64KiB", "--dram", "16MiB",
                              "--seconds", "0.05"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["put", "get", "exist", "write", "read"]
    assert all(line.startswith("kvpool") for line in lines)
