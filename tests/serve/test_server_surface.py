"""vLLM's server surface on the proxy (/tokenize, /detokenize, /v1/models/{id}, /version),
OpenAI-shaped errors on every route, the access log, and a client that goes away mid-stream:
one log line, no traceback. A second real proxy over the session's workers, its stderr kept."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvpool.launch.wait import answers, wait_for
from kvpool.serve.launch import ServingCluster
from kvpool.serve.tokenizer import ModelTokenizer
from tests.serve.test_proxy_live import client
from tests.support.net import free_port
from tests.support.procs import python_env, stop


@pytest.fixture(scope="module")
def proxy(cluster: ServingCluster, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("proxy") / "stderr.log"
    port = free_port()
    args = [sys.executable, "-m", "kvpool", "--log-level", "WARNING", "proxy", "--model",
            str(cluster.model_dir), "--port", str(port), "--served-model-name", "served-name",
            "--prefill", cluster.worker_urls["prefill"][0],
            "--decode", cluster.worker_urls["decode"][0]]
    with log.open("wb") as err:
        proc = subprocess.Popen(args, stderr=err, env=python_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(url + "/health"), 60.0, log.read_text, 0.2, procs=[proc])
        yield url, log
    finally:
        stop(proc)


def test_tokenize_and_detokenize(proxy: tuple[str, Path], cluster: ServingCluster) -> None:
    url, _ = proxy
    tok = ModelTokenizer(cluster.model_dir)
    got = httpx.post(url + "/tokenize", json={"prompt": "the pool"}).json()
    assert got["tokens"] == tok.encode("the pool") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0
    chat = httpx.post(url + "/tokenize", json={"model": "served-name", "messages": [
        {"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "hi"}])
    back = httpx.post(url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": tok.decode(got["tokens"])}
    both = httpx.post(url + "/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = httpx.post(url + "/tokenize", json={"model": "nope", "prompt": "a"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def _counted(url: str, metric: str, result: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'{metric}_total{{result="{result}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no {metric}")


def _cache_tokens(url: str, result: str) -> float:
    return _counted(url, "kvpool_proxy_tokenizer_cache_tokens", result)


def test_a_text_longer_than_the_context_could_hold_is_refused_before_tokenizing(
        proxy: tuple[str, Path]) -> None:
    """A prompt over 32 characters per context token is a 400 at once (tokenizing megabytes
    would hold the proxy's interpreter and stall everyone's requests and polls)."""
    from kvpool.serve.requests import MAX_CHARS_PER_TOKEN
    url, _ = proxy
    limit = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    text = "y" * (limit * MAX_CHARS_PER_TOKEN + 1)
    for path, body in (("/v1/completions", {"model": "served-name", "prompt": text}),
                       ("/v1/completions", {"model": "served-name", "prompt": ["a", text]}),
                       ("/v1/chat/completions", {"model": "served-name", "messages": [
                           {"role": "user", "content": text}]}),
                       ("/tokenize", {"prompt": text})):
        t0 = time.monotonic()
        reply = httpx.post(url + path, json=body, timeout=30)
        assert reply.status_code == 400 and "characters" in reply.json()["error"]["message"]
        assert time.monotonic() - t0 < 5, path


def test_models_version_and_errors_in_openai_shape(proxy: tuple[str, Path]) -> None:
    url, _ = proxy
    one = client(url).models.retrieve("served-name")
    assert one.id == "served-name" and one.object == "model"
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve("another")
    assert httpx.get(url + "/version").json()["version"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, url + path)
        err = r.json()["error"]
        assert r.status_code == status and path in err["message"] and err["type"], r.text
    out = client(url).completions.create(model="served-name", prompt="x", max_tokens=2)
    assert out.model == "served-name"


def test_access_log_and_a_client_that_goes_away(proxy: tuple[str, Path],
                                                cluster: ServingCluster) -> None:
    url, log = proxy
    client(url).completions.create(model="served-name", prompt="the pool", max_tokens=3,
                                   temperature=0, extra_body={"ignore_eos": True})
    httpx.post(url + "/v1/completions", json={"model": "served-name", "prompt": "x", "n": 0})
    body = {"model": "served-name", "prompt": "a long one", "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # and close the connection mid-stream
    deadline = time.monotonic() + 20
    wait_for(lambda: "client gone" in log.read_text(), 20.0, log.read_text, 0.2)
    text = log.read_text()
    assert "POST /v1/completions 200 prompt=" in text and "output=3" in text
    assert "POST /v1/completions 400 prompt=0" in text
    assert "Traceback" not in text, text
    # the abandoned request is not decoding on: the decode worker drains
    decode = cluster.worker_urls["decode"][0]
    wait_for(lambda: not httpx.get(decode + "/load", timeout=10).json()["num_running"],
             deadline + 20 - time.monotonic(), "the abandoned request to stop decoding", 0.1)


def test_a_client_gone_mid_body_is_an_access_line(proxy: tuple[str, Path]) -> None:
    """A client that closes while its body is still coming: one access line (a 400 no one
    reads), no traceback."""
    url, log = proxy
    before = log.read_text().count("POST /v1/completions 400")
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 500\r\n\r\n{\"model\": ")
        time.sleep(0.2)
    wait_for(lambda: log.read_text().count("POST /v1/completions 400") > before, 10.0,
             log.read_text, 0.1)
    assert "Traceback" not in log.read_text() and "ClientDisconnect" not in log.read_text()


def test_a_client_gone_is_seen_with_a_request_pipelined_behind(
        proxy: tuple[str, Path], cluster: ServingCluster) -> None:
    """A non-streamed request with another pipelined behind it on its connection: the client
    going is seen by the one running (uvicorn marks only the newest), which stops decoding
    and writes nothing to the closed connection."""
    url, log = proxy
    limit = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    decode = cluster.worker_urls["decode"][0]

    def post(max_tokens: int) -> bytes:
        body = json.dumps({"model": "served-name", "prompt": "the pool",
                           "max_tokens": max_tokens, "ignore_eos": True}).encode()
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(post(limit - 8) + post(2))  # the first decodes for well over 5 s
        wait_for(lambda: httpx.get(decode + "/load", timeout=10).json()["num_running"] > 0,
                 20.0, "the first request to decode", 0.05)
    wait_for(lambda: not httpx.get(decode + "/load", timeout=10).json()["num_running"], 3.0,
             "the abandoned request to stop decoding", 0.1)
    time.sleep(0.3)
    assert "Traceback" not in log.read_text(), log.read_text()[-2000:]


@pytest.mark.slow
def test_a_dropped_non_streaming_request_stops_decoding(proxy: tuple[str, Path],
                                                        cluster: ServingCluster) -> None:
    url, log = proxy
    # the whole context (some thousand tokens) takes the tiny model well over 5 s: a request
    # left running shows below
    limit = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": "served-name", "prompt": "the pool", "max_tokens": limit - 8,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json=body, timeout=1.5)
    decode = cluster.worker_urls["decode"][0]
    wait_for(lambda: not httpx.get(decode + "/load", timeout=10).json()["num_running"], 3.0,
             "the abandoned request to stop decoding", 0.1)
    assert log.read_text().count("client gone") >= 1 and "Traceback" not in log.read_text()


@pytest.mark.parametrize("command", ["proxy", "worker"])
def test_no_public_bind_without_a_token(command: str, cluster: ServingCluster) -> None:
    env = python_env()
    env.pop("KVPOOL_TOKEN", None)
    run = subprocess.run([sys.executable, "-m", "kvpool", command, "--model",
                          str(cluster.model_dir), "--host", "0.0.0.0", "--port",
                          str(free_port())], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2 and "refusing to listen on 0.0.0.0 without a token" in run.stderr


def test_admin_endpoints_need_the_token(cluster: ServingCluster) -> None:
    """An impostor worker cannot register itself (it would get the token and the prompts), and
    the proxy's measurements are not open."""
    from tests.serve.conftest import start_proxy
    proc, url = start_proxy(cluster.model_dir, "--token", "s3cret", ready="/v1/models")
    try:
        fake = {"url": "http://127.0.0.1:9"}
        bad = httpx.post(url + "/workers/register", json=fake)
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(url + "/workers/register", json=fake,
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(url + "/stats/samples").status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert httpx.get(url + "/stats/samples", headers=auth).status_code == 200
        assert httpx.post(url + "/workers/register", json=fake, headers=auth).status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 200  # the API itself stays open
    finally:
        stop(proc)


@pytest.mark.slow
def test_bounded_work_per_request(proxy: tuple[str, Path]) -> None:
    url, _ = proxy
    huge = b'{"model": "served-name", "prompt": "' + b"a" * (5 << 20) + b'"}'
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", content=huge, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 10
    stops = {"model": "served-name", "prompt": "x", "stop": ["s" * 10] * 17}
    r = httpx.post(url + "/v1/completions", json=stops)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    long_stop = {"model": "served-name", "prompt": "x", "stop": "s" * 600}
    assert httpx.post(url + "/v1/completions", json=long_stop).status_code == 400


def test_responses_and_access_lines_say_where_the_conductor_ran_them(
        proxy: tuple[str, Path], cluster: ServingCluster) -> None:
    """Headers name the prefill and decode workers, the reused tokens by source and the
    predicted TTFT; the access line ends with the same."""
    url, log = proxy
    body = {"model": "served-name", "prompt": "where did it run? " * 20, "max_tokens": 2}
    replies = [httpx.post(url + "/v1/completions", json=body, timeout=60) for _ in range(2)]
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True},
                      timeout=60) as streamed:
        list(streamed.iter_lines())
    for r in (*replies, streamed):
        assert r.status_code == 200
        assert r.headers["x-kvpool-prefill-worker"] in cluster.worker_urls["prefill"]
        assert r.headers["x-kvpool-decode-worker"] in cluster.worker_urls["decode"]
        assert float(r.headers["x-kvpool-predicted-ttft-ms"]) >= 0
    local, pool = (int(part.split("=")[1])
                   for part in replies[1].headers["x-kvpool-reused-tokens"].split(","))
    assert local + pool > 0  # the second time, the prefix is cached somewhere
    r = replies[1]
    line = (f"prefill={r.headers['x-kvpool-prefill-worker']} "
            f"decode={r.headers['x-kvpool-decode-worker']} reused=local:{local},pool:{pool} "
            f"predicted_ttft={r.headers['x-kvpool-predicted-ttft-ms']}ms")
    wait_for(lambda: line in log.read_text(), 10.0,
             lambda: (line, log.read_text()[-2000:]), 0.1)
