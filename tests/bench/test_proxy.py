"""`kvpool bench proxy`: its pure parts (the /proc CPU arithmetic, nginx's configuration, the
load client's reply reader, the ratios) by default; the whole bench, briefly, in the slow
job."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpool.bench.http_load import Load, drive, read_reply, request_bytes
from kvpool.bench.nginx import find_nginx, nginx_conf
from kvpool.bench.proc_cpu import (
    TICKS_PER_S,
    CpuMeter,
    ThreadShareMeter,
    WriteMeter,
    child_pids,
    cpu_ns,
    cpu_s,
    per_unit,
    stat_ticks,
    write_calls,
)
from kvpool.bench.proxy import _completion_tokens, _loads, _ndjson_tokens, _sse_tokens, int_list
from kvpool.bench.proxy_goals import goal_lines
from kvpool.bench.proxy_rows import (
    Scrape,
    Tally,
    bucket_delta,
    fmt,
    histogram_quantile,
    rows,
    with_added_latency,
    with_ratios,
)
from kvpool.thread_name import name_os_thread
from tests.support.procs import python_env
from tests.support.require import missing

STAT = ("4242 (py (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 "
        "317 45 0 0 20 0 3 0 1000 1000000 2000 18446744073709551615")


def test_stat_ticks_counts_the_fields_after_the_last_parenthesis() -> None:
    assert stat_ticks(STAT) == 317 + 45
    for bad in ("", "4242 no parens 1 2 3", "4242 (x) S 1 2"):
        with pytest.raises(ValueError, match="not a /proc/PID/stat line"):
            stat_ticks(bad)


def test_cpu_of_this_process_grows_with_work_and_children_are_listed() -> None:
    meter = CpuMeter([os.getpid()])
    meter.start()
    end = time.process_time() + 0.15
    while time.process_time() < end:
        pass
    assert 0.1 <= meter.seconds() <= 5.0
    assert cpu_s(os.getpid()) > 0
    child = subprocess.Popen(["sleep", "5"])
    try:
        assert child.pid in child_pids(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert child.pid not in child_pids(os.getpid())
    assert child_pids(2**22 + 1) == []  # no such process


def test_a_meter_keeps_what_an_exited_process_had_used() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nt=time.process_time()+0.2\n"
                              "while time.process_time()<t: pass\nprint(1, flush=True)\n"
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    meter = CpuMeter([child.pid])
    meter.start()
    assert child.stdout is not None and child.stdin is not None
    child.stdout.readline()  # its 0.2 s of work are done
    used = meter.seconds()
    assert used >= 0.1
    child.stdin.close()
    child.wait()
    assert meter.seconds() == used  # gone: the last reading stands
    with pytest.raises(ValueError, match="at least one pid"):
        CpuMeter([])


def test_a_named_threads_cpu_is_metered_apart_from_its_process() -> None:
    """The OS name a thread gives itself (the worker's engine thread does) is what /proc
    shows, and a ThreadShareMeter of that name counts that thread's work and not the others'
    as its share, within the whole of the process's threads (and as much as the process's
    own figure says)."""
    ready, go, done = threading.Event(), threading.Event(), threading.Event()

    def named() -> None:
        name_os_thread("kvpool-test-burn")
        ready.set()
        go.wait()  # all of its work after the meters start (it holds the GIL while it works)
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        done.wait()

    worker = threading.Thread(target=named)
    worker.start()
    ready.wait()
    try:
        whole = CpuMeter([os.getpid()])
        share = ThreadShareMeter([os.getpid()], "kvpool-test-burn")
        nobody = ThreadShareMeter([os.getpid()], "no-such-thread")
        whole.start()
        share.start()
        nobody.start()
        go.set()
        end = time.thread_time() + 0.2  # this thread works too, uncounted by the named meter
        while time.thread_time() < end:
            pass
        time.sleep(0.4)
        every, named = share.seconds()  # one read of each thread: the share within the whole
        assert 0.1 <= named <= 0.45
        assert whole.seconds() >= named + 0.1 and every >= named + 0.1
        assert nobody.seconds()[1] == 0.0
    finally:
        done.set()
        worker.join()


def test_a_write_meter_counts_the_write_calls_a_process_makes() -> None:
    """300 writes of a child (each a write() call on a pipe) are counted, at least, by its
    meter; what it had written is kept once it has exited."""
    child = subprocess.Popen([sys.executable, "-c", "import os, sys\nsys.stdin.readline()\n"
                              "for _ in range(300): os.write(1, b'x')\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert child.stdin is not None
    meter = WriteMeter([child.pid])
    meter.start()
    before = write_calls(child.pid)
    child.stdin.write(b"go\n")
    child.stdin.flush()
    deadline = time.monotonic() + 10
    while write_calls(child.pid) - before < 300 and time.monotonic() < deadline:
        time.sleep(0.02)
    counted = meter.calls()
    assert 300 <= counted < 400
    child.stdin.close()
    child.wait()
    assert meter.calls() == counted
    with pytest.raises(OSError):
        write_calls(child.pid)


def test_per_unit() -> None:
    assert per_unit(0.5, 1000, 1e6) == 500.0
    assert per_unit(0.03, 10, 1e3) == pytest.approx(3.0)
    assert per_unit(1.0, 0, 1e6) == 0.0
    assert TICKS_PER_S > 0


def test_nginx_conf_relays_unbuffered_over_kept_alive_connections(tmp_path: Path) -> None:
    text = nginx_conf(tmp_path, 18001, [18002, 18003])
    for line in ("worker_processes 1;", "listen 127.0.0.1:18001;",
                 "server 127.0.0.1:18002;", "server 127.0.0.1:18003;", "proxy_buffering off;", "proxy_http_version 1.1;",
                 'proxy_set_header Connection "";', "access_log off;",
                 f"pid {tmp_path / 'nginx.pid'};", f"proxy_temp_path {tmp_path / 'proxy'};"):
        assert line in text, line
    assert text.count("{") == text.count("}")
    exe = find_nginx()
    if exe is None:
        missing("nginx (scripts/setup.sh installs it) to check the configuration with `nginx -t`")
    (tmp_path / "nginx.conf").write_text(text)
    check = subprocess.run([exe, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                            "-e", str(tmp_path / "error.log")], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stderr


def _reply(raw: bytes) -> bytes:
    async def go() -> bytes:
        reader = asyncio.StreamReader()
        for i in range(len(raw)):  # a byte at a time
            reader.feed_data(raw[i:i + 1])
        reader.feed_eof()
        return await read_reply(reader)
    return asyncio.run(go())


def test_read_reply_joins_chunks_and_reads_content_length() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nworld\r\n0\r\nX-T: 1\r\n\r\n")
    assert _reply(chunked) == b"hello world"
    assert _reply(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc") == b"abc"
    with pytest.raises(ValueError, match="HTTP 503: b'busy'"):
        _reply(b"HTTP/1.1 503 No\r\nContent-Length: 4\r\n\r\nbusy")
    with pytest.raises(ValueError, match="broke mid-reply"):
        _reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
    with pytest.raises(ValueError, match="bad chunk size"):
        _reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
    with pytest.raises(ValueError, match="not an HTTP/1.x status line"):
        _reply(b"SSH-2.0\r\n\r\n")
    assert request_bytes("h", 1, "/p", b"{}") == (
        b"POST /p HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}")


def test_replies_are_checked_whole() -> None:
    sse = b'data: {"choices":[{"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    assert _sse_tokens(sse, 16) == 16
    with pytest.raises(ValueError, match="not whole"):
        _sse_tokens(sse[:-8], 16)
    ndjson = b'{"type":"tokens","token_ids":[1,2],"t":[0,0]}\n{"type":"token","token_id":3}\n' \
             b'{"type":"finish","finish_reason":"length"}\n'
    assert _ndjson_tokens(ndjson, 3) == 3
    with pytest.raises(ValueError, match=r"\(1 tokens\)"):
        _ndjson_tokens(ndjson.split(b"\n", 1)[1], 3)
    whole = json.dumps({"choices": [{"finish_reason": "length"}],
                        "usage": {"completion_tokens": 16}}).encode()
    assert _completion_tokens(whole, 16, False) == 16
    assert _completion_tokens(sse, 16, True) == 16
    for bad in (whole.replace(b"16", b"15"), whole.replace(b"length", b"stop"), b"{}",
                b"not json", sse):
        with pytest.raises(ValueError, match="completion is not whole"):
            _completion_tokens(bad, 16, False)


def test_concurrency_and_load_lists_are_checked() -> None:
    assert int_list("1,8,32") == [1, 8, 32] and _loads("req16, json16") == ["req16", "json16"]
    for bad in ("", "0", "a,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            int_list(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown"):
        _loads("req16,req17")


def test_histogram_quantiles_interpolate_inside_the_bucket() -> None:
    inf = float("inf")
    before = {1e-4: 10.0, 2e-4: 10.0, 1e-3: 10.0, inf: 10.0}
    after = {1e-4: 60.0, 2e-4: 110.0, 1e-3: 110.0, inf: 110.0}
    delta = bucket_delta(before, after)
    assert delta == {1e-4: 50.0, 2e-4: 100.0, 1e-3: 100.0, inf: 100.0}
    assert histogram_quantile(delta, 0.5) == pytest.approx(1e-4)
    assert histogram_quantile(delta, 0.25) == pytest.approx(0.5e-4)  # from 0 in the first
    assert histogram_quantile(delta, 0.99) == pytest.approx(1e-4 + 1e-4 * 49 / 50)
    assert histogram_quantile({1e-4: 0.0, inf: 4.0}, 0.5) == 1e-4     # +Inf: its lower bound
    assert histogram_quantile({1e-4: 0.0, inf: 0.0}, 0.5) is None
    assert histogram_quantile({}, 0.5) is None


def test_rows_carry_latency_added_over_direct_and_decisions() -> None:
    tallies = {("kvpool", "req16", 1): Tally(), ("direct", "req16", 1): Tally()}
    tallies["kvpool", "req16", 1].add(Load(4, 64, 0.02, (0.005, 0.005, 0.006, 0.010)), 0.008,
                                      0.004, Scrape({1e-4: 3.0, 2e-4: 4.0, float("inf"): 4.0},
                                                    chunks=40.0, relayed=30.0, gc_s=0.0002),
                                      relay_writes=16)
    tallies["direct", "req16", 1].add(Load(4, 64, 0.016, (0.004,) * 4), 0.0, 0.004)
    out = {r["relay"]: r for r in rows(tallies, {"engines": 1})}
    k, d = out["kvpool"], out["direct"]
    assert (k["requests"], k["relay_ms_per_request"], k["req_per_relay_cpu_s"]) == (4, 2.0, 500)
    assert (k["relay_writes_per_token"], k["relay_us_per_write"]) == (0.25, 500.0)
    assert (d["relay_writes_per_token"], d["relay_us_per_write"]) == (0.0, 0.0)
    assert k["latency_p50_ms"] == 5.5 and d["latency_p50_ms"] == 4.0
    assert k["added_p50_ms"] == 1.5 and "added_p50_ms" not in d
    assert k["decision_p50_us"] == pytest.approx(66.7, abs=0.1)
    assert "decision_p50_us" not in d and d["req_per_relay_cpu_s"] is None
    assert k["read_relay_share"] == 0.75 and "read_relay_share" not in d
    assert "75% of chunks relayed in the read callback" in fmt(k)
    assert k["relay_gc_us_per_request"] == 50.0 and "gc 50 us/request" in fmt(k)
    assert "relay_gc_us_per_request" not in d
    assert with_added_latency([{"relay": "kvpool", "load": "x", "concurrency": 1,
                                "latency_p50_ms": 1.0}]) == [
        {"relay": "kvpool", "load": "x", "concurrency": 1, "latency_p50_ms": 1.0}]


def test_a_reading_without_the_collector_s_figure_has_none_between() -> None:
    old, new = Scrape({}, gc_s=None), Scrape({}, gc_s=0.5)
    assert old.delta(new).gc_s is None and Scrape({}, gc_s=0.25).delta(new).gc_s == 0.25


def test_the_load_client_times_each_request(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            await reader.readexactly(2)
            await asyncio.sleep(0.01)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx")

    async def go() -> Load:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await drive("127.0.0.1", port, lambda i: ("/p", b"{}"), lambda b: len(b), 6, 2)
        finally:
            server.close()
    load = asyncio.run(go())
    assert (load.requests, load.units, len(load.latencies_s)) == (6, 6, 6)
    assert all(0.009 <= t < 1.0 for t in load.latencies_s)
    assert load.wall_s >= 0.03


def test_ratios_are_kvpool_over_nginx_on_the_same_load() -> None:
    rows = [{"relay": "kvpool", "load": "a", "relay_us_per_token": 100.0,
             "relay_ms_per_request": 6.0, "req_per_s": 50.0},
            {"relay": "nginx", "load": "a", "relay_us_per_token": 8.0,
             "relay_ms_per_request": 0.5, "req_per_s": 200.0},
            {"relay": "kvpool", "load": "b", "relay_us_per_token": 1.0,
             "relay_ms_per_request": 1.0, "req_per_s": 1.0}]
    rows[0]["relay_us_per_write"], rows[1]["relay_us_per_write"] = 60.0, 15.0
    out = with_ratios(rows)
    assert (out[0]["ratio_relay_us_per_token"], out[0]["ratio_relay_ms_per_request"],
            out[0]["ratio_req_per_s"], out[0]["ratio_relay_us_per_write"]) == (12.5, 12.0, 0.25,
                                                                                4.0)
    assert "ratio_req_per_s" not in out[1]
    assert out[2]["ratio_relay_us_per_token"] is None  # no nginx row for that load
    assert out[2]["ratio_relay_us_per_write"] is None  # nor a write count of its own


@pytest.mark.slow
def test_the_proxy_bench_runs_with_its_nginx_anchor() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "proxy", "--json", "--rounds", "2",
         "--streams", "8", "--requests", "24", "--concurrency", "1,4", "--stream-interval", "4",
         "--loads", "stream256,req16,json16", "--engines", "2",
         "--worker-sse", "--proxy-processes", "2", "--py-relay"],
        capture_output=True, text=True, timeout=600, env=python_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    relays = ["kvpool", "kvpool-wsse", "kvpool-p2", "py-relay", "py-http", "direct",
              *(["nginx"] if find_nginx() else [])]
    assert sorted((r["relay"], r["load"], r["concurrency"]) for r in rows) == sorted(
        (relay, load, c) for relay in relays for load in ("req16", "stream256", "json16")
        for c in (1, 4))
    for r in rows:
        per = 256 if r["load"] == "stream256" else 16
        assert r["requests"] == 2 * (8 if per == 256 else 24) and r["tokens"] == r["requests"] * per
        assert r["req_per_s"] > 0 and r["tokens_per_s"] > 0 and r["worker_us_per_token"] > 0
        assert 0 <= r["worker_engine_us_per_token"] <= r["worker_us_per_token"]
        assert r["relay_cpu_s"] >= 0 and r["stream_interval"] == 4 and r["engines"] == 2
        assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
        assert ("added_p50_ms" in r) == (r["relay"] != "direct")
    kvpool = [r for r in rows if r["relay"].startswith("kvpool")]
    assert all(r["relay_us_per_token"] > 0 and r["relay_ms_per_request"] > 0 for r in kvpool)
    for r in kvpool:  # one process's histograms are read; a group's are not
        assert (r.get("decision_p50_us") is not None) == (r["relay"] != "kvpool-p2"), r
        assert (r.get("relay_gc_us_per_request", -1) >= 0) == (r["relay"] != "kvpool-p2"), r
    if "nginx" in relays:
        req16 = next(r for r in kvpool if r["load"] == "req16" and r["concurrency"] == 4)
        nginx16 = next(r for r in rows if (r["relay"], r["load"], r["concurrency"]) ==
                       ("nginx", "req16", 4))
        assert req16["ratio_req_per_s"] > 0
        if nginx16["relay_cpu_s"] > 0:  # /proc counts 10 ms ticks: a short load can read 0
            assert req16["ratio_relay_ms_per_request"] > 1
        else:
            assert req16["ratio_relay_ms_per_request"] is None


def _goal_row(relay: str, load: str, c: int, **figures: float) -> dict[str, object]:
    return {"relay": relay, "load": load, "concurrency": c, "speed_up": 1000.0,
            "stream_interval": 1, "engines": 1, "relay_us_per_token": 1.0,
            "relay_ms_per_request": 1.0, "req_per_s": 100.0, "worker_us_per_token": 3.0,
            **figures}


def test_goals_are_judged_on_the_proxy_row_against_nginx_on_the_same_load() -> None:
    rows = [_goal_row("kvpool", "stream256", 32, relay_us_per_token=4.1,
                      relay_ms_per_request=1.4, worker_us_per_token=6.0),
            _goal_row("nginx", "stream256", 32, relay_us_per_token=2.0),
            _goal_row("kvpool", "req16", 32, req_per_s=79.0, worker_us_per_token=9.1),
            _goal_row("nginx", "req16", 32, relay_us_per_token=3.0),
            _goal_row("kvpool", "req16", 1, added_p50_ms=0.4),
            _goal_row("kvpool-base", "req16", 1, added_p50_ms=9.0)]
    lines = goal_lines(rows)
    assert [line.split(":")[0].split() for line in lines] == [
        ["MISS", "stream256", "c=32"], ["met", "stream256", "c=32"], ["met", "stream256", "c=32"],
        ["MISS", "req16", "c=32"], ["MISS", "req16", "c=32"], ["met", "req16", "c=1"]]
    assert [line.split()[-1] for line in lines] == ["2.0", "1.5", "3.0", "0.8", "3.0", "1.0"]
    assert "2.05 x nginx" in lines[0] and "1.400 ms" in lines[1]
    assert "3.0 x nginx's" in lines[2] and "0.79 x nginx" in lines[3] and "+0.40 ms" in lines[5]


def test_goals_need_the_settings_they_are_set_at() -> None:
    sped = [_goal_row("kvpool", "req16", 1, added_p50_ms=0.4, speed_up=20.0)]
    framed = [_goal_row("kvpool", "req16", 1, added_p50_ms=0.4, stream_interval=4)]
    assert goal_lines(sped) == goal_lines(framed) == []
    many = [_goal_row("kvpool", "req16", 32, engines=16, req_per_relay_cpu_s=499)]
    assert any(line.startswith("  MISS") and "499 requests per proxy CPU-second" in line
               for line in goal_lines(many))
    assert not any("per proxy CPU-second" in line for line in goal_lines(
        [_goal_row("kvpool", "req16", 32, engines=8, req_per_relay_cpu_s=499)]))


def test_a_cpu_meter_reads_below_a_tick_and_keeps_an_ended_threads_share() -> None:
    """Time on a CPU in nanoseconds (schedstat): 25 ms of work reads as 25 ms, not as the two
    or three ticks it spans; and a thread that ends between the readings, taking its
    nanoseconds with it, is still counted (the ticks are taken for that process)."""
    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
    if cpu_ns(os.getpid()) is None:
        pytest.skip("this kernel has no schedstat")
    meter = CpuMeter([os.getpid()])
    for _ in range(5):  # this thread alone works (others of the test process may not)
        meter.start()
        burn(0.025)
        used = meter.seconds()
        if used < 0.028:
            break
    assert 0.025 <= used < 0.028
    meter.start()
    worker = threading.Thread(target=burn, args=(0.3,))
    worker.start()
    worker.join()
    assert meter.seconds() >= 0.25
