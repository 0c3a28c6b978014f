"""A vLLM server's data-parallel ranks named as instances (`URL#dpN`, serve/vllm/ranks.py):
the names read, each rank's load from its own engine's series, and every call of the vllm
backend for a rank sent to its server pinned with `X-data-parallel-rank`, over a real socket
to an HTTP server that answers as a vLLM server of two ranks would (no vLLM runs here with
more than one engine: the double records what it was sent)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import FinishLine, GenerateRequest, PlainFrame
from kvpool.errors import ConfigError, InvalidArgument
from kvpool.serve.config import ProxyConfig
from kvpool.serve.vllm.backend import VllmBackend
from kvpool.serve.vllm.metrics_text import parse_metrics
from kvpool.serve.vllm.ranks import RANK_HEADER, Ranks, split_rank
from tests.serve.vllm.test_metrics_text import NEW


def test_a_rank_is_named_by_its_servers_url_and_dp_n() -> None:
    assert split_rank("http://h:8000#dp1") == ("http://h:8000", 1)
    assert split_rank("http://h:8000#dp255") == ("http://h:8000", 255)
    assert split_rank("http://h:8000") == ("http://h:8000", None)
    for bad in ("http://h:8000#1", "http://h:8000#dp", "http://h:8000#dp01",
                "http://h:8000#dp-1", "http://h:8000#dp1x", "http://h:8000#x#dp1",
                "http://h:8000#dp256", "http://h:8000#dp5000"):
        with pytest.raises(ConfigError, match="#dpN"):
            split_rank(bad)
    with pytest.raises(ConfigError, match="without a slash"):  # one name per instance
        split_rank("http://h:8000/#dp1")


def test_the_bare_url_beside_a_rank_is_rank_0_and_a_lone_one_is_left_to_vllm() -> None:
    ranks = Ranks(["http://a:1", "http://a:1#dp1", "http://b:1", "http://c:1#dp0"])
    assert ranks.target("http://a:1") == ("http://a:1", {RANK_HEADER: "0"})
    assert ranks.target("http://a:1#dp1") == ("http://a:1", {RANK_HEADER: "1"})
    assert ranks.target("http://c:1#dp0") == ("http://c:1", {RANK_HEADER: "0"})
    assert ranks.target("http://b:1") == ("http://b:1", {})  # vLLM's balancer chooses
    assert (ranks.engine("http://a:1#dp1"), ranks.engine("http://b:1")) == ("1", None)
    assert ranks.max_rank == 1
    with pytest.raises(ConfigError, match="named twice"):
        Ranks(["http://a:1", "http://a:1#dp0", "http://a:1#dp1"])


def test_a_ranks_load_is_its_own_engines() -> None:
    assert parse_metrics(NEW, "2") is None  # no such engine: no rank of that server
    one = parse_metrics(NEW, "1")
    assert one is not None and (one.num_running, one.num_waiting, one.kv_usage) == (2, 0, 0.25)
    assert one.num_gpu_blocks == 100 and one.block_size == 128  # the server's 200, halved
    zero = parse_metrics(NEW, "0")
    assert zero is not None and (zero.num_running, zero.num_waiting) == (3, 4)


def test_a_server_with_named_ranks_takes_no_registered_instance() -> None:
    """Registered after start, the bare URL of a server whose rank 1 is named would get rank
    0's events but calls unpinned (vLLM's balancer choosing): refused, as ranks are; other
    servers' URLs are not."""
    ranks = Ranks(["http://h:1#dp1", "http://g:1"])
    assert ranks.refused("http://h:1") is not None and "http://h:1#dp0" in ranks.refused(
        "http://h:1/")  # type: ignore[operator]
    assert "named at start" in ranks.refused("http://g:1#dp1")  # type: ignore[operator]
    assert ranks.refused("http://g:1") is None and ranks.refused("http://k:1") is None


def test_ranks_are_the_vllm_backends_alone_and_not_with_mooncakes_handoff() -> None:
    with pytest.raises(ConfigError, match="kvpool worker's URL has no fragment"):
        ProxyConfig(model_dir="m", colocated_urls=("http://w:1#dp1",))
    with pytest.raises(ConfigError, match="#dpN"):
        VllmBackend.from_config(ProxyConfig(model_dir="m", backend="vllm",
                                            colocated_urls=("http://w:1#rank1",)))
    import threading

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="named twice"):  # before its events' sockets
        VllmBackend.from_config(ProxyConfig(
            model_dir="m", backend="vllm", kv_events="tcp://127.0.0.1:0",
            colocated_urls=("http://w:1/", "http://w:1#dp0")))
    assert "kv-event-subscriber" not in {t.name for t in threading.enumerate()} - before
    with pytest.raises(ConfigError, match="mooncake does not take data-parallel ranks"):
        VllmBackend.from_config(ProxyConfig(
            model_dir="m", backend="vllm", kv_transfer="mooncake",
            prefill_urls=("http://p:1", "http://p:1#dp1"), decode_urls=("http://d:1",)))


class _TwoRanks(BaseHTTPRequestHandler):
    """Answers as a vLLM server of two engines; records (path, rank header) of each call."""

    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str | None]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, body: bytes, kind: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.seen.append((self.path.split("?")[0], self.headers.get(RANK_HEADER)))
        if self.path.startswith("/metrics"):
            self._answer(NEW.encode(), "text/plain")
        elif self.path == "/v1/models":
            self._answer(json.dumps({"data": [{"id": "m", "max_model_len": 512}]}).encode())
        else:
            self._answer(b"")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append((self.path, self.headers.get(RANK_HEADER)))
        chunks = [{"choices": [{"index": 0, "text": "ab", "token_ids": [5, 6],
                                "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": 0}}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._answer(body.encode(), "text/event-stream")


@contextmanager
def _server() -> Iterator[str]:
    _TwoRanks.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _TwoRanks)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_every_call_for_a_rank_goes_to_its_server_pinned_to_it() -> None:
    async def go(url: str) -> tuple[object, object, list[object]]:
        backend = VllmBackend({url: "both", f"{url}#dp1": "both"}, 5.0, model="m")
        try:
            info = await backend.info(f"{url}#dp1", 5.0)
            load = await backend.load(f"{url}#dp1", "/load", 5.0)
            req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                  sampling=SamplingParams(max_tokens=2))
            lines = [line async for line in backend.generate(f"{url}#dp1", req)]
            await backend.load(url, "/load", 5.0)  # the bare URL: rank 0
            return info, load, lines
        finally:
            await backend.aclose()

    async def missing(url: str) -> None:
        backend = VllmBackend({f"{url}#dp2": "both"}, 5.0, model="m")
        try:
            await backend.info(f"{url}#dp2", 5.0)
        finally:
            await backend.aclose()

    with _server() as url:
        info, load, lines = asyncio.run(go(url))
        seen = list(_TwoRanks.seen)
        with pytest.raises(InvalidArgument, match="no engine 2"):  # it never joins
            asyncio.run(missing(url))
    assert info.kv_capacity_tokens == 100 * 128  # type: ignore[attr-defined]  # one engine's
    assert (load.num_running, load.num_waiting) == (2, 0)  # type: ignore[attr-defined]
    assert isinstance(lines[0], PlainFrame) and lines[0].token_ids == [5, 6]
    assert isinstance(lines[-1], FinishLine) and lines[-1].finish_reason == "length"
    assert seen[:-1] and all(rank == "1" for _, rank in seen[:-1]), seen
    assert ("/v1/completions", "1") in seen and seen[-1] == ("/metrics", "0")


def test_a_servers_ranks_events_reach_its_ranks_named_either_way() -> None:
    """Ranks named URL#dp0 and URL#dp1: rank 0's events (the server's topic, at the
    endpoint's port) go to URL#dp0, rank 1's (its port plus one) to URL#dp1; a rank without a
    replay endpoint of its own gets its server's, offset by the rank, as vLLM binds it."""
    from kvpool.kvevents.events import BlockStored, EventBatch
    from kvpool.kvevents.publisher import KvEventPublisher
    from kvpool.serve.vllm.events import KvEventsFeed, _rank_replays
    from tests.kvevents.test_subscriber import _port_pair
    from tests.support.wait import wait_for

    assert _rank_replays({"http://h:1": "tcp://127.0.0.1:7000"},
                         ["http://h:1", "http://h:1#dp2", "http://g:1#dp1"]) == \
        {"http://h:1": "tcp://127.0.0.1:7000", "http://h:1#dp2": "tcp://127.0.0.1:7002"}
    assert _rank_replays({"http://h:1": "tcp://127.0.0.1:7000"},
                         ["http://h:1#dp0", "http://h:1#dp1"]) == \
        {"http://h:1": "tcp://127.0.0.1:7000", "http://h:1#dp0": "tcp://127.0.0.1:7000",
         "http://h:1#dp1": "tcp://127.0.0.1:7001"}
    port, server = _port_pair(), "http://h:8000"
    names = [f"{server}#dp0", f"{server}#dp1"]
    feed = KvEventsFeed(f"tcp://127.0.0.1:{port}", ranked=names)
    pubs = [KvEventPublisher(f"tcp://127.0.0.1:{port + r}", None, server, data_parallel_rank=r)
            for r in (0, 1)]
    try:
        def publish() -> bool:
            for r, pub in enumerate(pubs):
                pub.publish(EventBatch(ts=1.0, events=[BlockStored(
                    block_hashes=[100 + r], token_ids=[], block_size=16, medium="GPU")]))
            return all(feed.index.num_blocks(n) for n in names)
        wait_for(publish, 10)
        assert feed.index.matched_blocks(names[0], [100]) == 1
        assert feed.index.matched_blocks(names[1], [101]) == 1
        assert feed.index.matched_blocks(names[0], [101]) == 0
        assert server not in feed.index.instances()
    finally:
        for pub in pubs:
            pub.close()
        feed.close()
