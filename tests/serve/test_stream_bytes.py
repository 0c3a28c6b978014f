"""The proxy's responses byte for byte, against bytes recorded before the stream's path was
reworked (tokens coalesced per engine step): streamed and not, seeded sampling, logprobs, `n`,
echo, a list of prompts, a stop string, chat. Only the response id and `created` (a clock
reading) are masked; everything else, JSON spacing and chunk boundaries included, must match.

The recorded file is `data/stream_bytes.json` (case name -> body); `record()` writes it. It was
recorded before frames, then once more without the empty delta sent before each finish chunk
(that change alone: every other byte as before), and once more when a completions position's
`top_logprobs` took the chosen token where sampling took it from outside the top ones (those
entries added: every other byte as before)."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx

from kvpool.launch.children import stop
from kvpool.serve.launch import ServingCluster
from tests.serve.conftest import start_proxy

GOLDEN = Path(__file__).parent / "data" / "stream_bytes.json"
PROMPT = "the cache block pool and the prefill of the prompt"
_ID = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"')
_CREATED = re.compile(rb'"created":\d+')
_FLOAT = re.compile(rb"-?\d+\.\d+(?:e-?\d+)?")
_INDEX = re.compile(rb'"choices":\[\{"index":(\d+)')


def cases(model: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (endpoint, body)."""
    base = {"model": model, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    seeded = base | {"temperature": 0.9, "seed": 7}
    chat = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10,
            "ignore_eos": True, "temperature": 0.8, "seed": 3}
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for stream in (False, True):
        s = {"stream": stream} | ({"stream_options": {"include_usage": True}} if stream else {})
        tag = "stream" if stream else "body"
        out[f"greedy-{tag}"] = ("completions", base | {"temperature": 0} | s)
        out[f"seeded-n3-{tag}"] = ("completions", seeded | {"n": 3} | s)
        out[f"logprobs-echo-{tag}"] = ("completions", seeded | {"logprobs": 2, "echo": True} | s)
        out[f"logprobs-{tag}"] = ("completions", seeded | {"logprobs": 1, "max_tokens": 20} | s)
        out[f"prompts-{tag}"] = ("completions", seeded | {"prompt": [PROMPT, "a block"]} | s)
        out[f"stop-{tag}"] = ("completions", seeded | {"max_tokens": 30, "stop": ["e", "q"]} | s)
        out[f"stop-held-{tag}"] = ("completions", seeded | {"max_tokens": 30, "stop": ["ldone"]} | s)
        out[f"stop-released-{tag}"] = ("completions", seeded | {"max_tokens": 30,
                                                                 "stop": ["worldX", "invalZ"]} | s)
        out[f"chat-{tag}"] = ("chat/completions", chat | s)
        out[f"chat-logprobs-{tag}"] = ("chat/completions", chat | {
            "logprobs": True, "top_logprobs": 2} | s)
        out[f"chat-logprobs-n2-{tag}-rounded"] = ("chat/completions", chat | {
            "logprobs": True, "top_logprobs": 2, "n": 2} | s)
    return out


def masked(body: bytes, rounded: bool = False) -> str:
    """`body` with its id and `created` masked (and, `rounded`, its numbers with a fraction
    to 4 places: choices that share the engine's batch get logprobs that differ in the last
    bits of a float32, as the batch's composition varies); a stream's events in choice order (the
    choices of one stream interleave as their tokens come; each choice's events keep their
    order, and the usage chunk and [DONE] stay last)."""
    body = _CREATED.sub(b'"created":0', _ID.sub(rb'"id":"\1-ID"', body))
    if rounded:
        body = _FLOAT.sub(lambda m: b"%.4f" % float(m.group(0)), body)
    if not body.startswith(b"data: "):
        return body.decode()
    events = body.split(b"\n\n")
    return b"\n\n".join(sorted(events, key=_choice_index)).decode()


def _choice_index(event: bytes) -> int:
    found = _INDEX.search(event)
    return int(found.group(1)) if found else 1 << 30


def responses(url: str, model: str) -> dict[str, str]:
    """Every case's masked body, under a cache salt of their own (the workers' caches as
    fresh as when the bytes were recorded, whatever ran before)."""
    got, salt = {}, uuid.uuid4().hex
    with httpx.Client(timeout=120) as http:
        for name, (endpoint, body) in cases(model).items():
            resp = http.post(f"{url}/v1/{endpoint}", json=body | {"cache_salt": salt})
            assert resp.status_code == 200, (name, resp.text)
            got[name] = masked(resp.content, rounded=name.endswith("-rounded"))
    return got


def record(url: str, model: str) -> None:
    GOLDEN.write_text(json.dumps(responses(url, model), indent=1, sort_keys=True) + "\n")


_EMPTY = ('"text":"","logprobs":null,"finish_reason":null',
          '"delta":{"content":""},"logprobs":null,"finish_reason":null')


def _workers(cluster: ServingCluster) -> tuple[str, ...]:
    return ("--prefill", cluster.worker_urls["prefill"][0],
            "--decode", cluster.worker_urls["decode"][0])


def _responses_through(cluster: ServingCluster, *flags: str) -> dict[str, str]:
    """`responses` through a proxy of its own with `flags`, over the cluster's workers."""
    proc, url = start_proxy(cluster.model_dir, *flags, *_workers(cluster))
    try:
        return responses(url, cluster.model_name)
    finally:
        stop(proc)


def test_responses_equal_the_recorded_bytes(cluster: ServingCluster) -> None:
    """Recorded before frames, less the empty delta streams then sent before each finish
    chunk (no text, no logprobs: nothing for the client). A chunk per frame
    (--no-merge-frames): the default merges what one read brings, so its boundaries depend
    on timing."""
    want = json.loads(GOLDEN.read_text())
    got = _responses_through(cluster, "--no-merge-frames")
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name
        assert not any(e in got[name] for e in _EMPTY), name


def _events(body: str) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]


def _texts(body: str) -> dict[int, str]:
    """A masked body's text per choice: a stream's deltas joined, or the body's choices."""
    if not body.startswith("data: "):
        return {c["index"]: json.dumps(c, sort_keys=True) for c in json.loads(body)["choices"]}
    out: dict[int, str] = {}
    for event in _events(body):
        for c in event["choices"]:
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out


def test_merged_frames_give_the_recorded_text_and_usage(cluster: ServingCluster) -> None:
    """The default proxy (frames one read brings as one chunk): every response has the
    recorded text per choice, and the recorded usage."""
    want = json.loads(GOLDEN.read_text())
    got = responses(cluster.proxy_url, cluster.model_name)
    for name in want:
        assert _texts(got[name]) == _texts(want[name]), name
        assert _usage(got[name]) == _usage(want[name]), name


def _usage(body: str) -> Any:
    if not body.startswith("data: "):
        return json.loads(body)["usage"]
    return [e["usage"] for e in _events(body) if e.get("usage")]


def test_text_chunks_made_by_the_decoding_workers_are_the_same_bytes(
        cluster: ServingCluster) -> None:
    """--worker-sse: the streamed choices without logprobs or echo (greedy, seeded n=3, a
    list of prompts, stop strings, chat) get their chunks from the decode worker, the rest
    from the proxy: every response equals the recorded bytes."""
    got = _responses_through(cluster, "--worker-sse", "--no-merge-frames")
    want = json.loads(GOLDEN.read_text())
    for name in want:
        assert got[name] == want[name], name


def _stream_texts(url: str, body: dict[str, Any]) -> list[str]:
    resp = httpx.post(f"{url}/v1/completions", json=body | {"stream": True}, timeout=120)
    events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: {")]
    return [json.loads(e)["choices"][0]["text"] for e in events]


def test_a_stream_interval_gives_the_same_text_in_fewer_chunks(cluster: ServingCluster) -> None:
    """--stream-interval 4 (frames of 4 tokens after the first), with the proxy's text and
    with the workers': the text of an interval-1 stream, in fewer chunks."""
    body = {"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 24, "seed": 7,
            "temperature": 0.9, "ignore_eos": True, "cache_salt": uuid.uuid4().hex,
            "stop": ["ldone"]}
    proc, url = start_proxy(cluster.model_dir, "--no-merge-frames", *_workers(cluster))
    try:
        one = _stream_texts(url, body)
    finally:
        stop(proc)
    for flags in (("--no-merge-frames",), ("--worker-sse", "--no-merge-frames")):
        proc, url = start_proxy(cluster.model_dir, "--stream-interval", "4", *_workers(cluster),
                                *flags)
        try:
            four = _stream_texts(url, body)
        finally:
            stop(proc)
        assert "".join(four) == "".join(one) and len(four) < len(one), flags


def _chunks_relayed(url: str) -> float:
    """The proxy's count of relayed chunks (one TBT observation each)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^kvpool_proxy_tbt_seconds_count (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_whole_response_is_relayed_from_a_few_frames(cluster: ServingCluster) -> None:
    """A response that is one JSON body (no stop string) has its decode leg sent in frames of
    --whole-interval tokens: the same text as frames per step (a stop string that never
    matches keeps those), from two frames (the first goes at once) instead of one a step."""
    body = {"model": cluster.model_name, "prompt": PROMPT, "max_tokens": 40, "seed": 7,
            "temperature": 0.9, "ignore_eos": True, "cache_salt": uuid.uuid4().hex}
    proc, url = start_proxy(cluster.model_dir, "--no-merge-frames", *_workers(cluster))
    try:
        counts, texts = [], []
        for extra in ({}, {"stop": ["never in this text \x01"]}):
            before = _chunks_relayed(url)
            resp = httpx.post(f"{url}/v1/completions", json=body | extra, timeout=120)
            assert resp.status_code == 200, resp.text
            counts.append(_chunks_relayed(url) - before)
            texts.append(resp.json()["choices"][0]["text"])
    finally:
        stop(proc)
    assert texts[0] == texts[1]
    assert counts[0] <= 2 and counts[1] >= 30, counts  # the leg's first frame, then the rest
