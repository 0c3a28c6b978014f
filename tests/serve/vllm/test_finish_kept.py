"""A vLLM stream that breaks after its finish chunk (before the usage chunk and `[DONE]`) has
finished: the leg ends with its finish, as kvpool's own worker client keeps a finish line it
read, and is not resumed elsewhere (vLLM would make tokens past the stop token); a stream
that breaks before it is a failed leg."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvpool.engine.config import SamplingParams
from kvpool.engine.worker.messages import FinishLine, GenerateRequest, PlainFrame
from kvpool.errors import WorkerCallError
from kvpool.serve.vllm.backend import VllmBackend
from tests.serve.test_worker_client import read_request
from tests.serve.test_worker_stream import _serving

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EOS = 2


def _chunk(obj: dict[str, object] | str) -> bytes:
    data = b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _tokens(ids: list[int], finish: str | None = None) -> bytes:
    return _chunk({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                   "choices": [{"index": 0, "text": "", "token_ids": ids,
                                "finish_reason": finish, "logprobs": None}], "usage": None})


async def _leg(finish: bool, whole: bool) -> list[object]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + _tokens([11]) + _tokens([12]))
        writer.write(_tokens([EOS], "stop") if finish else b"")
        await writer.drain()
        await asyncio.sleep(0.05)
        if not whole:  # gone: no usage chunk, no [DONE], no last chunk
            writer.transport.abort()
            return
        writer.write(_chunk({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                             "choices": [], "usage": {"prompt_tokens": 3, "total_tokens": 6,
                                                      "completion_tokens": 3}}))
        writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with _serving(serve) as url:
        backend = VllmBackend({url: "decode"}, timeout_s=5.0, model="m")
        req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                              sampling=SamplingParams(max_tokens=16))
        try:
            return [m async for m in backend.generate(url, req)]
        finally:
            await backend.aclose()


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "cut-after-finish"])
def test_a_stream_that_carried_its_finish_has_finished(whole: bool) -> None:
    out = asyncio.run(_leg(finish=True, whole=whole))
    assert [t for m in out if isinstance(m, PlainFrame) for t in m.token_ids] == [11, 12, EOS]
    assert isinstance(out[-1], FinishLine) and out[-1].finish_reason == "stop"
    assert out[-1].num_output_tokens == 3


def test_a_stream_cut_before_its_finish_is_a_failed_leg() -> None:
    with pytest.raises(WorkerCallError):
        asyncio.run(_leg(finish=False, whole=False))
