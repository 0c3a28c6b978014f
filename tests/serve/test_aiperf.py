"""aiperf (NVIDIA's serving benchmark client, written elsewhere) against `kvpool up`: a short
streamed chat run with a local tokenizer, zero errors, every request counted. aiperf lives in
its own virtualenv (its pins are not kvpool's): $KVPOOL_AIPERF, `.venv-aiperf/bin/aiperf`
(what CI's slow job installs), or `aiperf` on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpool.serve.launch import ServingCluster
from tests.support.require import missing

pytestmark = pytest.mark.slow
REQUESTS = 24


def aiperf_binary() -> str | None:
    here = Path(__file__).resolve().parents[2] / ".venv-aiperf" / "bin" / "aiperf"
    for candidate in (os.environ.get("KVPOOL_AIPERF"), str(here), shutil.which("aiperf")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def test_aiperf_streams_with_zero_errors(cluster: ServingCluster, tmp_path: Path) -> None:
    binary = aiperf_binary()
    if binary is None:
        missing("aiperf is not installed (python -m venv .venv-aiperf && "
                ".venv-aiperf/bin/pip install aiperf)")
    out = tmp_path / "aiperf"
    cmd = [binary, "profile", "--model", cluster.model_name, "--url", cluster.proxy_url,
           "--endpoint-type", "chat", "--streaming", "--tokenizer", str(cluster.model_dir),
           "--request-count", str(REQUESTS), "--concurrency", "3",
           "--synthetic-input-tokens-mean", "96", "--output-tokens-mean", "16",
           "--extra-inputs", "ignore_eos:true", "--random-seed", "7",
           "--output-artifact-dir", str(out), "--ui-type", "none"]
    # (not HF_HUB_OFFLINE: aiperf then takes a local folder for a hub id and fails)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [], summary["error_summary"]
    assert summary["request_count"]["avg"] == REQUESTS and summary["is_complete"]
    assert summary["time_to_first_token"]["count"] == REQUESTS
    assert summary["usage_completion_tokens"]["avg"] == 16
    print(f"aiperf: TTFT p50 {summary['time_to_first_token']['p50']:.1f} ms, ITL p50 "
          f"{summary['inter_token_latency']['p50']:.2f} ms, "
          f"{summary['request_throughput']['avg']:.1f} req/s")
