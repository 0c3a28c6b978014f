"""The worker's HTTP edge in one process (FastAPI's TestClient): auth, bad bodies, roles,
reservations; and the steps a busy event loop merges (`merge_steps`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvpool.clock import VirtualClock
from kvpool.engine.config import EngineConfig, SamplingParams
from kvpool.engine.worker.app import create_app
from kvpool.engine.worker.messages import GenerateRequest
from kvpool.engine.worker.runtime import Worker, WorkerConfig

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def client(tiny_llama: Path) -> Iterator[TestClient]:
    worker = Worker(WorkerConfig(str(tiny_llama), role="decode", token="s3cret",
                                 engine=EngineConfig(block_size=8, num_blocks=8,
                                                     max_model_len=64)))
    with TestClient(create_app(worker)) as c:
        yield c


def test_token_is_required(client: TestClient) -> None:
    assert client.get("/health").json() == {"ok": True, "role": "decode"}  # the probe is open
    assert client.get("/info").status_code == 401
    bad = client.get("/load", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert client.get("/health", headers=AUTH).json() == {"ok": True, "role": "decode"}


def test_bad_bodies_and_roles_are_400(client: TestClient) -> None:
    assert client.post("/generate", json={"request_id": "x"}, headers=AUTH).status_code == 400
    too_long = {"request_id": "x", "prompt_token_ids": [5] * 60, "sampling": {"max_tokens": 10}}
    reply = client.post("/generate", json=too_long, headers=AUTH)
    assert reply.status_code == 400 and "max_model_len" in reply.json()["error"]["message"]
    wrong = client.post("/prefill", json={"request_id": "x", "prompt_token_ids": [5]}, headers=AUTH)
    assert wrong.status_code == 400 and "decode worker" in wrong.json()["error"]["message"]


def test_generate_takes_json_only_and_other_methods_fall_through(client: TestClient) -> None:
    """POST /generate is answered before FastAPI's layers, with its checks: a body typed as
    something else than JSON is refused (a cross-site form post), a bad token is a 401, and
    another method still gets FastAPI's 405."""
    body = json.dumps({"request_id": "t", "prompt_token_ids": [5],
                       "sampling": {"max_tokens": 1}})
    plain = client.post("/generate", content=body,
                        headers=AUTH | {"Content-Type": "text/plain"})
    assert plain.status_code == 400 and "application/json" in plain.json()["error"]["message"]
    bad = client.post("/generate", content=body, headers={"Authorization": "Bearer nope",
                                                          "Content-Type": "application/json"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert client.get("/generate", headers=AUTH).status_code == 405
    typed = client.post("/generate", content=body,
                        headers=AUTH | {"Content-Type": "application/json; charset=utf-8"})
    assert typed.status_code == 200


def test_reserve_until_full_then_503_and_abort_gives_back_after_the_grace(
        tiny_llama: Path) -> None:
    """An aborted reservation's blocks come back once a push its prefill worker may have
    started before the deadline is over (deadline + grace), not at the abort."""
    clock = VirtualClock()
    worker = Worker(WorkerConfig(str(tiny_llama), role="decode", token="s3cret",
                                 engine=EngineConfig(block_size=8, num_blocks=8,
                                                     max_model_len=64)), clock=clock)
    with TestClient(create_app(worker)) as client:
        one = client.post("/kv/reserve", json={"request_id": "a", "num_tokens": 20},
                          headers=AUTH)
        assert one.status_code == 200 and len(one.json()["regions"]) == 3 * 2 * 2
        assert one.json()["ttl_s"] == worker.reservations.ttl_s
        full = client.post("/kv/reserve", json={"request_id": "b", "num_tokens": 40},
                           headers=AUTH)
        assert full.status_code == 503 and full.json()["error"]["type"] == "out_of_kv_space"
        assert client.get("/load", headers=AUTH).json()["free_kv_tokens"] == 5 * 8
        assert client.post("/abort", json={"request_id": "a"}, headers=AUTH).json() == \
            {"ok": True}
        assert client.get("/load", headers=AUTH).json()["free_kv_tokens"] == 5 * 8  # held
        clock.advance(worker.reservations.ttl_s + worker.reservations.grace_s + 0.1)
        for _ in range(2):  # the loop's idle turns after a command
            worker.loop.call(lambda engine: None).result(timeout=5)
        assert client.get("/load", headers=AUTH).json()["free_kv_tokens"] == 8 * 8


def test_colocated_stream(client: TestClient) -> None:
    body = {"request_id": "s", "prompt_token_ids": [5, 6, 7],
            "sampling": {"max_tokens": 3, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body, headers=AUTH) as reply:
        assert reply.headers["content-type"] == "application/x-ndjson"
        lines = [line for line in reply.iter_lines() if line]
    frames = [json.loads(t) for t in lines[:-1]]
    assert [(f["type"], len(f["token_ids"]), len(f["t"])) for f in frames] == [("tokens", 1, 1)] * 3
    assert lines[-1] == ('{"type":"finish","finish_reason":"length","num_output_tokens":3,'
                         '"num_cached_tokens":0,"num_pool_tokens":0}')


def test_a_stream_interval_sends_the_first_token_alone_then_every_n(client: TestClient) -> None:
    body = {"request_id": "i", "prompt_token_ids": [5, 6, 7], "stream_interval": 2,
            "sampling": {"max_tokens": 5, "ignore_eos": True, "logprobs": 0, "temperature": 0}}
    with client.stream("POST", "/generate", json=body, headers=AUTH) as reply:
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert [len(f["token_ids"]) for f in lines[:-1]] == [1, 2, 2]
    assert [len(f["logprobs"]) for f in lines[:-1]] == [1, 2, 2]
    assert lines[-1]["type"] == "finish" and lines[-1]["num_output_tokens"] == 5
    one = client.post("/generate", json=body | {"request_id": "j", "stream_interval": 1},
                      headers=AUTH)
    ids = [t for line in one.text.splitlines()[:-1] for t in json.loads(line)["token_ids"]]
    assert ids == [t for f in lines[:-1] for t in f["token_ids"]]  # the same tokens, framed


def test_misspelt_and_out_of_range_fields_are_400(client: TestClient) -> None:
    base = {"request_id": "m", "prompt_token_ids": [5, 6]}
    typo = client.post("/generate", json=base | {"sampling": {"max_token": 3}}, headers=AUTH)
    assert typo.status_code == 400 and "max_token" in typo.json()["error"]["message"]
    extra = client.post("/generate", json=base | {"prompt": "x"}, headers=AUTH)
    assert extra.status_code == 400 and "prompt" in extra.json()["error"]["message"]
    bad = client.post("/generate", json=base | {"sampling": {"logprobs": 99}}, headers=AUTH)
    assert bad.status_code == 400 and "logprobs must be in 0..20" in bad.json()["error"]["message"]


def test_colocated_finish_line_reports_reuse(client: TestClient) -> None:
    prompt = list(range(3, 20))                  # two full blocks of 8, then one token
    finish = []
    for request_id in ("first", "again"):
        body = {"request_id": request_id, "prompt_token_ids": prompt,
                "sampling": {"max_tokens": 2, "ignore_eos": True}}
        with client.stream("POST", "/generate", json=body, headers=AUTH) as reply:
            finish.append(json.loads([line for line in reply.iter_lines() if line][-1]))
    assert [f["num_cached_tokens"] for f in finish] == [0, 16]


def test_a_stopped_engine_answers_503(tiny_llama: Path) -> None:
    worker = Worker(WorkerConfig(str(tiny_llama), role="both",
                                 engine=EngineConfig(block_size=8, num_blocks=8)))
    with TestClient(create_app(worker)) as c:
        worker.loop.stop()
        reply = c.get("/load")
        assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"]


def _sse_run(client: TestClient, rid: str, stop: list[str],
             prompt: tuple[int, ...] = (5, 6, 7)) -> tuple[list[dict], list[int]]:
    """/generate with `sse`: the events the frames and the finish carry (parsed), and the
    frames' token ids."""
    body = {"request_id": rid, "prompt_token_ids": list(prompt),
            "sampling": {"max_tokens": 24, "ignore_eos": True, "temperature": 0},
            "sse": {"kind": "completion", "id": "cmpl-x", "model": "m", "stop": stop}}
    reply = client.post("/generate", json=body, headers=AUTH)
    lines = [json.loads(line) for line in reply.text.splitlines() if line]
    raw = "".join(line.get("sse") or "" for line in lines)
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e]
    return [*events, lines[-1]], [t for line in lines for t in line.get("token_ids", [])]


def test_frames_carry_the_responses_text_chunks_and_a_stop_string_ends_them(
        client: TestClient, tiny_llama: Path) -> None:
    from kvpool.serve.tokenizer import ModelTokenizer

    events, ids = _sse_run(client, "sse-a", [])
    *chunks, last, finish = events
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == ModelTokenizer(tiny_llama).decode(ids) and len(ids) == 24
    assert all(c["id"] == "cmpl-x" and c["model"] == "m" for c in [*chunks, last])
    assert last["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                  "finish_reason": "length"}
    assert finish["type"] == "finish" and finish["num_output_tokens"] == 24
    stop = text[len(text) // 2:len(text) // 2 + 2]
    events, stopped_ids = _sse_run(client, "sse-b", [stop])
    *chunks, last, finish = events
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:text.index(stop)]
    assert last["choices"][0]["finish_reason"] == "stop" and finish["finish_reason"] == "stop"
    assert stopped_ids == ids[:len(stopped_ids)] and len(stopped_ids) < 24
    assert finish["num_output_tokens"] == len(stopped_ids)


def test_a_stop_string_at_the_worker_still_reports_the_prompts_reuse(
        client: TestClient) -> None:
    """A 17-token prompt run once, then again with a stop string that ends it early: the
    finish line of the stopped run reports its two cached blocks, as an unstopped run's."""
    prompt = tuple(range(40, 57))
    events, _ = _sse_run(client, "reuse-a", [], prompt)
    text = "".join(c["choices"][0]["text"] for c in events[:-2])
    events, ids = _sse_run(client, "reuse-b", [text[4:6]], prompt)
    finish = events[-1]
    assert finish["finish_reason"] == "stop" and len(ids) < 24
    assert finish["num_cached_tokens"] == 16


def test_info_says_whether_it_makes_sse_text(client: TestClient, tiny_llama: Path,
                                             tmp_path: Path) -> None:
    """A decoding worker with a tokenizer makes SSE text (InfoReply.sse_text); one whose
    folder has none does not, nor does a prefill worker: the proxy makes the text for them."""
    assert client.get("/info", headers=AUTH).json()["sse_text"] is True
    bare = tmp_path / "model"
    bare.mkdir()
    for f in tiny_llama.iterdir():
        if f.name != "tokenizer.json":
            (bare / f.name).symlink_to(f)
    for folder, role in ((bare, "decode"), (tiny_llama, "prefill")):
        worker = Worker(WorkerConfig(str(folder), role=role,
                                     engine=EngineConfig(block_size=8, num_blocks=8,
                                                         max_model_len=64)))
        with TestClient(create_app(worker)) as c:
            assert c.get("/info").json()["sse_text"] is False, role


def _step_lists(tiny_llama: Path, merge: bool) -> list[list[int]]:
    """A colocated request's outputs as `Worker.generate` hands them over, the event loop
    blocked for 0.5 s after the first (the engine thread keeps stepping meanwhile)."""
    async def go() -> list[list[int]]:
        worker = Worker(WorkerConfig(str(tiny_llama), role="both",
                                     engine=EngineConfig(block_size=8, num_blocks=8,
                                                         max_model_len=64)))
        try:
            req = GenerateRequest(request_id="m", prompt_token_ids=[5, 6, 7], merge_steps=merge,
                                  sampling=SamplingParams(max_tokens=12, ignore_eos=True,
                                                          temperature=0))
            got: list[list[int]] = []
            async for outs in worker.generate(req):
                if not got:
                    time.sleep(0.5)  # blocks the loop, not the engine thread
                got.append([o.token_id for o in outs if o.token_id is not None])
            return got
        finally:
            await worker.close()
    return asyncio.run(go())


def test_steps_waiting_for_a_busy_loop_are_merged_only_when_asked(tiny_llama: Path) -> None:
    """merge_steps: the steps that ended while the loop was busy come as one list (one frame);
    without it, one list per step. The same tokens either way."""
    merged, per_step = _step_lists(tiny_llama, True), _step_lists(tiny_llama, False)
    assert [t for ts in merged for t in ts] == [t for ts in per_step for t in ts]
    assert len([t for ts in merged for t in ts]) == 12
    assert all(len(ts) <= 1 for ts in per_step) and len(merged) <= 3
