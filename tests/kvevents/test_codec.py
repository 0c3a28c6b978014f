"""The KV-event codec against payloads encoded by vLLM's own classes, both forms, and fuzz."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from kvpool.errors import InvalidArgument, RemoteProtocolError
from kvpool.kvevents.codec import UnknownEvent, decode_batch, encode_batch
from kvpool.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

FRAMES = json.loads((Path(__file__).parents[1] / "data/kvevents/vllm_event_frames.json").read_text())


def frame(form: str, name: str) -> bytes:
    found = [f for f in FRAMES["frames"] if f["form"] == form and f["name"] == name]
    return bytes.fromhex(found[0]["payload_hex"])


@pytest.mark.parametrize("entry", FRAMES["frames"], ids=lambda f: f"{f['form']}-{f['name']}")
def test_vllm_frames_decode_and_reencode_to_the_same_bytes(entry: dict) -> None:
    payload = bytes.fromhex(entry["payload_hex"])
    assert encode_batch(decode_batch(payload), entry["form"]) == payload


def test_map_form_fields_as_vllm_032_wrote_them() -> None:
    batch = decode_batch(frame("map", "stored_newer_fields"))
    assert batch == EventBatch(ts=5.0, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[21, 22], parent_block_hash=20, token_ids=[1, 2, 3, 4],
                    block_size=2, medium="GPU", lora_name="sql",
                    extra_keys=[["sql", "salt-1"], None], group_idx=0,
                    kv_cache_spec_kind="full_attention", session_id="s-1"),
        BlockRemoved(block_hashes=[21], medium="GPU", group_idx=0)])


def test_array_form_as_vllm_011_wrote_it() -> None:
    batch = decode_batch(frame("array", "stored_bytes_parent"))
    assert batch == EventBatch(ts=2.5, data_parallel_rank=1, events=[
        BlockStored(block_hashes=[bytes(range(32))], parent_block_hash=b"\x07" * 32,
                    token_ids=[5, 6, 7, 8], block_size=4, lora_id=3, medium="CPU")])
    assert decode_batch(frame("array", "removed_and_cleared")).events == [
        BlockRemoved(block_hashes=[11, 12, 13], medium="GPU"), AllBlocksCleared()]


def test_64_bit_unsigned_hashes_survive() -> None:
    batch = decode_batch(frame("map", "stored_int_hashes"))
    assert batch.events[0].block_hashes == [1661466662038290245, 2**64 - 1]  # type: ignore[union-attr]


def test_oldest_layouts_decode() -> None:
    """Before `medium` (five-field BlockStored, one-field BlockRemoved) and before dp ranks."""
    enc = msgspec.msgpack.encode
    payload = enc([1.0, [["BlockStored", [1], None, [9, 9], 2, None], ["BlockRemoved", [1]]]])
    assert decode_batch(payload) == EventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[1], token_ids=[9, 9], block_size=2),
        BlockRemoved(block_hashes=[1])])


def test_unknown_tags_and_fields_are_kept_apart() -> None:
    enc = msgspec.msgpack.encode
    payload = enc([1, [{"type": "BlockAccessed", "x": 1}, {"type": "BlockRemoved",
                                                           "block_hashes": [3], "future": 1}], 0])
    assert decode_batch(payload).events == [UnknownEvent("BlockAccessed"), BlockRemoved(block_hashes=[3])]


@pytest.mark.parametrize("wire, says", [
    ({"ts": 1}, "must be an array"),
    ([1.0], "must be an array"),
    (["x", []], "ts must be a number"),
    ([1.0, {}], "events must be an array"),
    ([1.0, [], "r"], "data_parallel_rank must be an int"),
    ([1.0, [5]], "must be a map or an array"),
    ([1.0, [{"block_hashes": [1]}]], "no string tag"),
    ([1.0, [["BlockStored", [1], None]]], "has 2 fields, needs 4"),
    ([1.0, [{"type": "BlockStored", "block_hashes": "x", "parent_block_hash": None,
              "token_ids": [], "block_size": 1}]], "Expected `array`"),
    ([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]], "BlockRemoved"),
])
def test_malformed_batches_name_the_fault(wire: object, says: str) -> None:
    with pytest.raises(RemoteProtocolError, match=says):
        decode_batch(msgspec.msgpack.encode(wire))


def test_array_form_refuses_fields_it_has_no_place_for() -> None:
    batch = EventBatch(ts=1.0, events=[BlockStored(block_hashes=[1], lora_name="x")])
    with pytest.raises(InvalidArgument, match="lora_name"):
        encode_batch(batch, "array")


def test_byte_fuzz_gives_a_batch_or_the_protocol_error() -> None:
    rng = random.Random(7)
    seeds = [bytes.fromhex(f["payload_hex"]) for f in FRAMES["frames"]]
    outcomes = {"batch": 0, "error": 0}
    for i in range(4000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            pos = rng.randrange(len(data) + 1)
            if op == 0 and data:
                data[pos % len(data)] = rng.randrange(256)
            elif op == 1:
                data[pos:pos] = bytes([rng.randrange(256)])
            else:
                del data[pos:pos + rng.randint(1, 8)]
        if i % 10 == 0:
            data = bytearray(rng.randbytes(rng.randint(0, 40)))
        try:
            result = decode_batch(bytes(data))
        except RemoteProtocolError:
            outcomes["error"] += 1
        else:
            assert isinstance(result, EventBatch)
            outcomes["batch"] += 1
    assert outcomes["batch"] > 100 and outcomes["error"] > 100
