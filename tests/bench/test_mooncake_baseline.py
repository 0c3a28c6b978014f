"""The regression guard of `kvpool bench mooncake-api` (kvpool.bench.mooncake_baseline and
the bench's guard step): bands over recorded runs, verdicts, the file's checks, the exit
code, and the deliberately slowed client it is tested with."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from kvpool.bench import mooncake_api as bench
from kvpool.bench import mooncake_baseline as bl
from kvpool.bench.mooncake_client import _handicapped
from kvpool.errors import ConfigError

PUT = ("put_from", "batched", 65536, 32)
GET = ("get", "single", 4096, 1)


def recorded(*runs: dict[str, float]) -> dict:
    return {"command": ["--batch", "32"], "runs": [{"load": [1.0, 1.2], "ratios": r}
                                                   for r in runs]}


BASE = recorded({"put_from batched 65536 32": 1.5, "get single 4096 1": 1.2},
                {"put_from batched 65536 32": 1.7, "get single 4096 1": 1.0},
                {"put_from batched 65536 32": 1.6})


def test_a_run_figure_is_the_median_of_its_round_ratios() -> None:
    figures = bl.run_figures({("put_from", "batched", 65536): [1.0, 3.0, 2.0],
                              ("get", "single", 4096): [0.5, 0.7],
                              ("put", "single", 4096): []}, batch=32)
    assert figures == {PUT: 2.0, GET: 0.6}


def test_bands_span_the_recorded_runs() -> None:
    assert bl.bands(BASE) == {PUT: bl.Band(1.5, 1.6, 1.7, 3), GET: bl.Band(1.0, 1.1, 1.2, 2)}


def test_a_ratio_below_its_band_less_the_tolerance_regresses() -> None:
    verdicts = bl.compare({PUT: 1.19, GET: 0.8, ("put", "single", 4096, 1): 0.1}, BASE, 0.2)
    assert [(v.case, v.floor, v.regressed) for v in verdicts] == [
        (PUT, pytest.approx(1.2), True), (GET, pytest.approx(0.8), False)]
    lines = bl.report(verdicts, 0.2)
    assert lines[0].split()[:7] == ["REGRESSION", "put_from", "batched", "64", "KiB", "x32",
                                    "kv/mc"]
    assert "floor  1.20  (band 1.50-1.70 over 3 runs, -20%)" in lines[0]
    assert lines[1].split()[:5] == ["ok", "get", "single", "4", "KiB"]
    with pytest.raises(ConfigError, match="tolerance"):
        bl.compare({PUT: 1.0}, BASE, 1.0)


def test_a_recorded_run_widens_the_band() -> None:
    grown = bl.add_run(BASE, {PUT: 1.1}, ["--rounds", "5"], (2.345, 3.0), 4)
    assert grown["command"] == ["--rounds", "5"] and len(BASE["runs"]) == 3
    assert grown["runs"][-1] == {"load": [2.35, 3.0], "cpus": 4,
                                 "ratios": {"put_from batched 65536 32": 1.1}}
    assert bl.bands(grown)[PUT] == bl.Band(1.1, 1.55, 1.7, 4)
    assert bl.add_run(None, {GET: 0.9}, [], (1, 1), 2)["runs"] == [
        {"load": [1, 1], "cpus": 2, "ratios": {"get single 4096 1": 0.9}}]


def test_a_run_is_compared_with_the_runs_of_its_regime() -> None:
    """Quiet runs (load at most one per CPU at the start and the end) against quiet runs,
    crowded against crowded; a regime the baseline lacks against every run."""
    base = {"runs": [{"load": [0.8, 1.9], "cpus": 2, "ratios": {"get single 4096 1": 1.5}},
                     {"load": [1.0, 1.2], "cpus": 2, "ratios": {"get single 4096 1": 1.3}},
                     {"load": [9.0, 12.0], "cpus": 2, "ratios": {"get single 4096 1": 0.4}},
                     {"load": [3.0, 1.0], "ratios": {"get single 4096 1": 0.6}}]}
    assert bl.regime((0.5, 2.0), 2) == "quiet" and bl.regime((2.1, 0.3), 2) == "crowded"
    assert bl.bands(base, (1.0, 1.5), 2)[GET] == bl.Band(1.3, 1.4, 1.5, 2, "quiet")
    assert bl.bands(base, (5.0, 6.0), 2)[GET] == bl.Band(0.4, 0.5, 0.6, 2, "crowded")
    assert bl.bands(base, (5.0, 6.0), 4)[GET] == bl.Band(0.4, 0.4, 0.4, 1, "crowded")
    assert bl.bands(base)[GET].runs == 4
    only_quiet = {"runs": base["runs"][:2]}
    assert bl.bands(only_quiet, (9.0, 9.0), 2)[GET] == bl.Band(1.3, 1.4, 1.5, 2, "any")
    verdict, = bl.compare({GET: 1.0}, base, 0.2, (1.0, 1.0), 2)
    assert verdict.regressed and verdict.floor == pytest.approx(1.04)
    assert "over 2 quiet runs" in bl.report([verdict], 0.2)[0]
    assert not bl.compare({GET: 1.0}, base, 0.2, (9.0, 9.0), 2)[0].regressed


@pytest.mark.parametrize("content, complaint", [
    ("{", "Expecting"), ('{"runs": 3}', "runs must be a list"),
    ('{"runs": [{"ratios": {"put 4096": 1.0}}]}', "not 'op mode size batch'"),
    ('{"runs": [{"ratios": {"put single 4096 1": -1}}]}', "not a positive number"),
    ('{"command": []}', "runs"),
    ('{"runs": [{"load": [], "ratios": {}}]}', "load .* is not"),
    ('{"runs": [{"load": [1, 2], "cpus": null, "ratios": {}}]}', "cpus None is not"),
])
def test_a_bad_baseline_file_is_refused_by_name(tmp_path: Path, content: str,
                                                complaint: str) -> None:
    path = tmp_path / "base.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"baseline {path}: .*{complaint}"):
        bl.load(path)
    with pytest.raises(ConfigError, match="baseline .*missing.json"):
        bl.load(tmp_path / "missing.json")


def test_the_shipped_baseline_loads_and_covers_the_issue_cases() -> None:
    """In both regimes: a quiet machine gets the quiet band, a crowded one the crowded."""
    shipped = bl.load(bl.default_path())
    for load in ((0.5, 0.5), (100.0, 100.0)):
        cases = bl.bands(shipped, load, 2)
        for op in ("put_from", "get_into"):
            for size in (4096, 65536):
                for key in ((op, "batched", size, 32), (op, "single", size, 1)):
                    assert cases[key].runs >= 3 and cases[key].regime != "any"


def args_for(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["mooncake-api", "--baseline", str(tmp_path / "base.json"),
                              *extra])


def test_the_guard_exits_3_only_when_asked(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "base.json").write_text(json.dumps(BASE))
    slow = {PUT: 1.0, GET: 1.0}
    assert bench.guard(args_for(tmp_path), slow, (1.0, 1.0)) == 0
    assert "REGRESSION put_from batched" in capsys.readouterr().out
    assert bench.guard(args_for(tmp_path, "--fail-on-regression"), slow, (1.0, 1.0)) == 3
    assert bench.guard(args_for(tmp_path, "--fail-on-regression"), {PUT: 1.5, GET: 1.0},
                       (1.0, 1.0)) == 0
    out = capsys.readouterr().out
    assert out.count("REGRESSION") == 1 and "recorded with --batch 32" in out
    assert bench.guard(args_for(tmp_path, "--baseline", "none", "--fail-on-regression"),
                       slow, (1.0, 1.0)) == 0


def test_the_guard_records_runs_into_a_baseline(tmp_path: Path) -> None:
    path = tmp_path / "new.json"
    args = args_for(tmp_path, "--baseline", "none", "--record-baseline", str(path),
                    "--batch", "32", "--rounds", "3")
    assert bench.guard(args, {PUT: 1.4}, (0.5, 0.7)) == 0
    assert bench.guard(args, {PUT: 1.8}, (0.5, 0.7)) == 0
    saved = bl.load(path)
    assert saved["command"][saved["command"].index("--rounds") + 1] == "3"
    assert bl.bands(saved) == {PUT: bl.Band(1.4, 1.6, 1.8, 2)}
    other = args_for(tmp_path, "--baseline", "none", "--record-baseline", str(path),
                     "--batch", "32", "--rounds", "5")
    with pytest.raises(ConfigError, match="was recorded with .*--rounds 3"):
        bench.guard(other, {PUT: 0.1}, (0.5, 0.7))
    assert bl.load(path) == saved  # left as it was


def test_a_handicapped_call_waits_then_answers() -> None:
    slow = _handicapped(lambda key: key * 2, 0.02)
    t0 = time.perf_counter()
    assert slow(21) == 42
    assert time.perf_counter() - t0 >= 0.02


def test_a_baseline_of_another_load_is_not_compared(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "base.json").write_text(json.dumps(BASE))
    args = args_for(tmp_path, "--fail-on-regression", "--load", "2")
    assert bench.guard(args, {PUT: 0.1}, (3.0, 3.0)) == 0
    assert "not compared: recorded with --load 0, this run --load 2" in capsys.readouterr().out


def test_burners_spin_for_the_block_only() -> None:
    import os

    from kvpool.bench.burners import burning
    with burning(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with burning(0) as none:
        assert none == []


def test_a_bad_baseline_stops_the_bench_before_its_rounds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "base.json").write_text("{")
    args = args_for(tmp_path, "--impl", "kvpool")
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvpool bench mooncake-api: baseline {tmp_path}")

