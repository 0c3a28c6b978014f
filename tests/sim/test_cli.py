"""The `kvpool sim` and `kvpool bench conductor` commands on small trace slices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli.main import main
from kvpool.sim.experiments import EXPERIMENTS
from tests.sim.conftest import write_trace
from tests.support.procs import python_env


def small_trace(tmp_path: Path) -> Path:
    rows = [(0.5 * i, 600 + 300 * (i % 5), 3 + i % 7,
             [i % 3] + [100 + i * 10 + k for k in range(i % 4)]) for i in range(40)]
    return write_trace(tmp_path / "small.jsonl", rows)


def test_hit_rate_json_rows_in_a_real_process(tmp_path: Path) -> None:
    trace = small_trace(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "sim", "experiment", "hit-rate", "--trace", str(trace),
         "--json", "--no-progress", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=python_env(), timeout=60, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 18
    unlimited = [r for r in rows if r["policy"] == "lru" and r["capacity_blocks"] is None]
    assert unlimited[0]["hit_rate"] == pytest.approx(37 / 100, abs=1e-4)  # only first blocks repeat
    assert {"policy", "capacity_blocks", "hit_rate"} <= set(rows[0])
    assert (tmp_path / "out" / "hit-rate.png").stat().st_size > 1000


@pytest.mark.parametrize("name", sorted(set(EXPERIMENTS) - {"hit-rate"}))
def test_every_experiment_runs_on_a_slice(name: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace(tmp_path)
    # the synthetic experiments ignore the trace: --limit sets their requests per rate
    limit = ["--limit", "40"] if name in ("long-context", "public-datasets") else []
    if limit:
        limit.append("--no-reach")  # the sweep searches again per factor (tests/sim/test_reach.py)
    rc = main(["sim", "experiment", name, "--trace", str(trace), "--no-progress",
               "--out", str(tmp_path), *limit])
    assert rc == 0
    text = capsys.readouterr().out
    assert "paper" in text
    assert (tmp_path / f"{name}.png").is_file()


def test_sim_run_json_and_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = small_trace(tmp_path)
    assert main(["sim", "run", "--trace", str(trace), "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_requests"] == 40
    assert summary["num_completed"] + summary["rejected"] == 40
    assert main(["sim", "run", "--mode", "colocated", "--trace", str(trace), "--json",
                 "--chunk-tokens", "256", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["num_completed"] == 40
    csv = tmp_path / "load.csv"
    assert main(["sim", "run", "--trace", str(trace), "--json", "--no-progress",
                 "--pool-blocks", "8", "--num-prefill", "2", "--load-csv", str(csv)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_completed"] + summary["rejected"] == 40
    lines = csv.read_text().splitlines()
    assert lines[0] == "t_s,prefill_load,decode_load" and lines[1].startswith("0.0,")
    assert main(["sim", "run", "--trace", str(tmp_path / "nope.jsonl"), "--no-progress"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["sim", "run", "--trace", str(trace), "--admission", "bogus",
                 "--no-progress"]) == 2


# slow: a benchmark (a 300-request replay and a 16 x 2000-block view); the conductor's
# decisions and the view's events are tested in tests/conductor and tests/serve
@pytest.mark.slow
def test_bench_conductor_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "conductor", "--limit", "300", "--decisions", "50", "--view-blocks",
                 "2000", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in rows] == ["trace_replay", "decision", "view_sync"]
    view = rows[2]
    assert view["indexed_blocks"] == 16 * 2000 and view["events_ms"] < view["full_list_ms"]
    assert rows[0]["requests"] == 300 and rows[1]["decisions"] == 50
    assert rows[1]["unit"] == "us" and rows[1]["value"] > 0


def test_fit_then_simulate_with_the_fitted_model(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.conductor import CostModel

    truth = CostModel(prefill_base_s=0.05, prefill_linear_s=2e-4, prefill_quadratic_s=2e-9)
    samples = tmp_path / "samples.csv"
    samples.write_text("input_len,prefix_len,seconds\n" + "".join(
        f"{n},{p},{truth.prefill_s(n, p)}\n" for n in (1000, 8000, 32000) for p in (0, n // 2)))
    model_path = tmp_path / "cost.json"
    assert main(["sim", "fit", str(samples), "--out", str(model_path)]) == 0
    fitted = json.loads(model_path.read_text())
    assert fitted["prefill_linear_s"] == pytest.approx(2e-4, rel=1e-6)
    assert fitted["decode_base_s"] == CostModel().decode_base_s
    capsys.readouterr()
    trace = small_trace(tmp_path)
    assert main(["sim", "run", "--trace", str(trace), "--json", "--no-progress",
                 "--cost", str(model_path)]) == 0
    assert json.loads(capsys.readouterr().out)["num_requests"] == 40
    assert main(["sim", "experiment", "scheduling", "--trace", str(trace), "--no-progress",
                 "--cost", str(model_path), "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    (tmp_path / "bad.csv").write_text("1,2,3\n4,x,6\n")
    assert main(["sim", "fit", str(tmp_path / "bad.csv")]) == 2
    assert "bad.csv:2" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"prefill_speed": 1}')
    assert main(["sim", "run", "--trace", str(trace), "--cost", str(tmp_path / "bad.json"),
                 "--no-progress"]) == 2
    assert "unknown CostModel fields" in capsys.readouterr().err


@pytest.mark.slow
def test_all_writes_one_report_with_a_verdict_per_paper_figure(tmp_path: Path) -> None:
    trace = small_trace(tmp_path)
    rc = main(["sim", "experiment", "all", "--trace", str(trace), "--limit", "40",
               "--no-progress", "--out", str(tmp_path / "all")])
    assert rc == 0
    report = (tmp_path / "all" / "report.md").read_text()
    for name in EXPERIMENTS:
        assert f"## {name}\n" in report
    assert "| verdict |" in report and "Verdicts: " in report
    assert (tmp_path / "all" / "capacity" / "capacity.png").is_file()
    assert "band over 11 fits" in report  # capacity's gains over the neighbourhood
