"""`kvpool bench store` runs end to end (tiny settings; numbers come from the real run)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support.procs import python_env
from tests.support.require import require_module


def run_bench(*args: str) -> list[dict]:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, "-m", "kvpool", "bench", "store", "--json", *args],
                         capture_output=True, env=python_env(), timeout=120, check=True)
    return [json.loads(line) for line in out.stdout.decode().splitlines()]


# slow: a benchmark's whole run (a cluster, 4 sizes x 2 modes, checksums on and off);
# the store paths it times are tested in tests/store, its table by the master-only run
@pytest.mark.slow
def test_bench_store_kvpool_only() -> None:
    records = run_bench("--no-mooncake", "--sizes", "4KiB,64KiB", "--max-ops", "64",
                        "--repeat", "1", "--dram", "64MiB", "--lease-ms", "100")
    nosum = [r for r in records if r["system"] == "kvpool-nosum"]  # checksums off, same run
    records = [r for r in records if r["system"] != "kvpool-nosum"]
    assert [(r["op"], r["mode"], r["size"]) for r in nosum] == [
        (r["op"], r["mode"], r["size"]) for r in records]
    assert [(r["op"], r["mode"], r["size"]) for r in records] == [
        (op, mode, size) for size in (4096, 65536)
        for mode in ("single", "batch32") for op in ("put", "get")]
    assert all(r["system"] == "kvpool" and r["ops_per_s"] > 0 for r in records)
    assert [r["ops"] for r in records[:4]] == [64, 64, 64, 64]


def test_bench_store_master_only() -> None:
    records = run_bench("--master-only", "--seconds", "0.3", "--clients", "2")
    systems = [r["system"] for r in records]
    assert systems.count("master-service") == 10 and systems.count("master-rpc") == 11
    assert systems.count("tcp-echo") == 2
    assert systems.count("zmq-echo") == (2 if importlib.util.find_spec("zmq") else 0)
    assert [r["mode"] for r in records if r["system"] == "tcp-echo"] == ["x1", "x2"]
    assert {r["unit"] for r in records} == {"requests/s", "keys/s"}
    assert all(r["rate"] > 0 for r in records)


@pytest.mark.slow
@pytest.mark.mooncake
def test_bench_store_runs_the_mooncake_side() -> None:
    require_module("mooncake.store", "the real Mooncake wheel (scripts/setup.sh)")
    records = run_bench("--only", "mooncake", "--sizes", "4KiB", "--max-ops", "64",
                        "--repeat", "1", "--dram", "64MiB")
    assert [(r["system"], r["op"], r["mode"]) for r in records] == [
        ("mooncake", op, mode) for mode in ("single", "batch32") for op in ("put", "get")]
